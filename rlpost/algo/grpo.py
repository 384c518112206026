"""The GRPO loss family: a clipped policy-gradient objective, a KL term and an entropy bonus.

Per token t of sequence i, with ``ratio = exp(lp - old)`` (``old``: the behaviour log-prob the
inference engine returned) and the sequence's advantage ``A_i`` broadcast over its tokens:

    objective_t = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)

the clipped surrogate of PPO (Schulman et al. 2017, arXiv:1707.06347) used by GRPO (Shao et al.
2024, "DeepSeekMath", arXiv:2402.03300). ``clip_eps=(eps_low, eps_high)`` with
``eps_high > eps_low`` is DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476; 0.2, 0.28).

``objective="cispo"`` is CISPO (MiniMax-M1, arXiv:2506.13585): the importance weight is clipped
and held constant, and every token keeps its gradient::

    objective_t = -sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A * exp(lp - sg(lp))

The last factor is 1 with the gradient of ``lp``, so the value is ``-clip(ratio) * A`` (the value
TorchRL's ``CISPOLoss`` reports) and the gradient ``-clip(ratio) * A * grad(lp)``. TorchRL clamps
the log-ratio itself, which zeroes the gradient of every clipped token: that is PPO's clip
without its min, not CISPO, whose point is that no token (in particular the rare, high-ratio
"fork" tokens of long reasoning) is dropped from the update.

Each per-token term x_t (objective, KL, entropy) is reduced with the same ``aggregation``
(m = mask, B = rows in the batch), always as ``numerator(x) / D``:

- ``"token_mean"`` (DAPO token-level loss, TRL "bnpo"/"dapo", verl "token-mean"):
  ``sum(m * x) / sum(m)``, D = the loss tokens.
- ``"sequence_mean"`` (original GRPO, TRL "grpo", verl "seq-mean-token-mean"):
  ``sum_i(sum_t(m * x) / sum_t(m)) / D``, D = the rows with at least one loss token.
- ``"sequence_sum_norm"`` (Dr.GRPO, Liu et al. 2025, arXiv:2503.20783):
  ``sum(m * x) / (B * max_tokens)``, ``max_tokens`` the configured completion-length cap, a
  constant so that long answers are not down-weighted.
- ``"none"``: no reduction; the term per token, ``[B, T]``, 0 where the mask is False.

:func:`loss_normaliser` computes ``D``. A caller that splits one batch into pieces
(micro-batches, learner ranks) passes the whole batch's ``D`` as ``normaliser``: the pieces'
losses and gradients then add up to the whole batch's, whatever the split.

    loss = objective + kl_coef * KL - entropy_coef * entropy + kl_to_inference_coef * KL_inf

with the KL per token from :func:`rlpost.algo.kl.kl_per_token` (k3 by default, as in GRPO), and
``KL_inf`` the k3 estimate of KL(policy || behaviour policy) from the same ``old`` log-probs
(only when ``kl_to_inference_coef`` is given). ``advantages`` is one value per sequence ``[B]``
or one per token ``[B, T]``.

Off-policy correction (``off_policy_correction``, for samples the learner's weights did not
generate exactly: engine numerics, stale weights). With ``prox`` the learner's log-probs under
its weights at the start of the step (``proximal_logprobs``; default ``logprobs`` detached, exact
when a batch takes one optimizer step), the PPO ratio becomes ``exp(lp - prox)`` and each token's
objective is weighted by ``w = exp(prox - old)``, with threshold ``C`` (``off_policy_threshold``):

- ``"tis"``, truncated importance sampling: ``min(w, C)`` (TRL's ``token_truncate``);
- ``"mis"``, masked importance sampling: ``w``, or 0 where ``w > C`` (the token leaves the loss;
  TRL's ``token_mask``).

The weight is detached and the normaliser unchanged, so a masked token counts as a zero.

Deliberate deviations and choices, each for a reason:

- Padding (mask False) never affects a value or a gradient, whatever it holds: inputs are
  sanitised with ``torch.where`` before any arithmetic (``0 * nan`` is ``nan``, so multiplying by
  the mask would not do).
- ``old_logprobs``, ``ref_logprobs`` and ``advantages`` are constants of the objective and are
  detached; an ``old`` that shares the graph with ``lp`` would otherwise cancel the gradient.
- The math runs in at least float32 (bf16 ``exp`` of a log-ratio is too coarse for clipping).
- The KL is aggregated over masked tokens like the objective (TorchRL averages it over every
  position, padding included).
- ``sequence_mean`` averages over the rows that have at least one counted token (TRL counts an
  empty row as a zero, which lets padding rows dilute the loss). ``sequence_sum_norm`` keeps
  the paper's B = number of rows.
- An empty mask gives a zero loss (and zero gradient), not NaN.
- ``loss_kl``, ``loss_entropy`` and ``loss_kl_to_inference`` carry their coefficients and sign
  (TorchRL's convention), so ``loss == loss_objective + loss_kl + loss_entropy``
  (``+ loss_kl_to_inference`` when requested); a term whose coefficient is 0 is exactly 0 and is
  not computed into ``loss`` (so a non-finite KL cannot poison it through ``0 * inf``).
- Diagnostics (clip fractions, ``kl_approx``, ``ess``, ``kl_to_ref``, ``entropy``,
  ``kl_to_inference``) are token means over masked tokens whatever the aggregation, so they
  compare across runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Literal

import torch

from rlpost.algo.kl import KL_ESTIMATORS, KLEstimator, kl_per_token
from rlpost.runtime.dotted import load_callable

Aggregation = Literal["token_mean", "sequence_mean", "sequence_sum_norm", "none"]
AGGREGATIONS: tuple[str, ...] = ("token_mean", "sequence_mean", "sequence_sum_norm", "none")
OffPolicyCorrection = Literal["none", "tis", "mis"]
OFF_POLICY_CORRECTIONS: tuple[str, ...] = ("none", "tis", "mis")
Objective = Literal["ppo", "cispo"]
OBJECTIVES: tuple[str, ...] = ("ppo", "cispo")


@dataclass(frozen=True, eq=False)
class GRPOLossTerms:
    """What :func:`grpo_loss` returns: 0-d tensors (or None), the loss fields ``[B, T]`` under
    ``aggregation="none"``; ``loss`` (the sum of the ``loss_*`` terms) carries the graph. The
    rest are detached token-mean diagnostics:
    ``clip_fraction`` (share of masked tokens where the min picks the clipped term, split into
    ``_low``: ratio < 1 - eps_low with A < 0, and ``_high``: ratio > 1 + eps_high with A > 0),
    ``kl_approx`` (mean of old - lp: how far the policy has moved from the behaviour policy),
    ``ess`` (normalised effective sample size of the importance weights, 1 = on-policy),
    ``kl_to_ref`` (None without ``ref_logprobs``), ``entropy`` (None without ``entropy``),
    ``kl_to_inference`` (k3 KL to the behaviour log-probs; it and ``loss_kl_to_inference`` are
    None unless ``kl_to_inference_coef`` was given), ``sampling_logp_diff_mean`` (``|prox -
    old|``, whatever the correction) and ``off_policy_fraction`` (share of tokens whose
    importance weight was truncated or masked; None without a correction).

    A custom loss (:data:`LossFunction`) must set ``loss``; fields left None skip the metrics.
    """

    loss: torch.Tensor
    loss_objective: torch.Tensor | None = None
    loss_kl: torch.Tensor | None = None
    loss_entropy: torch.Tensor | None = None
    clip_fraction: torch.Tensor | None = None
    clip_fraction_low: torch.Tensor | None = None
    clip_fraction_high: torch.Tensor | None = None
    kl_approx: torch.Tensor | None = None
    ess: torch.Tensor | None = None
    kl_to_ref: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    loss_kl_to_inference: torch.Tensor | None = None
    kl_to_inference: torch.Tensor | None = None
    sampling_logp_diff_mean: torch.Tensor | None = None
    off_policy_fraction: torch.Tensor | None = None

    def metrics(self) -> dict[str, float]:
        """Every field that is set and is a single number, as python floats (for metrics.jsonl);
        per-token loss fields (``aggregation="none"``) are left out."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: float(value.item()) for name, value in values.items() if value is not None and value.ndim == 0}


def loss_normaliser(mask_bt: torch.Tensor, aggregation: Aggregation, max_tokens: int | None = None) -> float:
    """The denominator ``D`` of ``aggregation`` over ``mask_bt`` [B, T] (module docstring); a
    batch's ``D`` is the sum of its pieces'. ``"none"``: 1."""
    _check_aggregation(aggregation, max_tokens)
    if mask_bt.ndim != 2 or mask_bt.dtype != torch.bool:
        raise ValueError(f"mask_bt must be a bool [B, T] tensor, got {mask_bt.dtype} {tuple(mask_bt.shape)}")
    if aggregation == "token_mean":
        return float(mask_bt.sum())
    if aggregation == "sequence_mean":
        return float((mask_bt.sum(dim=1) > 0).sum())
    if aggregation == "sequence_sum_norm":
        return float(mask_bt.shape[0] * max_tokens)
    return 1.0


def masked_aggregate(
    x_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    aggregation: Aggregation = "token_mean",
    max_tokens: int | None = None,
    normaliser: float | None = None,
) -> torch.Tensor:
    """Reduce per-token values [B, T] over the tokens where ``mask_bt`` is True (module
    docstring). ``normaliser``: the whole batch's :func:`loss_normaliser` when this batch is a
    piece of it; None: this batch's own."""
    _check_aggregation(aggregation, max_tokens)
    if x_bt.ndim != 2 or x_bt.shape != mask_bt.shape:
        raise ValueError(f"x_bt {tuple(x_bt.shape)} and mask_bt {tuple(mask_bt.shape)} must be the same [B, T]")
    if mask_bt.dtype != torch.bool:
        raise ValueError(f"mask_bt must be a bool tensor, got dtype {mask_bt.dtype}")
    if normaliser is not None and not normaliser > 0:
        raise ValueError(f"normaliser must be > 0, got {normaliser!r}")
    x_bt = torch.where(mask_bt, x_bt, 0.0)
    if aggregation == "none":
        return x_bt
    if aggregation == "sequence_mean":
        # An empty row contributes 0 to the sum and is left out of the count.
        numerator = (x_bt.sum(dim=1) / mask_bt.sum(dim=1).clamp(min=1)).sum()
    else:
        numerator = x_bt.sum()
    if normaliser is None:  # an empty batch divides by 1: a zero loss, never NaN
        normaliser = max(loss_normaliser(mask_bt, aggregation, max_tokens), 1.0)
    return numerator / normaliser


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float | tuple[float, float] = 0.2,
    aggregation: Aggregation = "token_mean",
    max_tokens: int | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    kl_to_inference_coef: float | None = None,
    normaliser: float | None = None,
    off_policy_correction: OffPolicyCorrection = "none",
    off_policy_threshold: float = 2.0,
    proximal_logprobs: torch.Tensor | None = None,
    objective: Objective = "ppo",
) -> GRPOLossTerms:
    """Compute the GRPO loss and its diagnostics (see the module docstring for the math).

    Args:
        logprobs: [B, T] current-policy log-probs of the sampled tokens (carries the graph).
        old_logprobs: [B, T] behaviour log-probs (from the engine that generated the tokens).
        advantages: [B] one advantage per sequence, or [B, T] one per token.
        mask: [B, T] bool, True on the tokens that count (completion / assistant tokens).
        clip_eps: eps, or (eps_low, eps_high) for asymmetric (clip-higher) clipping.
        max_tokens: the completion-length cap; required by "sequence_sum_norm".
        ref_logprobs: [B, T] reference-model log-probs; required when ``kl_coef != 0``.
        entropy: [B, T] per-token policy entropy; required when ``entropy_coef != 0``.
        kl_to_inference_coef: weight of the k3 KL between the policy and the behaviour
            log-probs ``old_logprobs``; None (the default) computes neither the term nor its
            diagnostic, 0 the diagnostic only.
        normaliser: as in :func:`masked_aggregate`, for every loss term (the diagnostics stay
            this batch's token means).
        off_policy_threshold: the importance-weight cap ``C`` of "tis" and "mis" (> 1).
        proximal_logprobs: [B, T] the learner's log-probs of the tokens under its weights at
            the start of the step (constants); None: ``logprobs`` detached.
        objective: "ppo" (the clipped surrogate, GRPO and DAPO) or "cispo" (the clipped,
            detached importance weight times the log-prob's gradient; module docstring).
            ``clip_fraction`` counts, for "cispo", every token whose weight was clipped.

    Raises:
        ValueError: bad shapes (the message carries them), a non-bool mask, an unknown
            aggregation or estimator, bad ``clip_eps``, or a coefficient without its input.
    """
    eps_low, eps_high = _clip_bounds(clip_eps)
    _check_aggregation(aggregation, max_tokens)
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    _check_inputs(logprobs, old_logprobs, advantages, mask, ref_logprobs, entropy, proximal_logprobs)
    if off_policy_correction not in OFF_POLICY_CORRECTIONS:
        raise ValueError(
            f"off_policy_correction must be one of {OFF_POLICY_CORRECTIONS}, got {off_policy_correction!r}"
        )
    if not off_policy_threshold > 1.0:
        raise ValueError(f"off_policy_threshold must be > 1, got {off_policy_threshold!r}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if kl_coef != 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs")
    if entropy_coef != 0 and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs entropy")

    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    lp_bt = _sanitise(logprobs, mask, dtype)
    old_bt = _sanitise(old_logprobs.detach(), mask, dtype)
    adv = advantages.detach().to(dtype)
    adv_bt = torch.where(mask, adv if adv.ndim == 2 else adv[:, None], 0.0)

    prox_bt = _sanitise((logprobs if proximal_logprobs is None else proximal_logprobs).detach(), mask, dtype)
    weight_bt, corrected_bt = _importance_weights(prox_bt - old_bt, off_policy_correction, off_policy_threshold)
    log_ratio_bt = lp_bt - (old_bt if off_policy_correction == "none" else prox_bt)
    ratio_bt = log_ratio_bt.exp()
    clamped_ratio_bt = ratio_bt.clamp(1 - eps_low, 1 + eps_high)
    if objective == "ppo":
        # -min(ratio*A, clip(ratio)*A) picks the clipped term strictly below the unclipped one on
        # exactly these tokens; there clip() is constant, so their gradient is exactly zero.
        clipped_low_bt = (ratio_bt < 1 - eps_low) & (adv_bt < 0)
        clipped_high_bt = (ratio_bt > 1 + eps_high) & (adv_bt > 0)
        clipped_bt = clipped_low_bt | clipped_high_bt
        objective_bt = -torch.where(clipped_bt, clamped_ratio_bt, ratio_bt) * adv_bt
    else:  # cispo: a constant, clipped weight on every token's log-prob gradient
        clipped_low_bt, clipped_high_bt = ratio_bt < 1 - eps_low, ratio_bt > 1 + eps_high
        clipped_bt = clipped_low_bt | clipped_high_bt
        score_bt = (lp_bt - lp_bt.detach()).exp()  # 1, with the gradient of lp
        objective_bt = -clamped_ratio_bt.detach() * adv_bt * score_bt
    if weight_bt is not None:
        objective_bt = weight_bt * objective_bt

    def aggregate(x_bt: torch.Tensor) -> torch.Tensor:
        return masked_aggregate(x_bt, mask, aggregation, max_tokens, normaliser)

    def token_mean(x_bt: torch.Tensor) -> torch.Tensor:
        return masked_aggregate(x_bt.detach().to(dtype), mask, "token_mean")

    loss_objective = aggregate(objective_bt)
    loss_kl, loss_entropy, kl_to_ref, entropy_mean = kl_and_entropy_terms(
        lp_bt, mask, ref_logprobs, kl_coef, kl_estimator, entropy, entropy_coef, aggregate, token_mean
    )
    loss_kl_inf = kl_inf = None
    loss = loss_objective + loss_kl + loss_entropy
    if kl_to_inference_coef is not None:
        # masked tokens hold 0 in both, where k3 is exactly 0
        kl_inf_bt = kl_per_token(lp_bt, old_bt, "k3")
        kl_inf = token_mean(kl_inf_bt)
        loss_kl_inf = loss_objective.new_zeros(())
        if kl_to_inference_coef != 0:
            loss_kl_inf = kl_to_inference_coef * aggregate(kl_inf_bt)
        loss = loss + loss_kl_inf

    return GRPOLossTerms(
        loss=loss,
        loss_objective=loss_objective,
        loss_kl=loss_kl,
        loss_entropy=loss_entropy,
        clip_fraction=token_mean(clipped_bt),
        clip_fraction_low=token_mean(clipped_low_bt),
        clip_fraction_high=token_mean(clipped_high_bt),
        kl_approx=token_mean(-log_ratio_bt),
        ess=effective_sample_size(log_ratio_bt.detach(), mask),
        kl_to_ref=kl_to_ref,
        entropy=entropy_mean,
        loss_kl_to_inference=loss_kl_inf,
        kl_to_inference=kl_inf,
        sampling_logp_diff_mean=token_mean((prox_bt - old_bt).abs()),
        off_policy_fraction=None if corrected_bt is None else token_mean(corrected_bt),
    )


def kl_and_entropy_terms(
    lp_bt: torch.Tensor, mask: torch.Tensor, ref_logprobs: torch.Tensor | None, kl_coef: float,
    kl_estimator: KLEstimator, entropy: torch.Tensor | None, entropy_coef: float,
    aggregate: Callable[[torch.Tensor], torch.Tensor], token_mean: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """``(loss_kl, loss_entropy, kl_to_ref, entropy)`` as every loss of the family adds them to its
    objective (``lp_bt`` sanitised, in the math dtype); a term with coefficient 0 is exactly 0."""
    loss_kl, loss_entropy = lp_bt.new_zeros(()), lp_bt.new_zeros(())
    kl_to_ref = entropy_mean = None
    if ref_logprobs is not None:
        kl_bt = kl_per_token(lp_bt, _sanitise(ref_logprobs.detach(), mask, lp_bt.dtype), kl_estimator)
        kl_to_ref = token_mean(kl_bt)
        if kl_coef != 0:
            loss_kl = kl_coef * aggregate(kl_bt)
    if entropy is not None:
        entropy_bt = _sanitise(entropy, mask, lp_bt.dtype)
        entropy_mean = token_mean(entropy_bt)
        if entropy_coef != 0:
            loss_entropy = -entropy_coef * aggregate(entropy_bt)
    return loss_kl, loss_entropy, kl_to_ref, entropy_mean


def _importance_weights(
    log_w_bt: torch.Tensor, correction: OffPolicyCorrection, threshold: float
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(weight, corrected) per token (module docstring): each token's objective weight, and where
    it was truncated or masked; both None for "none"."""
    if correction == "none":
        return None, None
    w_bt = log_w_bt.exp()
    corrected_bt = w_bt > threshold
    if correction == "tis":
        return w_bt.clamp(max=threshold), corrected_bt
    return torch.where(corrected_bt, 0.0, w_bt), corrected_bt


def trust_region_mask(logprobs: torch.Tensor, old_logprobs: torch.Tensor, threshold: float) -> torch.Tensor:
    """True on the tokens whose ``0.5 * (logprobs - old_logprobs) ** 2 <= threshold``.

    TorchRL's KL-Mask: a per-token trust region; the tokens outside it (the policy drifted too
    far from the log-prob they were sampled with) are left out of the loss. Computed on detached
    values: the mask is a constant of the objective.
    """
    if logprobs.shape != old_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and old_logprobs {tuple(old_logprobs.shape)} must have the same shape"
        )
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    drift = logprobs.detach().to(dtype) - old_logprobs.detach().to(dtype)
    return 0.5 * drift.square() <= threshold


def effective_sample_size(log_weights_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """Normalised ESS of importance weights ``exp(log_weights)`` over the masked tokens.

    ``exp(2 * logsumexp(w) - logsumexp(2 * w)) / N`` (Kish's ESS in log space; 1 when all
    weights are equal). Defined as 1 when no token is masked.
    """
    w = torch.where(mask_bt, log_weights_bt, float("-inf")).flatten()
    num_tokens = mask_bt.sum()
    ess = torch.exp(2 * torch.logsumexp(w, dim=0) - torch.logsumexp(2 * w, dim=0)) / num_tokens
    return torch.where(num_tokens > 0, ess, torch.ones_like(ess))


def _sanitise(x_bt: torch.Tensor, mask_bt: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.where(mask_bt, x_bt.to(dtype), 0.0)


def _clip_bounds(clip_eps: float | tuple[float, float]) -> tuple[float, float]:
    if isinstance(clip_eps, (int, float)) and not isinstance(clip_eps, bool):
        eps_low = eps_high = float(clip_eps)
    elif isinstance(clip_eps, (tuple, list)) and len(clip_eps) == 2:
        eps_low, eps_high = (float(e) for e in clip_eps)
    else:
        raise ValueError(f"clip_eps must be a float or a (low, high) pair, got {clip_eps!r}")
    if not (0.0 <= eps_low <= 1.0 and eps_high >= 0.0):
        raise ValueError(f"clip_eps must satisfy 0 <= low <= 1 and high >= 0, got low={eps_low}, high={eps_high}")
    return eps_low, eps_high


def _check_aggregation(aggregation: str, max_tokens: int | None) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if aggregation == "sequence_sum_norm" and (max_tokens is None or max_tokens <= 0):
        raise ValueError(f"aggregation 'sequence_sum_norm' (Dr.GRPO) needs max_tokens > 0, got {max_tokens!r}")


def _check_inputs(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  ref_logprobs: torch.Tensor | None, entropy: torch.Tensor | None,
                  proximal_logprobs: torch.Tensor | None = None) -> None:  # fmt: skip
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    same_shape = {"old_logprobs": old_logprobs, "mask": mask, "ref_logprobs": ref_logprobs,
                  "entropy": entropy, "proximal_logprobs": proximal_logprobs}  # fmt: skip
    for name, tensor in same_shape.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logprobs has {tuple(logprobs.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got dtype {mask.dtype}")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages must have shape [B] = ({logprobs.shape[0]},) or [B, T] = "
            f"{tuple(logprobs.shape)}, got {tuple(advantages.shape)}"
        )


# A loss with grpo_loss's signature (the same arguments, by the same names) that returns
# GRPOLossTerms with at least ``loss`` set: what ``loss.custom_fn`` names.
LossFunction = Callable[..., GRPOLossTerms]


def load_loss_function(path: str) -> LossFunction:
    """The function ``path`` names (``"package.module:function"``, importable where the learner
    runs), called instead of :func:`grpo_loss` with its arguments. ValueError (naming the part
    that failed) on a malformed path, an unimportable module or no such callable."""
    return load_callable(path, "loss function")
