"""Group-relative advantages: one scalar advantage per sampled completion.

GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300) samples ``group_size`` completions
for each prompt and scores each one against its siblings instead of against a learned value
function. With rewards ``r_1..r_n`` of one group:

- ``scale="group"`` (GRPO, TRL default, TorchRL ``MCAdvantage``):
  ``A_i = (r_i - mean(r)) / (std(r) + eps)``, ``std`` with Bessel's correction (n - 1).
- ``scale="batch"``: same numerator, ``std`` taken over every reward in the batch.
- ``scale="none"`` (Dr.GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training",
  arXiv:2503.20783): ``A_i = r_i - mean(r)``; dividing by the std biases towards prompts that
  are too easy or too hard.

A group whose rewards are all equal carries no signal and gets ``A = 0`` exactly. Deliberate
deviation: that case is detected by comparing the rewards, not left to arithmetic, because
``r - mean(r)`` of equal floats is not always exactly zero (e.g. three rewards of 0.1), and with
``eps`` small the residue would be amplified into a spurious advantage. A group of one sample is
all-equal by definition (its Bessel std would be NaN).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

AdvantageScale = Literal["group", "batch", "none"]
ADVANTAGE_SCALES: tuple[str, ...] = ("group", "batch", "none")


def group_advantages(rewards: torch.Tensor, *, scale: AdvantageScale = "group", eps: float = 1e-4) -> torch.Tensor:
    """Advantages shaped like ``rewards`` [num_groups, group_size] (one row per prompt; integer
    or bool rewards become the default float dtype). ``eps`` (>= 0) is added to the std before
    dividing (TRL uses 1e-4). ValueError: ``rewards`` not 2-D, unknown ``scale``, negative ``eps``.
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    rewards_gn = torch.as_tensor(rewards)
    if rewards_gn.ndim != 2:
        raise ValueError(f"rewards must have shape [num_groups, group_size], got {tuple(rewards_gn.shape)}")
    if not rewards_gn.is_floating_point():
        rewards_gn = rewards_gn.to(torch.get_default_dtype())

    if rewards_gn.shape[1] < 2:
        # A group of one (or none) is all-equal; its Bessel std is undefined.
        return torch.zeros_like(rewards_gn)
    is_equal_g1 = (rewards_gn == rewards_gn[:, :1]).all(dim=1, keepdim=True)
    centred_gn = rewards_gn - rewards_gn.mean(dim=1, keepdim=True)
    if scale == "group":
        advantages_gn = centred_gn / (rewards_gn.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        advantages_gn = centred_gn / (rewards_gn.std() + eps)
    else:
        advantages_gn = centred_gn
    # torch.where, not a multiply: with eps = 0 an all-equal group divides 0 by 0.
    return torch.where(is_equal_g1, torch.zeros_like(advantages_gn), advantages_gn)


def scale_by_batch_std(centred_rows: Sequence[Sequence[float]], reward_rows: Sequence[Sequence[float]], *,
                       eps: float = 1e-4) -> list[list[float]]:  # fmt: skip
    """The "batch" scale of advantages already centred per group (``scale="none"``, e.g.
    MCAdvantage's): each divided by the std of every reward of every group, plus ``eps``. Groups
    may differ in size; for groups of one size the result is :func:`group_advantages`' with
    ``scale="batch"`` (an all-equal group's zeros stay zeros)."""
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if [len(row) for row in centred_rows] != [len(row) for row in reward_rows]:
        raise ValueError("centred_rows and reward_rows must have the same groups of the same sizes")
    every = torch.tensor([r for row in reward_rows for r in row], dtype=torch.float64)
    std = float(every.std()) if every.numel() > 1 else 0.0
    return [[a / (std + eps) if a != 0 else 0.0 for a in row] for row in centred_rows]


def distillation_advantages(advantages_b: torch.Tensor, teacher_logprobs_bt: torch.Tensor,
                            sampler_logprobs_bt: torch.Tensor, mask_bt: torch.Tensor, coef: float,
                            use_reward: bool = True) -> torch.Tensor:  # fmt: skip
    """Per-token advantages ``[B, T]`` of on-policy distillation: each sequence's advantage
    (when ``use_reward``) plus ``coef * (teacher_lp - sampler_lp)`` on each masked token, 0
    elsewhere.

    ``sampler_lp - teacher_lp`` is the per-token estimate of the reverse KL(student || teacher)
    on tokens the student sampled; as a negative per-token reward under the policy gradient it
    descends that KL with its score-function gradient (Agarwal et al. 2024, "On-Policy
    Distillation of Language Models", arXiv:2306.13649; the per-token form used by Qwen3 and
    Thinking Machines' on-policy distillation). A k3 penalty on the same tokens would only carry
    the pathwise gradient, whose expectation is the forward KL's.
    """
    if teacher_logprobs_bt.shape != sampler_logprobs_bt.shape or mask_bt.shape != teacher_logprobs_bt.shape:
        raise ValueError(
            f"teacher {tuple(teacher_logprobs_bt.shape)}, sampler {tuple(sampler_logprobs_bt.shape)} and mask "
            f"{tuple(mask_bt.shape)} log-probs must have the same [B, T] shape"
        )
    if advantages_b.shape != teacher_logprobs_bt.shape[:1]:
        raise ValueError(f"advantages must be [B] = ({mask_bt.shape[0]},), got {tuple(advantages_b.shape)}")
    gap_bt = (teacher_logprobs_bt.float() - sampler_logprobs_bt.float()).detach()
    base_bt = advantages_b.float()[:, None].expand_as(gap_bt) if use_reward else torch.zeros_like(gap_bt)
    return torch.where(mask_bt, base_bt + coef * gap_bt, 0.0)
