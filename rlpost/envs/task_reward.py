"""The GSM8K reward for a task with its own reference and its own answer check: :class:`TaskRewardParser`.

TorchRL's MATH and Countdown parsers score a response exactly as its GSM8K parser does; they
differ only in how the reference is read from the dataset's answer field and how an answer is
judged against it. So they are :class:`~rlpost.envs.gsm8k.GSM8KRewardParser` with those two steps
replaced (:meth:`TaskRewardParser.reference` and :meth:`TaskRewardParser.judge`): the same
fields, the same ``[B, 1]`` layout, keys, ``strict_format``, error counting and ``done`` flags.
See :mod:`rlpost.envs.gsm8k` for the fields written and their values.
"""

from __future__ import annotations

from typing import Any

from rlpost.envs.gsm8k import GSM8KRewardParser


class TaskRewardParser(GSM8KRewardParser):
    """:class:`~rlpost.envs.gsm8k.GSM8KRewardParser` whose reference and answer check are a
    subclass's: ``reference(answer_field)`` (``ValueError`` for a malformed dataset row, which then
    scores 0 and is counted in ``errors["ValueError"]``) and ``judge(answer, reference)`` ->
    ``(right, error type or None)``.
    """

    def reference(self, answer_field: Any) -> Any:
        """The reference a response is judged against, read from the dataset's answer field."""
        raise NotImplementedError

    def judge(self, answer: str, reference: Any) -> tuple[bool, str | None]:
        """``(right, error type or None)`` of the stripped answer-tag content ``answer``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(answer_key={self.answer_key!r}, strict_format={self.strict_format})"
