"""The fleet: a run's actors, their slots and placement, as one object.

:class:`Fleet` holds one client per actor of every role (the buffer, the inference workers, the
env pools, the learner or its group, the reference, the reward model, the control mailbox), the
slots of the roles that have a range (``rollout.num_inference_workers: A..B``,
``rollout.num_env_pools: A..B``: a :class:`Slots` each) and the :class:`ActorStarter` that places
and starts each role's actor in the run's placement group (:func:`make_placement_group`: a bundle
per actor that reserves CPUs, GPUs or custom resources; slots beyond it get groups of their
own). ``Fleet.start(cfg)`` starts it all, without any training loop, and ``fleet.stop()`` ends it.

The supervisor (:mod:`rlpost.service.supervisor`) mends what the fleet loses and resizes it on an
operator's request; the loop (:mod:`rlpost.service.loop`) drives steps over its clients.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from rlpost.actors import REWARD_ACTOR, learner_name
from rlpost.actors.calls import ActorFailure, first_line, wait_all, wait_stoppably
from rlpost.config import JobConfig
from rlpost.runtime.actors import release_names
from rlpost.service.clients import (
    ActorClient,
    ControlClient,
    EnvPoolClient,
    InferenceClient,
    LearnerClient,
    ReferenceClient,
)
from rlpost.transport.buffer import RayBuffer

log = logging.getLogger("rlpost")

STARTUP_TIMEOUT_S = 600.0  # an actor's start (a vLLM engine loads its model)
NAME_RELEASE_TIMEOUT_S = 120.0  # a lost actor's name, held until Ray declares its node dead
PLACEMENT_POLL_S = 0.5  # how often a lost worker's bundle is looked at while waiting for room
DRAIN_TIMEOUT_S = 120.0  # a worker leaving the fleet finishes its requests (the rest are re-issued)
POOL_STOP_TIMEOUT_S = 300.0  # an env pool leaving the fleet finishes its batch (a multi-turn one may be long)


class Fleet:
    """A run's topology: for each role its client (one per actor; the supervisor replaces a lost
    actor's), the slots of the roles that have a range (inference workers, env pools: wanted,
    serving, vacant), each env-pool slot's epoch, and where they start (the :class:`ActorStarter`:
    the run's placement group, the slots' own groups, the inference replicas).

    It is the one place that answers "what serves now" (:meth:`sizes`). :meth:`start` starts it
    without any training loop, :meth:`scale` resizes it and :meth:`stop` ends every actor and
    placement group. After the start, only the supervisor (:mod:`rlpost.service.supervisor`)
    changes it: through :meth:`scale` on an operator's request, and by replacing the clients of
    the actors it finds lost.

    Args:
        cfg: the job config.
        starter: starts each role's actor (an :class:`ActorStarter`, or a test's stand-in).
        buffer, inference, env_pools, learner, reference, control, reward: the started actors'
            clients (``reference``, ``control``, ``reward``: None when the run has none).
    """

    def __init__(self, cfg: JobConfig, starter: Any, buffer: RayBuffer, inference: list[InferenceClient],
                 env_pools: list[EnvPoolClient], learner: LearnerClient, reference: ReferenceClient | None = None,
                 control: ControlClient | None = None, reward: ActorClient | None = None):  # fmt: skip
        self.cfg, self.starter = cfg, starter
        self.buffer, self.inference, self.env_pools, self.learner = buffer, inference, env_pools, learner
        self.reference, self.control, self.reward = reference, control, reward
        self.epochs: dict[int, int] = collections.defaultdict(int)  # env-pool-<j> -> its incarnation
        # each role's slots (serving or vacant); the range's top is opened now, rlpost scale changes them
        self.inference_slots = Slots("inference", "inference", set(range(len(inference))))
        self.pool_slots = Slots("env-pool", "env_pools", set(range(len(env_pools))))
        self.open_slots(self.inference_slots, cfg.rollout.inference_worker_target())
        self.open_slots(self.pool_slots, cfg.rollout.env_pool_shards())

    @classmethod
    def start(cls, cfg: JobConfig) -> Fleet:
        """Place and start every actor of ``cfg``'s run: the engines up and the weight bus
        connected (:meth:`ActorStarter.start_all`). Usable on its own, without a training loop."""
        return ActorStarter(cfg).start_all()

    def stop(self) -> None:
        """Stop collection, shut the engines down, kill every actor and remove the placement
        groups (best effort, bounded)."""
        for pool in self.env_pools:
            _quietly(functools.partial(pool.stop, timeout_s=30))
        for worker in self.inference:
            _quietly(functools.partial(worker.shutdown, timeout_s=60))
        for client in self.clients():
            client.kill()
        self.starter.remove_placement_groups()

    def clients(self) -> list[Any]:
        """Every role's client (a learner group is one)."""
        roles = [*self.env_pools, *self.inference, self.learner, self.buffer, self.reference, self.reward, self.control]
        return [client for client in roles if client is not None]

    def named_handles(self) -> list[tuple[str, Any]]:
        """(actor name, handle) of every actor of the run, each learner rank on its own (what the
        watchdog asks for heartbeats)."""
        pairs = [(w.name, w.handle) for w in self.inference] + [(p.name, p.handle) for p in self.env_pools]
        pairs += self.learner.members + [(self.buffer.name, self.buffer.handle)]
        pairs += [(c.name, c.handle) for c in (self.reference, self.reward, self.control) if c is not None]
        return pairs

    def sizes(self) -> dict[str, int]:
        """What serves now: for each role with slots the serving actors, the vacant slots and the
        slots it has (metrics.jsonl, each line; the run's mailbox): ``inference_workers``,
        ``inference_workers_vacant``, ``inference_workers_target``, ``env_pools``,
        ``env_pools_vacant``, ``env_pools_target``."""
        return self.inference_slots.sizes(len(self.inference)) | self.pool_slots.sizes(len(self.env_pools))

    def wanted(self) -> dict[str, int]:
        """The slots each role has, as a scale request (what a checkpoint records)."""
        return {slots.key: len(slots.wanted) for slots in (self.inference_slots, self.pool_slots)}

    def open_slots(self, slots: Slots, count: int) -> None:
        """Open the lowest unused slots until there are ``count``; each is vacant until it has
        room and its actor starts (the supervisor's recovery starts it)."""
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
            if slots.vacant.pop(slot, None) is not None:
                self.starter.close_slot(slots.name(slot))

    def scale(self, request: dict[str, int]) -> bool:
        """Resize the roles ``request`` names (``rlpost scale``'s keys: ``inference`` workers,
        ``env_pools``) within the config's ranges (ValueError outside them, nothing changed). New
        slots are vacant until the cluster places their bundles (the supervisor's recovery then
        starts their actors); fewer slots close the vacant ones first, then retire the serving
        ones with the highest slots (:meth:`retire_workers`, :meth:`retire_pools`). True when a
        worker left: the weight bus must re-form without it. Safe to run again after a failure
        part-way."""
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
        """Stop the serving workers whose slots closed, after the pools stopped using them and
        they finished their requests (``DRAIN_TIMEOUT_S``; the rest are re-issued to the others).
        True when a worker left: the weight bus must then re-form without it (the caller's)."""
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
        """Stop the serving env pools whose slots closed: each stops after its current batch
        (``POOL_STOP_TIMEOUT_S``; what it had not put yet is collected again when its shard serves
        again, from its last put's position), then its actor goes. In sync mode the other pools
        collect what was left of its share of the step."""
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

    # ------------------------------------------------------------------ asked while the supervisor mends

    def fence_pool(self, slot: int) -> None:
        """``env-pool-<slot>`` is gone and no pool replaces it now: the buffer refuses a put its
        last incarnation left in flight and frees the room that one held for its next batch (which
        the serving pools need for the shares they take over)."""
        self.epochs[slot] += 1
        self.buffer.fence(f"env-pool-{slot}", self.epochs[slot])

    def placed(self, slots: Slots) -> list[int]:
        """The vacant slots of ``slots`` whose bundles the cluster has placed (by now)."""
        return [slot for slot in sorted(slots.vacant) if self.starter.has_room(slots.name(slot))]

    def wait_for_room(self, name: str) -> bool:
        """Whether ``name``'s bundle is placed, waiting up to ``resources.replacement_wait_s``
        (after a node's loss Ray places its bundles on other nodes at once where they fit)."""
        deadline = time.monotonic() + self.cfg.resources.replacement_wait_s
        while not self.starter.has_room(name):
            if time.monotonic() >= deadline:
                return False
            time.sleep(PLACEMENT_POLL_S)
        return True


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

    def sizes(self, serving: int) -> dict[str, int]:
        """``serving``, the vacant slots and the slots the fleet has, under the role's metrics keys
        (``inference_workers``, ``inference_workers_vacant``, ``inference_workers_target``; the
        same for ``env_pools``)."""
        from rlpost.service.mailbox import FLEET_KEYS

        serving_key, wanted_key, vacant_key = FLEET_KEYS[self.key]
        return {serving_key: serving, vacant_key: len(self.vacant), wanted_key: len(self.wanted)}


def slot_of(name: str) -> int:
    """The slot of ``inference-<i>`` or ``env-pool-<j>``: i or j."""
    return int(name.rsplit("-", 1)[1])


# ----------------------------------------------------------------------------- placement and starts


def role_plan(cfg: JobConfig) -> list[tuple[str, object]]:
    """(actor name, its RoleResources) for every actor of the run, in start order."""
    res = cfg.resources
    plan = [(f"inference-{i}", res.inference) for i in range(cfg.rollout.num_inference_workers)]
    plan += [(learner_name(r), res.learner) for r in range(res.learner.num_workers)]
    if cfg.reference.enabled:
        plan.append(("reference", res.reference))
    if cfg.reward_model is not None:
        plan.append((REWARD_ACTOR, res.reward))
    plan += [(f"env-pool-{i}", res.env_pool) for i in range(cfg.rollout.num_env_pools)]
    return plan


def role_bundles(cfg: JobConfig) -> list[tuple[str, dict[str, float]]]:
    """(actor name, its placement bundle) for every actor that reserves something: its CPUs,
    GPUs and custom resources."""
    return [(name, bundle) for name, role in role_plan(cfg) if (bundle := bundle_of(role))]


def bundle_of(role) -> dict[str, float]:
    """What one actor of a role (a RoleResources) reserves: its CPUs, GPUs and custom resources."""
    return {k: v for k, v in (("CPU", role.num_cpus), ("GPU", role.num_gpus)) if v > 0} | role.resources


def make_placement_group(cfg: JobConfig, timeout_s: float = 120.0):
    """One placement group for the run: a bundle per actor that reserves CPUs, GPUs or custom
    resources (``resources.<role>.resources``).

    Returns the group (None when no actor reserves anything) and each such actor's bundle index.
    The strategy (PACK/SPREAD/...) comes from ``resources.placement_strategy``: PACK keeps an
    inference worker's GPUs with the learner's on few nodes, SPREAD puts them on different nodes.
    If the cluster cannot hold the bundles in ``timeout_s`` (``resources.placement_timeout_s``)
    the run stops, naming what it asked for and what the cluster has.
    """
    import ray
    from ray.util.placement_group import placement_group

    named = role_bundles(cfg)
    index = {name: i for i, (name, _) in enumerate(named)}
    bundles = [bundle for _, bundle in named]
    if not bundles:
        return None, index
    pg = placement_group(bundles, strategy=cfg.resources.placement_strategy, name=f"rlpost-{cfg.logging.run_name}")
    placed = pg.ready()
    try:
        wait_stoppably([placed], timeout_s)  # a stop signal ends the wait (the group is removed)
        ready, _ = ray.wait([placed], timeout=0)
    except BaseException:
        ray.util.remove_placement_group(pg)
        raise
    if not ready:
        ray.util.remove_placement_group(pg)
        asked = {k: round(sum(b.get(k, 0) for b in bundles), 2) for k in ("CPU", "GPU")}
        raise RuntimeError(
            f"the cluster cannot place the run's actors: they ask for {asked} "
            f"({cfg.resources.placement_strategy}), the cluster has {ray.cluster_resources()}; "
            "lower resources.* or add nodes"
        )
    return pg, index


class ActorStarter:
    """Starts the run's actors: each with its role's start function (``rlpost.actors.<role>``),
    given only its role's settings, in its bundle of the run's placement group."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.placement_group, self.bundle_index = make_placement_group(cfg, timeout_s=cfg.resources.placement_timeout_s)
        self.slot_groups: dict[str, Any] = {}  # slots beyond the run's group: actor name -> its own group
        self.fleet = self._inference_fleet()

    def _group_of(self, name: str):
        """(placement group, bundle index) holding actor ``name``, or None when it reserves nothing."""
        if name in self.bundle_index:
            return self.placement_group, self.bundle_index[name]
        if name in self.slot_groups:
            return self.slot_groups[name], 0
        return None

    def place(self, name: str):
        """The scheduling strategy of actor ``name``: its bundle (None: it reserves nothing)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        held = self._group_of(name)
        return None if held is None else PlacementGroupSchedulingStrategy(*held)

    def has_room(self, name: str) -> bool:
        """Whether actor ``name`` can start now: its bundle is placed on a node (after a node's
        loss Ray places the bundles it held on other nodes where they fit, or waits for one)."""
        held = self._group_of(name)
        if held is None:
            return True
        from ray.util.placement_group import placement_group_table

        group, index = held
        return bool(placement_group_table(group)["bundles_to_node_id"].get(index))

    def open_slot(self, name: str) -> None:
        """Make ``name`` (``inference-<i>``, ``env-pool-<j>``) a slot of its role's fleet: beyond
        the run's placement group it gets a one-bundle group of its own, which Ray places whenever
        the cluster has room (a cluster autoscaler sees it as pending demand and adds a node);
        :meth:`has_room` says when."""
        from ray.util.placement_group import placement_group

        if name.startswith("inference-") and slot_of(name) >= self.fleet.num_replicas:
            self.fleet.resize(slot_of(name) + 1)
        bundle = bundle_of(self._role_resources(name))
        if name in self.bundle_index or name in self.slot_groups or not bundle:
            return
        self.slot_groups[name] = placement_group(
            [bundle], strategy="PACK", name=f"rlpost-{self.cfg.logging.run_name}-{name}"
        )

    def close_slot(self, name: str) -> None:
        """``name`` leaves its fleet: an inference worker's replica stops, and a group of the
        slot's own is removed (a slot of the run's placement group keeps its bundle reserved: Ray
        cannot take one bundle out of a group)."""
        import ray

        if name.startswith("inference-"):
            self.fleet.stop_replica(slot_of(name))
        group = self.slot_groups.pop(name, None)
        if group is not None:
            ray.util.remove_placement_group(group)

    def _role_resources(self, name: str):
        """The RoleResources of the role actor ``name`` belongs to."""
        return self.cfg.resources.inference if name.startswith("inference-") else self.cfg.resources.env_pool

    def _inference_fleet(self):
        """The run's inference workers as an :class:`~rlpost.actors.async_vllm.AsyncVLLM` fleet:
        its replica ``i`` is ``inference-<i>``, in its bundle, with the job's engine settings.
        The supervisor, not Ray, restarts a replica (it re-forms the bus and tells the pools)."""
        from rlpost.actors.async_vllm import AsyncVLLM
        from rlpost.actors.inference import InferenceSettings, start_inference

        settings = InferenceSettings.from_job(self.cfg)

        def start_replica(index: int):
            return start_inference(settings, index, scheduling_strategy=self.place(f"inference-{index}"))

        return AsyncVLLM.from_replica_starter(
            start_replica, self.cfg.rollout.num_inference_workers, settings.model_path,
            tensor_parallel_size=settings.engine.tensor_parallel_size,
        )  # fmt: skip

    def buffer(self) -> RayBuffer:
        """``buffer``. It reserves no bundle; unless ``resources.buffer.resources`` sends it
        elsewhere it runs on the head node (:func:`on_the_head`), so that losing another node
        does not take the groups in flight with it."""
        from rlpost.actors.buffer import BufferSettings, start_buffer

        settings = BufferSettings.from_job(self.cfg)
        options = {} if settings.resources.resources else {"scheduling_strategy": on_the_head()}
        release_names(["buffer"], NAME_RELEASE_TIMEOUT_S)
        return start_buffer(settings, **options)

    def inference(self, index: int) -> InferenceClient:
        """``inference-<index>``: the fleet's replica ``index``, started (again)."""
        name = f"inference-{index}"
        release_names([name], NAME_RELEASE_TIMEOUT_S)
        return InferenceClient(name, self.fleet.start_replica(index))

    def learner(self) -> LearnerClient:
        """The learner, or its group of ``resources.learner.num_workers`` ranks, one bundle each."""
        from rlpost.actors.learner import LearnerSettings, start_learner_group

        settings = LearnerSettings.from_job(self.cfg)
        release_names([learner_name(r) for r in range(settings.resources.num_workers)], NAME_RELEASE_TIMEOUT_S)
        ranks = start_learner_group(settings, settings.resources.num_workers,
                                    options_for=lambda r: {"scheduling_strategy": self.place(learner_name(r))})  # fmt: skip
        others = [(learner_name(r), handle) for r, handle in enumerate(ranks) if r > 0]
        return LearnerClient(learner_name(0), ranks[0], others)

    def reference(self) -> ReferenceClient:
        from rlpost.actors.reference import ReferenceSettings, start_reference

        settings = ReferenceSettings.from_job(self.cfg)
        release_names(["reference"], NAME_RELEASE_TIMEOUT_S)
        return ReferenceClient("reference", start_reference(settings, scheduling_strategy=self.place("reference")))

    def reward(self) -> ActorClient:
        """``reward``, the reward model's actor, which the env pools find by its name."""
        from rlpost.actors.reward import RewardSettings, start_reward

        release_names([REWARD_ACTOR], NAME_RELEASE_TIMEOUT_S)
        settings = RewardSettings.from_job(self.cfg)
        return ActorClient(REWARD_ACTOR, start_reward(settings, scheduling_strategy=self.place(REWARD_ACTOR)))

    def env_pool(
        self, index: int, inference: list[InferenceClient], buffer: RayBuffer, epoch: int = 0
    ) -> EnvPoolClient:
        from rlpost.actors.env_pool import EnvPoolSettings, start_env_pool
        from rlpost.policies import RemoteVLLMClient

        name = f"env-pool-{index}"
        release_names([name], NAME_RELEASE_TIMEOUT_S)
        handle = start_env_pool(
            EnvPoolSettings.from_job(self.cfg),
            index,
            RemoteVLLMClient([w.handle for w in inference]),
            buffer,  # sent to the pool as a copy that does not own the actor
            epoch=epoch,
            scheduling_strategy=self.place(name),
        )
        return EnvPoolClient(name, handle)

    def control(self) -> ControlClient:
        """``control``, the run's mailbox for ``rlpost scale``, on the head node (:func:`on_the_head`)."""
        from rlpost.service.mailbox import CONTROL_ACTOR, start_control

        release_names([CONTROL_ACTOR], NAME_RELEASE_TIMEOUT_S)
        bounds = self.cfg.rollout.scale_bounds()
        return ControlClient(CONTROL_ACTOR, start_control(bounds, scheduling_strategy=on_the_head()))

    def start_all(self) -> Fleet:
        """Every actor of the run, its engines up and the weight bus connected. A stop signal
        (Ctrl-C, SIGTERM) while the engines and models load ends the start within a second, and
        a start that fails or is stopped kills every actor it started and removes the run's
        placement groups before it raises."""
        cfg = self.cfg
        started: list[ActorClient] = []

        def keep(client):
            started.append(client)
            return client

        try:
            buffer = keep(self.buffer())
            inference = [keep(self.inference(i)) for i in range(cfg.rollout.num_inference_workers)]
            learner = keep(self.learner())
            reference = keep(self.reference()) if cfg.reference.enabled else None
            reward = keep(self.reward()) if cfg.reward_model is not None else None
            env_pools = [keep(self.env_pool(j, inference, buffer)) for j in range(cfg.rollout.num_env_pools)]
            wait_all([w.submit("get_version") for w in inference], STARTUP_TIMEOUT_S, stoppable=True)
            fleet = Fleet(cfg, self, buffer, inference, env_pools, learner, reference, keep(self.control()), reward)
            connect_bus(cfg, fleet, timeout_s=STARTUP_TIMEOUT_S)
        except BaseException:
            for client in started:
                client.kill()
            self.remove_placement_groups()
            raise
        return fleet

    def remove_placement_groups(self) -> None:
        """Remove the run's placement group and every slot's own (a start that did not finish, or
        the fleet's stop)."""
        _remove_groups([self.placement_group, *self.slot_groups.values()])


def on_the_head():
    """The scheduling strategy that pins an actor to the cluster's head node, for the actors that
    reserve nothing and hold the run's state between calls (the buffer, the control mailbox):
    the head's loss ends the cluster, and the run, anyway, while any other node may go. Ray gives
    the head the resource ``node:__internal_head__``; without one (an unusual cluster) the
    driver's node. Not soft: Ray's soft affinity placed half of such actors elsewhere on a
    two-node cluster, where a node's loss took the buffer with it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    heads = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {})]
    node = heads[0] if heads else ray.get_runtime_context().get_node_id()
    return NodeAffinitySchedulingStrategy(node, soft=False)


def connect_bus(cfg: JobConfig, fleet: Fleet, timeout_s: float) -> None:
    """Form the weight bus: the learner's vLLMUpdater joins every inference worker to it."""
    import ray

    ws = cfg.weight_sync
    host = ray.util.get_node_ip_address() if cfg.resources.address else "127.0.0.1"
    fleet.learner.connect_workers(
        [w.handle for w in fleet.inference], host, ws.backend, ws.bucket_mb, ws.timeout_s, timeout_s=timeout_s,
        shared_memory=ws.shared_memory,
    )  # fmt: skip


def _remove_groups(groups: list) -> None:
    """Remove these placement groups (None: none), best effort."""
    import ray

    for group in groups:
        if group is not None:
            _quietly(functools.partial(ray.util.remove_placement_group, group))


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception as exc:  # shutdown must reach every actor even when one is already gone
        log.debug("shutdown step failed: %s", exc)
