"""Results a client polls for (:class:`FutureStore`), and the queue that runs one model's requests
in the order the client numbered them (:class:`ModelQueue`).

Every long request answers at once with a request id; its work runs as an asyncio task, and the
client polls ``retrieve_future`` with the id. A poll waits up to ``long_poll_s`` for the result
(the SDK polls again at once after a "try again", so a server that answered at once would be
polled in a busy loop), and a finished result can be read again until it is dropped
``keep_s`` after it finished.

The SDK numbers each training client's requests (``seq_id``, from 1, no gaps) and sends the chunks
of one ``forward_backward`` at once, lowest last; the server must take them all at once and run
them in number order. A number sent again (a client's retry after a timeout) gets the first
request's id, so an ``optim_step`` is never applied twice. A gap that stays open
``gap_timeout_s`` (a client that died between two posts) fails the requests waiting behind it,
rather than keeping them forever.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger("rlpost")

# the categories the SDK knows for a failed request
USER, SERVER = "user", "server"


class RequestError(Exception):
    """A request that failed for a reason the client should see (``category`` user or server;
    ``status``: the HTTP status when it is answered at once)."""

    def __init__(self, message: str, category: str = USER, status: int = 400):
        super().__init__(message)
        self.category, self.status = category, status


@dataclass
class Future:
    """One request's outcome: a payload and its content type, or an error and its category."""

    request_id: str
    tenant: str
    kind: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    payload: bytes | None = None
    content_type: str = "application/json"
    error: str | None = None
    category: str = USER
    finished_at: float | None = None
    on_done: Callable[[Future], None] | None = None  # the store's observer (metrics)

    def finish(self, payload: bytes, content_type: str) -> None:
        self.payload, self.content_type = payload, content_type
        self._done()

    def fail(self, message: str, category: str) -> None:
        self.error, self.category = message, category
        self._done()

    def _done(self) -> None:
        self.finished_at = time.monotonic()
        self.done.set()
        if self.on_done is not None:
            self.on_done(self)


class FutureStore:
    """Every request's :class:`Future` by id; see the module docstring."""

    def __init__(self, *, keep_s: float = 3600.0, long_poll_s: float = 30.0,
                 observer: Callable[[Future], None] | None = None):  # fmt: skip
        self.keep_s, self.long_poll_s, self.observer = keep_s, long_poll_s, observer
        self.futures: dict[str, Future] = {}
        self._tasks: set[asyncio.Task] = set()
        self._ids = itertools.count(1)

    def create(self, tenant: str, kind: str) -> Future:
        self._drop_old()
        future = Future(f"req-{next(self._ids)}-{uuid.uuid4().hex[:12]}", tenant, kind, on_done=self.observer)
        self.futures[future.request_id] = future
        return future

    def run(self, future: Future, work: Callable[[], Awaitable[tuple[bytes, str]]]) -> None:
        """Run ``work`` (returning ``(payload, content type)``) as a task that settles ``future``."""
        task = asyncio.get_running_loop().create_task(settle(future, work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self, request_id: str, tenant: str) -> Future | None:
        """The future once it is done, or still pending after the long poll; None when there is no
        such request for this tenant (another tenant's id is as unknown as a made-up one)."""
        future = self.futures.get(request_id)
        if future is None or future.tenant != tenant:
            return None
        try:
            await asyncio.wait_for(asyncio.shield(future.done.wait()), self.long_poll_s)
        except asyncio.TimeoutError:
            pass
        return future

    def _drop_old(self) -> None:
        forget_finished(self.futures, self.keep_s)


def forget_finished(futures: dict, keep_s: float) -> None:
    """Drop from ``futures`` (any key) those that finished over ``keep_s`` ago: a retry that late
    is no retry, and a long-lived service must not keep every result it ever gave."""
    cutoff = time.monotonic() - keep_s
    for key in [k for k, f in futures.items() if f.finished_at is not None and f.finished_at < cutoff]:
        del futures[key]


async def settle(future: Future, work: Callable[[], Awaitable[tuple[bytes, str]]]) -> None:
    """Await ``work`` and record its outcome: a client's mistake (ValueError, KeyError,
    :class:`RequestError`) as a user error, anything else as a server error (logged)."""
    try:
        payload, content_type = await work()
    except RequestError as exc:
        future.fail(str(exc), exc.category)
    except (ValueError, KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        future.fail(str(message), USER)
    except Exception as exc:  # a server fault: the client sees its first line, the log all of it
        log.exception("serve: %s %s failed", future.kind, future.request_id)
        future.fail(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", SERVER)
    else:
        future.finish(payload, content_type)


class ModelQueue:
    """One model's requests, run one at a time in ``seq_id`` order (module docstring)."""

    def __init__(self, store: FutureStore, *, next_seq: int = 1, gap_timeout_s: float = 120.0):
        self.store, self.next_seq, self.gap_timeout_s = store, next_seq, gap_timeout_s
        self.by_seq: dict[int, Future] = {}  # the numbers taken (finished ones for keep_s): a retry's answer
        self._waiting: dict[int, tuple[Future, Callable[[], Awaitable[tuple[bytes, str]]]]] = {}
        self._arrived = asyncio.Event()
        self._runner: asyncio.Task | None = None
        self.closed, self.closed_why = False, ""

    def submit(self, seq_id: int, tenant: str, kind: str, work: Callable[[], Awaitable[tuple[bytes, str]]]) -> Future:
        """The future of request ``seq_id``: the first one's when the number was taken before."""
        if seq_id in self.by_seq:
            return self.by_seq[seq_id]
        future = self.store.create(tenant, kind)
        if self.closed:
            future.fail(f"model: {self.closed_why}", USER)
            return future
        if seq_id < self.next_seq:
            future.fail(f"seq_id: {seq_id} comes after {self.next_seq - 1} was run; numbers must not go back", USER)
            return future
        self.by_seq[seq_id] = future
        self._waiting[seq_id] = (future, work)
        self._arrived.set()
        if self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self._run())
        return future

    def close(self, why: str = "this model was unloaded") -> None:
        """Fail the requests still waiting (``why``) and any sent later; the one running finishes."""
        self.closed, self.closed_why = True, why
        for future, _ in self._waiting.values():
            future.fail(f"model: {why}", USER)
        self._waiting.clear()
        self._arrived.set()  # the runner, waiting for a number, sees the queue closed

    async def idle(self) -> None:
        """Wait until the request running (if any) has finished; call after :meth:`close`."""
        if self._runner is not None:
            await asyncio.shield(self._runner)

    async def _run(self) -> None:
        while not self.closed:
            if self.next_seq not in self._waiting:
                self._arrived.clear()
                timeout = self.gap_timeout_s if self._waiting else None
                try:
                    await asyncio.wait_for(self._arrived.wait(), timeout)
                except asyncio.TimeoutError:
                    self._fail_behind_gap()
                continue
            future, work = self._waiting.pop(self.next_seq)
            await settle(future, work)
            self.next_seq += 1
            forget_finished(self.by_seq, self.store.keep_s)

    def _fail_behind_gap(self) -> None:
        missing, last = self.next_seq, max(self._waiting)
        log.warning("serve: seq_id %d never arrived in %.0f s; failing %d requests behind it", missing,
                    self.gap_timeout_s, len(self._waiting))  # fmt: skip
        for future, _ in self._waiting.values():
            future.fail(f"seq_id: request {missing} never arrived within {self.gap_timeout_s:.0f} s", USER)
        self._waiting.clear()
        self.next_seq = last + 1
