"""The driver's progress display for a training run (a tqdm bar, or plain lines in a log)."""

from __future__ import annotations

import datetime as dt
import math
import sys
import time
from typing import TextIO


class Progress:
    """The driver's progress: step, reward, eval score (the last one seen), samples/s and ETA.
    On a terminal, a tqdm bar; elsewhere (a Ray job's log, a file; ``is_terminal`` overrides
    ``stream.isatty()``) a plain line every ``every`` steps and at the last, e.g. ``rlpost: step
    40/200 reward=0.412 eval=0.350 samples/s=9.8 eta=0:12:31`` (ETA from this process's pace)."""

    EVAL_KEYS = ("eval_pass_at_1", "eval_reward_mean")

    def __init__(self, steps: int, enabled: bool, initial: int = 0, every: int | None = None,
                 stream: TextIO | None = None, is_terminal: bool | None = None):  # fmt: skip
        self.steps, self.enabled, self.initial = steps, enabled, initial
        self.every = every if every is not None else max(1, steps // 20)
        self.stream = stream if stream is not None else sys.stderr
        self.eval_score: float | None = None
        self.started = time.monotonic()
        terminal = is_terminal if is_terminal is not None else _isatty(self.stream)
        self.bar = None
        if enabled and terminal:
            from tqdm import tqdm

            self.bar = tqdm(total=steps, initial=initial, desc="rlpost", unit="step", file=self.stream)

    def update(self, record: dict) -> None:
        """Show the step ``record`` (a metrics row) finished."""
        for key in self.EVAL_KEYS:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.eval_score = float(value)
                break
        if not self.enabled:
            return
        if self.bar is not None:
            postfix = {"reward": _fmt(record.get("reward_mean"), ".3f")}
            if self.eval_score is not None:
                postfix["eval"] = _fmt(self.eval_score, ".3f")
            postfix.update(sps=_fmt(record.get("samples_per_s"), ".1f"), loss=_fmt(record.get("loss"), ".3f"))
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
            return
        step = int(record["step"])
        if step % self.every == 0 or step == self.steps:
            self.stream.write(self.line(record) + "\n")
            self.stream.flush()

    def line(self, record: dict) -> str:
        """The plain progress line for ``record``."""
        step = int(record["step"])
        done = step - self.initial
        elapsed = time.monotonic() - self.started
        eta = elapsed / done * (self.steps - step) if done > 0 else None
        parts = [f"rlpost: step {step}/{self.steps}", f"reward={_fmt(record.get('reward_mean'), '.3f')}"]
        if self.eval_score is not None:
            parts.append(f"eval={_fmt(self.eval_score, '.3f')}")
        parts.append(f"samples/s={_fmt(record.get('samples_per_s'), '.1f')}")
        parts.append(f"eta={dt.timedelta(seconds=round(eta)) if eta is not None else '?'}")
        return " ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _fmt(value: object, spec: str) -> str:
    """``value`` formatted with ``spec``, or ``-`` when it is not a number (None: not measured)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    return format(value, spec)
