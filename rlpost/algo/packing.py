"""Sequence packing: rows of different lengths laid end to end in a few rows of one width.

A micro-batch padded to its longest row spends most of its tokens on padding when lengths are
skewed (the norm in reasoning RL: a few long completions, many short ones). Packing places the
rows end to end instead, in *bins* whose width is the longest row, each row keeping its own
position ids (0, 1, ... from its first token) and attending only within itself::

    padded [4 rows x 8]          packed [2 bins x 8]
    a a a a a a a a              a a a a a a a a
    b b . . . . . .              b b c c c d d .      positions 0 1 0 1 2 0 1 0
    c c c . . . . .
    d d . . . . . .

:func:`pack_lengths` chooses the bins (first fit, longest first); every bin is at most as wide as
the longest row, so a packed micro-batch never costs more tokens, nor more attention per bin,
than the padded one.
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_lengths(lengths: Sequence[int], capacity: int | None = None) -> list[list[int]]:
    """Bins of row indices whose lengths sum to at most ``capacity`` (default: the longest
    length), first fit with the longest rows first; within a bin rows keep their order in
    ``lengths``, and bins come in the order they were opened. A row longer than ``capacity``
    gets a bin of its own."""
    if not lengths:
        return []
    if min(lengths) < 0:
        raise ValueError(f"lengths must be >= 0, got {min(lengths)}")
    capacity = max(lengths) if capacity is None else capacity
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((b for b, left in enumerate(room) if left >= lengths[i]), None)
        if slot is None:
            bins.append([i])
            room.append(capacity - lengths[i])
        else:
            bins[slot].append(i)
            room[slot] -= lengths[i]
    return [sorted(b) for b in bins]


def packed_tokens(lengths: Sequence[int], capacity: int | None = None) -> int:
    """Tokens a packed batch holds: bins x the longest row (what the model's forward computes)."""
    return len(pack_lengths(lengths, capacity)) * max(lengths, default=0)
