"""The fleet: a run's actors, their slots and placement, as one object.

:class:`Fleet` holds the clients, slots and starter; ``Fleet.start(cfg)`` starts it all without
any training loop. Its methods do what a change of the fleet takes (start an actor in a slot, a
new buffer, the weight bus's next generation); when to do it is the supervisor's
(:mod:`rlpost.service.supervisor`), which mends what the fleet loses and resizes it on an
operator's request. Where actors start is :mod:`rlpost.service.starter`'s.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from typing import Any

from rlpost.actors.calls import ActorFailure, first_line
from rlpost.config import JobConfig
from rlpost.service.clients import (
    ActorClient,
    ControlClient,
    EnvPoolClient,
    InferenceClient,
    LearnerClient,
    ReferenceClient,
)
from rlpost.service.starter import STARTUP_TIMEOUT_S, ActorStarter, quietly, slot_of
from rlpost.transport.buffer import BufferSnapshot, RayBuffer

log = logging.getLogger("rlpost")

CALL_TIMEOUT_S = 60.0  # a short control call (set handles, join the bus, load a pool's state)
PLACEMENT_POLL_S = 0.5  # how often a lost worker's bundle is looked at while waiting for room
DRAIN_TIMEOUT_S = 120.0  # a worker leaving the fleet finishes its requests (the rest are re-issued)
POOL_STOP_TIMEOUT_S = 300.0  # an env pool leaving the fleet finishes its batch (a multi-turn one may be long)


class NoRoom(Exception):
    """A slot actor's bundle lost its node while the actor started (the node was lost, and Ray
    declared it so only after the actor's death was seen): the slot is left vacant."""


class Fleet:
    """A run's topology: one client per actor of every role, the slots of the roles with a range
    (``rollout.num_inference_workers: A..B``, ``rollout.num_env_pools: A..B``: a :class:`Slots`
    each), each env-pool slot's epoch, and the :class:`ActorStarter` (or a test's stand-in) that
    places and starts them. The one place that answers "what serves now" (:meth:`sizes`).

    :meth:`start` starts it without any training loop and :meth:`stop` ends every actor and
    placement group. After the start only the supervisor changes it: :meth:`scale` on an
    operator's request, and replacing the clients of the actors it finds lost. ``reference``,
    ``control``, ``reward``: None when the run has none.
    """

    def __init__(self, cfg: JobConfig, starter: Any, buffer: RayBuffer, inference: list[InferenceClient],
                 env_pools: list[EnvPoolClient], learner: LearnerClient, reference: ReferenceClient | None = None,
                 control: ControlClient | None = None, reward: ActorClient | None = None):  # fmt: skip
        self.cfg, self.starter = cfg, starter
        self.buffer, self.inference, self.env_pools, self.learner = buffer, inference, env_pools, learner
        self.reference, self.control, self.reward = reference, control, reward
        self.epochs: dict[int, int] = collections.defaultdict(int)  # env-pool-<j> -> its incarnation
        self.starting: dict[str, Starting] = {}  # slot actors starting in the background, by name
        # the range's top (with the load policy, its minimum) is opened now, vacant until placed;
        # rlpost scale and the load policy change them
        self.inference_slots = Slots("inference", "inference", set(range(len(inference))))
        self.pool_slots = Slots("env-pool", "env_pools", set(range(len(env_pools))))
        self.open_slots(self.inference_slots, cfg.rollout.inference_worker_target())
        self.open_slots(self.pool_slots, cfg.rollout.env_pool_target())

    @classmethod
    def start(cls, cfg: JobConfig, starter: Any = None) -> Fleet:
        """Place and start every actor of the run, engines up and the weight bus connected. A start
        that fails or is stopped (Ctrl-C) leaves no actor."""
        starter = ActorStarter(cfg) if starter is None else starter
        fleet = cls(cfg, starter, **starter.start_all())
        try:
            starter.connect_bus(fleet.learner, fleet.inference)
        except BaseException:
            for client in fleet.clients():
                client.kill()
            starter.remove_placement_groups()
            raise
        return fleet

    def stop(self) -> None:
        """Stop collection, shut the engines down, kill every actor and remove the placement
        groups (best effort, bounded)."""
        for pool in self.env_pools:
            quietly(functools.partial(pool.stop, timeout_s=30))
        for worker in self.inference:
            quietly(functools.partial(worker.shutdown, timeout_s=60))
        for client in [*self.clients(), *(start.client for start in self.starting.values())]:
            client.kill()
        self.starter.remove_placement_groups()

    def clients(self) -> list[Any]:
        """Every role's client (a learner group is one)."""
        roles = [*self.env_pools, *self.inference, self.learner, self.buffer, self.reference, self.reward, self.control]
        return [client for client in roles if client is not None]

    def named_handles(self) -> list[tuple[str, Any]]:
        """(actor name, handle) of every actor, each learner rank on its own: what the watchdog asks."""
        pairs = [(w.name, w.handle) for w in self.inference] + [(p.name, p.handle) for p in self.env_pools]
        pairs += self.learner.members + [(self.buffer.name, self.buffer.handle)]
        pairs += [(c.name, c.handle) for c in (self.reference, self.reward, self.control) if c is not None]
        return pairs

    def sizes(self) -> dict[str, int]:
        """What serves now, for metrics.jsonl and the mailbox (:meth:`Slots.sizes` of each role)."""
        return self.inference_slots.sizes(len(self.inference)) | self.pool_slots.sizes(len(self.env_pools))

    def wanted(self) -> dict[str, int]:
        """The slots each role has, as a scale request (what a checkpoint records)."""
        return {slots.key: len(slots.wanted) for slots in (self.inference_slots, self.pool_slots)}

    def open_slots(self, slots: Slots, count: int) -> None:
        """Open the lowest unused slots until there are ``count``; each is vacant until the
        supervisor's recovery finds room and starts its actor."""
        slot = 0
        while len(slots.wanted) < count:
            if slot not in slots.wanted:
                self.starter.open_slot(slots.name(slot))
                slots.wanted.add(slot)
                slots.fresh.add(slot)
                slots.vacant[slot] = time.monotonic()
            slot += 1

    def resize_slots(self, slots: Slots, count: int) -> None:
        """Open or close ``slots`` until the role has ``count``: vacant ones close first, then
        the highest; the serving actors of closed slots are retired by the caller."""
        if count != len(slots.wanted):
            log.warning("scaling the %s fleet from %d to %d", slots.prefix, len(slots.wanted), count)
        self.open_slots(slots, count)
        while len(slots.wanted) > count:
            vacant = sorted(set(slots.vacant) & slots.wanted)
            slot = vacant[-1] if vacant else max(slots.wanted)
            slots.wanted.discard(slot)
            slots.fresh.discard(slot)
            if slots.name(slot) in self.starting:
                self.starting.pop(slots.name(slot)).client.kill()  # still starting: it never served
            if slots.vacant.pop(slot, None) is not None:
                self.starter.close_slot(slots.name(slot))

    def scale(self, request: dict[str, int]) -> bool:
        """Resize the roles ``request`` names (``inference``, ``env_pools``) within the config's
        ranges (ValueError outside them, nothing changed). New slots are vacant until placed (the
        supervisor's recovery then starts them); fewer close vacant slots first, then retire the
        highest serving ones. True when a worker left: the bus must re-form without it. Safe to
        run again after a failure part-way."""
        from rlpost.service.mailbox import check_scale_request

        check_scale_request(self.cfg.rollout.scale_bounds(), request)
        workers_left = False
        if "inference" in request:
            self.resize_slots(self.inference_slots, request["inference"])
            workers_left = self.retire_workers()
        if "env_pools" in request:
            self.resize_slots(self.pool_slots, request["env_pools"])
            self.retire_pools()
        return workers_left

    def retire_workers(self) -> bool:
        """Stop the serving workers whose slots closed, after the pools stopped using them and they
        finished their requests (``DRAIN_TIMEOUT_S``; the rest are re-issued). True when one left."""
        leaving = [w for w in self.inference if slot_of(w.name) not in self.inference_slots.wanted]
        if not leaving:
            return False
        staying = [w for w in self.inference if w not in leaving]
        for pool in self.env_pools:
            if pool.alive():
                pool.set_inference([w.handle for w in staying])
        for worker in leaving:
            try:
                if not worker.drain(DRAIN_TIMEOUT_S):
                    log.warning("%s did not finish its requests within %.0f s: the env pools re-issue them to the "
                                "other workers", worker.name, DRAIN_TIMEOUT_S)  # fmt: skip
            except ActorFailure as exc:  # gone already: its requests were re-issued
                log.warning("%s was lost while leaving the fleet (%s)", worker.name, first_line(exc))
            self.starter.close_slot(worker.name)
            worker.kill()
        self.inference = staying
        return True

    def retire_pools(self) -> None:
        """Stop the serving env pools whose slots closed, each after its current batch
        (``POOL_STOP_TIMEOUT_S``; what it had not put is collected again from its last put's
        position when its shard serves again). In sync mode the others take over its share."""
        leaving = [p for p in self.env_pools if slot_of(p.name) not in self.pool_slots.wanted]
        for pool in leaving:
            try:
                pool.stop(timeout_s=POOL_STOP_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 (lost, failed or slow: its last put's position stands)
                log.warning("%s did not stop cleanly while leaving the fleet (%s)", pool.name, first_line(exc))
            self.starter.close_slot(pool.name)
            pool.kill()
            self.fence_pool(slot_of(pool.name))
            self.env_pools = [p for p in self.env_pools if p is not pool]

    def fence_pool(self, slot: int) -> None:
        """``env-pool-<slot>`` is gone and not replaced now: the buffer refuses a put its last
        incarnation left in flight and frees the room held for its next batch (the serving pools
        need it for the shares they take over)."""
        self.epochs[slot] += 1
        self.buffer.fence(f"env-pool-{slot}", self.epochs[slot])

    def lost(self, named: set[str]) -> list[Any]:
        """The clients of the actors lost now (not the mailbox: its exchange mends it): those
        ``named`` (by a failure, the watchdog or an unreachable peer), killed to be sure since a
        silent actor is as good as dead, and every one Ray's record says is dead or restarting."""
        roles = [self.learner, self.buffer, *self.inference, self.reference, self.reward, *self.env_pools]
        lost = []
        for client in [c for c in roles if c is not None]:
            if named & set(client.names):
                client.kill()
                lost.append(client)
            elif not client.alive():
                lost.append(client)
        return lost

    def placed(self, slots: Slots) -> list[int]:
        """The vacant slots of ``slots`` whose bundles the cluster has placed (by now), but for those
        whose actor starts already (:meth:`begin`)."""
        names = [(slot, slots.name(slot)) for slot in sorted(slots.vacant)]
        return [slot for slot, name in names if name not in self.starting and self.starter.has_room(name)]

    def wait_for_room(self, name: str) -> bool:
        """Whether ``name``'s bundle is placed, waiting up to ``resources.replacement_wait_s``
        (after a node's loss Ray places its bundles on other nodes at once where they fit)."""
        deadline = time.monotonic() + self.cfg.resources.replacement_wait_s
        while not self.starter.has_room(name):
            if time.monotonic() >= deadline:
                return False
            time.sleep(PLACEMENT_POLL_S)
        return True

    def restart_buffer(self, acknowledged: dict[str, int]) -> dict[str, int]:
        """A new buffer told what the learner's side received (``acknowledged``: producer -> last
        seq taken); every live pool puts again what was not acknowledged. Returns each one's count."""
        self.buffer.kill()
        buffer = self.starter.buffer()
        buffer.restore(BufferSnapshot([], {}, last_seqs=dict(acknowledged), acknowledged=dict(acknowledged)))
        self.buffer = buffer
        return {pool.name: pool.set_buffer(buffer, timeout_s=CALL_TIMEOUT_S) for pool in self.env_pools if pool.alive()}

    def start_inference(self, slot: int, vacate_without_room: bool = False) -> bool:
        """Start ``inference-<slot>`` (again), its engine up; it serves once the bus re-forms with it.
        True for a replacement, False for a new slot's first. ``vacate_without_room``: if the slot's
        bundle loses its node while the worker starts, the worker is ended and NoRoom raised (the
        slot's old worker leaves the fleet); otherwise the start waits for a node."""
        name = self.inference_slots.name(slot)
        worker = self.starter.inference(slot)
        if not self._started(worker, vacate_without_room):
            self.inference = [w for w in self.inference if w.name != name]
            raise NoRoom(name)
        worker.wait_ready(STARTUP_TIMEOUT_S)
        return self.join_inference(worker)

    def join_inference(self, worker: InferenceClient) -> bool:
        """``worker`` (up) serves in its slot from the bus's next generation; whether the slot had one before."""
        self.inference = sorted([w for w in self.inference if w.name != worker.name] + [worker],
                                key=lambda w: slot_of(w.name))  # fmt: skip
        return self.inference_slots.filled(slot_of(worker.name))

    def start_pool(self, slot: int, collecting: bool, has_position: bool = False,
                   vacate_without_room: bool = False) -> tuple[dict | None, bool]:  # fmt: skip
        """Start ``env-pool-<slot>`` (again) with the next epoch, from the position its predecessor's
        last put recorded in the buffer (none: its shard's start); ``collecting``: at once (async).
        ``has_position``: the shard put before, so a buffer without its position means it is lost
        (ResumeNeeded, before the pool collects anything). ``vacate_without_room``: as for
        :meth:`start_inference` (the slot is then fenced). Returns (the position or None, whether
        it replaced a pool)."""
        name = self.pool_slots.name(slot)
        for old in [p for p in self.env_pools if p.name == name]:
            old.kill()
        pool = self._new_pool(slot)
        if not self._started(pool, vacate_without_room):
            self.env_pools = [p for p in self.env_pools if p.name != name]
            self.fence_pool(slot)
            raise NoRoom(name)
        return self.join_pool(pool, collecting, has_position)

    def _new_pool(self, slot: int) -> EnvPoolClient:
        """``env-pool-<slot>``'s next incarnation (its constructor may still run)."""
        self.epochs[slot] += 1
        return self.starter.env_pool(slot, self.inference, self.buffer, epoch=self.epochs[slot])

    def join_pool(self, pool: EnvPoolClient, collecting: bool, has_position: bool) -> tuple[dict | None, bool]:
        """``pool`` (up) takes its slot: fenced at its epoch, from its shard's last put, collecting
        at once when ``collecting``; :meth:`start_pool` says the rest."""
        slot = slot_of(pool.name)
        self.env_pools = sorted([p for p in self.env_pools if p.name != pool.name] + [pool],
                                key=lambda p: slot_of(p.name))  # fmt: skip
        state = self.buffer.fence(pool.name, self.epochs[slot])
        if state is None and has_position:
            raise ResumeNeeded(f"{pool.name} was lost together with the buffer that held its position")
        if state is not None:
            pool.load_state_dict(state, timeout_s=STARTUP_TIMEOUT_S)
        if collecting:
            pool.start(None, timeout_s=STARTUP_TIMEOUT_S)
        return state, self.pool_slots.filled(slot)

    def begin(self, slots: Slots, slot: int) -> None:
        """Start the actor of vacant slot ``slot`` of ``slots`` (its bundle placed) in the background
        while others of its role serve: :meth:`take_started` hands it over once it is up. A vLLM
        engine takes from ~20 s (tiny model, CPU) to minutes to load, an env pool ~8 s on two
        cores; the run does not wait for either."""
        client = self.starter.inference(slot) if slots is self.inference_slots else self._new_pool(slot)
        self.starting[client.name] = Starting(client, client.submit_ready(), time.monotonic(), self.buffer)

    def take_started(self) -> tuple[list[Starting], list[tuple[str, str]]]:
        """The background starts that ended, out of ``starting``: those up (for the caller to join:
        :meth:`join_inference`, :meth:`join_pool`; each is pointed at the current workers and
        buffer first), and (name, why) of those that failed, did not come up within
        STARTUP_TIMEOUT_S or whose bundle lost its node: ended, their slots still vacant (tried
        again once placed)."""
        ready, failed = [], []
        for name, start in list(self.starting.items()):
            why = None
            if not start.ready.done():
                if self.starter.has_room(name) and time.monotonic() - start.since < STARTUP_TIMEOUT_S:
                    continue
                why = "it did not come up" if self.starter.has_room(name) else "its bundle lost its node"
            else:
                try:
                    start.ready.result(0.0)
                    if isinstance(start.client, EnvPoolClient):  # the fleet may have changed meanwhile
                        start.client.set_inference([w.handle for w in self.inference])
                        if start.buffer is not self.buffer:
                            start.client.set_buffer(self.buffer, timeout_s=CALL_TIMEOUT_S)
                except Exception as exc:  # noqa: BLE001 (any start failure leaves the slot vacant)
                    why = first_line(exc)
            del self.starting[name]
            if why is None:
                ready.append(start)
            else:
                start.client.kill()
                failed.append((name, why))
        return ready, failed

    def _started(self, client: ActorClient, vacate_without_room: bool) -> bool:
        """Whether a just-started slot actor is up; False (the actor ended) when
        ``vacate_without_room`` and its bundle lost its node meanwhile (:meth:`ActorClient.wait_started`)."""
        if not vacate_without_room:
            return True  # its first call waits for it, however long placing it takes
        if client.wait_started(STARTUP_TIMEOUT_S, lambda: self.starter.has_room(client.name)):
            return True
        client.kill()
        return False

    def restart(self, role: str) -> None:
        """Start the ``reference`` or ``reward`` actor again in place of the lost one: they hold
        nothing a new one lacks (the env pools' calls to the reward actor wait for it)."""
        getattr(self, role).kill()
        setattr(self, role, getattr(self.starter, role)())

    def reform_bus(self) -> int:
        """The bus's next generation with every serving worker, the weights published to them and
        their handles given to the live pools; returns the generation. A peer's failure raises."""
        handles = [w.handle for w in self.inference]
        generation = self.learner.set_workers(handles, timeout_s=CALL_TIMEOUT_S)
        self.publish()
        for pool in self.env_pools:
            if pool.alive():
                pool.set_inference(handles)
        return generation

    def publish(self, wait: bool = True) -> dict:
        """The learner publishes through its vLLMUpdater (every worker receives and reloads);
        returns the sync's metrics and the ``policy_version`` sent. ``wait=False``: return once
        sent; the next publish first waits for that reload and raises a failure found there."""
        start = time.perf_counter()
        published = self.learner.publish(wait).result(self.publish_timeout_s)
        return {
            "policy_version": int(published["policy_version"]),
            "weight_sync_s": time.perf_counter() - start,
            "weight_sync_bytes": published.get("bytes"),
            "weight_load_s": published.get("weight_load_s"),  # the slowest engine's reload
            "weight_sync_receivers_shm": published.get("receivers_shm"),
            "weight_sync_receivers_bus": published.get("receivers_bus"),
        }

    @property
    def publish_timeout_s(self) -> float:
        """Bound of one publish call on the learner: it may confirm an earlier update and then
        publish its own, each up to two bus waits of ``weight_sync.timeout_s`` and the workers'
        grace (the learner's own bounds end it first)."""
        return 4 * self.cfg.weight_sync.timeout_s + 180


@dataclasses.dataclass
class Starting:
    """A slot actor starting in the background (:meth:`Fleet.begin`)."""

    client: Any  # an InferenceClient or EnvPoolClient
    ready: Any  # its Pending readiness call: done once its constructor ran (an engine: loaded)
    since: float  # monotonic
    buffer: Any  # the buffer it was given (a pool joins the current one)


class ResumeNeeded(RuntimeError):
    """The run cannot go on with the actors it has; it can restart from its last checkpoint."""


@dataclasses.dataclass
class Slots:
    """The slots of one role's fleet: ``<prefix>-<i>`` for each i in ``wanted``, serving or
    vacant (no room for its actor in the cluster yet); ``fresh`` ones never had an actor (their
    first start is not a restart). ``key`` names the role in scale requests and metrics."""

    prefix: str  # "inference", "env-pool": the actors' names
    key: str  # "inference", "env_pools": the scale key
    wanted: set[int]
    vacant: dict[int, float] = dataclasses.field(default_factory=dict)  # slot -> since when (monotonic)
    fresh: set[int] = dataclasses.field(default_factory=set)

    def name(self, slot: int) -> str:
        return f"{self.prefix}-{slot}"

    def filled(self, slot: int) -> bool:
        """``slot``'s actor started (no longer vacant nor fresh); whether it had one before."""
        self.vacant.pop(slot, None)
        had_one = slot not in self.fresh
        self.fresh.discard(slot)
        return had_one

    def sizes(self, serving: int) -> dict[str, int]:
        """``serving``, the vacant slots and the slots wanted, under the role's metrics keys
        (``inference_workers``, ``inference_workers_vacant``, ``inference_workers_target``; the
        same for ``env_pools``)."""
        from rlpost.service.mailbox import FLEET_KEYS

        serving_key, wanted_key, vacant_key = FLEET_KEYS[self.key]
        return {serving_key: serving, vacant_key: len(self.vacant), wanted_key: len(self.wanted)}
