"""An actor's side of the supervision: a heartbeat that a busy actor still answers, its work's
progress, and the error that ended it.

Ray says ALIVE for a process that is stopped (SIGSTOP, a frozen node), deadlocked or stuck in a
call that never returns. So the supervisor asks every actor itself (:mod:`rlpost.service.watchdog`),
answered on a thread of its own (the Ray concurrency group LIVENESS_GROUP), so a long call never
delays the answer. No answer within the role's deadline: the process runs no Python at all. An
answer whose work has not progressed for the deadline: the working thread is blocked.

Work is marked: computing code (generate, a learner step, a checkpoint) runs inside
:func:`working` and calls :func:`progress` at each step it completes. Time outside a ``working``
section (waiting on another actor, idle) is never a stall: the peer has its own heartbeat and the
wait its own timeout.

Trap: an actor whose constructor raises can die before Ray reports why (Ray formats the error
with the half-built object's ``repr``, and a ``repr`` that raises kills the worker; a C extension
may abort on the way out). So :func:`remote_class` gives every actor a ``repr`` that cannot fail
and records the constructor's error in Ray's key-value store (:func:`recorded_error`).

This module imports nothing of rlpost or Ray at import: in-process, marking costs a lock and a clock read.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

LIVENESS_GROUP = "liveness"  # the Ray concurrency group (one thread) that answers heartbeats
HEARTBEAT_METHOD = "rlpost_heartbeat"


class _Work:
    """The process's open work sections and when its work last progressed."""

    def __init__(self):
        self.lock = threading.Lock()
        self.open: dict[int, tuple[str, int]] = {}  # thread id -> (label of its outermost section, depth)
        self.last_progress = time.monotonic()

    def enter(self, label: str) -> None:
        thread = threading.get_ident()
        with self.lock:
            outer, depth = self.open.get(thread, (label, 0))
            self.open[thread] = (outer, depth + 1)
            self.last_progress = time.monotonic()  # starting work is progress too

    def leave(self) -> None:
        thread = threading.get_ident()
        with self.lock:
            label, depth = self.open[thread]
            if depth == 1:
                del self.open[thread]
            else:
                self.open[thread] = (label, depth - 1)
            self.last_progress = time.monotonic()

    def mark(self) -> None:
        self.last_progress = time.monotonic()  # one float store: no lock needed

    def report(self) -> dict[str, Any]:
        with self.lock:
            labels = sorted({label for label, _ in self.open.values()})
            stalled_s = time.monotonic() - self.last_progress if labels else 0.0
        return {"pid": os.getpid(), "working": labels, "stalled_s": stalled_s}


_WORK = _Work()


@contextlib.contextmanager
def working(label: str) -> Iterator[None]:
    """Mark the calling thread's work (``label``, e.g. ``"generate"``) until the block ends;
    inside, :func:`progress` must come at least every ``watchdog.<role>.progress_s`` or the
    watchdog takes the actor for hung. Nested sections count as the outer one."""
    _WORK.enter(label)
    try:
        yield
    finally:
        _WORK.leave()


def progress() -> None:
    """The work of this process moved on (an engine step, a micro-batch, a file written)."""
    _WORK.mark()


def report() -> dict[str, Any]:
    """What a heartbeat answers: ``pid``, the labels of the open work sections (``working``),
    and ``stalled_s``, the seconds since the work last progressed (0 when no section is open)."""
    return _WORK.report()


ERROR_NAMESPACE = "rlpost-errors"  # in Ray's key-value store: actor id -> the error it recorded before it ended


def rlpost_heartbeat(self) -> dict[str, Any]:
    """The heartbeat method of every rlpost actor (added by :func:`remote_class`): its answer is
    :func:`report`. Called in LIVENESS_GROUP, it runs beside whatever the actor is doing."""
    return report()


def record_error(exc: BaseException, where: str) -> None:
    """Keep ``exc`` and ``where`` it was raised (``"constructor"``, or what the actor was doing)
    in Ray's key-value store under this actor's id, for :func:`recorded_error`. Nothing outside
    an actor, and never an error of its own."""
    try:
        import ray
        from ray.experimental import internal_kv

        actor_id = ray.get_runtime_context().get_actor_id()
        if actor_id:
            text = " ".join(f"{type(exc).__name__}: {exc}".strip().splitlines())
            internal_kv._internal_kv_put(actor_id, f"{where}: {text}"[:2000], namespace=ERROR_NAMESPACE)
    except Exception:  # the error being raised matters, not this record of it
        pass


def recorded_error(actor_id: str | None) -> str | None:
    """What actor ``actor_id`` recorded before it ended (``"where: Type: message"``,
    :func:`record_error`); None when it recorded nothing."""
    if not actor_id:
        return None
    try:
        from ray.experimental import internal_kv

        value = internal_kv._internal_kv_get(actor_id, namespace=ERROR_NAMESPACE)
    except Exception:  # no connection to the cluster: nothing to add
        return None
    return value.decode() if value else None


def remote_class(actor_class: type, **remote_options: Any) -> Any:
    """``ray.remote`` of a subclass of ``actor_class`` that answers the heartbeat, has a ``repr``
    that cannot fail, and records its constructor's error. ``remote_options`` go to ``ray.remote``
    (a concurrency group must be declared there, not in ``.options()``)."""
    import ray

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            actor_class.__init__(self, *args, **kwargs)
        except BaseException as exc:
            record_error(exc, "constructor")
            raise

    def __repr__(self) -> str:
        try:
            return actor_class.__repr__(self)
        except Exception:  # a half-built object (its constructor raised): its class's repr may not work on it
            return f"{actor_class.__name__}(not built)"

    members = {"__module__": actor_class.__module__, "__doc__": actor_class.__doc__, "__init__": __init__,
               "__repr__": __repr__, HEARTBEAT_METHOD: rlpost_heartbeat}  # fmt: skip
    watched = type(actor_class.__name__, (actor_class,), members)
    groups = {**remote_options.pop("concurrency_groups", {}), LIVENESS_GROUP: 1}
    return ray.remote(concurrency_groups=groups, **remote_options)(watched)


def heartbeat_ref(handle: Any) -> Any:
    """Ask the actor ``handle`` (started through :func:`remote_class`) for its heartbeat; the
    ObjectRef of its answer."""
    return getattr(handle, HEARTBEAT_METHOD).options(concurrency_group=LIVENESS_GROUP).remote()
