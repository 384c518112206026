"""Per-token estimators of KL(policy || reference) from log-probs of sampled tokens.

The tokens were sampled from the policy, so with ``d = ref - lp`` (J. Schulman, "Approximating
KL Divergence", 2020, http://joschu.net/blog/kl-approx.html):

- ``k1 = lp - ref = -d``: unbiased, high variance, can be negative per token.
- ``k2 = (lp - ref)^2 / 2 = d^2 / 2``: biased, low variance, >= 0.
- ``k3 = exp(d) - d - 1``: unbiased, low variance, >= 0 (GRPO, DeepSeekMath arXiv:2402.03300).

k3 is computed as ``expm1(d) - d``, the same value with less rounding error for small ``d``
(the common case: the policy stays close to the reference).
"""

from __future__ import annotations

from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """The per-token KL estimate, shaped like the inputs (no masking here); ValueError on an
    unknown ``estimator`` or mismatched shapes."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} must have the same shape"
        )
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs).square()
    log_ratio = ref_logprobs - logprobs
    return torch.expm1(log_ratio) - log_ratio


def k3_kl_token_estimate(target_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    """TorchRL's ``k3_kl_token_estimate``: the per-token k3 estimate ``expm1(d) - d`` with
    ``d = target_log_prob - log_prob``, shaped like the inputs, for tokens sampled from the
    distribution behind ``log_prob`` (``kl_per_token(log_prob, target_log_prob)``)."""
    return kl_per_token(log_prob, target_log_prob, "k3")
