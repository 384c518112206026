"""Supervised losses on sampled (or given) tokens: SFT, MinorSFT, and the learner's SFT terms.

Per sequence i with loss mask m (the assistant tokens) and log-probs lp of its tokens:

- SFT, the negative log-likelihood: ``-sum_t(m * lp)``, divided by ``sum_t(m)`` when normalised
  by the sequence length (:func:`sequence_log_likelihood` gives the log-likelihood).
- MinorSFT (Xie et al. 2024, arXiv:2408.10642), DPO-like and gentler than SFT:
  ``-log sigmoid(beta * (LL_i - LL_ref_i))`` with LL the sequence log-likelihoods of the model
  and of a frozen reference (:func:`minor_sft_loss`).

:func:`sft_loss` is the learner's form: :func:`rlpost.algo.grpo_loss`'s signature and result
(:class:`~rlpost.algo.GRPOLossTerms`), the per-token NLL reduced with the same aggregations and
the same ``normaliser`` for a batch split into micro-batches, so that expert iteration (top-k
samples of each group, trained with SFT) runs through the same learner as GRPO.
"""

from __future__ import annotations

import torch

from rlpost.algo.grpo import Aggregation, GRPOLossTerms, kl_and_entropy_terms, masked_aggregate
from rlpost.algo.kl import KLEstimator

REDUCTIONS: tuple[str, ...] = ("mean", "sum", "none")


def sequence_log_likelihood(logprobs_bt: torch.Tensor, mask_bt: torch.Tensor, normalize: bool) -> torch.Tensor:
    """``[B]``: each row's summed log-probs over ``mask_bt``, divided by its masked token count
    when ``normalize`` (a row without one divides by 1). Masked-out positions never count,
    whatever they hold."""
    if logprobs_bt.shape != mask_bt.shape or mask_bt.dtype != torch.bool:
        raise ValueError(
            f"logprobs {tuple(logprobs_bt.shape)} and a bool mask of the same shape are needed, got mask "
            f"{mask_bt.dtype} {tuple(mask_bt.shape)}"
        )
    summed = torch.where(mask_bt, logprobs_bt, 0.0).sum(dim=-1)
    if normalize:
        summed = summed / mask_bt.sum(dim=-1).clamp(min=1)
    return summed


def reduce(values_b: torch.Tensor, reduction: str) -> torch.Tensor:
    """``"mean"``, ``"sum"`` or ``"none"`` (the values as they are) over sequences."""
    if reduction == "mean":
        return values_b.mean()
    if reduction == "sum":
        return values_b.sum()
    if reduction == "none":
        return values_b
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def minor_sft_loss(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, beta: float,
                   reduction: str = "mean") -> torch.Tensor:  # fmt: skip
    """MinorSFT: ``-log sigmoid(beta * (log_probs - ref_log_probs))``, reduced; the inputs are
    sequence log-likelihoods (or any matching values) of the model and of the reference."""
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            "log_probs and ref_log_probs must have the same shape, got "
            f"{tuple(log_probs.shape)} and {tuple(ref_log_probs.shape)}"
        )
    return reduce(-torch.nn.functional.logsigmoid(beta * (log_probs - ref_log_probs.detach())), reduction)


def sft_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregation: Aggregation = "token_mean",
    max_tokens: int | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    normaliser: float | None = None,
    **ignored,
) -> GRPOLossTerms:
    """The SFT loss in :func:`rlpost.algo.grpo_loss`'s form: ``loss_objective`` is the
    per-token NLL ``-lp`` over ``mask`` reduced with ``aggregation`` (``normaliser`` as there),
    plus the KL to ``ref_logprobs`` and the entropy bonus exactly as grpo_loss adds them.

    ``old_logprobs`` and ``advantages`` are not part of the objective (SFT imitates the tokens
    whatever their reward); ``kl_approx`` (mean ``old - lp``) is reported from them. The PPO-only
    keywords (``clip_eps``, ``kl_to_inference_coef``, the off-policy correction) are accepted and
    must be left at their defaults: the learner's configuration refuses them with SFT.
    """
    if ignored.get("off_policy_correction", "none") != "none":
        raise ValueError("sft_loss has no importance ratio: off_policy_correction must be 'none'")
    if mask.dtype != torch.bool or mask.shape != logprobs.shape:
        raise ValueError(f"mask must be bool {tuple(logprobs.shape)}, got {mask.dtype} {tuple(mask.shape)}")
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    lp_bt = torch.where(mask, logprobs.to(dtype), 0.0)

    def aggregate(x_bt: torch.Tensor) -> torch.Tensor:
        return masked_aggregate(x_bt, mask, aggregation, max_tokens, normaliser)

    def token_mean(x_bt: torch.Tensor) -> torch.Tensor:
        return masked_aggregate(x_bt.detach().to(dtype), mask, "token_mean")

    loss_objective = aggregate(-lp_bt)
    if kl_coef != 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs")
    if entropy_coef != 0 and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs entropy")
    loss_kl, loss_entropy, kl_to_ref, entropy_mean = kl_and_entropy_terms(
        lp_bt, mask, ref_logprobs, kl_coef, kl_estimator, entropy, entropy_coef, aggregate, token_mean
    )
    old_bt = torch.where(mask, old_logprobs.detach().to(dtype), 0.0)
    return GRPOLossTerms(
        loss=loss_objective + loss_kl + loss_entropy,
        loss_objective=loss_objective,
        loss_kl=loss_kl,
        loss_entropy=loss_entropy,
        kl_approx=token_mean(old_bt - lp_bt),
        kl_to_ref=kl_to_ref,
        entropy=entropy_mean,
    )
