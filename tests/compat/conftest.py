"""Fixtures of the TorchRL compatibility tier.

The tier runs TorchRL's documented examples with two substitutions: rlpost's imports, and the
offline tiny model instead of a hub model. A ``vllm.LLM`` is built as TorchRL's tutorial builds
it (``LLM(model=...)``, so vLLM's default raw log-probs mode), plus the settings this machine's
CPU engine needs: without a KV-cache size vLLM's CPU backend reserves 92% of the RAM, the tiny
model is fp32, and seeded requests need chunked prefill off (a vLLM 0.32 CPU trap).
``max_logprobs=-1`` lets the wrapper re-score sampled tokens at temperatures != 1. One engine
serves the whole session.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

CPU_ENGINE_SETTINGS = dict(
    kv_cache_memory_bytes=256 * 2**20,
    max_model_len=512,
    dtype="float32",
    enforce_eager=True,
    enable_chunked_prefill=False,
    max_num_batched_tokens=4096,
    seed=0,
)


_ENGINES: dict[str, object] = {}


@pytest.fixture
def plain_llm(tiny_model_path):
    """``vllm.LLM(model=tiny)`` in vLLM's default ``logprobs_mode`` (raw log-probs); shared by
    the tier's modules and shut down when the tier's last test is done (an idle engine still
    takes CPU and ~2 GB while the other tiers run)."""
    if "plain" not in _ENGINES:
        from vllm import LLM

        llm = LLM(model=str(tiny_model_path), max_logprobs=-1, **CPU_ENGINE_SETTINGS)
        assert llm.llm_engine.model_config.logprobs_mode == "raw_logprobs"
        _ENGINES["plain"] = llm
    return _ENGINES["plain"]


def _shutdown_engines() -> None:
    from rlpost.policies import shutdown_vllm_engine

    while _ENGINES:
        _, llm = _ENGINES.popitem()
        shutdown_vllm_engine(llm)
        del llm
    gc.collect()


def pytest_runtest_teardown(item, nextitem):
    if _ENGINES and (nextitem is None or Path(__file__).parent not in Path(nextitem.path).parents):
        _shutdown_engines()


def pytest_sessionfinish(session, exitstatus):
    _shutdown_engines()


@pytest.fixture(scope="session")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
