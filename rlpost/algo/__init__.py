"""Pure GRPO math: group advantages, KL estimators, the clipped loss and its aggregations, and
the chunked log-probs and entropies of the taken tokens through the LM head, and the bins of
sequence packing.

Imports torch only (no ray, vllm, transformers, tensordict or torch.distributed) so that it can
be tested and reused anywhere; tests/unit/test_algo_purity.py enforces it. The TensorDict-facing
modules built on it live in ``rlpost.objectives``.
"""

from rlpost.algo.advantages import ADVANTAGE_SCALES, AdvantageScale, group_advantages
from rlpost.algo.chunked import chunked_logprobs_and_entropy, chunked_token_logprobs
from rlpost.algo.grpo import (
    AGGREGATIONS,
    OFF_POLICY_CORRECTIONS,
    Aggregation,
    GRPOLossTerms,
    LossFunction,
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

__all__ = [
    "ADVANTAGE_SCALES",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "OFF_POLICY_CORRECTIONS",
    "AdvantageScale",
    "Aggregation",
    "GRPOLossTerms",
    "KLEstimator",
    "LossFunction",
    "OffPolicyCorrection",
    "chunked_logprobs_and_entropy",
    "chunked_token_logprobs",
    "effective_sample_size",
    "group_advantages",
    "grpo_loss",
    "k3_kl_token_estimate",
    "kl_per_token",
    "load_loss_function",
    "loss_normaliser",
    "masked_aggregate",
    "pack_lengths",
    "packed_tokens",
    "trust_region_mask",
]
