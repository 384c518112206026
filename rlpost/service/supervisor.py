"""The supervisor: starts the run's actors and owns every failure of one.

The training loop (:mod:`rlpost.service.loop`) runs each part of a step through
:meth:`Supervisor.run`. When an actor is lost the part's call raises one of the clients' errors
(:mod:`rlpost.service.clients`); the supervisor then recovers and runs the part again. A part is safe
to run again: taking from the buffer, annotating, a weight sync and a checkpoint repeat
harmlessly, and collection goes on from what the buffer recorded. Between parts,
:meth:`Supervisor.check` reads every actor's state in Ray's control store every HEALTH_CHECK_S
seconds, so a death is noticed while the loop waits, and whoever meets a dead peer first says
so at once: a client call to a dead actor, a weight sync with a dead worker, an env pool whose
engine client found its worker dead (its ``wait`` raises) all end in a recovery right away. Recovery restarts what is dead, in this order:

    learner dead        -> LearnerDied: run_with_auto_resume restarts the whole run from its
                           last checkpoint (trainer.auto_resume) or it stops naming the
                           resume command
    buffer dead         -> a new buffer, told what the learner's side already received (the
                           ledger); every env pool puts again what it put and was not
                           acknowledged, so no completed group is lost or taken twice
    inference-<i> dead  -> started again in its bundle; the bus re-forms with every worker and
                           the current weights are published; the env pools get the new
                           handles (their request in flight on the dead worker is re-issued by
                           their RemoteVLLMClient). When the cluster has no room for its
                           bundle (its node was lost and no other node can hold it) within
                           resources.replacement_wait_s, the run goes on with the other
                           workers, and the worker is started again at a health check once
                           the bundle is placed (the node's replacement, or a node added):
                           `inference_workers` in metrics.jsonl counts the serving ones
    a weight sync failed (or timed out) -> the bus re-forms and the weights are sent again
    reference dead      -> started again (it is stateless); with kl_in: reward an env pool's
                           call that met the dead one waits for the new one
                           (reference.restart_wait_s)
    reward dead         -> started again (stateless); an env pool's call that met the dead one
                           waits for the new one (reward_model.restart_wait_s)
    env-pool-<j> dead   -> started again with a higher epoch from the position its last put
                           recorded (the buffer fences off the old one's late puts); in async
                           mode it starts collecting. With no room for it (as for a worker) and
                           another pool serving, its slot is left vacant: its shard of the
                           prompt stream waits at that position, the other pools collect the
                           step's prompts, and it starts again once its bundle is placed
                           (`env_pools` in metrics.jsonl counts the serving ones)
    an async pool's collection failed -> the pool is replaced the same way

The fleet's size changes too. Each role with slots (inference workers, env pools; a
:class:`Slots` each) wants the top of its range (``rollout.num_inference_workers: A..B``,
``rollout.num_env_pools: A..B``) and starts each slot beyond A when the cluster places it; an
operator's ``rlpost scale`` (a request left in the run's ``control`` actor, taken at a health
check) opens or closes slots: :meth:`Supervisor.resize`.

An actor that is alive to Ray but answers nothing (stopped, on a frozen node, deadlocked) is
killed by the run's watchdog (:mod:`rlpost.service.watchdog`, started by :meth:`Supervisor.watch`), and
then recovered from as above: the supervisor only names the watchdog's verdict in its messages
and counts it (``watchdog_kills``).

A part that keeps failing after MAX_ATTEMPTS recoveries stops the run with the last cause, and
so does an error that is not an actor's loss (a bug, a bad input): retrying would not help.
Restarts are counted in metrics.jsonl (``restarts_inference``, ``restarts_env_pool``,
``restarts_reference``, ``restarts_reward``, ``restarts_buffer``, ``bus_reforms``; ``learner_resumes``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rlpost.actors import REWARD_ACTOR, learner_name
from rlpost.actors.calls import ActorFailure, BusFailure, first_line, wait_all, wait_stoppably
from rlpost.config import JobConfig
from rlpost.record.run_dir import latest_checkpoint
from rlpost.runtime.actors import release_names
from rlpost.runtime.shutdown import raise_if_stopping
from rlpost.service.clients import (
    ActorClient,
    ControlClient,
    EnvPoolClient,
    InferenceClient,
    LearnerClient,
    ReferenceClient,
)
from rlpost.service.run_state import RunState
from rlpost.service.watchdog import Watchdog
from rlpost.transport.buffer import BufferSnapshot, RayBuffer

log = logging.getLogger("rlpost")
T = TypeVar("T")

MAX_ATTEMPTS = 4  # tries of one part of a step (the first and three after recoveries)
STARTUP_TIMEOUT_S = 600.0  # an actor's start (a vLLM engine loads its model)
PLACEMENT_POLL_S = 0.5  # how often a lost worker's bundle is looked at while waiting for room
DRAIN_TIMEOUT_S = 120.0  # a worker leaving the fleet finishes its requests (the rest are re-issued)
POOL_STOP_TIMEOUT_S = 300.0  # an env pool leaving the fleet finishes its batch (a multi-turn one may be long)
PING_TIMEOUT_S = 5.0  # a worker asked whether it can be reached (after a peer of a call was lost)
NAME_RELEASE_TIMEOUT_S = 120.0  # a lost actor's name, held until Ray declares its node dead
CALL_TIMEOUT_S = 60.0  # a short control call (set handles, join the bus, load a pool's state)
HEALTH_CHECK_S = 2.0  # actors' states are read at most this often while things go well (~1 ms each)
MAX_POOL_FAILURES = 3  # an async pool whose collection fails (not by a lost actor) this often stops the run
MAX_AUTO_RESUMES = 3  # restarts of a whole run from its last checkpoint (trainer.auto_resume)


class ResumeNeeded(RuntimeError):
    """The run cannot go on with the actors it has; it can restart from its last checkpoint."""


class LearnerDied(ResumeNeeded):
    """The learner actor is gone; the message says how to resume."""


def run_with_auto_resume(cfg: JobConfig, run_dir: Path, resume: bool, run_once: Callable[[bool, int], None]) -> None:
    """``run_once(resume, learner_resumes)``; when it raises ResumeNeeded (the learner died) and
    ``trainer.auto_resume`` is on, run it again from the last checkpoint, at most
    MAX_AUTO_RESUMES times. Otherwise the error propagates, naming the resume command."""
    learner_resumes = 0
    while True:
        try:
            return run_once(resume, learner_resumes)
        except ResumeNeeded as exc:
            if not (cfg.trainer.auto_resume and learner_resumes < MAX_AUTO_RESUMES and latest_checkpoint(run_dir)):
                raise
            learner_resumes += 1
            log.warning(
                "%s; auto_resume: restarting the run from its last checkpoint (%d of %d)",
                exc,
                learner_resumes,
                MAX_AUTO_RESUMES,
            )
            resume = True


# ----------------------------------------------------------------------------- the actors


@dataclasses.dataclass
class RunActors:
    """A client for every actor of the run (the supervisor replaces them as it restarts actors)."""

    buffer: RayBuffer
    inference: list[InferenceClient]
    env_pools: list[EnvPoolClient]
    learner: LearnerClient
    reference: ReferenceClient | None
    placement_group: Any = None
    # slots beyond the run's placement group (actor name -> its own group: the starter's dict,
    # which it updates as slots open and close)
    slot_groups: dict[str, Any] = dataclasses.field(default_factory=dict)
    control: ControlClient | None = None  # the operators' mailbox (rlpost scale)
    reward: ActorClient | None = None  # the reward model's actor (reward_model), called by the env pools

    def named_handles(self) -> list[tuple[str, Any]]:
        """(actor name, handle) of every actor of the run, each learner rank on its own (what the
        watchdog asks for heartbeats)."""
        pairs = [(w.name, w.handle) for w in self.inference] + [(p.name, p.handle) for p in self.env_pools]
        pairs += self.learner.members + [(self.buffer.name, self.buffer.handle)]
        pairs += [(c.name, c.handle) for c in (self.reference, self.reward, self.control) if c is not None]
        return pairs


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

    def start_all(self) -> RunActors:
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
            actors = RunActors(buffer, inference, env_pools, learner, reference, self.placement_group,
                               self.slot_groups, keep(self.control()), reward)  # fmt: skip
            connect_bus(cfg, actors, timeout_s=STARTUP_TIMEOUT_S)
        except BaseException:
            for client in started:
                client.kill()
            self.remove_placement_groups()
            raise
        return actors

    def remove_placement_groups(self) -> None:
        """Remove the run's placement group and every slot's own (a start that did not finish)."""
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


def connect_bus(cfg: JobConfig, actors: RunActors, timeout_s: float) -> None:
    """Form the weight bus: the learner's vLLMUpdater joins every inference worker to it."""
    import ray

    ws = cfg.weight_sync
    host = ray.util.get_node_ip_address() if cfg.resources.address else "127.0.0.1"
    actors.learner.connect_workers(
        [w.handle for w in actors.inference], host, ws.backend, ws.bucket_mb, ws.timeout_s, timeout_s=timeout_s,
        shared_memory=ws.shared_memory,
    )  # fmt: skip


def stop_actors(actors: RunActors) -> None:
    """Stop collection, shut engines down, kill every actor (best effort, bounded)."""

    for pool in actors.env_pools:
        _quietly(functools.partial(pool.stop, timeout_s=30))
    for worker in actors.inference:
        _quietly(functools.partial(worker.shutdown, timeout_s=60))
    clients = [*actors.env_pools, *actors.inference, actors.learner, actors.buffer, actors.reference, actors.reward,
               actors.control]  # fmt: skip
    for client in clients:
        if client is not None:
            client.kill()
    _remove_groups([actors.placement_group, *actors.slot_groups.values()])


def _remove_groups(groups: list) -> None:
    """Remove these placement groups (None: none), best effort."""
    import ray

    for group in groups:
        if group is not None:
            _quietly(functools.partial(ray.util.remove_placement_group, group))


def _replaced(name: str, since: float) -> None:
    """Log that ``name`` serves again, ``since`` (monotonic) being when its loss was acted on.
    For an inference worker that is once the bus re-formed with it and the env pools have it."""
    log.warning("%s replaced: serving again %.1f s after its loss was noticed", name, time.monotonic() - since)


def slot_of(name: str) -> int:
    """The slot of ``inference-<i>`` or ``env-pool-<j>``: i or j."""
    return int(name.rsplit("-", 1)[1])


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception as exc:  # shutdown must reach every actor even when one is already gone
        log.debug("shutdown step failed: %s", exc)


# ----------------------------------------------------------------------------- the supervisor


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


class Supervisor:
    """Keeps the run's actors alive for the training loop; see the module docstring.

    Args:
        cfg: the job config.
        run_dir: the run directory (named in LearnerDied's message).
        actors: the started actors' clients; replaced in place as actors are restarted.
        starter: starts a role's actor again (an :class:`ActorStarter`, or a test's stand-in).
        state: the loop's state (step, policy version, ledger), which the loop writes and the
            supervisor only reads: the step for messages, the version a publish must carry, the
            ledger a new buffer is rebuilt from.
    """

    def __init__(self, cfg: JobConfig, run_dir: Path, actors: RunActors, starter: Any, state: RunState):
        self.cfg, self.run_dir, self.actors, self.starter, self.state = cfg, Path(run_dir), actors, starter, state
        # recovery's own counts, which the loop reads for metrics.jsonl and checkpoints
        self.counts = {
            "restarts_inference": 0,
            "restarts_env_pool": 0,
            "restarts_reference": 0,
            "restarts_reward": 0,
            "restarts_buffer": 0,
            "bus_reforms": 0,
            "watchdog_kills": 0,  # actors found frozen or hung, killed and then replaced like the dead
        }
        self.epochs: dict[int, int] = collections.defaultdict(int)  # env-pool-<j> -> its incarnation
        self.pool_failures: dict[int, int] = collections.defaultdict(int)  # env-pool-<j> -> failed collections
        self.last_check = time.monotonic()
        self.health_check_s = HEALTH_CHECK_S
        self.collecting = False  # async mode: the pools collect on their own from now on
        self.restarted_at: dict[str, float] = {}  # workers started again, until the bus serves them
        self.watchdog: Watchdog | None = None  # finds frozen and hung actors (watch())
        self.verdicts: dict[str, str] = {}  # actor name -> why the watchdog killed it (for the messages)
        # each fleet's slots (serving or vacant); the range's top is opened now, rlpost scale changes them
        self.inference_slots = Slots("inference", "inference", set(range(len(actors.inference))))
        self.pool_slots = Slots("env-pool", "env_pools", set(range(len(actors.env_pools))))
        self._open_slots(self.inference_slots, cfg.rollout.inference_worker_target())
        self._open_slots(self.pool_slots, cfg.rollout.env_pool_shards())

    # ------------------------------------------------------------------ what the loop calls

    def watch(self) -> None:
        """Start the watchdog over the run's actors (``watchdog``): from now on a frozen or hung
        actor is killed, and then recovered from like a dead one."""
        self.watchdog = Watchdog(self.cfg.watchdog, self.actors.named_handles).start()

    def close(self) -> None:
        """Stop the watchdog, then every actor (:func:`stop_actors`)."""
        if self.watchdog is not None:
            self.watchdog.stop()
        stop_actors(self.actors)

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
        for pool in self.actors.env_pools:
            if pool.wait(0.0):  # not running yet (a retry after a recovery skips the started)
                pool.start(None)
        self.collecting = True

    def check(self, force: bool = False) -> None:
        """Look for lost actors (at most every HEALTH_CHECK_S unless ``force``) and recover, then
        take an operator's request from the run's mailbox. Raises StopRequested when a stop
        signal came (the loop calls this at every poll)."""
        raise_if_stopping()
        if not force and time.monotonic() - self.last_check < self.health_check_s:
            return
        self.last_check = time.monotonic()
        self.run("health check", lambda: self.recover(None))
        requested = self._exchange_with_control()
        if requested:
            self.run("scale", lambda: self.resize(requested))

    def _exchange_with_control(self) -> dict[str, int]:
        """Report the fleet to the run's mailbox and take the request it holds (empty: none); a
        lost mailbox is started again (a request it held is lost, and the log says so)."""
        control = self.actors.control
        if control is None:
            return {}
        try:
            return control.exchange(self.fleet_sizes(), timeout_s=CALL_TIMEOUT_S)
        except ActorFailure as exc:
            why = self._how_lost(control.name)
            why = first_line(exc) if why == "died" else why
            log.warning("the run's control mailbox failed (%s); starting it again (a scale request it held "
                        "is lost: ask again)", why)  # fmt: skip
            start = time.monotonic()
            control.kill()
            self.actors.control = self.starter.control()
            _replaced(control.name, start)
            return {}

    # ------------------------------------------------------------------ the fleet's size

    def resize(self, request: dict[str, int]) -> None:
        """Give the fleets what ``request`` asks for (``rlpost scale``: ``inference`` workers,
        ``env_pools``). New slots are vacant until the cluster places their bundles (each beyond
        the run's placement group has a group of its own), and their actors start like a lost
        actor's replacement (at once when there is room): a worker loads the current weights and
        joins the bus, a pool takes up its shard of the prompt stream where it last stopped.
        Fewer slots: vacant ones close first, then the serving ones with the highest slots leave
        (:meth:`_retire_workers`, :meth:`_retire_pools`). Raises ValueError outside the config's
        ranges. Safe to run again after a failure part-way."""
        from rlpost.service.mailbox import check_scale_request

        check_scale_request(self.cfg.rollout.scale_bounds(), request)
        if "inference" in request:
            self._resize_slots(self.inference_slots, request["inference"])
            self._retire_workers()
        if "env_pools" in request:
            self._resize_slots(self.pool_slots, request["env_pools"])
            self._retire_pools()
        self.recover(None)  # vacant slots with room start now

    def fleet_wanted(self) -> dict[str, int]:
        """The slots each fleet has, as a scale request (what a checkpoint records)."""
        return {slots.key: len(slots.wanted) for slots in (self.inference_slots, self.pool_slots)}

    def restore_counts(self, counts: dict[str, int]) -> None:
        """After a resume: the restart and re-form counts a checkpoint recorded, so that they go
        on counting across the restart (names the config no longer has are dropped)."""
        self.counts.update({name: int(n) for name, n in counts.items() if name in self.counts})

    def restore_fleet(self, wanted: dict[str, int]) -> None:
        """After a resume: the fleet a checkpoint recorded (:meth:`fleet_wanted`), so that an
        operator's ``rlpost scale`` outlives a restart; a count the resumed config's ranges no
        longer allow is left at the config's, and the log says so."""
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

    def _resize_slots(self, slots: Slots, count: int) -> None:
        """Open or close ``slots`` until the fleet has ``count``: vacant ones close first, then
        the highest; the serving actors of closed slots are retired by the caller."""
        if count != len(slots.wanted):
            log.warning("scaling the %s fleet from %d to %d", slots.prefix, len(slots.wanted), count)
        self._open_slots(slots, count)
        while len(slots.wanted) > count:
            vacant = sorted(set(slots.vacant) & slots.wanted)
            slot = vacant[-1] if vacant else max(slots.wanted)
            slots.wanted.discard(slot)
            slots.fresh.discard(slot)
            if slots.vacant.pop(slot, None) is not None:
                self.starter.close_slot(slots.name(slot))

    def _open_slots(self, slots: Slots, count: int) -> None:
        """Open the lowest unused slots until there are ``count``; each is vacant until it has
        room and its actor starts (:meth:`recover`)."""
        slot = 0
        while len(slots.wanted) < count:
            if slot not in slots.wanted:
                self.starter.open_slot(slots.name(slot))
                slots.wanted.add(slot)
                slots.fresh.add(slot)
                slots.vacant[slot] = time.monotonic()
            slot += 1

    def _retire_workers(self) -> None:
        """Stop the serving workers whose slots closed, after the pools stopped using them and
        they finished their requests (``DRAIN_TIMEOUT_S``; the rest are re-issued to the others);
        the bus then re-forms without them."""
        leaving = [w for w in self.actors.inference if slot_of(w.name) not in self.inference_slots.wanted]
        if not leaving:
            return
        staying = [w for w in self.actors.inference if w not in leaving]
        for pool in self.actors.env_pools:
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
        self.actors.inference = staying
        self._reform_bus()

    def _retire_pools(self) -> None:
        """Stop the serving env pools whose slots closed: each stops after its current batch
        (``POOL_STOP_TIMEOUT_S``; what it had not put yet is collected again when its shard serves
        again, from its last put's position), then its actor goes. In sync mode the other pools
        collect what was left of its share of the step."""
        leaving = [p for p in self.actors.env_pools if slot_of(p.name) not in self.pool_slots.wanted]
        for pool in leaving:
            try:
                pool.stop(timeout_s=POOL_STOP_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 (lost, failed or slow: its last put's position stands)
                log.warning("%s did not stop cleanly while leaving the fleet (%s)", pool.name, first_line(exc))
            self.starter.close_slot(pool.name)
            pool.kill()
            self._fence_pool(slot_of(pool.name))
            self.actors.env_pools = [p for p in self.actors.env_pools if p is not pool]

    # ------------------------------------------------------------------ recovery

    def recover(self, failure: ActorFailure | None, reform_bus: bool = False) -> None:
        """Restart every lost actor in dependency order (module docstring); re-form the bus
        when a worker was restarted or ``reform_bus``."""
        lost = {failure.name} if failure is not None and failure.name else set()
        lost |= self._killed_by_watchdog()
        if failure is not None and failure.name is None:  # a peer of the callee: which one?
            lost |= {w.name for w in self.actors.inference if w.unreachable(PING_TIMEOUT_S)}
        if not self._alive(self.actors.learner, lost):
            raise LearnerDied(self._learner_message(failure))
        if not self._alive(self.actors.buffer, lost):
            self._restart_buffer()
        dead = [w for w in self.actors.inference if not self._alive(w, lost)]
        for worker in dead:
            self._replace_inference(worker)
        placed = self._placed(self.inference_slots)
        for slot in placed:
            self._refill(slot)
        if dead or placed or isinstance(failure, BusFailure) or (failure is not None and reform_bus):
            self._reform_bus()
        if self.actors.reference is not None and not self._alive(self.actors.reference, lost):
            self._restart_stateless("reference")
        if self.actors.reward is not None and not self._alive(self.actors.reward, lost):
            self._restart_stateless(REWARD_ACTOR)
        for pool in [p for p in self.actors.env_pools if not self._alive(p, lost)]:
            self._replace_pool(pool)
        for slot in self._placed(self.pool_slots):
            self._refill_pool(slot)
        if self.collecting:
            self._replace_failed_pools()

    def _killed_by_watchdog(self) -> set[str]:
        """The actors the watchdog killed since the last recovery (frozen or hung): counted, and
        their verdicts kept for the messages of their replacement."""
        verdicts = self.watchdog.take_verdicts() if self.watchdog is not None else {}
        self.counts["watchdog_kills"] += len(verdicts)
        self.verdicts.update(verdicts)
        return set(verdicts)

    def _how_lost(self, name: str) -> str:
        """How actor ``name`` was lost, for the log: "died", or the watchdog's verdict."""
        self._killed_by_watchdog()  # a kill since the last recovery: its verdict too
        why = self.verdicts.pop(name, None)
        return "died" if why is None else f"was killed by the watchdog ({why})"

    def _placed(self, slots: Slots) -> list[int]:
        """The vacant slots of ``slots`` whose bundles the cluster has placed (by now)."""
        return [slot for slot in sorted(slots.vacant) if self.starter.has_room(slots.name(slot))]

    def _alive(self, client: Any, lost: set[str]) -> bool:
        """False for the actors a failure named or that cannot be reached (killed to be sure: a
        silent actor is as good as dead) and for any actor Ray's record says is dead or
        restarting (:func:`rlpost.service.clients.actor_state`)."""
        if lost & set(client.names):
            client.kill()
            return False
        return client.alive()

    def _learner_message(self, failure: ActorFailure | None) -> str:
        last = latest_checkpoint(self.run_dir)
        where = (
            f"the last checkpoint is {last}; resume with: rlpost train --resume {self.run_dir}"
            if last
            else "no checkpoint was written yet (trainer.checkpoint_interval), so the run must start again"
        )
        cause = f" ({first_line(failure)})" if failure is not None else ""
        killed = [
            f"{name} was {self.verdicts.pop(name)}" for name in self.actors.learner.names if name in self.verdicts
        ]
        if killed:
            cause = f" ({'; '.join(killed)}: the watchdog killed it)"
        return f"the learner died during step {self.state.step}{cause}; {where}"

    def _restart_buffer(self) -> None:
        """A new buffer from the ledger; every live pool puts again what it keeps."""
        log.warning(
            "the buffer %s; starting it again and asking the env pools for the groups it held", self._how_lost("buffer")
        )
        start = time.monotonic()
        self.actors.buffer.kill()
        buffer = self.starter.buffer()
        acknowledged = dict(self.state.ledger.acknowledged)
        buffer.restore(BufferSnapshot([], {}, last_seqs=acknowledged, acknowledged=acknowledged))
        self.actors.buffer = buffer
        self.counts["restarts_buffer"] += 1
        for j, pool in enumerate(self.actors.env_pools):
            if pool.alive():
                count = pool.set_buffer(buffer, timeout_s=CALL_TIMEOUT_S)
                log.warning("env-pool-%d put %d groups the learner had not received into the new buffer", j, count)
        _replaced("buffer", start)

    def _replace_inference(self, lost: InferenceClient) -> None:
        """Start a dead worker again in its slot; with no room for it in the cluster (within
        ``resources.replacement_wait_s``) and another worker serving, leave its slot vacant."""
        slot = slot_of(lost.name)
        lost.kill()
        others = [w for w in self.actors.inference if w is not lost]
        if others and not self._wait_for_room(lost.name):
            self.actors.inference = others
            self._leave_vacant(self.inference_slots, slot, len(others), "inference workers")
            return
        log.warning("%s %s; starting it again", lost.name, self._how_lost(lost.name))
        self._start_inference(slot)

    def _leave_vacant(self, slots: Slots, slot: int, serving: int, what: str) -> None:
        """A lost actor's slot without room in the cluster: vacant until its bundle is placed."""
        slots.vacant[slot] = time.monotonic()
        log.warning(
            "%s died and the cluster has no room for it: going on with %d of %d %s; it starts again once its "
            "bundle is placed (a node added or replaced)",
            slots.name(slot), serving, len(slots.wanted), what,
        )  # fmt: skip

    def _take_vacant(self, slots: Slots, slot: int) -> None:
        """A vacant slot whose bundle is placed (again): say so; its actor starts next."""
        waited = time.monotonic() - slots.vacant.pop(slot)
        if slot in slots.fresh:
            log.warning("the cluster has room for %s (a new slot, %.0f s); starting it", slots.name(slot), waited)
        else:
            log.warning("the cluster has room for %s again (vacant %.0f s); starting it", slots.name(slot), waited)

    def _refill(self, slot: int) -> None:
        """A vacant inference slot whose bundle is placed (again): its worker starts and joins."""
        self._take_vacant(self.inference_slots, slot)
        self._start_inference(slot)

    def _start_inference(self, slot: int) -> None:
        """Start ``inference-<slot>`` (a replacement, or the first worker of a new slot)."""
        name = f"inference-{slot}"
        if slot not in self.inference_slots.fresh:
            self.restarted_at[name] = time.monotonic()
        worker = self.starter.inference(slot)
        worker.wait_ready(STARTUP_TIMEOUT_S)
        workers = [w for w in self.actors.inference if w.name != name] + [worker]
        self.actors.inference = sorted(workers, key=lambda w: slot_of(w.name))
        if slot in self.inference_slots.fresh:
            self.inference_slots.fresh.discard(slot)
        else:
            self.counts["restarts_inference"] += 1

    def _wait_for_room(self, name: str) -> bool:
        """Whether ``name``'s bundle is placed, waiting up to ``resources.replacement_wait_s``
        (after a node's loss Ray places its bundles on other nodes at once where they fit)."""
        deadline = time.monotonic() + self.cfg.resources.replacement_wait_s
        while not self.starter.has_room(name):
            if time.monotonic() >= deadline:
                return False
            time.sleep(PLACEMENT_POLL_S)
        return True

    def fleet_sizes(self) -> dict[str, int]:
        """For each fleet the serving actors, the vacant slots and the slots it has (metrics.jsonl,
        each line; the run's mailbox): ``inference_workers``, ``inference_workers_vacant``,
        ``inference_workers_target``, ``env_pools``, ``env_pools_vacant``, ``env_pools_target``."""
        workers, pools = len(self.actors.inference), len(self.actors.env_pools)
        return self.inference_slots.sizes(workers) | self.pool_slots.sizes(pools)

    def _reform_bus(self) -> None:
        """Open the bus's next generation with every worker, publish the current weights, and
        give the live env pools the workers' handles."""
        workers = self.actors.inference
        generation = self.actors.learner.set_workers([w.handle for w in workers], timeout_s=CALL_TIMEOUT_S)
        self.counts["bus_reforms"] += 1
        log.warning("weight bus re-formed (generation %s) with %d workers", generation, len(workers))
        self.publish_weights()
        for pool in self.actors.env_pools:
            if pool.alive():
                pool.set_inference([w.handle for w in workers])
        for name, start in self.restarted_at.items():  # serving the current weights to the pools
            _replaced(name, start)
        self.restarted_at.clear()

    def _restart_stateless(self, role: str) -> None:
        """Start the dead ``reference`` or ``reward`` actor again: they hold nothing a new one lacks
        (the env pools' calls to the reward actor wait for its replacement)."""
        log.warning("the %s actor %s; starting it again", role, self._how_lost(role))
        start = time.monotonic()
        getattr(self.actors, role).kill()
        setattr(self.actors, role, getattr(self.starter, role)())
        self.counts[f"restarts_{role}"] += 1
        _replaced(role, start)

    def _replace_pool(self, lost: EnvPoolClient) -> None:
        """Start a dead env pool again in its slot; with no room for it in the cluster (within
        ``resources.replacement_wait_s``) and another pool serving, leave its slot vacant (its
        shard's prompts wait at its last put's position)."""
        slot = slot_of(lost.name)
        lost.kill()
        others = [p for p in self.actors.env_pools if p is not lost]
        if others and not self._wait_for_room(lost.name):
            self.actors.env_pools = others
            self._fence_pool(slot)
            self._leave_vacant(self.pool_slots, slot, len(others), "env pools")
            return
        log.warning("%s %s; starting it again", lost.name, self._how_lost(lost.name))
        self._start_pool(slot)

    def _fence_pool(self, slot: int) -> None:
        """``env-pool-<slot>`` is gone and no pool replaces it now: the buffer refuses a put its
        last incarnation left in flight and frees the room that one held for its next batch (which
        the serving pools need for the shares they take over)."""
        self.epochs[slot] += 1
        self.actors.buffer.fence(f"env-pool-{slot}", self.epochs[slot])

    def _refill_pool(self, slot: int) -> None:
        """A vacant env-pool slot whose bundle is placed (again): its pool starts."""
        self._take_vacant(self.pool_slots, slot)
        self._start_pool(slot)

    def _start_pool(self, slot: int) -> None:
        """Start ``env-pool-<slot>`` (a replacement, or the first pool of a new slot) with a new
        epoch from the position of its predecessor's last put (none: its shard's start)."""
        name = f"env-pool-{slot}"
        start = time.monotonic()
        for old in [p for p in self.actors.env_pools if p.name == name]:
            old.kill()
        self.epochs[slot] += 1
        pool = self.starter.env_pool(slot, self.actors.inference, self.actors.buffer, epoch=self.epochs[slot])
        state = self.actors.buffer.fence(name, self.epochs[slot])
        if state is None and self.state.ledger.acknowledged.get(name):
            raise ResumeNeeded(f"{name} was lost together with the buffer that held its position")
        if state is not None:
            pool.load_state_dict(state, timeout_s=STARTUP_TIMEOUT_S)
        if self.collecting:
            pool.start(None, timeout_s=STARTUP_TIMEOUT_S)
        pools = [p for p in self.actors.env_pools if p.name != name] + [pool]
        self.actors.env_pools = sorted(pools, key=lambda p: slot_of(p.name))
        collected = state["num_prompts_collected"] if state else 0
        if slot in self.pool_slots.fresh:
            self.pool_slots.fresh.discard(slot)
            log.warning("%s started (a new slot, epoch %d): %d prompts of its shard collected", name,
                        self.epochs[slot], collected)  # fmt: skip
            return
        log.warning("%s started again (epoch %d) from its last put: %s prompts collected", name, self.epochs[slot],
                    collected)  # fmt: skip
        self.counts["restarts_env_pool"] += 1
        _replaced(name, start)

    def _replace_failed_pools(self) -> None:
        """Async mode: a pool whose collection ended with an error is replaced (its error is
        logged); one that fails this way MAX_POOL_FAILURES times stops the run with it."""
        for pool in list(self.actors.env_pools):
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

    # ------------------------------------------------------------------ the weight bus

    def publish_weights(self, wait: bool = True) -> dict:
        """The learner publishes its weights through its vLLMUpdater, which has every worker
        receive and reload them; returns the sync's metrics. ``wait=False``: return once the
        weights are sent and let the workers reload while the learner trains on; the next
        publish first waits for that reload, and a failure found there is raised then. Raises
        a client error when a peer fails (the caller recovers)."""
        start = time.perf_counter()
        published = self.actors.learner.publish(wait).result(self.publish_timeout_s)
        sync_s = time.perf_counter() - start
        if int(published["policy_version"]) != self.state.version:
            raise RuntimeError(
                f"the learner published version {int(published['policy_version'])}, the loop expected {self.state.version}"
            )
        return {
            "weight_sync_s": sync_s,
            "weight_sync_bytes": published.get("bytes"),
            "weight_load_s": published.get("weight_load_s"),
            "weight_sync_receivers_shm": published.get("receivers_shm"),
            "weight_sync_receivers_bus": published.get("receivers_bus"),
        }  # the slowest engine's reload (of the update before, when that one was not waited for)

    @property
    def publish_timeout_s(self) -> float:
        """Bound of one publish call on the learner: it may confirm an earlier update and then
        publish its own, each up to two bus waits of ``weight_sync.timeout_s`` and the workers'
        grace (the learner's own bounds end it first)."""
        return 4 * self.cfg.weight_sync.timeout_s + 180
