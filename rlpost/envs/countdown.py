"""Countdown (the numbers round of the TV game, as in TinyZero's RL runs) with TorchRL's API:
:class:`CountdownEnv` and :class:`CountdownRewardParser`.

A problem is a few source numbers and a target; the answer is an arithmetic expression over the
numbers, each used at most once, with ``+``, ``-``, ``*``, ``/`` and parentheses, that equals the
target. Problems are generated offline (no dataset); the prompt and the reference are TorchRL's::

    query   "Using the numbers [3, 25, 4, 7], create an arithmetic expression that equals 112. ..."
    answer  "target=112, numbers=3,25,4,7"

The parser writes TorchRL's GRPO fields (see :mod:`rlpost.envs.gsm8k`): ``correct_reward`` (1.0)
when the first ``<answer>`` holds a valid expression equal to the target, else ``format_reward``
(0.1), 0.0 without one.

Deliberate deviations from TorchRL (each tested):

- Expressions are read with Python's parser and evaluated in exact fractions, never with
  ``eval``. Only the four operations, unary signs, parentheses and whole-number literals are
  accepted: TorchRL's character filter lets through ``**`` (``9**9**9**9`` hangs its step),
  ``//`` and decimal points, so ``2.5 * 4`` counted as using the numbers 2 and 5.
- The value must equal the target exactly (TorchRL: within 1e-9 in floats).
- Problems are rows of a fixed, seeded set (:class:`CountdownProblems`, ``num_rows`` of them,
  default a million; row ``i`` is a function of ``(row_seed, i)``), served in the seeded order of
  any rlpost dataset, so a run resumes exactly and env pools can shard it. TorchRL draws from an
  endless stream whose problems depend on how the DataLoader is iterated. ``row_seed`` defaults
  to ``seed``, else 0, so ``seed=None`` gives a fixed problem set in a random order.
- A target outside ``[1, max_target]`` falls back to the sum of the numbers, then to the largest
  number, so it never exceeds ``max_target`` (TorchRL's sum fallback can).
- ``dataset=`` also takes a dataset: rows with TorchRL's ``query`` and ``answer``, or with
  ``target`` and ``nums`` (or ``numbers``) columns, as in the public Countdown task sets.
- A reference that is not in the ``target=..., numbers=...`` form scores 0 and is counted in
  ``errors["ValueError"]`` (TorchRL stops with an ``AttributeError``).
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any, Literal

import torch

from rlpost.envs.chat import ChatEnv, DatasetChatEnv
from rlpost.envs.gsm8k import GSM8KRewardParser, task_env_kwargs

__all__ = [
    "COUNTDOWN_SYSTEM_PROMPT", "CountdownColumns", "CountdownEnv", "CountdownProblems", "CountdownRewardParser",
    "countdown_answer", "countdown_query",
]  # fmt: skip

# TorchRL's CountdownEnv.SYSTEM_PROMPT, word for word (line breaks included).
COUNTDOWN_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user gives a set of numbers and a target. The Assistant "
    "must find an arithmetic expression using each given number at most once that equals the target.\n"
    "The reasoning process and answer are enclosed within <think></think> and <answer></answer> tags, "
    "respectively.\n"
    "The answer should contain ONLY the arithmetic expression (e.g. (25 + 3) * 4)."
)

_EXPRESSION_CHARS = re.compile(r"[0-9\s+\-*/()]+", re.ASCII)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_TARGET = re.compile(r"target\s*=\s*(-?\d+)")
_NUMBERS = re.compile(r"numbers\s*=\s*\[?\s*(\d+(?:\s*,\s*\d+)*)")


class _NotAllowed(Exception):
    """An expression node outside Countdown's rules."""


# ---------------------------------------------------------------------------- the problems


def countdown_query(target: int, numbers: Sequence[int]) -> str:
    """TorchRL's prompt of a problem (the numbers are written as a Python list)."""
    return (
        f"Using the numbers {list(numbers)}, create an arithmetic expression that equals {target}. "
        "You may use each number at most once. Only use +, -, *, / and parentheses."
    )


def countdown_answer(target: int, numbers: Sequence[int]) -> str:
    """TorchRL's reference string of a problem: ``"target=112, numbers=3,25,4,7"``."""
    return f"target={target}, numbers={','.join(str(n) for n in numbers)}"


class CountdownProblems:
    """``num_rows`` Countdown problems, made on demand: row ``i`` draws ``num_count`` numbers in
    ``[1, max_number]`` seeded with ``(seed, i)``, then a reachable target (the numbers in a random
    order with random ``+``, ``-``, ``*``, absolute value; outside ``[1, max_target]``, their sum,
    else the largest). It has the parts of a ``datasets.Dataset`` the primer reads (``len``,
    ``[i]``, ``column_names``)."""

    column_names = ["query", "answer", "target", "numbers"]

    def __init__(self, num_rows: int, *, num_count: int = 4, max_number: int = 100, max_target: int = 1000,
                 seed: int = 0) -> None:  # fmt: skip
        for key, value, low in (("num_rows", num_rows, 1), ("num_count", num_count, 1), ("max_number", max_number, 1)):
            if value < low:
                raise ValueError(f"CountdownEnv {key} must be >= {low}, got {value}")
        if max_target < max_number:
            raise ValueError(
                f"CountdownEnv max_target ({max_target}) must be >= max_number ({max_number}): a single number must "
                "be a valid target"
            )
        self.num_rows, self.num_count, self.max_number, self.max_target = num_rows, num_count, max_number, max_target
        self.seed = int(seed)

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_rows:
            raise IndexError(f"CountdownProblems has {self.num_rows} rows, got index {index}")
        rng = random.Random(f"countdown:{self.seed}:{index}")  # a str seed hashes the same on every run
        numbers = [rng.randint(1, self.max_number) for _ in range(self.num_count)]
        target = self._target(rng, numbers)
        return {
            "query": countdown_query(target, numbers), "answer": countdown_answer(target, numbers),
            "target": target, "numbers": numbers,
        }  # fmt: skip

    def _target(self, rng: random.Random, numbers: list[int]) -> int:
        order = rng.sample(numbers, len(numbers))
        value = order[0]
        for number in order[1:]:
            value = _BINARY[rng.choice((ast.Add, ast.Sub, ast.Mult))](value, number)
        for candidate in (abs(value), sum(numbers)):
            if 1 <= candidate <= self.max_target:
                return candidate
        return max(numbers)

    def __repr__(self) -> str:
        return (
            f"CountdownProblems(num_rows={self.num_rows}, num_count={self.num_count}, max_number={self.max_number}, "
            f"max_target={self.max_target}, seed={self.seed})"
        )


class CountdownColumns:
    """CountdownEnv's collate function: a row lacking the query key or ``answer`` gets TorchRL's
    query and reference from ``target`` and ``nums`` (or ``numbers``); rows or one row."""

    def __init__(self, data_key: str = "query") -> None:
        self.data_key = data_key

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            return self._complete(dict(batch))
        return [self._complete(dict(row)) for row in batch]

    def _complete(self, row: dict[str, Any]) -> dict[str, Any]:
        if self.data_key in row and "answer" in row:
            return row
        numbers = row.get("nums", row.get("numbers"))
        if "target" not in row or numbers is None:
            raise ValueError(
                f"Countdown rows need {self.data_key!r} and 'answer' columns, or 'target' and 'nums' (or 'numbers'); "
                f"this row has the columns {sorted(row)}"
            )
        target, numbers = int(row["target"]), [int(n) for n in numbers]
        row.setdefault(self.data_key, countdown_query(target, numbers))
        row.setdefault("answer", countdown_answer(target, numbers))
        return row


# ---------------------------------------------------------------------------- the reward


def _literals(node: ast.AST) -> list[int]:
    """The whole-number literals of an expression tree; ``_NotAllowed`` for any other node."""
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _literals(node.left) + _literals(node.right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _literals(node.operand)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return [node.value]
    raise _NotAllowed(type(node).__name__)


def _evaluate(node: ast.AST) -> Fraction:
    """The exact value of a tree :func:`_literals` accepted (``ZeroDivisionError`` on ``/0``)."""
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_evaluate(node.operand))
    return Fraction(node.value)


class CountdownRewardParser(GSM8KRewardParser):
    """TorchRL's Countdown reward (module docstring): GSM8K's fields and arguments but the
    math-verify ones; the answer is judged by :meth:`validate_expression`."""

    def __init__(
        self,
        tokenizer: Any = None,
        in_keys: Sequence[Any] | None = None,
        out_keys: Sequence[Any] | None = None,
        eos_token: str | None = None,
        set_done_if_answer: bool = True,
        input_mode: Literal["history", "text", "tokens"] | None = None,
        format_reward: float = 0.1,
        correct_reward: float = 1.0,
        *,
        answer_key: str | None = None,
        strict_format: bool = False,
    ) -> None:
        super().__init__(
            tokenizer, in_keys, out_keys, eos_token, set_done_if_answer, input_mode, format_reward, correct_reward,
            answer_key=answer_key, strict_format=strict_format, use_math_verify=False,
        )  # fmt: skip

    @staticmethod
    def validate_expression(expression: str, target: int, numbers: Sequence[int]) -> bool:
        """Whether ``expression`` uses only ``+ - * /``, unary signs, parentheses and whole
        numbers, each one of ``numbers`` (each given number at most once), and equals ``target``
        exactly. Malformed input is False, never an error."""
        if not _EXPRESSION_CHARS.fullmatch(expression):
            return False
        try:
            tree = ast.parse(expression.strip(), mode="eval").body
            used = _literals(tree)
        except (SyntaxError, ValueError, RecursionError, MemoryError, _NotAllowed):
            return False
        available = list(numbers)
        for number in used:
            if number not in available:
                return False
            available.remove(number)
        try:  # at most len(numbers) literals: the value is cheap to compute exactly
            return _evaluate(tree) == target
        except (ZeroDivisionError, RecursionError):
            return False

    @staticmethod
    def parse_ground_truth(answer: str) -> tuple[int, list[int]]:
        """``(target, numbers)`` of a reference ``"target=112, numbers=3,25,4,7"`` (TorchRL's
        format; ``numbers=[3, 25]`` is read too). Another form raises ``ValueError``."""
        text = answer if isinstance(answer, str) else str(answer)
        target, numbers = _TARGET.search(text), _NUMBERS.search(text)
        if target is None or numbers is None:
            raise ValueError(f"Countdown reference is not 'target=<int>, numbers=<int>,<int>,...': {text[:200]!r}")
        return int(target.group(1)), [int(n) for n in re.findall(r"\d+", numbers.group(1))]

    def reference(self, answer_field: Any) -> tuple[int, list[int]]:
        return self.parse_ground_truth(answer_field)

    def judge(self, answer: str, reference: tuple[int, list[int]]) -> tuple[bool, str | None]:
        target, numbers = reference
        return self.validate_expression(answer, target, numbers), None

    def __repr__(self) -> str:
        return f"CountdownRewardParser(answer_key={self.answer_key!r}, strict_format={self.strict_format})"


# ---------------------------------------------------------------------------- the env


class CountdownEnv(DatasetChatEnv):
    """Countdown as a chat env, with TorchRL's keywords: generated problems, no download.

    Each reset writes the prompt under ``query`` and the reference under ``answer`` (plus
    ``target`` and ``numbers``); a :class:`CountdownRewardParser` scores it. Keywords: TorchRL's
    ``num_count`` (numbers per problem), ``max_number``, ``max_target``; ``shuffle`` is the order
    rows are served in; ``collate_fn`` defaults to :class:`CountdownColumns`; the others are
    :class:`~rlpost.envs.gsm8k.GSM8KEnv`'s, plus rlpost's ``dataset`` (rows instead of generated
    ones: ``query``/``answer``, or ``target`` and ``nums``/``numbers``), ``num_rows`` (problems
    generated) and ``row_seed`` (their seed; default ``seed``, else 0; ``seed`` sets the order).
    """

    SYSTEM_PROMPT = COUNTDOWN_SYSTEM_PROMPT

    def __init__(
        self, *, num_count: int = 4, max_number: int = 100, max_target: int = 1000, shuffle: bool = True,
        num_envs: int = 1, repeats: int | None = None, batch_size_dl: int = 1, seed: int | None = None,
        group_repeats: bool = False, tokenizer: Any = None, device: torch.device | str | None = None,
        template_kwargs: dict[str, Any] | None = None, apply_template: bool | None = False, compute_reward: bool = True,
        collate_fn: Callable | None = None, max_steps: int | None = 1,
        input_mode: Literal["history", "text", "tokens"] = "history", dataset: Any = None, num_rows: int = 1_000_000,
        row_seed: int | None = None, name: str | None = None, split: str | None = "train", data_key: str | None = None,
        system_prompt: str | None = None, num_shards: int = 1, shard_index: int = 0, strict_format: bool = False,
    ) -> None:  # fmt: skip
        self.num_count, self.max_number, self.max_target = num_count, max_number, max_target
        if dataset is None:
            problem_seed = row_seed if row_seed is not None else (seed or 0)
            dataset = CountdownProblems(
                num_rows, num_count=num_count, max_number=max_number, max_target=max_target, seed=problem_seed
            )
        if collate_fn is None:
            collate_fn = CountdownColumns(data_key or ChatEnv.data_key)
        super().__init__(**task_env_kwargs(locals(), answer_column="answer"))
        if compute_reward:
            self.append_transform(CountdownRewardParser(tokenizer=tokenizer, strict_format=strict_format))
