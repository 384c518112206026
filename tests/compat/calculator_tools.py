"""The calculator tools of TorchRL's tool tests, as module-level functions (SimpleToolTransform
runs its tools in worker processes, which import the module of each function they run).

Only the standard library is imported, so a worker starts in well under a second."""

from __future__ import annotations

import random
import time


def calculator(operation: str, a: float, b: float) -> dict:
    """Add or multiply ``a`` and ``b``: ``{"result": ...}``; another operation raises ``ValueError``."""
    if operation == "add":
        return {"result": a + b}
    if operation == "multiply":
        return {"result": a * b}
    raise ValueError(f"Unknown operation: {operation}")


def delayed_calculator(operation: str, a: float, b: float) -> dict:
    """:func:`calculator` after a random wait of 0.1 to 0.3 s, which it reports under ``"delay"``."""
    delay = random.uniform(0.1, 0.3)
    time.sleep(delay)
    return {**calculator(operation, a, b), "delay": delay}


CALCULATOR_SCHEMA = {
    "name": "calculator",
    "description": "A simple calculator that can add or multiply two numbers",
    "parameters": {
        "type": "object",
        "properties": {
            "operation": {"type": "string", "enum": ["add", "multiply"]},
            "a": {"type": "number"},
            "b": {"type": "number"},
        },
        "required": ["operation", "a", "b"],
    },
}
