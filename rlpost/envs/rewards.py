"""The answer-format reward shared by GSM8K and the tiny model's arithmetic task, and user rewards.

A completion answers with ``<think>...</think><answer>...</answer>``; the reward looks only at the
last ``<answer>`` (DeepSeek-R1-style format reward, as in the GSM8K environments of the seed
systems):

    reward = 1.0  if normalize(answer) == normalize(target)
             0.1  if an answer tag is present but the answer is wrong
             0.0  otherwise, or when text follows the last ``</answer>`` (the answer must end the
                  completion, as in R1's strict format reward)

Trap: without the last rule what the policy writes after ``</answer>`` is reward-free, nothing
holds the end-of-sequence token up, and the tiny model drifted within 25 GRPO steps from
"<answer>8</answer><|im_end|>" to "<answer>8</answer>0</answer>1</answer>..." up to ``max_tokens``
(twice the tokens per step, and answers spoilt by a stray ``<answer>``).
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from rlpost.runtime.dotted import load_callable

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
CORRECT_REWARD, FORMAT_REWARD = 1.0, 0.1

_NUMBER_RE = re.compile(r"-?(\d+|\d*\.\d+)")


def extract_answer(completion: str) -> str | None:
    """The stripped content of the last ``<answer>`` tag, or None. An unclosed last tag takes the
    rest of the text: generation usually stops *at* ``</answer>`` (a stop string, which engines
    strip from the output), so text ending inside the tag is the normal case."""
    start = completion.rfind(ANSWER_OPEN)
    if start < 0:
        return None
    content = completion[start + len(ANSWER_OPEN) :]
    end = content.find(ANSWER_CLOSE)
    return (content if end < 0 else content[:end]).strip()


def _text_after_answer(completion: str) -> bool:
    """Whether anything but whitespace follows the ``</answer>`` that closes the last answer."""
    start = completion.rfind(ANSWER_OPEN)
    end = completion.find(ANSWER_CLOSE, start)
    return end >= 0 and bool(completion[end + len(ANSWER_CLOSE) :].strip())


def has_answer(completion: str) -> bool:
    """Whether the completion contains an answer, which ends a GSM8K/arithmetic episode."""
    return extract_answer(completion) is not None


def normalize_answer(answer: str) -> str:
    """The comparable form of a numeric answer: ``" $1,234.50. "`` -> ``"1234.5"``; without
    whitespace, commas, ``$``, a trailing ``.`` and a leading ``+``, numbers written canonically
    (``".5"`` -> ``"0.5"``, ``"007"`` -> ``"7"``, ``"-0"`` -> ``"0"``); other text kept as is."""
    text = re.sub(r"[\s,$]", "", answer).rstrip(".")
    if text.startswith("+"):
        text = text[1:]
    if not _NUMBER_RE.fullmatch(text):
        return text
    # String operations, not int()/float(): exact for any length and any number of decimals.
    sign, digits = ("-", text[1:]) if text.startswith("-") else ("", text)
    whole, _, fraction = digits.partition(".")
    whole, fraction = whole.lstrip("0") or "0", fraction.rstrip("0")
    number = whole + ("." + fraction if fraction else "")
    return number if number == "0" else sign + number


def gsm8k_target(answer_field: Any) -> str:
    """The reference answer of a GSM8K answer field: the stripped text after its last ``####``
    (``ValueError`` without one, or with nothing after it)."""
    text = answer_field if isinstance(answer_field, str) else str(answer_field)
    marker = text.rfind("####")
    target = text[marker + 4 :].strip() if marker >= 0 else ""
    if not target:
        preview = text if len(text) <= 200 else text[:200] + "..."
        raise ValueError(f"GSM8K answer has no final answer after '####': {preview!r}")
    return target


def parse_gsm8k_target(answer_field: str) -> str:
    """The normalised :func:`gsm8k_target`."""
    return normalize_answer(gsm8k_target(answer_field))


def final_answer(completion: str) -> str | None:
    """The last answer (:func:`extract_answer`), or None when there is none or anything but
    whitespace follows its ``</answer>``."""
    answer = extract_answer(completion)
    return None if answer is None or _text_after_answer(completion) else answer


def answer_reward(completion: str, target: str) -> float:
    """1.0 if the last answer equals ``target`` once both are normalised, 0.1 if it is wrong, 0.0
    if there is no answer tag or text other than whitespace follows its ``</answer>``."""
    answer = final_answer(completion)
    if answer is None:
        return 0.0
    return CORRECT_REWARD if normalize_answer(answer) == normalize_answer(target) else FORMAT_REWARD


RewardFn = Callable[[str, Mapping[str, Any]], float]


def call_user_reward(fn: RewardFn, completion: str, row: Mapping[str, Any]) -> tuple[float, str | None]:
    """``(fn(completion, row), None)``, or ``(0.0, error type name)`` when it fails, so that one
    bad sample never stops an env: an exception (``SystemExit`` included), a non-number, or a
    NaN/inf (:func:`reward_value`), which would poison the group's advantages.
    ``KeyboardInterrupt`` still propagates: it is the operator's, not the function's.
    """
    try:
        value = fn(completion, row)
    except (Exception, SystemExit) as exc:  # reported as the result's error type
        return 0.0, type(exc).__name__
    return reward_value(value)


def reward_value(value: Any) -> tuple[float, str | None]:
    """``(float(value), None)`` for a finite number; ``(0.0, error type name)`` otherwise (the
    ``TypeError``/``ValueError`` of ``float()``, or ``"NonFiniteReward"`` for NaN/inf)."""
    try:
        reward = float(value)
    except (TypeError, ValueError) as exc:
        return 0.0, type(exc).__name__
    if not math.isfinite(reward):
        return 0.0, "NonFiniteReward"
    return reward, None


def load_reward_fn(dotted_path: str) -> RewardFn:
    """The reward function at ``"package.module:function"`` or ``"package.module.function"``
    (:func:`rlpost.runtime.dotted.load_callable`; its ValueError names the path)."""
    return load_callable(dotted_path, "reward function")


def add_reward(next_td: TensorDictBase, rewards: list[float]) -> TensorDictBase:
    """``next_td["reward"] += rewards`` (one per env), keeping the ``[B, 1]`` float32 layout."""
    reward = next_td.get("reward")
    next_td.set("reward", reward + torch.tensor(rewards, dtype=reward.dtype, device=reward.device).view_as(reward))
    return next_td


def end_episodes(next_td: TensorDictBase, ended: Sequence[bool]) -> TensorDictBase:
    """Set ``terminated`` and ``done`` in the rows where ``ended`` holds (one flag per env)."""
    done = next_td.get("done")
    flags = torch.tensor(list(ended), dtype=torch.bool, device=done.device).view_as(done)
    for key in ("terminated", "done"):
        next_td.set(key, next_td.get(key) | flags)
    return next_td


def count_failure(errors: Counter, error: str, log: logging.Logger, message: str, *args: Any) -> str:
    """Count a sample scored 0 by a failure, by type, in a reward's ``errors`` (an env sums them in
    ``reward_errors``); the first of each type is logged (``message % args``). Returns ``error``."""
    if not errors[error]:
        log.warning(message, *args)
    errors[error] += 1
    return error
