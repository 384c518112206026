"""The supervisor: it owns every failure of a run's actors, and the fleet's size.

The loop runs each part of a step through :meth:`Supervisor.run`: when an actor is lost the
part's call raises a client error (:mod:`rlpost.service.clients`); the supervisor recovers and
runs the part again. Every part is safe to run again: a take, an annotation, a weight sync and a
checkpoint repeat harmlessly, and collection goes on from what the buffer recorded. Between parts
:meth:`Supervisor.check` reads every actor's state in Ray's control store every HEALTH_CHECK_S,
so a death is noticed while the loop waits; an actor alive to Ray but answering nothing is killed
by the watchdog (:mod:`rlpost.service.watchdog`) and then recovered from like a dead one.

:meth:`Supervisor.recover` decides what to start again, in dependency order, and the fleet does
the starting: the learner's loss is LearnerDied (the run restarts from its last checkpoint with
``trainer.auto_resume``, else it stops naming the resume command); a new buffer from the ledger,
the pools putting again what was not acknowledged; a worker started again in its slot, then the
bus's next generation with the current weights; the stateless reference and reward actors; an
env pool with the next epoch from its last put's position. A worker or pool with no room within
``resources.replacement_wait_s`` leaves its slot vacant (another of its role serving) until the
bundle is placed. docs/failures.md has the whole table and the guarantees.

Ranges (``rollout.num_inference_workers: A..B``, ``rollout.num_env_pools: A..B``) open their top
as slots that start when placed; ``rlpost scale`` (a request in the run's ``control`` mailbox,
taken at a health check) opens or closes slots: :meth:`Supervisor.resize`. With the load policy
(``rollout.autoscale``, :mod:`rlpost.service.autoscale`) the ranges open at their minimum and the
policy resizes them after each step (:meth:`Supervisor.autoscale`); an operator's request pins a
role, ``KEY=auto`` releases it.

A part still failing after MAX_ATTEMPTS tries stops the run with the last cause, and so does an
error that is not an actor's loss (a bug, a bad input): retrying would not help. Restarts are
counted in metrics.jsonl (``restarts_<role>``, ``bus_reforms``, ``watchdog_kills``; ``learner_resumes``).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from rlpost.actors import REWARD_ACTOR
from rlpost.actors.calls import ActorFailure, BusFailure, first_line
from rlpost.config import JobConfig
from rlpost.record.run_dir import latest_checkpoint
from rlpost.runtime.shutdown import raise_if_stopping
from rlpost.service.autoscale import LoadPolicy, step_load
from rlpost.service.clients import EnvPoolClient, InferenceClient
from rlpost.service.fleet import CALL_TIMEOUT_S, Fleet, NoRoom, ResumeNeeded, Slots
from rlpost.service.mailbox import AUTO
from rlpost.service.run_state import RunState
from rlpost.service.starter import slot_of
from rlpost.service.watchdog import Watchdog

log = logging.getLogger("rlpost")
T = TypeVar("T")

MAX_ATTEMPTS = 4  # tries of one part of a step (the first and three after recoveries)
PING_TIMEOUT_S = 5.0  # a worker asked whether it can be reached (after a peer of a call was lost)
HEALTH_CHECK_S = 2.0  # actors' states are read at most this often while things go well (~1 ms each)
MAX_POOL_FAILURES = 3  # an async pool whose collection fails (not by a lost actor) this often stops the run


class LearnerDied(ResumeNeeded):
    """The learner actor is gone; the message says how to resume."""


def _replaced(name: str, since: float) -> None:
    """Log that ``name`` serves again, ``since`` (monotonic) being when its loss was acted on.
    For an inference worker that is once the bus re-formed with it and the env pools have it."""
    log.warning("%s replaced: serving again %.1f s after its loss was noticed", name, time.monotonic() - since)


class Supervisor:
    """Keeps the run's actors alive for the training loop; see the module docstring.

    Args:
        run_dir: named in LearnerDied's message.
        fleet: the run's actors; the supervisor has it start replacements and resize its slots.
        state: the loop's state, which the supervisor only reads: the step for its messages and
            the ledger a new buffer and a new env pool start from. None: a fleet with no loop.
    """

    def __init__(self, cfg: JobConfig, run_dir: Path, fleet: Fleet, state: RunState | None = None):
        self.cfg, self.run_dir, self.fleet = cfg, Path(run_dir), fleet
        self.state = RunState() if state is None else state
        # recovery's own counts (written here only), which the loop reads for metrics and checkpoints;
        # watchdog_kills: actors found frozen or hung, killed and then replaced like the dead
        roles = ("inference", "env_pool", "reference", "reward", "buffer")
        self.counts = {**{f"restarts_{r}": 0 for r in roles}, "bus_reforms": 0, "watchdog_kills": 0}
        self.pool_failures: dict[int, int] = collections.defaultdict(int)  # env-pool-<j> -> failed collections
        self.last_check = time.monotonic()
        self.health_check_s = HEALTH_CHECK_S
        self.collecting = False  # async mode: the pools collect on their own from now on
        self.restarted_at: dict[str, float] = {}  # workers started again, until the bus serves them
        self.watchdog: Watchdog | None = None  # finds frozen and hung actors (watch())
        self.verdicts: dict[str, str] = {}  # actor name -> why the watchdog killed it (for the messages)
        rollout = cfg.rollout
        self.policy = None  # the load policy (rollout.autoscale), fed by autoscale() after each step
        if rollout.autoscale.enabled:
            self.policy = LoadPolicy(rollout.autoscale, rollout.autoscale_ranges())
        self.load_row: dict | None = None  # the last step's metrics as the policy read them
        self.busy_seen: dict[str, float] = {}  # inference worker -> its engine's busy seconds when last read

    def watch(self) -> None:
        """Start the watchdog: from now on a frozen or hung actor is killed, then recovered from."""
        self.watchdog = Watchdog(self.cfg.watchdog, self.fleet.named_handles).start()

    def close(self) -> None:
        """Stop the watchdog, then every actor (:meth:`Fleet.stop`)."""
        if self.watchdog is not None:
            self.watchdog.stop()
        self.fleet.stop()

    def run(self, what: str, part: Callable[[], T], *, bus: bool = False) -> T:
        """``part()``, run again after a recovery when an actor it needed is lost (``bus``: the
        part is a weight sync, so a failure re-forms the bus even when no worker died)."""
        failure: ActorFailure | None = None
        for attempt in range(1, MAX_ATTEMPTS + 1):
            raise_if_stopping()  # a safe point for SIGINT / SIGTERM (rlpost.runtime.shutdown)
            try:
                if failure is not None:
                    self.recover(failure, reform_bus=bus)
                return part()
            except ActorFailure as exc:
                log.warning("%s (attempt %d of %d): %s", what, attempt, MAX_ATTEMPTS, exc)
                failure = exc
        raise RuntimeError(
            f"{what} failed {MAX_ATTEMPTS} times in step {self.state.step}; last: {failure}"
        ) from failure

    def start_collection(self) -> None:
        """Async mode: every env pool starts collecting until it is stopped."""
        for pool in self.fleet.env_pools:
            if pool.wait(0.0):  # not running yet (a retry after a recovery skips the started)
                pool.start(None)
        self.collecting = True

    def check(self, force: bool = False) -> None:
        """Look for lost actors (at most every HEALTH_CHECK_S unless ``force``) and recover, then
        take an operator's request from the mailbox. Raises StopRequested after a stop signal."""
        raise_if_stopping()
        if not force and time.monotonic() - self.last_check < self.health_check_s:
            return
        self.last_check = time.monotonic()
        self.run("health check", lambda: self.recover(None))
        requested = self._pin(self._exchange_with_control())
        if requested:
            self.run("scale", lambda: self.resize(requested))

    def _exchange_with_control(self) -> dict[str, int]:
        """Report the fleet to the run's mailbox and take the request it holds (empty: none); a
        lost mailbox is started again (a request it held is lost, and the log says so)."""
        control = self.fleet.control
        if control is None:
            return {}
        try:
            return control.exchange(self.fleet.sizes(), timeout_s=CALL_TIMEOUT_S)
        except ActorFailure as exc:
            why = self._how_lost(control.name)
            why = first_line(exc) if why == "died" else why
            log.warning("the run's control mailbox failed (%s); starting it again (a scale request it held "
                        "is lost: ask again)", why)  # fmt: skip
            start = time.monotonic()
            control.kill()
            self.fleet.control = self.fleet.starter.control()
            _replaced(control.name, start)
            return {}

    def _pin(self, request: dict[str, int | str]) -> dict[str, int]:
        """An operator's request with the load policy on: each count pins its role, AUTO releases
        it (the mailbox refuses AUTO without a policy). Returns the counts to apply."""
        for key, count in request.items():
            if self.policy is None:
                continue
            if count == AUTO:
                self.policy.release(key)
                log.warning("the load policy sizes the %s fleet again (released by an operator)", key)
            else:
                self.policy.pin(key)
                log.warning("the %s fleet is pinned at %d by an operator (rlpost scale ... %s=auto releases it)",
                            key, count, key)  # fmt: skip
        return {key: count for key, count in request.items() if count != AUTO}

    def autoscale(self, row: dict) -> dict:
        """The load policy's turn after a step (nothing without ``rollout.autoscale``): it reads the
        step's metrics ``row`` and the engines' busy time (:func:`~rlpost.service.autoscale.step_load`)
        and its decision, if any, resizes the fleet (:meth:`resize`). Returns the keys for the step's
        metrics line: the signals read, and the decision with its reason."""
        if self.policy is None:
            return {}
        async_mode = self.cfg.trainer.mode == "async"
        busy = self._engine_busy(row["step_time_s"] if async_mode else row["collect_s"])
        serving = [len(self.fleet.inference), len(self.fleet.env_pools)]
        row = {**row, "autoscale_fleet": serving, "autoscale_engine_busy": busy}
        load = step_load(row, self.load_row, async_mode)
        resumed_first = self.load_row is None and row["step"] > 1  # its counts run from the run's start
        self.load_row = row
        keys = {"autoscale_engine_busy": busy, "autoscale_wait_share": load.wait_share, "autoscale_fleet": serving}
        if resumed_first:
            return keys  # not read: the policy's window starts with the next step
        now = time.monotonic()
        waiting = {s.key: now - min(s.vacant.values()) for s in (self.fleet.inference_slots, self.fleet.pool_slots)
                   if s.vacant}  # fmt: skip
        decision = self.policy.observe(load, self.fleet.wanted(), waiting)
        if decision is None:
            return keys
        log.warning("load policy: %s", decision.describe())
        self.run("autoscale", lambda: self.resize({decision.role: decision.after}))
        return {**keys, "autoscale_decision": decision.describe(), "autoscale_reason": decision.reason,
                "autoscale_role": decision.role}  # fmt: skip

    def _engine_busy(self, generating_s: float) -> float | None:
        """The serving engines' busy share of ``generating_s`` since the last read (None: no worker
        answered); a worker that does not answer at once is the health check's to judge."""
        seen, busy = {}, []
        deadline = time.monotonic() + PING_TIMEOUT_S
        asked = [(worker.name, worker.ask_busy_s()) for worker in self.fleet.inference]  # all at once
        for name, answer in asked:
            try:
                seen[name] = answer.result(max(0.0, deadline - time.monotonic()))
            except ActorFailure:
                continue
            before = self.busy_seen.get(name, 0.0)
            busy.append(seen[name] - before if seen[name] >= before else seen[name])
        self.busy_seen = seen
        if not busy or generating_s <= 0:
            return None
        return min(1.0, sum(busy) / (len(busy) * generating_s))

    def resize(self, request: dict[str, int]) -> None:
        """``rlpost scale``'s request (:meth:`Fleet.scale`; ValueError outside the config's ranges;
        safe to run again after a failure part-way). A new slot's actor starts like a lost one's
        replacement once its bundle is placed: a worker loads the current weights and joins the
        bus, a pool takes up its shard where it last stopped."""
        if self.fleet.scale(request):
            self._reform_bus()  # without the workers that left
        self.recover(None)  # vacant slots with room start now

    def restore_counts(self, counts: dict[str, int]) -> None:
        """After a resume: the checkpoint's counts, so they count on across restarts (unknown names dropped)."""
        self.counts.update({name: int(n) for name, n in counts.items() if name in self.counts})

    def restore_fleet(self, wanted: dict[str, int], pins: list[str] | None = None) -> None:
        """After a resume: the checkpoint's fleet (:meth:`Fleet.wanted`) and the load policy's pins,
        so that ``rlpost scale`` and the policy's sizing outlive a restart; a count outside the
        resumed config's ranges stays the config's (logged)."""
        from rlpost.service.mailbox import check_scale_request

        bounds, request = self.cfg.rollout.scale_bounds(), {}
        for key, count in wanted.items():
            try:
                check_scale_request(bounds, {key: count})
            except ValueError as exc:
                log.warning("resume: the checkpoint's fleet %s=%d is not restored (%s)", key, count, exc)
                continue
            request[key] = count
        if request:
            self.resize(request)
        for key in pins or ():  # a pinned role's count is the one just restored
            if self.policy is not None and key in request:
                self.policy.pin(key)

    def recover(self, failure: ActorFailure | None, reform_bus: bool = False) -> None:
        """Restart every actor :meth:`Fleet.lost` reports, in dependency order (module docstring);
        re-form the bus when a worker was restarted or ``reform_bus``."""
        lost = {failure.name} if failure is not None and failure.name else set()
        lost |= self._killed_by_watchdog()
        if failure is not None and failure.name is None:  # a peer of the callee: which one?
            lost |= {w.name for w in self.fleet.inference if w.unreachable(PING_TIMEOUT_S)}
        lost = self.fleet.lost(lost)
        if self.fleet.learner in lost:
            raise LearnerDied(self._learner_message(failure))
        if self.fleet.buffer in lost:
            self._restart_buffer()
        dead = [w for w in self.fleet.inference if w in lost]
        for worker in dead:
            self._replace_inference(worker)
        refilled = [slot for slot in self.fleet.placed(self.fleet.inference_slots) if self._refill(slot, "inference")]
        joined = self._join_started()
        if dead or refilled or joined or isinstance(failure, BusFailure) or (failure is not None and reform_bus):
            self._reform_bus()
        for role in ("reference", REWARD_ACTOR):
            if getattr(self.fleet, role) in lost:
                self._restart_stateless(role)
        for pool in [p for p in self.fleet.env_pools if p in lost]:
            self._replace_pool(pool)
        for slot in self.fleet.placed(self.fleet.pool_slots):
            self._refill(slot, "env_pools")
        if self.collecting:
            self._replace_failed_pools()

    def _killed_by_watchdog(self) -> set[str]:
        """The actors the watchdog killed since the last recovery: counted, verdicts kept for the log."""
        verdicts = self.watchdog.take_verdicts() if self.watchdog is not None else {}
        self.counts["watchdog_kills"] += len(verdicts)
        self.verdicts.update(verdicts)
        return set(verdicts)

    def _how_lost(self, name: str) -> str:
        """How actor ``name`` was lost, for the log: "died", or the watchdog's verdict."""
        self._killed_by_watchdog()  # a kill since the last recovery: its verdict too
        why = self.verdicts.pop(name, None)
        return "died" if why is None else f"was killed by the watchdog ({why})"

    def _learner_message(self, failure: ActorFailure | None) -> str:
        last = latest_checkpoint(self.run_dir)
        where = (
            f"the last checkpoint is {last}; resume with: rlpost train --resume {self.run_dir}"
            if last
            else "no checkpoint was written yet (trainer.checkpoint_interval), so the run must start again"
        )
        cause = f" ({first_line(failure)})" if failure is not None else ""
        killed = [f"{name} was {self.verdicts.pop(name)}" for name in self.fleet.learner.names if name in self.verdicts]
        if killed:
            cause = f" ({'; '.join(killed)}: the watchdog killed it)"
        return f"the learner died during step {self.state.step}{cause}; {where}"

    def _restart_buffer(self) -> None:
        """A new buffer from the ledger; every live pool puts again what it keeps."""
        log.warning(
            "the buffer %s; starting it again and asking the env pools for the groups it held", self._how_lost("buffer")
        )
        start = time.monotonic()
        put_again = self.fleet.restart_buffer(self.state.ledger.acknowledged)
        self.counts["restarts_buffer"] += 1
        for name, count in put_again.items():
            log.warning("%s put %d groups the learner had not received into the new buffer", name, count)
        _replaced("buffer", start)

    def _replace_inference(self, lost: InferenceClient) -> None:
        """Start a dead worker again in its slot; with no room within ``resources.replacement_wait_s``
        and another worker serving, leave its slot vacant."""
        slot = slot_of(lost.name)
        lost.kill()
        others = [w for w in self.fleet.inference if w is not lost]
        if others and not self.fleet.wait_for_room(lost.name):
            self.fleet.inference = others
            self._leave_vacant(self.fleet.inference_slots, slot, len(others), "inference workers")
            return
        log.warning("%s %s; starting it again", lost.name, self._how_lost(lost.name))
        self._start_inference(slot, vacate_without_room=bool(others))

    def _leave_vacant(self, slots: Slots, slot: int, serving: int, what: str) -> None:
        """A lost actor's slot without room in the cluster: vacant until its bundle is placed."""
        slots.vacant[slot] = time.monotonic()
        log.warning(
            "%s died and the cluster has no room for it: going on with %d of %d %s; it starts again once its "
            "bundle is placed (a node added or replaced)",
            slots.name(slot), serving, len(slots.wanted), what,
        )  # fmt: skip

    def _take_vacant(self, slots: Slots, slot: int) -> None:
        """Log that a vacant slot's bundle is placed (again); its actor starts next."""
        waited = time.monotonic() - slots.vacant[slot]
        if slot in slots.fresh:
            log.warning("the cluster has room for %s (a new slot, %.0f s); starting it", slots.name(slot), waited)
        else:
            log.warning("the cluster has room for %s again (vacant %.0f s); starting it", slots.name(slot), waited)

    def _refill(self, slot: int, role: str) -> bool:
        """A vacant slot of ``role`` (``inference``, ``env_pools``) whose bundle is placed (again):
        while others of its role serve, its actor starts in the background and joins at a later
        health check (:meth:`_join_started`); with none serving the run waits for it. True when it
        started now."""
        slots, serving = {"inference": (self.fleet.inference_slots, self.fleet.inference),
                          "env_pools": (self.fleet.pool_slots, self.fleet.env_pools)}[role]  # fmt: skip
        self._take_vacant(slots, slot)
        if serving:
            self.fleet.begin(slots, slot)
            return False
        if role == "inference":
            self._start_inference(slot, vacate_without_room=False)
        else:
            self._start_pool(slot)
        return True

    def _join_started(self) -> bool:
        """The actors started in the background that are up join the fleet (a worker serves from
        the bus's next generation, a pool from its shard's last put); a start that failed leaves
        its slot vacant. Returns whether a worker joined (the bus must re-form)."""
        ready, failed = self.fleet.take_started()
        for name, why in failed:
            log.warning("%s did not start (%s); its slot waits to be placed again", name, why)
        worker_joined = False
        for start in ready:
            name = start.client.name
            log.warning(
                "%s is up (%.0f s after its start began); it joins the fleet", name, time.monotonic() - start.since
            )
            if name.startswith(self.fleet.pool_slots.prefix):
                has_position = bool(self.state.ledger.acknowledged.get(name))
                self._pool_started(
                    name, *self.fleet.join_pool(start.client, self.collecting, has_position), start.since
                )
                continue
            worker_joined = True
            if self.fleet.join_inference(start.client):
                self.restarted_at[name] = start.since
                self.counts["restarts_inference"] += 1
        return worker_joined

    def _start_inference(self, slot: int, vacate_without_room: bool) -> None:
        """Start ``inference-<slot>`` (a replacement or a new slot's first); it serves once the bus
        re-forms. ``vacate_without_room`` (another worker serves): if its bundle loses its node
        while it starts, the slot is left vacant (:class:`NoRoom`)."""
        start = time.monotonic()
        try:
            replaced = self.fleet.start_inference(slot, vacate_without_room)
        except NoRoom:
            self._leave_vacant(self.fleet.inference_slots, slot, len(self.fleet.inference), "inference workers")
            return
        if replaced:
            self.restarted_at[self.fleet.inference_slots.name(slot)] = start
            self.counts["restarts_inference"] += 1

    def _reform_bus(self) -> None:
        """The bus's next generation with every worker, the current weights published to it."""
        generation = self.fleet.reform_bus()
        self.counts["bus_reforms"] += 1
        log.warning("weight bus re-formed (generation %s) with %d workers", generation, len(self.fleet.inference))
        for name, start in self.restarted_at.items():  # serving the current weights to the pools
            _replaced(name, start)
        self.restarted_at.clear()

    def _restart_stateless(self, role: str) -> None:
        """Start the dead ``reference`` or ``reward`` actor again (:meth:`Fleet.restart`)."""
        log.warning("the %s actor %s; starting it again", role, self._how_lost(role))
        start = time.monotonic()
        self.fleet.restart(role)
        self.counts[f"restarts_{role}"] += 1
        _replaced(role, start)

    def _replace_pool(self, lost: EnvPoolClient) -> None:
        """As :meth:`_replace_inference` for an env pool (a vacant shard waits at its last put's position)."""
        slot = slot_of(lost.name)
        lost.kill()
        others = [p for p in self.fleet.env_pools if p is not lost]
        if others and not self.fleet.wait_for_room(lost.name):
            self.fleet.env_pools = others
            self.fleet.fence_pool(slot)
            self._leave_vacant(self.fleet.pool_slots, slot, len(others), "env pools")
            return
        log.warning("%s %s; starting it again", lost.name, self._how_lost(lost.name))
        self._start_pool(slot, vacate_without_room=bool(others))

    def _start_pool(self, slot: int, vacate_without_room: bool = False) -> None:
        """Start ``env-pool-<slot>`` (a replacement or a new slot's first): :meth:`Fleet.start_pool`;
        ``vacate_without_room`` as for :meth:`_start_inference`."""
        name, start = self.fleet.pool_slots.name(slot), time.monotonic()
        has_position = bool(self.state.ledger.acknowledged.get(name))
        try:
            state, restart = self.fleet.start_pool(slot, self.collecting, has_position, vacate_without_room)
        except NoRoom:
            self._leave_vacant(self.fleet.pool_slots, slot, len(self.fleet.env_pools), "env pools")
            return
        self._pool_started(name, state, restart, start)

    def _pool_started(self, name: str, state: dict | None, restart: bool, start: float) -> None:
        """Log (and count) ``name`` taking its slot from ``state``, its shard's last put."""
        slot = slot_of(name)
        collected, epoch = state["num_prompts_collected"] if state else 0, self.fleet.epochs[slot]
        if not restart:
            log.warning("%s started (a new slot, epoch %d): %d prompts of its shard collected", name, epoch, collected)
            return
        log.warning("%s started again (epoch %d) from its last put: %s prompts collected", name, epoch, collected)
        self.counts["restarts_env_pool"] += 1
        _replaced(name, start)

    def _replace_failed_pools(self) -> None:
        """Async mode: a pool whose collection ended with an error is replaced (its error is
        logged); one that fails this way MAX_POOL_FAILURES times stops the run with it."""
        for pool in list(self.fleet.env_pools):
            slot = slot_of(pool.name)
            try:
                ended = pool.wait(0.0)
            except ActorFailure:
                raise
            except Exception as exc:
                self.pool_failures[slot] += 1
                if self.pool_failures[slot] >= MAX_POOL_FAILURES:
                    raise
                log.warning("%s stopped collecting (%s); replacing it", pool.name, first_line(exc))
                self._start_pool(slot)
                continue
            if ended:
                log.warning("%s stopped collecting; replacing it", pool.name)
                self._start_pool(slot)
