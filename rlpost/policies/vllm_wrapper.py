"""vLLMWrapper: the LLM policy interface on a vLLM engine (the inference workers' view).

The wrapper never touches ``vllm.LLM`` directly: it talks to an *engine client* with two
methods on plain data (:class:`VLLMEngineClient`)::

    generate(prompt_token_ids: list[list[int]], sampling: dict) -> list[list[Completion]]
    score(token_ids: list[list[int]], *, temperature: float) -> list[list[float]]

:class:`LocalVLLMClient` implements it on an in-process ``vllm.LLM``; a Ray worker forwarding
the same plain-data calls gives identical results.

Engine requirements (:func:`make_vllm_engine` sets them): ``logprobs_mode="processed_logprobs"``
(sampled-token log-probs after temperature / top-p: the behaviour policy's; vLLM's default raw
ones are off by the temperature), and ``max_logprobs=-1``: vLLM's prompt log-probs are always at
temperature 1, so scoring at T != 1 renormalises ``log_softmax(lp / T)`` over the whole
vocabulary (exact, but heavy for large vocabularies; the Transformers wrapper is the cheap scorer).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings
from typing import Any

import torch

from rlpost.policies.base import Completion, LLMWrapperBase
from rlpost.policies.remote_client import RemoteVLLMClient, is_local_worker, is_remote_worker
from rlpost.policies.vllm_client import LocalVLLMClient, VLLMEngineClient, cut_by_model_len, processed_logprobs
from rlpost.policies.vllm_engine import (
    SPIN_AFTER_WORK_S,
    WORKER_EXTENSION,
    engine_cpu_cores,
    make_vllm_engine,
    shutdown_vllm_engine,
)

__all__ = [
    "SPIN_AFTER_WORK_S",
    "WORKER_EXTENSION",
    "LocalVLLMClient",
    "VLLMEngineClient",
    "cut_by_model_len",
    "engine_cpu_cores",
    "make_vllm_engine",
    "processed_logprobs",
    "shutdown_vllm_engine",
    "vLLMWrapper",
]

log = logging.getLogger("rlpost")

_STANDARD = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")
# TorchRL's common names and their vLLM names (None: not a vLLM sampling option).
_VLLM_NAMES = {
    "stop_sequences": "stop", "num_beams": None, "length_penalty": None, "early_stopping": None, "logprobs": None,
}  # fmt: skip
# Sampling options that change the distribution beyond temperature / top-k / top-p.
_DISTRIBUTION_CHANGING = (
    "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "logit_bias", "bad_words",
    "allowed_token_ids", "logits_processors",
)  # fmt: skip


class vLLMWrapper(LLMWrapperBase):
    """LLM wrapper around a vLLM engine; see :class:`LLMWrapperBase` for the keyword arguments,
    inputs and outputs.

    Args:
        model: a ``vllm.LLM`` (wrapped in :class:`LocalVLLMClient`), a worker of
            :func:`make_vllm_worker`, a fleet of them (``AsyncVLLM``), any
            :class:`VLLMEngineClient` (e.g. a remote inference worker's client), or a model path
            (an engine is made with :func:`make_vllm_engine`).
        tokenizer: the model's tokenizer (or a path); taken from the engine's
            ``get_tokenizer()`` when omitted.
        pad_model_input: TorchRL's argument, refused as TorchRL refuses it (ValueError when
            given): vLLM schedules its own batches.

    Log-probs are never silently wrong: on an engine in vLLM's default raw mode (a plain
    ``vllm.LLM(model=...)``) the wrapper re-scores the sampled tokens under the processed
    distribution when ``max_logprobs=-1`` (slow), else refuses at construction with a ValueError
    naming ``logprobs_mode`` and the fix.

    Attributes:
        sampling_params: the ``vllm.SamplingParams`` a call uses (built on access).
    """

    def __init__(self, model, *, tokenizer=None, pad_model_input: bool | None = None, **kwargs):
        if pad_model_input is not None:
            raise ValueError("pad_model_input is not supported by vLLMWrapper.")
        if isinstance(model, (str, os.PathLike)):
            model = make_vllm_engine(model)
        client = _worker_client(model, tokenizer)
        if client is None:
            client = model if _is_client(model) else LocalVLLMClient(model)
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        if tokenizer is None and hasattr(client, "get_tokenizer"):
            tokenizer = client.get_tokenizer()
        super().__init__(tokenizer=tokenizer, **kwargs)
        self.client = client
        self.model = model
        self._rescore = self._check_logprobs_mode()

    def _engine(self):
        return self.client

    def _full_logits(self, tensordict):
        """vLLM returns log-probs of given tokens, never the logits: ``get_dist`` raises TorchRL's
        NotImplementedError (score with ``generate=False``, or use TransformersWrapper.get_dist)."""
        raise NotImplementedError(
            "vLLM does not return logits: get_dist needs a TransformersWrapper; "
            "vLLMWrapper(generate=False) returns the log-probs of given tokens"
        )

    @property
    def sampling_params(self):
        """The ``vllm.SamplingParams`` of a generation call (or of a scoring call's prefill)."""
        from vllm import SamplingParams

        sampling = dict(self._sampling())
        want = bool(sampling.pop("logprobs"))
        if not self.generate:
            sampling.update(max_tokens=1, n=1, prompt_logprobs=0)
        return SamplingParams(**sampling, logprobs=0 if want else None, detokenize=False)

    def _sampling(self) -> dict[str, Any]:
        params = self.generate_params
        sampling = {_VLLM_NAMES.get(k, k): v for k, v in params.items() if k not in _STANDARD and _VLLM_NAMES.get(k, k)}
        sampling.update(
            n=self.num_samples or 1,
            max_tokens=params["max_new_tokens"],
            temperature=params["temperature"],
            top_p=params["top_p"],
            top_k=params["top_k"],
            seed=params["seed"],
            logprobs=self.return_log_probs,
        )
        return sampling

    def _generate_ids(self, prompt_ids: list[list[int]], num_samples: int) -> list[list[Completion]]:
        sampling = self._sampling()
        sampling["n"] = num_samples
        completions = self.client.generate(prompt_ids, sampling)
        if self._rescore and self.return_log_probs:
            self._replace_raw_logprobs(prompt_ids, completions)
        return completions

    def _replace_raw_logprobs(self, prompt_ids: list[list[int]], completions: list[list[Completion]]) -> None:
        """Swap the engine's raw log-probs for the processed ones (see the class docstring)."""
        params = self.generate_params
        fulls, starts, flat = [], [], []
        for prompt, group in zip(prompt_ids, completions):
            for completion in group:
                fulls.append(list(prompt) + list(completion.token_ids))
                starts.append(len(prompt))
                flat.append(completion)
        scores = self.client.rescore(
            fulls, starts, temperature=params["temperature"], top_p=params["top_p"], top_k=params["top_k"]
        )
        for completion, row in zip(flat, scores):
            completion.logprobs = row

    def _score_ids(self, full_ids: list[list[int]], score_from: int = 0) -> list[torch.Tensor]:
        # vLLM returns every position's log-prob in one pass: score_from saves nothing here
        scores = self.client.score(full_ids, temperature=self.temperature)
        return [torch.tensor(s, dtype=torch.float32) for s in scores]

    def _check_logprobs_mode(self) -> bool:
        """Whether sampled-token log-probs must be re-scored; a ValueError when they would be
        wrong and cannot be fixed (see the class docstring)."""
        mode = getattr(self.client, "logprobs_mode", "processed_logprobs")
        if mode == "processed_logprobs":
            return False
        fix = (
            "create the engine with logprobs_mode='processed_logprobs' "
            "(vllm.LLM(model=..., logprobs_mode='processed_logprobs') or rlpost.policies.make_vllm_engine)"
        )
        if mode != "raw_logprobs":
            raise ValueError(f"vLLMWrapper needs log-probs, but this engine returns logprobs_mode={mode!r}: {fix}")
        params = self.generate_params
        full_vocab = self.client.max_logprobs == -1 or self.client.max_logprobs >= self.client.vocab_size
        if not self.generate:
            if not math.isclose(self.temperature, 1.0) and not full_vocab:
                raise ValueError(
                    f"scoring at temperature {self.temperature} reads the whole vocabulary per position, but this "
                    f"engine caps log-probs at max_logprobs={self.client.max_logprobs}: create it with max_logprobs=-1"
                )
            return False
        if not self.return_log_probs or _unprocessed(params):
            return False
        unsupported = _distribution_changing(params)
        if unsupported or not full_vocab:
            reason = (
                f"{unsupported} cannot be re-applied"
                if unsupported
                else f"re-scoring needs the whole vocabulary and the engine has max_logprobs={self.client.max_logprobs}"
            )
            raise ValueError(
                f"this vLLM engine returns raw log-probs (logprobs_mode='raw_logprobs', vLLM's default), which ignore "
                f"temperature={params['temperature']}, top_p={params['top_p']}, top_k={params['top_k']}: the "
                f"behaviour policy's log-probs would be wrong and {reason}. Fix: {fix}, or create it with "
                "max_logprobs=-1 so that vLLMWrapper can re-score the sampled tokens."
            )
        warnings.warn(
            "vLLMWrapper: the engine returns raw log-probs (logprobs_mode='raw_logprobs'); sampled tokens are "
            "re-scored under the processed distribution: one more prefill per call that returns the whole "
            "vocabulary at every position, which is slow (30x the generation time with the 448-token tiny "
            "model, far more with a real vocabulary). Use logprobs_mode='processed_logprobs' to avoid it.",
            stacklevel=3,
        )
        return True


def _unprocessed(params: dict[str, Any]) -> bool:
    """Whether sampling leaves the distribution as it is (raw log-probs are then the processed ones)."""
    greedy = params["temperature"] == 0
    plain = math.isclose(params["temperature"], 1.0) and params["top_p"] >= 1.0 and not params["top_k"]
    return (greedy or plain) and not _distribution_changing(params)


def _distribution_changing(params: dict[str, Any]) -> list[str]:
    """The options given that change the sampling distribution (neutral values do not count)."""
    neutral = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}
    return sorted(k for k in _DISTRIBUTION_CHANGING if params.get(k) not in (None, neutral.get(k)))


def _worker_client(model: Any, tokenizer: Any) -> Any:
    """The engine client of a worker from ``make_vllm_worker`` (a Ray actor or an in-process
    worker) or of a fleet of them (``AsyncVLLM``: anything with ``get_engine_client()``), or None
    for anything else."""
    if callable(getattr(model, "get_engine_client", None)):
        return model.get_engine_client()
    if is_local_worker(model):
        return model.client
    if not is_remote_worker(model):
        return None
    import ray

    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ray.get(model.get_model_path.remote(), timeout=600))
    return RemoteVLLMClient([model], tokenizer=tokenizer)


def _is_client(obj) -> bool:
    return callable(getattr(obj, "score", None)) and callable(getattr(obj, "generate", None)) and not _is_vllm_llm(obj)


def _is_vllm_llm(obj) -> bool:
    vllm = sys.modules.get("vllm")  # an LLM instance implies vllm is imported; never import it here
    return vllm is not None and isinstance(obj, vllm.LLM)
