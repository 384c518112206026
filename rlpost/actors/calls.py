"""Bounded calls into actors, and the errors their failures become.

A call waits a bounded time and turns Ray's failures into recoverable errors (:func:`classify`):

    the called actor died or was killed                     -> ActorLost(name)
    the call failed because another actor it used died      -> ActorLost(None)
    a weight sync failed (a bus peer died or went silent)   -> BusFailure
    no answer within the call's timeout                     -> CallTimeout(name)

Any other error propagates as the actor raised it, with the remote traceback chained.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlpost.runtime.actors import ActorFailure, ActorLost, CallTimeout
from rlpost.runtime.liveness import recorded_error
from rlpost.runtime.shutdown import raise_if_stopping

STOP_POLL_S = 0.5  # a stoppable wait looks for a stop signal this often


class InferenceWorkerLost(RuntimeError):
    """Raised by an env pool's ``wait`` when its engine client found an inference worker dead: the
    pool goes on (its request waits for the replacement); this only says at once that one is needed."""


class BusFailure(ActorFailure):
    """A weight sync failed: a bus peer died or did not answer within ``weight_sync.timeout_s``."""


def _is_actor_death(exc: BaseException) -> bool:
    import ray

    return isinstance(exc, (ray.exceptions.RayActorError, ActorLost, InferenceWorkerLost))  # BufferLost is an ActorLost


def _causes(exc: BaseException):
    """``exc`` and the errors it was raised from, nearest first (Ray's task errors included)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = getattr(exc, "cause", None) or exc.__cause__ or exc.__context__


def classify(exc: BaseException, name: str, method: str) -> BaseException:
    """The error a failed call of ``name.method`` should raise (see the module docstring)."""
    import ray

    from rlpost.transport.bus_types import WeightSyncError

    if isinstance(exc, ray.exceptions.GetTimeoutError):
        return CallTimeout(f"{name} did not answer {method}", name)
    # A RayTaskError means the called actor ran the method and raised: it is alive. Ray raises it
    # as a subclass of its cause's class too, so one whose cause is another actor's death is also
    # a RayActorError and must be told apart from the called actor's own death.
    if isinstance(exc, ray.exceptions.RayActorError) and not isinstance(exc, ray.exceptions.RayTaskError):
        return ActorLost(f"{name} died during {method}{_why_dead(exc)}", name)
    causes = list(_causes(exc))
    if any(isinstance(c, WeightSyncError) for c in causes):
        return BusFailure(f"weight sync failed in {name}.{method}: {first_line(exc)}", None)
    if any(_is_actor_death(c) for c in causes[1:]):
        return ActorLost(f"{name}.{method} failed because an actor it used died: {first_line(exc)}", None)
    return exc


def _why_dead(exc: BaseException) -> str:
    """Why the actor died, as a clause: its constructor's error, or Ray's "The actor is dead
    because ..." sentence, with the error the actor recorded (:func:`recorded_error`); or empty."""
    recorded = recorded_error(getattr(exc, "actor_id", None))
    if getattr(exc, "actor_init_failed", False) or (recorded or "").startswith("constructor: "):
        return f": its constructor raised {recorded.removeprefix('constructor: ') if recorded else first_line(exc)}"
    for line in str(exc).splitlines():
        if line.startswith("The actor is dead because"):
            said = ": " + line.split(". ")[0].rstrip(".")
            return said + (f" (its last error: {recorded})" if recorded else "")
    return f": its last error: {recorded}" if recorded else ""


def first_line(exc: BaseException) -> str:
    """The last line of an error's text (Ray's task errors put the cause's message there)."""
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


@dataclasses.dataclass
class Pending:
    """A call in flight (``ref``) whose result is collected later, with the same error mapping."""

    name: str
    method: str
    ref: Any

    def done(self) -> bool:
        """Whether the call has finished (its result, or its failure, can be taken at once)."""
        import ray

        return bool(ray.wait([self.ref], timeout=0)[0])

    def result(self, timeout_s: float, *, stoppable: bool = False):
        """The call's result within ``timeout_s``. ``stoppable`` (a run's start, where nothing in
        flight must finish first): a stop signal ends the wait within STOP_POLL_S (StopRequested)."""
        import ray

        if stoppable:
            wait_stoppably([self.ref], timeout_s)
        try:
            return ray.get(self.ref, timeout=0.0 if stoppable else timeout_s)
        except Exception as exc:
            mapped = classify(exc, self.name, self.method)
            if mapped is not exc:
                raise mapped from exc
            cause = getattr(exc, "cause", None)
            if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, Exception):
                # the actor's own error, with its own message (the remote traceback stays chained)
                raise cause from exc
            raise


@dataclasses.dataclass
class GroupPending:
    """One call in flight on every rank of a group (``calls``, rank 0 first): its result is rank
    0's once every rank answered. The first rank that fails fails the call at once, so a dead
    rank is known without waiting for the others, whose collectives only time out later."""

    calls: list[Pending]

    def result(self, timeout_s: float):
        import time

        import ray

        deadline = time.monotonic() + timeout_s
        remaining = {call.ref: call for call in self.calls}
        while remaining:
            ready, _ = ray.wait(list(remaining), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = next(iter(remaining.values()))
                raise CallTimeout(f"{late.name} did not answer {late.method}", late.name)
            for ref in ready:
                remaining.pop(ref).result(0.0)  # raises that rank's (mapped) error
        return self.calls[0].result(0.0)


def wait_stoppably(refs: list, timeout_s: float) -> None:
    """Wait until every one of ``refs`` is ready or ``timeout_s`` passed, raising StopRequested
    within STOP_POLL_S of a stop signal (:func:`rlpost.runtime.shutdown.raise_if_stopping`)."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    waiting = list(refs)
    while waiting:
        raise_if_stopping()
        left = deadline - time.monotonic()
        if left <= 0:
            return
        _, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=min(STOP_POLL_S, left))


def wait_all(pending: list[Pending], timeout_s: float, *, stoppable: bool = False) -> list:
    """Results of every call in ``pending``; all are waited for (none left running unobserved),
    then the first failure is raised."""
    import time

    deadline = time.monotonic() + timeout_s
    results, failure = [], None
    for call in pending:
        try:
            results.append(call.result(max(0.0, deadline - time.monotonic()), stoppable=stoppable))
        except Exception as exc:
            results.append(None)
            failure = failure or exc
    if failure is not None:
        raise failure
    return results
