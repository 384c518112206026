"""vLLMWrapper: the LLM policy interface on a vLLM engine (the inference workers' view).

The wrapper never touches ``vllm.LLM`` directly: it talks to an *engine client* with two
methods on plain data (:class:`VLLMEngineClient`)::

    generate(prompt_token_ids: list[list[int]], sampling: dict) -> list[list[Completion]]
    score(token_ids: list[list[int]], *, temperature: float) -> list[list[float]]

:class:`LocalVLLMClient` implements it on an in-process ``vllm.LLM``; a Ray inference-worker
handle that forwards the same calls (the service issue) gives identical results, because the
arguments and results are plain lists and dicts.

Engine requirements (:func:`make_vllm_engine` sets them): ``logprobs_mode="processed_logprobs"``
so that sampled-token log-probs are taken after temperature / top-p (the behaviour policy's,
REFERENCE.md pitfall 2); ``max_logprobs=-1`` so that scoring at temperature != 1 can read the
full prompt distribution (vLLM's prompt log-probs skip the sampling processors, i.e. are always
at temperature 1, so the client renormalises ``log_softmax(lp / T)`` over the whole vocabulary --
exact, but heavy for large vocabularies; the Transformers wrapper is the cheap scorer there).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Protocol

import torch

from rlpost.policies.base import Completion, LLMWrapperBase

_STANDARD = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")


class VLLMEngineClient(Protocol):
    """What :class:`vLLMWrapper` needs from an engine; arguments and results are plain data."""

    def generate(self, prompt_token_ids: list[list[int]], sampling: dict[str, Any]) -> list[list[Completion]]:
        """``sampling``: vLLM ``SamplingParams`` fields (``n``, ``max_tokens``, ``temperature``,
        ``top_p``, ``top_k``, ``seed``, ``logprobs`` as a bool, extras). One list of ``n``
        completions per prompt, in prompt order."""
        ...

    def score(self, token_ids: list[list[int]], *, temperature: float) -> list[list[float]]:
        """Per sequence, ``log p(ids[t] | ids[:t])`` at ``temperature`` for every ``t``, with 0.0
        at ``t = 0``."""
        ...


class LocalVLLMClient:
    """:class:`VLLMEngineClient` on an in-process ``vllm.LLM``."""

    def __init__(self, llm):
        self.llm = llm

    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    def generate(self, prompt_token_ids: list[list[int]], sampling: dict[str, Any]) -> list[list[Completion]]:
        from vllm import SamplingParams

        sampling = dict(sampling)
        want_logprobs = bool(sampling.pop("logprobs", True))
        params = SamplingParams(**sampling, logprobs=0 if want_logprobs else None, detokenize=False)
        outputs = self.llm.generate(_token_prompts(prompt_token_ids), params, use_tqdm=False)
        return [[_completion(c, want_logprobs) for c in request.outputs] for request in outputs]

    def score(self, token_ids: list[list[int]], *, temperature: float) -> list[list[float]]:
        from vllm import SamplingParams

        full_vocab = not math.isclose(temperature, 1.0)
        params = SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=-1 if full_vocab else 0, detokenize=False
        )
        outputs = self.llm.generate(_token_prompts(token_ids), params, use_tqdm=False)
        return [
            _prompt_scores(ids, out.prompt_logprobs, temperature, full_vocab) for ids, out in zip(token_ids, outputs)
        ]

    def shutdown(self) -> None:
        """Stop the engine's child processes (vLLM 0.32: ``llm_engine.engine_core.shutdown()``)."""
        shutdown_vllm_engine(self.llm)


class vLLMWrapper(LLMWrapperBase):
    """LLM wrapper around a vLLM engine; see :class:`LLMWrapperBase` for the keyword arguments,
    inputs and outputs.

    Args:
        model: a ``vllm.LLM`` (wrapped in :class:`LocalVLLMClient`) or any
            :class:`VLLMEngineClient` (e.g. a remote inference worker's client).
        tokenizer: the model's tokenizer; taken from the client's ``get_tokenizer()`` if omitted.
    """

    def __init__(self, model, *, tokenizer=None, **kwargs):
        client = model if _is_client(model) else LocalVLLMClient(model)
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        if tokenizer is None and hasattr(client, "get_tokenizer"):
            tokenizer = client.get_tokenizer()
        super().__init__(tokenizer=tokenizer, **kwargs)
        self.client = client

    def _engine(self):
        return self.client

    def _generate_ids(self, prompt_ids: list[list[int]], num_samples: int) -> list[list[Completion]]:
        params = self.generate_params
        sampling = {k: v for k, v in params.items() if k not in _STANDARD}
        sampling.update(
            n=num_samples,
            max_tokens=params["max_new_tokens"],
            temperature=params["temperature"],
            top_p=params["top_p"],
            top_k=params["top_k"],
            seed=params["seed"],
            logprobs=self.return_log_probs,
        )
        return self.client.generate(prompt_ids, sampling)

    def _score_ids(self, full_ids: list[list[int]]) -> list[torch.Tensor]:
        scores = self.client.score(full_ids, temperature=self.temperature)
        return [torch.tensor(s, dtype=torch.float32) for s in scores]


def make_vllm_engine(
    model_path: str | os.PathLike,
    *,
    dtype: str = "float32",
    enforce_eager: bool = True,
    max_model_len: int = 512,
    seed: int = 0,
    kv_cache_memory_bytes: int | None = 256 * 2**20,
    max_logprobs: int = -1,
    **engine_kwargs,
):
    """Create a ``vllm.LLM`` configured the way rlpost needs it.

    Always sets ``logprobs_mode="processed_logprobs"`` (another value is a ValueError), and
    ``max_logprobs=-1`` (tempered scoring reads full prompt distributions). ``dtype`` is float32
    by default so that inference log-probs match the fp32 learner. On the CPU backend:

    - the KV cache is ``kv_cache_memory_bytes`` (256 MiB holds ~250k tokens of the tiny model,
      and keeps one engine under 2 GB resident). vLLM's legacy ``VLLM_CPU_KVCACHE_SPACE``
      variable (whole GiB) overrides it when set in the environment; with
      ``kv_cache_memory_bytes=None`` it is set to 1 GiB unless already set.
    - chunked prefill is off (see the comment below); pass ``enable_chunked_prefill`` to override.

    The engine runs in child processes: create it under ``if __name__ == "__main__":`` in
    scripts and release it with :func:`shutdown_vllm_engine`.
    """
    from vllm import LLM
    from vllm.platforms import current_platform

    mode = engine_kwargs.pop("logprobs_mode", "processed_logprobs")
    if mode != "processed_logprobs":
        raise ValueError(f"rlpost needs logprobs_mode='processed_logprobs', got {mode!r}")
    if current_platform.is_cpu():
        if kv_cache_memory_bytes is None:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # vLLM 0.32 CPU trap: a seeded request whose prompt is prefilled in chunks crashes the
        # engine ("CPU Generator does not use offset") once a batch's prompts exceed
        # max_num_batched_tokens; without chunked prefill prompts are scheduled whole.
        engine_kwargs.setdefault("enable_chunked_prefill", False)
        if not engine_kwargs["enable_chunked_prefill"]:
            engine_kwargs.setdefault("max_num_batched_tokens", max(max_model_len, 4096))
    if kv_cache_memory_bytes is not None:
        engine_kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    return LLM(
        str(model_path),
        dtype=dtype,
        enforce_eager=enforce_eager,
        max_model_len=max_model_len,
        seed=seed,
        max_logprobs=max_logprobs,
        logprobs_mode="processed_logprobs",
        **engine_kwargs,
    )


def shutdown_vllm_engine(llm) -> None:
    """Stop a ``vllm.LLM``'s engine-core and worker processes now instead of at garbage collection."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()


def _is_client(obj) -> bool:
    return callable(getattr(obj, "score", None)) and callable(getattr(obj, "generate", None)) and not _is_vllm_llm(obj)


def _is_vllm_llm(obj) -> bool:
    vllm = sys.modules.get("vllm")  # an LLM instance implies vllm is imported; never import it here
    return vllm is not None and isinstance(obj, vllm.LLM)


def _token_prompts(token_ids: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": list(ids)} for ids in token_ids]


def _completion(output, want_logprobs: bool) -> Completion:
    ids = list(output.token_ids)
    logprobs = None
    if want_logprobs:
        logprobs = [position[tok].logprob for tok, position in zip(ids, output.logprobs)]
    return Completion(token_ids=ids, logprobs=logprobs, finished=output.finish_reason == "stop")


def _prompt_scores(ids: list[int], prompt_logprobs, temperature: float, full_vocab: bool) -> list[float]:
    scores = [0.0]
    for tok, position in zip(ids[1:], prompt_logprobs[1:]):
        if not full_vocab:
            scores.append(position[tok].logprob)
            continue
        vocab = torch.tensor(list(position.keys()))
        raw = torch.tensor([lp.logprob for lp in position.values()], dtype=torch.float32)
        # raw = log_softmax(logits); log_softmax(raw / T) == log_softmax(logits / T)
        tempered = torch.log_softmax(raw / temperature, dim=-1)
        scores.append(float(tempered[vocab == tok][0]))
    return scores
