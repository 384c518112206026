"""The metrics of a learner step (pure functions): each pass combines its micro-batches'
(:func:`combine_micro_metrics`), passes are averaged (:func:`mean_dicts`), and
:func:`batch_metrics` adds what the samples say."""

from __future__ import annotations

import torch

from rlpost.data.samples import Sample

# Diagnostics that are token means over the loss tokens whatever the aggregation: combined over
# micro-batches weighted by their loss tokens (exact, except for ess, which is not a mean).
_TOKEN_MEAN_METRICS = (
    "clip_fraction",
    "clip_fraction_low",
    "clip_fraction_high",
    "kl_approx",
    "ess",
    "kl_to_ref",
    "entropy",
    "kl_to_inference",
    "sampling_logp_diff_mean",
    "off_policy_fraction",
)
_LOSS_METRICS = ("loss", "loss_objective", "loss_kl", "loss_entropy")


def combine_micro_metrics(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Loss terms: sum of the micro-batch losses (each over the whole batch's normaliser, so the
    sum is the full-batch loss); token-mean diagnostics: weighted by each micro-batch's loss
    tokens. A term no micro-batch reported (a custom loss's) is left out."""
    total_tokens = max(sum(n for _, n in parts), 1)
    out: dict[str, float] = {}
    for name in _LOSS_METRICS:
        if any(name in m for m, _ in parts):
            out[name] = sum(m.get(name, 0.0) for m, _ in parts)
    for name in _TOKEN_MEAN_METRICS:
        if any(name in m for m, _ in parts):
            out[name] = sum(m.get(name, 0.0) * n for m, n in parts) / total_tokens
    out.setdefault("kl_to_ref", 0.0)  # metrics.jsonl requires it; 0 without a reference
    return out


def mean_dicts(dicts: list[dict[str, float]]) -> dict[str, float]:
    """Mean over the optimizer steps of one learner step (lr: the last one's)."""
    out = {k: sum(d[k] for d in dicts) / len(dicts) for k in dicts[0]}
    out["lr"] = dicts[-1]["lr"]
    return out


def batch_metrics(rows: list[tuple[Sample, float]], version_at_start: int) -> dict[str, float]:
    """Rewards, lengths, staleness against ``version_at_start`` and the sampling policy's entropy."""
    rewards = torch.tensor([s.reward for s, _ in rows], dtype=torch.float64)
    staleness = [version_at_start - s.policy_version for s, _ in rows]
    lengths = [s.num_generated for s, _ in rows]
    metrics = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "num_samples": float(len(rows)),
        "num_tokens": float(sum(lengths)),  # loss (generated) tokens trained on
        "completion_len_mean": sum(lengths) / len(lengths),
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": float(max(staleness)),
        # the sampling policy's entropy, estimated by -log p of the tokens it generated: watched
        # for entropy collapse whether or not the loss has an entropy term
        "entropy_sampled": -sum(lp for s, _ in rows for lp, m in zip(s.logprobs, s.loss_mask) if m)
        / max(sum(lengths), 1),
    }
    # per token, where the samples say which version generated each (in-flight updates)
    labelled = [(s.policy_version, v) for s, _ in rows if s.token_versions
                for v, m in zip(s.token_versions, s.loss_mask) if m and v >= 0]  # fmt: skip
    if labelled:
        metrics["token_staleness_mean"] = sum(version_at_start - v for _, v in labelled) / len(labelled)
        metrics["inflight_token_fraction"] = sum(v > first for first, v in labelled) / len(labelled)
    return metrics
