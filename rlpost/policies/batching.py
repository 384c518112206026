"""BatchQueue: concurrent calls of an LLM wrapper grouped into shared model calls (TorchRL's ``batching``).

With ``batching=True`` (or ``min_batch_size`` / ``max_batch_size``) a wrapper called from several
threads at once (env workers, a thread pool of rollouts) runs their rows together::

    thread A: wrapper(td of 2 rows) --+
    thread B: wrapper(td of 3 rows) --+--> queue [a0 a1 b0 b1 b2] --> one model call on 5 rows
                                                                     --> each caller gets its rows

The rules, TorchRL's:

- a batch runs once ``min_batch_size`` rows are queued, or once the oldest queued row has waited
  ``timeout_s`` (then whatever is queued runs, a short batch);
- a batch holds at most ``max_batch_size`` rows (None: all that are queued), taken oldest first;
- one batch runs at a time, on the thread of a caller that is waiting anyway (no thread of its
  own), so calls of the model never overlap;
- an exception raised by a batch is raised in every caller with a row in it; a caller whose rows
  were all in other batches is not affected.

Every wait is bounded: a caller returns at most ``timeout_s`` after its call plus the time of
the batches that run before and with its rows. Deliberate deviations from TorchRL: a caller whose rows wait for a
fuller batch waits only ``timeout_s`` (TorchRL's waits with no bound when ``min_batch_size`` is
never reached); ``min_batch_size=None`` with a ``max_batch_size`` means 1, as TorchRL documents.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any


def batch_size_bounds(
    batching: bool | None, min_batch_size: int | None, max_batch_size: int | None
) -> tuple[int | None, int | None]:
    """``(min_batch_size, max_batch_size)`` (both None: no batching), by TorchRL's rules: a size
    alone turns batching on, ``min_batch_size`` defaulting to 1; sizes with ``batching=False``,
    or ``min > max``, are errors."""
    if batching is False and (min_batch_size is not None or max_batch_size is not None):
        raise ValueError("min_batch_size and max_batch_size must be None if batching is False.")
    for name, size in (("min_batch_size", min_batch_size), ("max_batch_size", max_batch_size)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {size!r}")
    if min_batch_size is not None and max_batch_size is not None and min_batch_size > max_batch_size:
        raise ValueError(f"min_batch_size ({min_batch_size}) must be <= max_batch_size ({max_batch_size})")
    if min_batch_size is None and (batching or max_batch_size is not None):
        min_batch_size = 1
    return min_batch_size, max_batch_size


@dataclass
class _Entry:
    """One queued row: what runs, the future its caller waits on, and when it stops waiting for
    a fuller batch (``time.monotonic()``)."""

    item: Any
    future: Future
    deadline: float


class BatchQueue:
    """Groups the rows of concurrent :meth:`submit` calls into calls of ``run(items) -> results``
    (one per item, in order), by the module's rules. ``timeout_s`` is TorchRL's
    ``batching_timeout``; ``poll_s`` the longest single wait on the condition before checking again.
    """

    def __init__(
        self,
        run: Callable[[list[Any]], Sequence[Any]],
        *,
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        timeout_s: float = 10.0,
        poll_s: float = 0.5,
    ):
        if min_batch_size < 1 or (max_batch_size is not None and max_batch_size < min_batch_size):
            raise ValueError(f"need 1 <= min_batch_size <= max_batch_size, got {min_batch_size}, {max_batch_size}")
        if not timeout_s > 0 or not poll_s > 0:
            raise ValueError(f"timeout_s and poll_s must be > 0, got {timeout_s}, {poll_s}")
        self.run = run
        self.min_batch_size, self.max_batch_size = min_batch_size, max_batch_size
        self.timeout_s, self.poll_s = float(timeout_s), float(poll_s)
        self._init_state()

    def _init_state(self) -> None:
        self._cond = threading.Condition()
        self._queue: list[_Entry] = []
        self._running: list[_Entry] = []  # the batch being run, if any

    # a queue is copied (deepcopy, pickling into a Ray actor) without its lock or queued rows
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_cond", "_queue", "_running")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_state()

    def submit(self, items: Sequence[Any]) -> list[Any]:
        """Queue ``items``, help run batches until they are done, and return their results in
        order; raises the exception of a batch that held one of them."""
        deadline = time.monotonic() + self.timeout_s
        entries = [_Entry(item, Future(), deadline) for item in items]
        with self._cond:
            self._queue.extend(entries)
            self._cond.notify_all()
        futures = [entry.future for entry in entries]
        while not all(future.done() for future in futures):
            batch = self._claim(futures)
            if batch:
                self._run(batch)
        return [future.result(timeout=0) for future in futures]

    def _claim(self, futures: list[Future]) -> list[_Entry]:
        """The batch this thread should run now, taken off the queue; or, when none is due,
        ``[]`` after waiting (at most ``poll_s``) for the queue to change."""
        with self._cond:
            if all(future.done() for future in futures):
                return []
            now = time.monotonic()
            due = self._queue and (len(self._queue) >= self.min_batch_size or self._queue[0].deadline <= now)
            if due and not self._running:
                size = len(self._queue) if self.max_batch_size is None else self.max_batch_size
                self._running = self._queue[:size]
                del self._queue[:size]
                return self._running
            wait = self.poll_s
            if self._queue and not self._running:  # wake up when the oldest row stops waiting
                wait = min(wait, max(self._queue[0].deadline - now, 0.0))
            self._cond.wait(timeout=wait)
            return []

    def _run(self, batch: list[_Entry]) -> None:
        try:
            results = list(self.run([entry.item for entry in batch]))
            if len(results) != len(batch):
                raise RuntimeError(f"a batched call returned {len(results)} results for {len(batch)} inputs")
        except BaseException as exc:  # every caller of the batch hears of it, this one included
            for entry in batch:
                entry.future.set_exception(exc)
            if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: after telling them
                raise
        else:
            for entry, result in zip(batch, results):
                entry.future.set_result(result)
        finally:
            with self._cond:
                self._running = []
                self._cond.notify_all()

    def cleanup(self, *, flush: bool = False) -> None:
        """Empty the queue (TorchRL's ``cleanup_batching``): its rows' callers get a
        ``CancelledError``, or, with ``flush=True``, the results of running them now (in batches
        of at most ``max_batch_size``). A batch already running finishes as usual."""
        with self._cond:
            left, self._queue = self._queue, []
        if not flush:
            for entry in left:
                entry.future.set_exception(CancelledError("Batching aborted by cleanup_batching()"))
            with self._cond:
                self._cond.notify_all()
            return
        size = self.max_batch_size or max(len(left), 1)
        for start in range(0, len(left), size):
            self._run_after_current(left[start : start + size])

    def _run_after_current(self, batch: list[_Entry]) -> None:
        """Run ``batch`` once no other batch runs (bounded waits, as callers wait)."""
        with self._cond:
            while self._running:
                self._cond.wait(timeout=self.poll_s)
            self._running = batch
        self._run(batch)

    def state(self) -> dict[str, Any]:
        """TorchRL's ``get_batching_state()``: sizes, queue length, and whether a batch runs."""
        with self._cond:
            processing = bool(self._running)
            queued = len(self._queue)
            pending = queued + sum(not entry.future.done() for entry in self._running)
        return {
            "batching_enabled": True,
            "min_batch_size": self.min_batch_size,
            "max_batch_size": self.max_batch_size,
            "queue_size": queued,
            "processing": processing,
            "lock_state": "locked" if processing else "unlocked",
            "pending_futures": pending,
            "timeout": self.timeout_s,
        }
