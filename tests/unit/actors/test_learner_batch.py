"""The learner's batch: splitting rows into micro-batches, packing them to a token budget."""

import pytest

from rlpost.actors.batch import collate_samples, split_rows, split_to_budget
from rlpost.algo.packing import packed_tokens
from rlpost.data.samples import Sample

pytestmark = pytest.mark.unit


def row(length: int, tag: int) -> tuple[Sample, float]:
    sample = Sample(
        prompt_id=tag,
        token_ids=[tag] * length,
        logprobs=[0.0] * length,
        loss_mask=[False] + [True] * (length - 1),
        prompt_len=1,
        reward=0.0,
        policy_version=0,
        finished=True,
    )
    return sample, float(tag)


def padded_size(pack) -> int:
    return collate_samples([s for s, _ in pack], pad_token_id=0).get(("tokens", "full")).numel()


def test_packs_stay_within_the_budget_and_keep_every_row_once():
    rows = [row(n, i) for i, n in enumerate([5, 30, 7, 12, 30, 3, 16, 9])]
    packs = split_to_budget(rows, 40)
    assert all(padded_size(pack) <= 40 for pack in packs)
    assert sorted(a for pack in packs for _, a in pack) == [float(i) for i in range(len(rows))]
    # longest first: the two 30-token rows cannot share (60 > 40), the short ones fill up
    assert [len(pack) for pack in packs] == [1, 1, 2, 4]
    for pack in packs:  # a pack keeps the rows' order
        tags = [a for _, a in pack]
        assert tags == sorted(tags)


def test_a_row_longer_than_the_budget_goes_alone():
    packs = split_to_budget([row(50, 0), row(4, 1), row(4, 2)], 16)
    assert [[a for _, a in pack] for pack in packs] == [[0.0], [1.0, 2.0]]


def test_a_budget_that_fits_everything_makes_one_pack():
    rows = [row(n, i) for i, n in enumerate([4, 8, 6])]
    assert split_to_budget(rows, 3 * 8) == [rows]
    with pytest.raises(ValueError, match="max_tokens"):
        split_to_budget(rows, 0)


def test_packed_micro_batches_count_the_bins_the_scorer_packs():
    """With sequence packing a micro-batch costs its bins x the longest row: more rows fit the
    same budget, and the count is the one pack_lengths gives."""
    lengths = [32, 4, 24, 4, 4, 20, 3, 4, 1]
    rows = [row(n, i) for i, n in enumerate(lengths)]
    padded = split_to_budget(rows, 96)
    assert [[len(s.token_ids) for s, _ in b] for b in padded] == [[32, 24, 20], [4, 4, 4, 3, 4, 1]]
    packed = split_to_budget(rows, 96, packed=True)
    assert packed == [rows]  # bins [32], [4, 24, 4], [4, 20, 3, 4, 1]: 3 x 32 tokens
    assert packed_tokens(lengths) == 96
    smaller = split_to_budget(rows, 64, packed=True)
    # longest first: 32 and 24 share the first (the 20 would need a third bin of 32), the rest
    # is [20], [4, 4, 4, 4, 3, 1] in bins of 20
    assert [[len(s.token_ids) for s, _ in b] for b in smaller] == [[32, 24], [4, 4, 4, 20, 3, 4, 1]]
    for batch in smaller:
        assert packed_tokens([len(s.token_ids) for s, _ in batch]) <= 64


def test_split_rows_makes_contiguous_slices_of_near_equal_size():
    assert split_rows(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_rows([1, 2], 5) == [[1], [2]]  # never an empty slice
