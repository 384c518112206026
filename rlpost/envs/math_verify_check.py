"""math-verify's equivalence check, in a module of its own for the worker processes that run it.

Trap: a :class:`~rlpost.envs.function_pool.FunctionPool` worker imports the function's module
before the call's time limit starts. Here that is math-verify (sympy: ~1 s, which inside the limit
took most of a fresh worker's first check) and not ``rlpost.envs`` (torch, tensordict: ~5 s more
on 2 busy cores, paid again by every worker replacing one killed past ``verify_timeout_s``).
:mod:`rlpost.envs.gsm8k` names this module by path, so the trainer never imports math-verify.
"""

from __future__ import annotations

import logging

from math_verify import parse, verify


class _DropDisabledTimeoutNotice(logging.Filter):
    """math-verify logs a warning the first time its time limits are off; here that is intended
    (the caller enforces the limit), so the notice is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


_NOTICE_FILTER = _DropDisabledTimeoutNotice()


def math_verify_equal(answer: str, target: str) -> bool:
    """``verify(parse(target), parse(answer))``, False when either has nothing math-verify reads.

    Trap: math-verify's own time limits use ``signal.alarm`` (main thread only; elsewhere, e.g. a
    Ray actor's executor, it raises instead of checking), so they are off and this has no limit
    of its own: :class:`~rlpost.envs.gsm8k.GSM8KRewardParser` runs it in a
    :class:`~rlpost.envs.function_pool.FunctionPool` worker that is killed past the limit.
    """
    for name in ("math_verify.parser", "math_verify.grader"):
        math_logger = logging.getLogger(name)
        if _NOTICE_FILTER not in math_logger.filters:
            math_logger.addFilter(_NOTICE_FILTER)
    gold = parse(target, parsing_timeout=None)
    prediction = parse(answer, parsing_timeout=None)
    return bool(gold) and bool(prediction) and bool(verify(gold, prediction, timeout_seconds=None))
