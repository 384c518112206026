"""MATH (Hendrycks et al. 2021, "Measuring Mathematical Problem Solving With the MATH Dataset") with
TorchRL's API: :class:`MATHEnv` and :class:`MATHRewardParser`.

A MATH row is a competition problem and a worked solution whose final answer is in ``\\boxed{}``
(``problem``, ``level``, ``type``, ``solution``). The parser writes TorchRL's GRPO fields (see
:mod:`rlpost.envs.gsm8k`), judging the first answer tag against the solution's last
``\\boxed{...}``: right when both are equal once normalised
(:meth:`MATHRewardParser.normalize_answer`) or when math-verify finds them equivalent
(``\\frac{1}{2}`` and ``0.5``, ``x^2+1`` and ``1+x^2``), in a worker with a wall-clock limit as
for GSM8K (:mod:`rlpost.envs.math_verify_check`).

Deliberate deviations from TorchRL (each tested):

- TorchRL hands math-verify the bare answer and the bare boxed reference; math-verify reads LaTeX
  only inside math delimiters, so it finds nothing in many MATH answers (``x^2+1``,
  ``\\dfrac{\\sqrt{3}}{2}``, ``(1,2)``) and TorchRL then scores even an answer identical to the
  reference as wrong (0.1). Here identical answers (after normalisation) are right without
  math-verify, and both sides are wrapped in ``$...$`` before math-verify reads them. TorchRL
  also passes the prediction as math-verify's gold; here the reference is the gold.
- Commas are kept by the normalisation, except as thousands separators (``1,000``): TorchRL
  drops every comma, so the answer ``12`` matched the reference ``1, 2`` (two solutions).
- The reference is read as the MATH paper's grader reads it: the last ``\\boxed{...}``,
  ``\\fbox{...}`` or ``\\boxed x`` form; an unclosed box takes the rest of the text (TorchRL:
  ``\\boxed{`` only, and an unclosed box loses its last character). A solution without a box is
  its own reference, as in TorchRL (so a dataset whose answer column holds the bare answer
  works); an empty box scores 0 and is counted in ``errors["ValueError"]``.
- :meth:`MATHRewardParser.answers_match` is a method, not a static method: it uses the parser's
  worker pool and time limit. A check past ``verify_timeout_s`` scores 0, counted in
  ``errors["Timeout"]`` (TorchRL's check has no limit: a hard expression can hang the step).
- The GSM8K parser's deviations hold too (``[B, 1]`` fields, ``strict_format``, errors counted).
- :class:`MATHEnv` writes TorchRL's reset keys (``query``, ``answer``, ``level``, ``type``) by
  renaming columns (:class:`MATHColumns`); a dataset's own ``answer`` column (a short final
  answer) is kept rather than replaced by the solution.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from rlpost.envs.chat import ChatEnv, DatasetChatEnv
from rlpost.envs.gsm8k import GSM8KRewardParser, task_env_kwargs

__all__ = ["MATH_SYSTEM_PROMPT", "MATHColumns", "MATHEnv", "MATHRewardParser", "last_boxed"]

# TorchRL's MATHEnv.SYSTEM_PROMPT, word for word (line breaks included).
MATH_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a math problem, and the Assistant solves it.\n"
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer.\n"
    "The reasoning process and answer are enclosed within <think></think> and <answer></answer> tags, "
    "respectively, i.e.,\n"
    "<think>reasoning process here</think> <answer>answer here</answer>.\n"
    "The answer should be a mathematical expression (use LaTeX if needed)."
)

# LaTeX that changes nothing in an answer's value: spacing commands, \left / \right, whitespace, $
_NO_VALUE = re.compile(r"\\[,;:!]|\\left(?![A-Za-z])|\\right(?![A-Za-z])|\s+|\$")
_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")
_BOX_OPENERS = ("\\boxed{", "\\fbox{", "\\boxed ")


def last_boxed(text: str) -> str | None:
    """The stripped content of the last ``\\boxed{...}``, ``\\fbox{...}`` or ``\\boxed x`` (up to
    the next ``$``) in ``text``, None without one. Braces nest; an unclosed box takes the rest."""
    start, opener = max((text.rfind(o), o) for o in _BOX_OPENERS)
    if start < 0:
        return None
    body = text[start + len(opener) :]
    if opener == "\\boxed ":
        if not body.lstrip().startswith("{"):
            return body.split("$", 1)[0].strip()
        body = body.lstrip()[1:]  # "\\boxed {x}": the brace form after all
    depth = 1
    for index, char in enumerate(body):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return body[:index].strip()
    return body.strip()


def inline_math(text: str) -> str:
    """``text`` as inline LaTeX (``$...$``), the form in which math-verify reads an expression."""
    return "$" + text.strip().strip("$").strip() + "$"


class MATHRewardParser(GSM8KRewardParser):
    """TorchRL's MATH reward (module docstring): GSM8K's fields and arguments, answers compared as
    LaTeX; ``use_math_verify=False`` is the normalised string comparison only (TorchRL's fallback).
    """

    @staticmethod
    def extract_boxed(text: str) -> str:
        """The reference of a solution: the content of its last box (:func:`last_boxed`), or the
        whole stripped text when it has none (TorchRL's fallback)."""
        boxed = last_boxed(text)
        return text.strip() if boxed is None else boxed

    @staticmethod
    def normalize_answer(answer: str) -> str:
        """A MATH answer without whitespace, ``$``, ``\\left``/``\\right`` and spacing commands,
        ``\\dfrac``/``\\tfrac`` as ``\\frac``, and without thousands separators (other commas,
        as in ``(1,2)``, are kept)."""
        text = _NO_VALUE.sub("", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
        return text.replace(",", "") if _THOUSANDS.fullmatch(text) else text

    def reference(self, answer_field: Any) -> str:
        solution = answer_field if isinstance(answer_field, str) else str(answer_field)
        reference = self.extract_boxed(solution)
        if not reference:
            preview = solution if len(solution) <= 200 else solution[:200] + "..."
            raise ValueError(f"MATH solution has an empty \\boxed{{}}: {preview!r}")
        return reference

    def judge(self, answer: str, reference: str) -> tuple[bool, str | None]:
        return self._verify(inline_math(answer), inline_math(reference))

    def answers_match(self, predicted: str, reference: str) -> bool:
        """TorchRL's name: whether ``predicted`` is right for the (already extracted) reference."""
        return self.check_answer(predicted, reference)


class MATHColumns:
    """MATHEnv's collate function (TorchRL's renames): ``problem`` to the query key and
    ``solution`` to ``answer``, each unless the row has the new name; rows or a dict of columns."""

    def __init__(self, data_key: str = "query") -> None:
        self.renames = {"problem": data_key, "solution": "answer"}

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            return self._rename(dict(batch))
        return [self._rename(dict(row)) for row in batch]

    def _rename(self, row: dict[str, Any]) -> dict[str, Any]:
        for old, new in self.renames.items():
            if old in row and new not in row:
                row[new] = row.pop(old)
        return row


class MATHEnv(DatasetChatEnv):
    """MATH as a chat env, with TorchRL's keywords; ``DigitalLearningGmbH/MATH-lighteval`` by default.

    Each reset writes the problem under ``query`` and the solution under ``answer`` (with the
    row's other columns, e.g. ``level`` and ``type``); a :class:`MATHRewardParser` scores it.
    Keywords: :class:`~rlpost.envs.gsm8k.GSM8KEnv`'s but ``prompt_column`` and ``answer_column``;
    ``collate_fn`` defaults to :class:`MATHColumns`, ``dataloader_actor_name`` to TorchRL's
    ``"math_dataloader"``. Columns: ``problem`` and ``solution`` (or ``query`` and ``answer``).
    """

    SYSTEM_PROMPT = MATH_SYSTEM_PROMPT

    def __init__(
        self, *, dataset: Any = "DigitalLearningGmbH/MATH-lighteval", shuffle: bool = True, num_envs: int = 1,
        repeats: int | None = None, batch_size_dl: int = 1, seed: int | None = None, group_repeats: bool = False,
        tokenizer: Any = None, device: torch.device | str | None = None, template_kwargs: dict[str, Any] | None = None,
        apply_template: bool | None = False, compute_reward: bool = True, collate_fn: Callable | None = None,
        max_steps: int | None = 1, input_mode: Literal["history", "text", "tokens"] = "history",
        ray_backend: bool = False, dataloader_actor_name: str | None = None, name: str | None = None,
        split: str | None = "train", data_key: str | None = None, system_prompt: str | None = None, num_shards: int = 1,
        shard_index: int = 0, strict_format: bool = False,
    ) -> None:  # fmt: skip
        if ray_backend and dataloader_actor_name is None:
            dataloader_actor_name = "math_dataloader"  # TorchRL's name
        if collate_fn is None:
            collate_fn = MATHColumns(data_key or ChatEnv.data_key)
        super().__init__(**task_env_kwargs(locals(), answer_column="answer"))
        if compute_reward:
            self.append_transform(MATHRewardParser(tokenizer=tokenizer, strict_format=strict_format))
