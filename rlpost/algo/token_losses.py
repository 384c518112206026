"""Per-token losses over client-given tokens, summed: the losses a service client names by string
(the Tinker API's ``forward_backward(data, loss_fn=...)``).

Each datum is one sequence; position t of its input predicts ``target_tokens[t]``, whose current
log-prob is ``lp_t`` (it carries the graph). With ``q_t`` the sampling log-prob the client sent
(``logprobs``), ``A_t`` its per-token advantage and ``w_t`` its per-token weight:

- ``cross_entropy``: ``-sum_t(w_t * lp_t)`` (SFT; ``w`` may be soft, e.g. a teacher's
  probabilities over K candidate targets per position, targets ``[N, K]``).
- ``importance_sampling``: ``-sum_t(exp(lp_t - q_t) * A_t)`` (REINFORCE with an importance
  ratio: off-policy by the sampler's numerics or staleness, unbiased).
- ``ppo``: ``-sum_t(min(r_t * A_t, clip(r_t, low, high) * A_t))`` with ``r = exp(lp - q)``.
- ``cispo``: the gradient of ``-sum_t(sg(clip(r_t, low, high)) * A_t * lp_t)`` (CISPO). Its
  reported value is ``-sum_t(clip(r_t, low, high) * A_t)``, the surrogate at the current weights
  as rlpost's GRPO reports it, where a formula written with ``lp_t`` as a factor reports a value
  scaled by the log-probs, which says nothing about the objective (a deliberate difference).

``low`` and ``high`` are the ratio's bounds (``loss_fn_config``: ``clip_low_threshold``,
``clip_high_threshold``; default 0.8 and 1.2, an epsilon of 0.2). The three policy losses are
:func:`rlpost.algo.grpo.grpo_loss` with ``aggregation="none"`` summed over the datum's tokens:
the GRPO service's own objective, not a second copy of it; importance sampling is its PPO
objective with a clip range that never binds (``[0, inf)``).

Sums, not means, as the API specifies: the client decides the normalisation by the weights or
advantages it sends (a mean over a batch of N tokens is weights of 1/N). The reported metric is
``loss:sum``, the sum over the request's data, which the client adds up across a request's chunks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from rlpost.algo.grpo import grpo_loss

TOKEN_LOSSES: tuple[str, ...] = ("cross_entropy", "importance_sampling", "ppo", "cispo")
# the inputs each loss reads besides target_tokens
LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
}
# loss_fn_config keys each loss takes, with their defaults
LOSS_CONFIG: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}


def check_loss(name: str, config: Mapping[str, float] | None) -> dict[str, float]:
    """The loss's full config (defaults filled in), or a ValueError naming the unknown loss or key."""
    if name not in TOKEN_LOSSES:
        raise ValueError(f"loss_fn: unknown loss {name!r}; this server computes {', '.join(TOKEN_LOSSES)}")
    given = dict(config or {})
    unknown = sorted(set(given) - set(LOSS_CONFIG[name]))
    if unknown:
        allowed = sorted(LOSS_CONFIG[name]) or "none"
        raise ValueError(f"loss_fn_config: {name} takes no key {unknown}; it takes {allowed}")
    merged = {**LOSS_CONFIG[name], **{k: float(v) for k, v in given.items()}}
    if "clip_low_threshold" in merged:
        low, high = merged["clip_low_threshold"], merged["clip_high_threshold"]
        if not (0.0 <= low <= 1.0 <= high and math.isfinite(high)):
            raise ValueError(
                f"loss_fn_config: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got {low} and {high}"
            )
    return merged


def token_loss(name: str, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
               config: Mapping[str, float] | None = None) -> torch.Tensor:  # fmt: skip
    """The loss ``name`` of one datum, summed over its positions: a 0-d tensor with the graph of
    ``logprobs``.

    ``logprobs`` is ``[N]`` (or ``[N, K]`` for cross-entropy over K targets per position): the
    current log-probs of the datum's ``target_tokens``; ``inputs`` the datum's other loss inputs,
    each of ``logprobs``' shape (:data:`LOSS_INPUTS` names them).
    """
    merged = check_loss(name, config)
    missing = [key for key in LOSS_INPUTS[name] if key not in inputs]
    if missing:
        raise ValueError(f"loss_fn_inputs: {name} needs {list(LOSS_INPUTS[name])}; missing {missing}")
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    values = {key: inputs[key].to(dtype) for key in LOSS_INPUTS[name]}
    for key, value in values.items():
        if value.shape != logprobs.shape:
            raise ValueError(
                f"loss_fn_inputs.{key}: shape {tuple(value.shape)} differs from target_tokens' {tuple(logprobs.shape)}"
            )
    lp = logprobs.to(dtype)
    if name == "cross_entropy":
        return -(values["weights"] * lp).sum()
    if name == "importance_sampling":
        clip_eps: tuple[float, float] = (1.0, math.inf)
    else:
        clip_eps = (1.0 - merged["clip_low_threshold"], merged["clip_high_threshold"] - 1.0)
    if lp.ndim != 1:
        raise ValueError(f"target_tokens: {name} takes one target per position, got shape {tuple(lp.shape)}")
    mask = torch.ones_like(lp, dtype=torch.bool)[None]
    terms = grpo_loss(
        lp[None],
        values["logprobs"][None],
        values["advantages"][None],
        mask,
        clip_eps=clip_eps,
        aggregation="none",
        objective="cispo" if name == "cispo" else "ppo",
    )
    return terms.loss.sum()
