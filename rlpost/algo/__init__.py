"""Pure GRPO math: group advantages (and on-policy distillation's per-token ones), KL estimators,
the clipped loss (PPO's or CISPO's) and its aggregations, the SFT losses, which samples of a
group to keep (top-k, balanced subsets), the chunked log-probs and entropies of the taken tokens
through the LM head, and the bins of sequence packing.

Imports torch only (no ray, vllm, transformers, tensordict or torch.distributed) so that it can
be tested and reused anywhere; tests/unit/algo/test_algo_purity.py enforces it. The TensorDict-facing
modules built on it live in ``rlpost.objectives``.
"""

from rlpost.algo.advantages import (
    ADVANTAGE_SCALES,
    AdvantageScale,
    distillation_advantages,
    group_advantages,
    scale_by_batch_std,
)
from rlpost.algo.chunked import chunked_logprobs_and_entropy, chunked_token_logprobs
from rlpost.algo.grpo import (
    AGGREGATIONS,
    OBJECTIVES,
    OFF_POLICY_CORRECTIONS,
    Aggregation,
    GRPOLossTerms,
    LossFunction,
    Objective,
    OffPolicyCorrection,
    effective_sample_size,
    grpo_loss,
    load_loss_function,
    loss_normaliser,
    masked_aggregate,
    trust_region_mask,
)
from rlpost.algo.kl import KL_ESTIMATORS, KLEstimator, k3_kl_token_estimate, kl_per_token
from rlpost.algo.packing import pack_lengths, packed_tokens
from rlpost.algo.selection import SELECTION_STRATEGIES, select_subset, top_k_above_median
from rlpost.algo.sft import minor_sft_loss, sequence_log_likelihood, sft_loss

__all__ = [
    "ADVANTAGE_SCALES",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "OBJECTIVES",
    "OFF_POLICY_CORRECTIONS",
    "SELECTION_STRATEGIES",
    "AdvantageScale",
    "Aggregation",
    "GRPOLossTerms",
    "KLEstimator",
    "LossFunction",
    "Objective",
    "OffPolicyCorrection",
    "chunked_logprobs_and_entropy",
    "chunked_token_logprobs",
    "distillation_advantages",
    "effective_sample_size",
    "group_advantages",
    "grpo_loss",
    "k3_kl_token_estimate",
    "kl_per_token",
    "load_loss_function",
    "loss_normaliser",
    "masked_aggregate",
    "minor_sft_loss",
    "pack_lengths",
    "packed_tokens",
    "scale_by_batch_std",
    "select_subset",
    "sequence_log_likelihood",
    "sft_loss",
    "top_k_above_median",
    "trust_region_mask",
]
