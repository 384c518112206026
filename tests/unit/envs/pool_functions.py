"""User functions for the FunctionPool tests (tools and reward functions run in worker processes).

A worker imports the module of each function it runs; a test module imports torch, tensordict and
rlpost, seconds of a worker's start on 2 cores, paid again by each worker that replaces a killed
one. This module imports only the standard library, so the tests wait on what they check."""

from __future__ import annotations

import time


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def shout(text: str) -> str:
    print("this print goes to the worker's stderr, not the protocol")
    return text.upper()


def divide(a: int, b: int) -> float:
    return a / b


def sleepy(seconds: float) -> str:
    time.sleep(seconds)
    return "woke up"


def hanging_reward(completion: str, row: dict) -> float:
    if "hang" in completion:
        time.sleep(60)
    return 1.0


def flaky_reward(completion: str, row: dict) -> float:
    if "boom" in completion:
        raise ZeroDivisionError("boom")
    if "nan" in completion:
        return float("nan")
    return float(len(row["question"]) > 0) + 0.25
