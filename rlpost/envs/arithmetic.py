"""The synthetic arithmetic tasks of the tiny model, generated offline from a seed.

Rows look like GSM8K rows reduced to their essentials: ``{"question": "What is 7 + 5?",
"answer": "12"}``. The completion is graded with the same answer format as GSM8K
(``<answer>...</answer>``, see :mod:`rlpost.envs.rewards`), so the demo and the tests exercise the
real reward path with no download.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ARITHMETIC_SYSTEM_PROMPT = "Answer with <answer>number</answer>."
TOOL_ARITHMETIC_SYSTEM_PROMPT = "Compute with a ```python block, then answer with <answer>number</answer>."


def make_arithmetic_rows(num_rows: int, *, seed: int = 0, max_operand: int = 10) -> list[dict[str, str]]:
    """``num_rows`` questions "What is a + b?" / "What is a - b?" with operands in [0, max_operand].

    The same seed always gives the same rows (a private ``random.Random``; no global state).
    """
    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}")
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-")
        result = a + b if op == "+" else a - b
        rows.append({"question": f"What is {a} {op} {b}?", "answer": str(result)})
    return rows


def make_tool_arithmetic_rows(num_rows: int, *, seed: int = 0) -> list[dict[str, str]]:
    """``num_rows`` questions "What is a * b?" with a in [100, 9999] and b in [10, 999]: products
    too large for a small model to work out in its head, so the way to the reward is the Python
    tool (the ``tool_arithmetic`` task). Same seed, same rows."""
    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}")
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        a, b = rng.randint(100, 9999), rng.randint(10, 999)
        rows.append({"question": f"What is {a} * {b}?", "answer": str(a * b)})
    return rows


def write_arithmetic_jsonl(path: str | Path, num_rows: int, *, seed: int = 0) -> Path:
    """Write :func:`make_arithmetic_rows` as a jsonl file that ``datasets`` loads as a local dataset."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in make_arithmetic_rows(num_rows, seed=seed):
            f.write(json.dumps(row) + "\n")
    return path
