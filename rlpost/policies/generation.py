"""Generation arguments of the LLM wrappers: TorchRL's names, precedence and checks."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

# vLLM's SamplingParams default; TorchRL's vLLMWrapper passes no length, so vLLM's 16 applies.
DEFAULT_MAX_NEW_TOKENS = 16
# Backend names and the standard names they stand for. As in TorchRL, when both are given the
# backend name wins (``max_tokens`` over ``max_new_tokens``, ``n`` over ``num_return_sequences``).
_BACKEND_NAMES = {"max_tokens": "max_new_tokens", "n": "num_return_sequences"}


def normalize_generate_kwargs(generate_kwargs: dict | None, num_samples: int | None) -> tuple[dict, int | None]:
    """Map user generation kwargs to the standard names; returns (params, num_samples).

    Standard keys: ``max_new_tokens`` (default 16, vLLM's), ``temperature`` (0 = greedy),
    ``top_p``, ``top_k`` (0 = off), ``seed``; anything else is passed to the backend unchanged.
    TorchRL's rules: ``max_tokens`` and ``n`` are the backend names of ``max_new_tokens`` and
    ``num_return_sequences`` and win over them (with a warning here); ``n`` > 1 is
    ``num_samples`` (a different ``num_samples`` is a ValueError); ``do_sample=False`` means
    greedy and is a ValueError with a non-zero temperature; temperature must be >= 0, top_p in
    [0, 1], top_k and repetition_penalty > 0.
    """
    params: dict[str, Any] = dict(generate_kwargs or {})
    for backend, standard in _BACKEND_NAMES.items():
        if backend not in params:
            continue
        if standard in params and params[standard] != params[backend]:
            warnings.warn(
                f"generate_kwargs has {backend}={params[backend]!r} and {standard}={params[standard]!r}: "
                f"{backend} wins (TorchRL's rule)",
                stacklevel=3,
            )
        params[standard] = params.pop(backend)
    _validate_sampling(params)
    if params.pop("do_sample", True) is False:
        params["temperature"] = 0.0
    n = params.pop("num_return_sequences", None)
    if n is not None and n > 1 and num_samples is not None and n != num_samples:
        raise ValueError(f"num_samples={num_samples} differs from generate_kwargs['n']={n}")
    if num_samples is None and n is not None and n > 1:
        num_samples = n
    if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 1):
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
    params.setdefault("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    params.setdefault("temperature", 1.0)
    params.setdefault("top_p", 1.0)
    params.setdefault("top_k", 0)
    params.setdefault("seed", None)
    return params, num_samples


def standard_names(generate_kwargs: dict | None) -> dict:
    """The kwargs as given, with backend names renamed to the standard ones (the backend name wins,
    as in :func:`normalize_generate_kwargs`)."""
    kwargs = dict(generate_kwargs or {})
    for backend, standard in _BACKEND_NAMES.items():
        if backend in kwargs:
            kwargs[standard] = kwargs.pop(backend)
    return kwargs


def _validate_sampling(params: dict[str, Any]) -> None:
    """TorchRL's checks on user-given sampling values (all ValueError)."""
    temperature = params.get("temperature")
    if params.get("do_sample") is False and temperature not in (None, 0, 0.0):
        raise ValueError(f"When do_sample=False (greedy decoding), temperature must be 0, got {temperature}")
    if temperature is not None and temperature < 0:
        raise ValueError(f"Temperature must be non-negative, got {temperature}")
    top_p = params.get("top_p")
    if top_p is not None and not 0 <= top_p <= 1:
        raise ValueError(f"top_p must be between 0 and 1, got {top_p}")
    top_k = params.get("top_k")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k must be positive, got {top_k} (leave it out to disable top-k)")
    penalty = params.get("repetition_penalty")
    if penalty is not None and penalty <= 0:
        raise ValueError(f"repetition_penalty must be positive, got {penalty}")


@dataclass
class Completion:
    """One sampled continuation, as an engine returns it (plain data: it crosses processes).

    ``token_ids`` include the EOS token when generation stopped on it (``finished=True``);
    ``logprobs``: their processed log-probs (None when not requested). ``token_versions``: each
    token's policy version after an in-flight update; None when one version (the call's) made all.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    finished: bool
    token_versions: list[int] | None = None
