"""The batch the learner trains on and the reference scores: samples as one right-padded TensorDict.

Both read GRPOLoss's keys, so the reference scores exactly what the learner trains on::

    ("tokens", "full")                   [B, T] prompt + completion ids, padded with the pad id
    ("masks", "all_attention_mask")      [B, T] True on real tokens
    ("masks", "all_assistant_mask")      [B, T] True on the tokens the loss counts (generated)
    ("log_probs", "full")                [B, T] the engine's log-probs (0 on prompt and padding)
    ("ref_log_probs", "full")            [B, T] the reference's, when every sample has them
    "advantage", "policy_version", "reward"   [B]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict

from rlpost.data.samples import Group, Sample
from rlpost.objectives.grpo import ASSISTANT_MASK, ATTENTION_MASK, LOG_PROBS_FULL, REF_LOG_PROBS_FULL, TOKENS_FULL


def batch_rows(groups: Sequence[Group]) -> list[tuple[Sample, float]]:
    """The samples of ``groups`` in order, each with its advantage."""
    rows: list[tuple[Sample, float]] = []
    for group in groups:
        if len(group.advantages) != len(group.samples):
            raise ValueError(
                f"group of prompt {group.prompt_id}: {len(group.samples)} samples "
                f"but {len(group.advantages)} advantages"
            )
        rows.extend(zip(group.samples, group.advantages))
    if not rows:
        raise ValueError("a learner batch needs at least one sample; got no samples")
    return rows


def collate_samples(
    samples: Sequence[Sample], pad_token_id: int, advantages: Sequence[float] | None = None
) -> TensorDict:
    """``samples`` as the right-padded [B, T] TensorDict of the module docstring (padding: masks
    False, log-probs 0); ``advantages`` None: zeros, for scoring only."""
    if not samples:
        raise ValueError("a batch needs at least one sample; got no samples")
    if advantages is not None and len(advantages) != len(samples):
        raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
    for sample in samples:
        _check_sample(sample)
    num_rows, width = len(samples), max(len(s.token_ids) for s in samples)
    tokens_bt = torch.full((num_rows, width), pad_token_id, dtype=torch.long)
    attention_bt = torch.zeros((num_rows, width), dtype=torch.bool)
    assistant_bt = torch.zeros((num_rows, width), dtype=torch.bool)
    logprobs_bt = torch.zeros((num_rows, width), dtype=torch.float32)
    with_ref = all(s.ref_logprobs is not None for s in samples)
    ref_bt = torch.zeros((num_rows, width), dtype=torch.float32)
    for i, sample in enumerate(samples):
        n = len(sample.token_ids)
        tokens_bt[i, :n] = torch.tensor(sample.token_ids, dtype=torch.long)
        attention_bt[i, :n] = True
        assistant_bt[i, :n] = torch.tensor(sample.loss_mask, dtype=torch.bool)
        logprobs_bt[i, :n] = torch.tensor(sample.logprobs, dtype=torch.float32)
        if with_ref:
            ref_bt[i, :n] = torch.tensor(sample.ref_logprobs, dtype=torch.float32)
    data = {
        TOKENS_FULL: tokens_bt,
        ATTENTION_MASK: attention_bt,
        ASSISTANT_MASK: assistant_bt,
        LOG_PROBS_FULL: logprobs_bt,
        "advantage": torch.tensor(
            list(advantages) if advantages is not None else [0.0] * num_rows, dtype=torch.float32
        ),
        "policy_version": torch.tensor([s.policy_version for s in samples], dtype=torch.long),
        "reward": torch.tensor([s.reward for s in samples], dtype=torch.float32),
    }
    if with_ref:
        data[REF_LOG_PROBS_FULL] = ref_bt
    return TensorDict(data, batch_size=[num_rows])


def loss_tokens(batch: TensorDict) -> torch.Tensor:
    """The tokens the loss counts in a batch, [B, T]: the generated (assistant) tokens."""
    return batch.get(ASSISTANT_MASK) & batch.get(ATTENTION_MASK)


def split_rows(rows: Sequence, num_chunks: int) -> list[list]:
    """``num_chunks`` contiguous slices of ``rows`` (sizes differ by at most 1; never empty)."""
    num_chunks = max(1, min(num_chunks, len(rows)))
    size, extra = divmod(len(rows), num_chunks)
    bounds = [0]
    for i in range(num_chunks):
        bounds.append(bounds[-1] + size + (i < extra))
    return [list(rows[a:b]) for a, b in zip(bounds, bounds[1:])]


def split_to_budget(
    rows: Sequence[tuple[Sample, float]], max_tokens: int, *, packed: bool = False
) -> list[list[tuple[Sample, float]]]:
    """``rows`` (sample, advantage) in micro-batches of at most ``max_tokens`` tokens as the forward
    holds them: rows x the longest row when padded, or with ``packed`` the bins of
    :func:`rlpost.algo.packing.pack_lengths` x the longest row. Rows are taken longest first (little
    padding) and keep their order within a micro-batch; a row over ``max_tokens`` is alone. The
    loss does not depend on the split (every micro-batch is divided by the whole batch's normaliser).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0].token_ids))
    batches: list[list[int]] = []
    width = 0  # the longest row of the open micro-batch (its first: rows come longest first)
    room: list[int] = []  # packed: the free tokens of each of its bins (the model's rows)
    for i in order:
        length = len(rows[i][0].token_ids)
        if packed:  # first fit into the open micro-batch's bins, or one bin more
            slot = next((b for b, left in enumerate(room) if left >= length), None)
            model_rows = len(room) + (slot is None)
        else:
            model_rows = len(batches[-1]) + 1 if batches else 1
        if not batches or width * model_rows > max_tokens:
            batches.append([i])
            width, room = length, [0]
            continue
        batches[-1].append(i)
        if packed and slot is None:
            room.append(width - length)
        elif packed:
            room[slot] -= length
    return [[rows[i] for i in sorted(batch)] for batch in batches]


def _check_sample(sample: Sample) -> None:
    lengths = {len(sample.token_ids), len(sample.logprobs), len(sample.loss_mask)}
    if sample.ref_logprobs is not None:
        lengths.add(len(sample.ref_logprobs))
    if len(lengths) != 1 or not sample.token_ids:
        raise ValueError(
            f"sample of prompt {sample.prompt_id}: token_ids ({len(sample.token_ids)}), logprobs "
            f"({len(sample.logprobs)}), loss_mask ({len(sample.loss_mask)}) and ref_logprobs "
            f"must be non-empty and of one length"
        )
