"""``timeit``: named wall-clock timers for scripts, TorchRL's ``torchrl._utils.timeit``.

A timer is a context manager (``with timeit("collect"):``), a decorator (``@timeit("train")``),
or started by hand (``t = timeit("run").start(); t.elapsed()``); each exit records its time under
its name in one registry for the process. ``timeit.todict()`` gives the mean time per call of each
name (``percall=False``: the total), ``timeit.print(prefix)`` logs one line per name and returns
them, ``timeit.reset()`` (or ``erase()``) zeroes every name. TorchRL's GRPO scripts log
``timeit.todict()`` every few steps and reset it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rlpost")


class timeit:  # noqa: N801 (TorchRL's name)
    # name -> [mean seconds per call, total seconds, calls] since the last reset
    _REG: dict[str, list[float]] = {}
    _MARKS: dict[str, float] = {}
    _printevery_count = 0

    def __init__(self, name: str):
        self.name = name
        self.t0: float | None = None

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with timeit(self.name):
                return fn(*args, **kwargs)

        return timed

    def start(self) -> timeit:
        self.t0 = time.perf_counter()
        return self

    def elapsed(self) -> float:
        """Seconds since the timer started (it keeps running)."""
        if self.t0 is None:
            raise RuntimeError(f"timeit({self.name!r}) was not started: use it in a with block or call start()")
        return time.perf_counter() - self.t0

    def __enter__(self) -> timeit:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self._record(self.name, self.elapsed())

    @classmethod
    def _record(cls, name: str, seconds: float) -> None:
        mean, total, calls = cls._REG.setdefault(name, [0.0, 0.0, 0])
        calls += 1
        cls._REG[name] = [mean + (seconds - mean) / calls, total + seconds, calls]

    @classmethod
    def mark_start(cls, name: str) -> None:
        """Start the named event; :meth:`mark_end` records it (for a start and an end in different places)."""
        cls._MARKS[name] = time.perf_counter()

    @classmethod
    def mark_end(cls, name: str) -> None:
        if name not in cls._MARKS:
            raise KeyError(f"timeit.mark_end({name!r}) without timeit.mark_start({name!r})")
        cls._record(name, time.perf_counter() - cls._MARKS.pop(name))

    @classmethod
    def todict(cls, percall: bool = True, prefix: str | None = None) -> dict[str, float]:
        """Seconds per call (``percall``) or in total, by name (``prefix/name`` with a prefix)."""
        column = 0 if percall else 1
        return {(f"{prefix}/{name}" if prefix else name): row[column] for name, row in cls._REG.items()}

    @classmethod
    def print(cls, prefix: str | None = None) -> str:
        """Log one line per name (sorted) and return the lines."""
        lines = []
        for name in sorted(cls._REG):
            mean, total, _ = cls._REG[name]
            line = f"{name} took {mean * 1000:4.4f} msec (total = {total: 4.4f} sec since last reset)."
            lines.append(f"{prefix} -- {line}" if prefix else line)
            log.info(lines[-1])
        return "\n".join(lines)

    @classmethod
    def printevery(cls, num_prints: int, total_count: int, *, prefix: str | None = None, erase: bool = False) -> None:
        """Print about ``num_prints`` times over ``total_count`` calls (every ``total_count // num_prints``)."""
        if cls._printevery_count % max(1, total_count // num_prints) == 0:
            cls.print(prefix=prefix)
            if erase:
                cls.erase()
        cls._printevery_count += 1

    @classmethod
    def erase(cls) -> None:
        """Zero every name's record (the names stay)."""
        for name in cls._REG:
            cls._REG[name] = [0.0, 0.0, 0]

    @classmethod
    def reset(cls) -> None:
        cls.erase()
