"""What a client holds on the service: sessions, and in them models and samplers; and which
sessions have gone silent.

Ids follow the SDK's scheme (the SDK relies on it when it makes a training client from a saved
state without asking): a session's models are ``<session>:train:<n>`` and its samplers
``<session>:sample:<n>``, so an object's session is the part of its id before the first ``:``.

A session lasts until its client finishes it (``ServiceClient`` does when closed) or stops
sending anything, heartbeats included, for ``session_timeout_s`` (the SDK sends one every 10 s
while its process lives). Its models and samplers end with it, once their running requests are
done; a silent session's models are first saved as ``tinker://<model>/weights/session-end``
(their state as of their last optim_step), since their client did not say it was done with them.
A session that ended is remembered for a while so that its client is told so (410, which also
stops the SDK's heartbeat) rather than that it never existed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rlpost.actors.adapters import AdapterSpec
from rlpost.serve.futures import Future, ModelQueue


def session_of(object_id: str) -> str:
    """The session of a model or sampler id (``<session>:train:<n>``, ``<session>:sample:<n>``)."""
    return object_id.split(":", 1)[0]


@dataclass
class Session:
    tenant: str
    futures: dict[str, Future] = field(default_factory=dict)  # model id -> its making's first future (retries)
    last_seen: float = field(default_factory=time.monotonic)  # the last request naming it or its objects

    def seen(self) -> None:
        self.last_seen = time.monotonic()


@dataclass
class Ended:
    """A session that ended: whose, why (a clause: "was finished by its client"), and when."""

    tenant: str
    why: str
    at: float = field(default_factory=time.monotonic)


@dataclass
class Model:
    tenant: str
    model_id: str
    adapter: str  # the trainer's name for its adapter
    spec: AdapterSpec
    queue: ModelQueue
    # what a replaced trainer is given back (rlpost.serve.recovery): the adapter and optimizer as of
    # the last snapshot (after each optim_step, creation and load), and the trainer calls that
    # changed the model since, as (method, args after the adapter, kwargs), replayed in order
    checkpoint: dict[str, bytes] | None = None
    replay: list[tuple[str, tuple, dict]] = field(default_factory=list)


@dataclass
class Sampler:
    tenant: str
    sampler_id: str
    adapter: str | None  # None: the base model
    payload: tuple[Any, Any] | None = None  # Ray refs to the adapter's config and tensors
    model_path: str | None = None
    futures: dict[int, Future] = field(default_factory=dict)
    probe: list[float] | None = None  # the trainer's log-probs of the parity probe under this adapter


def silent(sessions: dict[str, Session], timeout_s: float, now: float | None = None) -> list[str]:
    """The sessions nothing has named for over ``timeout_s``."""
    now = time.monotonic() if now is None else now
    return [sid for sid, session in sessions.items() if now - session.last_seen > timeout_s]


def forget_ended(ended: dict[str, Ended], keep_s: float, now: float | None = None) -> None:
    """Drop the records of sessions that ended over ``keep_s`` ago."""
    now = time.monotonic() if now is None else now
    for sid in [sid for sid, e in ended.items() if now - e.at > keep_s]:
        del ended[sid]
