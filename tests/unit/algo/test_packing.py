"""Sequence packing's bins: first fit, longest first, never wider than the longest row."""

import random

import pytest

from rlpost.algo.packing import pack_lengths, packed_tokens

pytestmark = pytest.mark.unit


def test_bins_hold_every_row_once_within_the_capacity():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 30))]
        bins = pack_lengths(lengths)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(b == sorted(b) for b in bins)  # rows keep their order within a bin
        assert all(sum(lengths[i] for i in b) <= max(lengths) for b in bins)
        assert packed_tokens(lengths) <= len(lengths) * max(lengths)  # never more than padding


def test_skewed_lengths_pack_into_fewer_rows():
    # half the rows 8x shorter than the longest: 4 long rows alone, the 4 short ones share one
    assert pack_lengths([64, 8, 64, 8, 64, 8, 64, 8]) == [[0], [2], [4], [6], [1, 3, 5, 7]]
    assert packed_tokens([64, 8, 64, 8, 64, 8, 64, 8]) == 5 * 64  # padded: 8 * 64
    assert pack_lengths([5, 3, 2], capacity=5) == [[0], [1, 2]]
    assert pack_lengths([9, 2], capacity=4) == [[0], [1]]  # a row over the capacity: a bin of its own
    assert pack_lengths([]) == [] and packed_tokens([]) == 0


def test_bad_input():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        pack_lengths([1, 2], capacity=0)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        pack_lengths([1, -2])
