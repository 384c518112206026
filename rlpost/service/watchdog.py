"""The watchdog: the run's actors that are alive to Ray but frozen or hung are killed, so that the
supervisor replaces them as it replaces the dead.

Trap: a process that is stopped (SIGSTOP, a frozen node) or whose working thread is blocked (a
deadlock, a collective that never returns) stays ALIVE in Ray's record, and a call into it waits
until its own timeout, minutes for a learner step (a dead one fails every call at once). So a
driver thread asks every actor for a heartbeat every ``watchdog.interval_s``
(:mod:`rlpost.runtime.liveness`, the actor's side) and judges each by its role's deadlines
(``watchdog.<role>``, :class:`~rlpost.config.RoleDeadlines`):

    no answer for answer_s                      -> frozen: the process runs no Python at all
    an answer saying its work made no progress
    for progress_s while a call was working     -> hung: a thread blocked inside the work

A busy actor is neither: the heartbeat runs on a thread of its own beside the actor's calls, and a
long call (a big generation, a learner step, a checkpoint) marks its progress at each engine
step, micro-batch or file. Waiting on another actor is never work, so an actor blocked on a frozen
peer is not blamed for it: the peer is.

The verdict is a kill (:func:`end`); every call waiting on the actor then fails as on a death,
and the supervisor's recovery does the rest. The watchdog only kills; the supervisor alone
decides what starts again (the fleet starts it), and reads :meth:`Watchdog.take_verdicts` to say
why one was lost and to count it (``watchdog_kills`` in metrics.jsonl).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from rlpost.config import RoleDeadlines, WatchdogConfig
from rlpost.runtime.actors import actor_record, actor_state, kill
from rlpost.runtime.liveness import heartbeat_ref

log = logging.getLogger("rlpost")


def role_of(name: str) -> str:
    """The ``watchdog`` section's key for actor ``name`` (``env-pool-0`` -> ``env_pool``)."""
    for prefix, role in (("inference-", "inference"), ("env-pool-", "env_pool"), ("learner-", "learner")):
        if name.startswith(prefix):
            return role
    return name


def end(handle: Any) -> None:
    """Kill the actor ``handle`` for good. Trap: ``ray.kill`` asks the process to exit, which a
    stopped one cannot: its raylet sends SIGKILL only after a grace period (~6 s here), while
    every call into it waits. So a process on this node gets SIGKILL from here at once."""
    import ray

    record = actor_record(handle)
    kill(handle)
    here = ray.get_runtime_context().get_node_id()
    if record.get("Pid") and record.get("Address", {}).get("NodeID") == here:
        try:
            os.kill(int(record["Pid"]), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # gone already, or not ours to end: Ray's raylet will
            pass


def verdict(deadlines: RoleDeadlines, *, now: float, waiting_since: float | None, reply: dict | None) -> str | None:
    """Why an actor is to be killed, or None. ``waiting_since``: since when a heartbeat has gone
    unanswered, counted from when it could answer (None: none outstanding); ``reply``: its last
    answer (:func:`rlpost.runtime.liveness.report`)."""
    if waiting_since is not None and now - waiting_since > deadlines.answer_s:
        return f"frozen: no answer to its heartbeat for {now - waiting_since:.0f} s (watchdog answer_s={deadlines.answer_s:g})"
    if reply is None or deadlines.progress_s is None:
        return None
    if reply.get("working") and reply.get("stalled_s", 0.0) > deadlines.progress_s:
        what = ", ".join(reply["working"])
        return (f"hung: its work ({what}) made no progress for {reply['stalled_s']:.0f} s "
                f"(watchdog progress_s={deadlines.progress_s:g})")  # fmt: skip
    return None


@dataclasses.dataclass
class _Watched:
    """One actor as the watchdog sees it."""

    name: str
    handle: Any
    ref: Any = None  # the heartbeat in flight
    silent_since: float | None = None  # when the oldest heartbeat unanswered since its last answer was sent
    answered: bool = False  # it answered once: its constructor returned
    ready_since: float | None = None  # never answered yet: when Ray's record first said ALIVE
    reply: dict | None = None  # its last answer
    dead: bool = False  # a heartbeat met its death: the supervisor's to replace, nothing more to ask


class Watchdog:
    """Heartbeats every actor ``actors()`` lists (read anew each round: the supervisor replaces
    actors) and kills the frozen and hung ones. :meth:`check` is one round; :meth:`start` runs
    rounds every ``cfg.interval_s`` on a daemon thread until :meth:`stop`."""

    def __init__(self, cfg: WatchdogConfig, actors: Callable[[], list[tuple[str, Any]]]):
        self.cfg, self.actors = cfg, actors
        self.watched: dict[str, _Watched] = {}  # Ray actor id -> what is known of it
        self._verdicts: dict[str, str] = {}  # actor name -> why it was killed, until the supervisor takes it
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        if self.cfg.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="rlpost-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None

    def take_verdicts(self) -> dict[str, str]:
        """The actors killed since the last call: name -> why (the supervisor logs and counts them)."""
        with self._lock:
            taken, self._verdicts = self._verdicts, {}
        return taken

    def _loop(self) -> None:
        import ray

        while not self._stop.wait(self.cfg.interval_s):
            if not ray.is_initialized():
                return
            try:
                self.check()
            except Exception:  # a round that failed must not end the watch; the next one tries again
                log.exception("watchdog: a round of heartbeats failed")

    def check(self) -> dict[str, str]:
        """One round (answers, verdicts, kills, new heartbeats); returns the killed: name -> why."""
        import ray

        now = time.monotonic()
        current = {handle._actor_id.hex(): (name, handle) for name, handle in self.actors()}
        for key in set(self.watched) - set(current):  # replaced or stopped by the supervisor
            del self.watched[key]
        for key, (name, handle) in current.items():
            self.watched.setdefault(key, _Watched(name, handle))
        pending = {w.ref: w for w in self.watched.values() if w.ref is not None}
        if pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
            for ref in ready:
                self._take_answer(pending[ref], ref)
        killed = {}
        for watched in self.watched.values():
            if watched.dead:
                continue
            why = verdict(self._deadlines(watched.name), now=now, waiting_since=self._silent_since(watched, now),
                          reply=watched.reply)  # fmt: skip
            if why is not None:
                killed[watched.name] = why
                with self._lock:  # before the kill: whoever meets the death may ask why at once
                    self._verdicts[watched.name] = why
                log.warning("watchdog: %s is %s; killing it, to be replaced as a lost actor", watched.name, why)
                end(watched.handle)
                watched.dead = True
        for watched in self.watched.values():
            if watched.ref is None and not watched.dead:
                watched.ref = heartbeat_ref(watched.handle)
                if watched.answered and watched.silent_since is None:
                    watched.silent_since = now
        return killed

    def _take_answer(self, watched: _Watched, ref: Any) -> None:
        import ray

        watched.ref = None
        try:
            watched.reply = ray.get(ref, timeout=0)
        except ray.exceptions.ActorUnavailableError:
            return  # its node does not answer now (it may again): still silent, asked again
        except ray.exceptions.RayActorError:
            watched.dead = True  # its death is Ray's news to the supervisor; the watch ends here
            return
        except Exception as exc:  # an actor without the heartbeat (not started by rlpost): not watched
            log.warning("watchdog: %s cannot answer a heartbeat (%s); it is not watched", watched.name, exc)
            watched.dead = True
            return
        watched.answered, watched.silent_since = True, None

    def _silent_since(self, watched: _Watched, now: float) -> float | None:
        """Since when ``watched`` has been silent (None: it answered its last heartbeat): from the
        first heartbeat after its last answer, or, before its first, from when Ray's record first
        said ALIVE (a constructor loading a model answers nothing; the start's timeout bounds it)."""
        if watched.answered:
            return watched.silent_since
        if watched.ready_since is None and actor_state(watched.handle) == "ALIVE":
            watched.ready_since = now
        return watched.ready_since

    def _deadlines(self, name: str) -> RoleDeadlines:
        return getattr(self.cfg, role_of(name))
