"""Which samples of a group to train on: expert iteration's top-k, and subsets of oversampled
groups whose mean return carries a learning signal.

Plain Python over one float per sample (a group's rewards or returns); the transforms that read
them from TensorDicts are :class:`rlpost.data.TopKRewardSelector` and
:class:`rlpost.objectives.MCAdvantageSelector`, and rlpost's env pools call these functions on
their groups directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import combinations
from typing import Literal

SelectionStrategy = Literal["first", "uniform", "balanced"]
SELECTION_STRATEGIES: tuple[str, ...] = ("first", "uniform", "balanced")


def top_k_above_median(values: Sequence[float], k: int | None) -> list[int]:
    """Expert iteration's choice (TorchRL's ``TopKRewardSelector``): the indices of the values
    strictly above the group's median, best first, at most ``k`` of them (None: all of them).

    The median of an even count is the lower middle value (torch's ``median``). A group whose
    values are all equal gives ``[]``: nothing in it is better than the rest. Ties keep the
    earlier sample first.
    """
    if k is not None and k < 1:
        raise ValueError(f"k must be >= 1 (or None), got {k!r}")
    if not values:
        return []
    ordered = sorted(values)
    median = ordered[(len(ordered) - 1) // 2]
    above = [i for i, value in enumerate(values) if value > median]
    above.sort(key=lambda i: -values[i])
    return above if k is None else above[:k]


def mean_in_bounds(values: Sequence[float], indices: Sequence[int], bounds: tuple[float, float] | None) -> bool:
    """Whether the mean of ``values`` at ``indices`` is strictly inside ``bounds`` (None: any)."""
    if bounds is None:
        return True
    low, high = bounds
    mean = sum(values[i] for i in indices) / len(indices)
    return low < mean < high


def spread_indices(values: Sequence[float], size: int) -> list[int]:
    """``size`` indices spread evenly over the values sorted ascending (the ends included; the
    middle one for ``size == 1``)."""
    ordered = sorted(range(len(values)), key=values.__getitem__)
    if size == 1:
        return [ordered[len(ordered) // 2]]
    last = len(ordered) - 1
    return [ordered[round(position * last / (size - 1))] for position in range(size)]


def select_subset(values: Sequence[float], size: int, strategy: SelectionStrategy = "balanced",
                  bounds: tuple[float, float] | None = None,
                  max_combinations: int = 100_000) -> list[int] | None:  # fmt: skip
    """``size`` of the candidates ``values`` whose mean is strictly inside ``bounds``, or None
    when the strategy finds no such subset (the group is then dropped).

    - ``"first"``: the first ``size``.
    - ``"uniform"`` (and any strategy without bounds): spread over the sorted values.
    - ``"balanced"``: of every subset (while there are at most ``max_combinations``), the one
      whose mean is closest to the middle of ``bounds``, the widest spread of values breaking
      ties; beyond that count, a spread start and greedy swaps toward the bounds.

    With exactly ``size`` candidates every strategy takes them all (if their mean is inside).
    """
    if strategy not in SELECTION_STRATEGIES:
        raise ValueError(f"strategy must be one of {SELECTION_STRATEGIES}, got {strategy!r}")
    if len(values) < size:
        raise ValueError(f"Need at least {size} candidates, got {len(values)}.")
    if len(values) == size or strategy == "first":
        chosen = list(range(size))
    elif strategy == "uniform" or bounds is None:
        chosen = spread_indices(values, size)
    else:
        return _balanced(values, size, bounds, max_combinations)
    return chosen if mean_in_bounds(values, chosen, bounds) else None


def _balanced(values: Sequence[float], size: int, bounds: tuple[float, float],
              max_combinations: int) -> list[int] | None:  # fmt: skip
    low, high = bounds
    middle = 0.5 * (low + high)
    if math.comb(len(values), size) <= max_combinations:
        best, best_score = None, None
        for subset in combinations(range(len(values)), size):
            picked = [values[i] for i in subset]
            mean = sum(picked) / size
            if low < mean < high:
                score = (abs(mean - middle), -(max(picked) - min(picked)))
                if best_score is None or score < best_score:
                    best, best_score = list(subset), score
        return best
    # too many subsets: start spread out, then swap the worst-placed member for the best outsider
    chosen = spread_indices(values, size)
    if mean_in_bounds(values, chosen, bounds):
        return chosen
    too_low = sum(values[i] for i in chosen) / size <= low
    outsiders = sorted(set(range(len(values))) - set(chosen), key=values.__getitem__, reverse=too_low)
    members = sorted(chosen, key=values.__getitem__, reverse=not too_low)
    for incoming, outgoing in zip(outsiders, members):
        chosen[chosen.index(outgoing)] = incoming
        if mean_in_bounds(values, chosen, bounds):
            return chosen
    return None
