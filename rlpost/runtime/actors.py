"""What the driver knows of an actor without asking it: Ray's record of it (alive, lost), how to
kill it and free its name, and the errors a call to a lost or silent actor becomes. Every bounded
client of an actor raises them (the mapping: :mod:`rlpost.actors.calls`; also
:mod:`rlpost.service.clients`, :class:`~rlpost.transport.buffer.RayBuffer`); the supervisor
catches them and replaces what was lost.
"""

from __future__ import annotations

import time
from typing import Any


class ActorFailure(RuntimeError):
    """A call failed because an actor of the run is gone or silent; the supervisor recovers.
    ``name``: the actor known to be lost (None when the failure came from further away)."""

    def __init__(self, message: str, name: str | None = None):
        super().__init__(message)
        self.name = name


class ActorLost(ActorFailure):
    """An actor died: the one called (``name``) or one the called actor depended on."""


class CallTimeout(ActorFailure):
    """The actor ``name`` did not answer a call within its timeout."""


# Ray's actor states that serve no call now or later: RESTARTING too (its process died; nothing
# it held survived).
LOST_STATES = frozenset({"DEAD", "RESTARTING"})
NAME_POLL_S = 0.5  # release_names: how often it asks whether a lost actor's name is free


def actor_state(handle: Any) -> str:
    """The state of the actor ``handle`` in Ray's control store (GCS): ``"ALIVE"``, ``"DEAD"``,
    ``"RESTARTING"``, ``"PENDING_CREATION"`` or ``"DEPENDENCIES_UNREADY"``; ``"DEAD"`` without a record.

    Trap: after a death by anything but ``ray.kill(handle)``, ``ray.get_actor`` keeps returning
    the handle until its last handle is released, so a name lookup cannot tell dead from alive.
    One GCS call (~1 ms) through ``ray._private.state``: the public ``ray.util.state`` needs the
    dashboard's server, which a run may not have.
    """
    return actor_record(handle).get("State", "DEAD")


def actor_record(handle: Any) -> dict:
    """Ray's record of the actor ``handle`` (``State``, ``Pid``, ``NumRestarts``, ``Address``,
    ...; see :func:`actor_state`), empty when there is none."""
    from ray._private import state

    return state.actors(actor_id=handle._actor_id.hex()) or {}


def alive(name: str, handle: Any) -> bool:
    """Whether the actor ``handle`` is alive by Ray's record and still holds ``name`` (else it
    was replaced)."""
    import ray

    if actor_state(handle) in LOST_STATES:
        return False
    try:
        return ray.get_actor(name) == handle
    except ValueError:
        return False


def kill(handle: Any) -> None:
    """Kill the actor ``handle`` (no-op when it is already gone)."""
    import ray

    try:
        ray.kill(handle)
    except Exception:  # already dead: nothing to do
        pass


def release_names(names: list[str], timeout_s: float) -> None:
    """Free each of ``names`` for a new actor: kill whichever actor holds it and wait until Ray
    lets the name go, at most ``timeout_s`` in all (then RuntimeError naming it).

    Trap: a holder on a lost node keeps its name until Ray declares the node dead (~15 s of
    health checks); starting the new actor meanwhile fails with ``ActorAlreadyExistsError``.
    """
    import ray

    deadline = time.monotonic() + timeout_s
    for name in names:
        while True:
            try:
                holder = ray.get_actor(name)
            except ValueError:  # nobody holds it
                break
            kill(holder)
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"the actor name {name!r} is still held by its lost predecessor after {timeout_s:.0f} s "
                    f"(state {actor_state(holder)}); Ray frees it once it declares the predecessor's node dead"
                )
            time.sleep(NAME_POLL_S)
