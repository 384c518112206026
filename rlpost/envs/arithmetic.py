"""The synthetic arithmetic tasks of the tiny model, generated offline from a seed.

Rows are GSM8K rows reduced to ``{"question": "What is 7 + 5?", "answer": "12"}``, graded with
GSM8K's answer format (:mod:`rlpost.envs.rewards`), so the demo and the tests exercise the real
reward path with no download.

Splits: a fixed eighth of the questions is held out (:func:`is_held_out`, a hash of the text):
``"train"`` never draws them, ``"test"`` only them (evaluation on questions RL never saw), None
any (the tiny model's supervised warm-start data).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable

ARITHMETIC_SYSTEM_PROMPT = "Answer with <answer>number</answer>."
TOOL_ARITHMETIC_SYSTEM_PROMPT = "Compute with a ```python block, then answer with <answer>number</answer>."


SPLITS = (None, "train", "test")
HELD_OUT_BUCKETS = 8  # one question in this many is held out for evaluation


def is_held_out(question: str) -> bool:
    """Whether ``question`` belongs to the held-out (test) split: a fixed hash of its text, the
    same on every machine and Python version."""
    return zlib.crc32(question.encode()) % HELD_OUT_BUCKETS == 0


def make_arithmetic_rows(
    num_rows: int, *, seed: int = 0, max_operand: int = 10, split: str | None = None
) -> list[dict[str, str]]:
    """``num_rows`` questions "What is a + b?" / "What is a - b?" with operands in [0, max_operand];
    the same seed and split give the same rows (a private ``random.Random``)."""

    def draw(rng: random.Random) -> dict[str, str]:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-")
        return {"question": f"What is {a} {op} {b}?", "answer": str(a + b if op == "+" else a - b)}

    return _draw_rows(draw, num_rows, seed, split)


def make_tool_arithmetic_rows(num_rows: int, *, seed: int = 0, split: str | None = None) -> list[dict[str, str]]:
    """``num_rows`` questions "What is a * b?" with a in [100, 9999] and b in [10, 999]: too large
    for a small model's head, so the way to the reward is the Python tool (``tool_arithmetic``)."""

    def draw(rng: random.Random) -> dict[str, str]:
        a, b = rng.randint(100, 9999), rng.randint(10, 999)
        return {"question": f"What is {a} * {b}?", "answer": str(a * b)}

    return _draw_rows(draw, num_rows, seed, split)


def _draw_rows(draw: Callable[[random.Random], dict[str, str]], num_rows: int, seed: int,
               split: str | None) -> list[dict[str, str]]:  # fmt: skip
    """``num_rows`` rows from ``draw``, keeping only those of ``split``."""
    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} for the synthetic arithmetic tasks, got {split!r}")
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    while len(rows) < num_rows:
        row = draw(rng)
        if split is None or is_held_out(row["question"]) == (split == "test"):
            rows.append(row)
    return rows
