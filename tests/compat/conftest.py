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


@pytest.fixture(scope="session")
def plain_llm(tiny_model_path):
    """``vllm.LLM(model=tiny)`` in vLLM's default ``logprobs_mode`` (raw log-probs)."""
    from vllm import LLM

    from rlpost.policies import shutdown_vllm_engine

    llm = LLM(model=str(tiny_model_path), max_logprobs=-1, **CPU_ENGINE_SETTINGS)
    assert llm.llm_engine.model_config.logprobs_mode == "raw_logprobs"
    yield llm
    shutdown_vllm_engine(llm)
    del llm
    gc.collect()


@pytest.fixture(scope="session")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
