"""The supervisor: starts the run's actors and owns every failure of one.

The training loop (:mod:`rlpost.controller`) runs each part of a step through
:meth:`Supervisor.run`. When an actor is lost the part's call raises one of the clients' errors
(:mod:`rlpost.clients`); the supervisor then recovers and runs the part again. A part is safe
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
    reference dead      -> started again (it is stateless)
    env-pool-<i> dead   -> started again with a higher epoch from the position its last put
                           recorded (the buffer fences off the old one's late puts); in async
                           mode it starts collecting
    an async pool's collection failed -> the pool is replaced the same way

The fleet's size changes too: the run wants ``rollout.max_inference_workers`` (the top of a range
``num_inference_workers: A..B``) and starts each slot beyond A when the cluster places it, and an
operator's ``rlpost scale`` (a request left in the run's ``control`` actor, taken at a health
check) opens or closes slots: :meth:`Supervisor.resize_inference`.

A part that keeps failing after MAX_ATTEMPTS recoveries stops the run with the last cause, and
so does an error that is not an actor's loss (a bug, a bad input): retrying would not help.
Restarts are counted in metrics.jsonl (``restarts_inference``, ``restarts_env_pool``,
``restarts_reference``, ``restarts_buffer``, ``bus_reforms``; ``learner_resumes``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rlpost.actors import learner_name
from rlpost.actors.calls import ActorFailure, BusFailure, first_line, wait_all
from rlpost.clients import (
    BufferClient,
    ControlClient,
    EnvPoolClient,
    InferenceClient,
    LearnerClient,
    ReferenceClient,
    release_names,
)
from rlpost.config import JobConfig
from rlpost.runs import latest_checkpoint
from rlpost.shutdown import raise_if_stopping
from rlpost.transport.buffer import BufferSnapshot, Taken

log = logging.getLogger("rlpost")
T = TypeVar("T")

MAX_ATTEMPTS = 4  # tries of one part of a step (the first and three after recoveries)
STARTUP_TIMEOUT_S = 600.0  # an actor's start (a vLLM engine loads its model)
PLACEMENT_POLL_S = 0.5  # how often a lost worker's bundle is looked at while waiting for room
DRAIN_TIMEOUT_S = 120.0  # a worker leaving the fleet finishes its requests (the rest are re-issued)
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

    buffer: BufferClient
    inference: list[InferenceClient]
    env_pools: list[EnvPoolClient]
    learner: LearnerClient
    reference: ReferenceClient | None
    placement_group: Any = None
    # inference slots beyond the run's placement group -> their own group (the starter's dict,
    # which it updates as slots open and close)
    slot_groups: dict[int, Any] = dataclasses.field(default_factory=dict)
    control: ControlClient | None = None  # the operators' mailbox (rlpost scale)


@dataclasses.dataclass
class Ledger:
    """What the learner's side received from the buffer. It outlives the buffer actor: a new
    buffer is started from it, and the accounting in metrics.jsonl comes from it."""

    groups_taken: int = 0  # trained once their step ends
    groups_dropped_stale: int = 0
    acknowledged: dict[str, int] = dataclasses.field(default_factory=dict)  # producer -> highest seq received

    def record(self, taken: Taken) -> None:
        self.groups_taken += len(taken.groups)
        self.groups_dropped_stale += taken.num_dropped_stale
        seqs = dict(taken.dropped_seqs)
        for group in taken.groups:
            if group.producer is not None and group.seq is not None:
                seqs[group.producer] = max(group.seq, seqs.get(group.producer, 0))
        for producer, seq in seqs.items():
            self.acknowledged[producer] = max(seq, self.acknowledged.get(producer, 0))

    def accounting(self, buffer_size: int, last_seqs: dict[str, int]) -> dict[str, int]:
        """The metrics.jsonl counts; after a step, ``groups_put == groups_trained +
        groups_dropped_stale + groups_in_buffer``."""
        return {
            "groups_put": sum(last_seqs.values()),
            "groups_trained": self.groups_taken,
            "groups_dropped_stale": self.groups_dropped_stale,
            "groups_in_buffer": buffer_size,
        }


def role_plan(cfg: JobConfig) -> list[tuple[str, object]]:
    """(actor name, its RoleResources) for every actor of the run, in start order."""
    res = cfg.resources
    plan = [(f"inference-{i}", res.inference) for i in range(cfg.rollout.num_inference_workers)]
    plan += [(learner_name(r), res.learner) for r in range(res.learner.num_workers)]
    if cfg.reference.enabled:
        plan.append(("reference", res.reference))
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
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
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
        self.slot_groups: dict[int, Any] = {}  # inference slots beyond the run's group -> their own group
        self.fleet = self._inference_fleet()

    def _group_of(self, name: str):
        """(placement group, bundle index) holding actor ``name``, or None when it reserves nothing."""
        if name in self.bundle_index:
            return self.placement_group, self.bundle_index[name]
        if name.startswith("inference-") and _slot(name) in self.slot_groups:
            return self.slot_groups[_slot(name)], 0
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

    def open_slot(self, index: int) -> None:
        """Make ``inference-<index>`` a slot of the fleet: beyond the run's placement group it gets
        a one-bundle group of its own, which Ray places whenever the cluster has room (a cluster
        autoscaler sees it as pending demand and adds a node); :meth:`has_room` says when."""
        from ray.util.placement_group import placement_group

        if index >= self.fleet.num_replicas:
            self.fleet.resize(index + 1)
        bundle = bundle_of(self.cfg.resources.inference)
        if f"inference-{index}" in self.bundle_index or index in self.slot_groups or not bundle:
            return
        name = f"rlpost-{self.cfg.logging.run_name}-inference-{index}"
        self.slot_groups[index] = placement_group([bundle], strategy="PACK", name=name)

    def close_slot(self, index: int) -> None:
        """``inference-<index>`` leaves the fleet: its replica stops and a group of its own is
        removed (a slot of the run's placement group keeps its bundle reserved: Ray cannot take
        one bundle out of a group)."""
        import ray

        self.fleet.stop_replica(index)
        group = self.slot_groups.pop(index, None)
        if group is not None:
            ray.util.remove_placement_group(group)

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

    def buffer(self) -> BufferClient:
        """``buffer``. It reserves no bundle; unless ``resources.buffer.resources`` sends it
        elsewhere it runs on the head node (:func:`on_the_head`), so that losing another node
        does not take the groups in flight with it."""
        from rlpost.actors.buffer import BufferSettings, start_buffer

        settings = BufferSettings.from_job(self.cfg)
        options = {} if settings.resources.resources else {"scheduling_strategy": on_the_head()}
        release_names(["buffer"], NAME_RELEASE_TIMEOUT_S)
        return BufferClient(start_buffer(settings, **options).rb)

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

    def env_pool(
        self, index: int, inference: list[InferenceClient], buffer: BufferClient, epoch: int = 0
    ) -> EnvPoolClient:
        from rlpost.actors.env_pool import EnvPoolSettings, start_env_pool
        from rlpost.policies import RemoteVLLMClient
        from rlpost.transport.buffer import RayBuffer

        name = f"env-pool-{index}"
        release_names([name], NAME_RELEASE_TIMEOUT_S)
        handle = start_env_pool(
            EnvPoolSettings.from_job(self.cfg),
            index,
            RemoteVLLMClient([w.handle for w in inference]),
            RayBuffer(buffer.rb),  # sent to the pool as a copy that does not own the actor
            epoch=epoch,
            scheduling_strategy=self.place(name),
        )
        return EnvPoolClient(name, handle)

    def control(self) -> ControlClient:
        """``control``, the run's mailbox for ``rlpost scale``, on the head node (:func:`on_the_head`)."""
        from rlpost.control import CONTROL_ACTOR, start_control

        release_names([CONTROL_ACTOR], NAME_RELEASE_TIMEOUT_S)
        bounds = self.cfg.rollout.inference_worker_bounds()
        return ControlClient(CONTROL_ACTOR, start_control(bounds, scheduling_strategy=on_the_head()))

    def start_all(self) -> RunActors:
        """Every actor of the run, its engines up and the weight bus connected."""
        cfg = self.cfg
        buffer = self.buffer()
        inference = [self.inference(i) for i in range(cfg.rollout.num_inference_workers)]
        learner = self.learner()
        reference = self.reference() if cfg.reference.enabled else None
        env_pools = [self.env_pool(j, inference, buffer) for j in range(cfg.rollout.num_env_pools)]
        wait_all([w.submit("get_version") for w in inference], STARTUP_TIMEOUT_S)
        actors = RunActors(buffer, inference, env_pools, learner, reference, self.placement_group, self.slot_groups,
                           self.control())  # fmt: skip
        connect_bus(cfg, actors, timeout_s=STARTUP_TIMEOUT_S)
        return actors


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
    import ray

    for pool in actors.env_pools:
        _quietly(functools.partial(pool.stop, timeout_s=30))
    for worker in actors.inference:
        _quietly(functools.partial(worker.shutdown, timeout_s=60))
    clients = [*actors.env_pools, *actors.inference, actors.learner, actors.buffer, actors.reference, actors.control]
    for client in clients:
        if client is not None:
            client.kill()
    for group in [actors.placement_group, *actors.slot_groups.values()]:
        if group is not None:
            _quietly(functools.partial(ray.util.remove_placement_group, group))


def _replaced(name: str, since: float) -> None:
    """Log that ``name`` serves again, ``since`` (monotonic) being when its loss was acted on.
    For an inference worker that is once the bus re-formed with it and the env pools have it."""
    log.warning("%s replaced: serving again %.1f s after its loss was noticed", name, time.monotonic() - since)


def _slot(name: str) -> int:
    """The slot of ``inference-<i>``: i."""
    return int(name.rsplit("-", 1)[1])


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception as exc:  # shutdown must reach every actor even when one is already gone
        log.debug("shutdown step failed: %s", exc)


# ----------------------------------------------------------------------------- the supervisor


class Supervisor:
    """Keeps the run's actors alive for the training loop; see the module docstring.

    Args:
        cfg: the job config.
        run_dir: the run directory (named in LearnerDied's message).
        actors: the started actors' clients; replaced in place as actors are restarted.
        starter: starts a role's actor again (an :class:`ActorStarter`, or a test's stand-in).
        ledger: what the learner's side received from the buffer (to rebuild a buffer).
    """

    def __init__(self, cfg: JobConfig, run_dir: Path, actors: RunActors, starter: Any, ledger: Ledger):
        self.cfg, self.run_dir, self.actors, self.starter, self.ledger = cfg, Path(run_dir), actors, starter, ledger
        self.counts = {
            "restarts_inference": 0,
            "restarts_env_pool": 0,
            "restarts_reference": 0,
            "restarts_buffer": 0,
            "bus_reforms": 0,
        }
        self.version = 0  # the learner's weights version (the loop sets it after each step)
        self.step = 0  # the step being trained (for messages)
        self.epochs = [0] * len(actors.env_pools)
        self.pool_failures = [0] * len(actors.env_pools)
        self.last_check = time.monotonic()
        self.health_check_s = HEALTH_CHECK_S
        self.collecting = False  # async mode: the pools collect on their own from now on
        self.restarted_at: dict[str, float] = {}  # workers started again, until the bus serves them
        self.vacant: dict[int, float] = {}  # inference slots without room in the cluster -> since when
        # the fleet's slots: inference-<i> for each i (serving or vacant); rlpost scale changes them
        self.slots = set(range(len(actors.inference)))
        self.fresh: set[int] = set()  # slots opened whose first worker has not started yet
        self._open_slots(cfg.rollout.inference_worker_target())

    # ------------------------------------------------------------------ what the loop calls

    def run(self, what: str, part: Callable[[], T], *, bus: bool = False) -> T:
        """``part()``, run again after a recovery when an actor it needed is lost (``bus``: the
        part is a weight sync, so a failure re-forms the bus even when no worker died)."""
        failure: ActorFailure | None = None
        for attempt in range(1, MAX_ATTEMPTS + 1):
            raise_if_stopping()  # a safe point for SIGINT / SIGTERM (rlpost.shutdown)
            try:
                if failure is not None:
                    self.recover(failure, reform_bus=bus)
                return part()
            except ActorFailure as exc:
                log.warning("%s (attempt %d of %d): %s", what, attempt, MAX_ATTEMPTS, exc)
                failure = exc
        raise RuntimeError(f"{what} failed {MAX_ATTEMPTS} times in step {self.step}; last: {failure}") from failure

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
        if requested is not None:
            self.run("scale", lambda: self.resize_inference(requested))

    def _exchange_with_control(self) -> int | None:
        """Report the fleet to the run's mailbox and take a request from it; a lost mailbox is
        started again (a request it held is lost, and the log says so)."""
        control = self.actors.control
        if control is None:
            return None
        try:
            return control.exchange(self.fleet_sizes(), timeout_s=CALL_TIMEOUT_S)
        except ActorFailure as exc:
            log.warning("the run's control mailbox failed (%s); starting it again (a scale request it held "
                        "is lost: ask again)", first_line(exc))  # fmt: skip
            control.kill()
            self.actors.control = self.starter.control()
            return None

    # ------------------------------------------------------------------ the fleet's size

    def resize_inference(self, workers: int) -> None:
        """Give the fleet ``workers`` inference slots (``rlpost scale``). New slots are vacant
        until the cluster places their bundles (each beyond the run's placement group has a group
        of its own), and their workers start, load the current weights and join the bus like a
        lost worker's replacement (at once when there is room). Fewer slots: vacant ones close
        first, then the serving workers with the highest slots leave: the env pools stop sending
        them requests, each finishes what it has (``DRAIN_TIMEOUT_S``; the rest are re-issued to
        the others) and stops, and the bus re-forms without them. Raises ValueError outside the
        config's range. Safe to run again after a failure part-way."""
        from rlpost.control import check_scale_request

        check_scale_request(self.cfg.rollout.inference_worker_bounds(), workers)
        if workers != len(self.slots):
            log.warning("scaling the inference fleet from %d to %d workers", len(self.slots), workers)
        if workers > len(self.slots):
            self._open_slots(workers)
        while len(self.slots) > workers:
            vacant = sorted(set(self.vacant) & self.slots)
            slot = vacant[-1] if vacant else max(self.slots)
            self.slots.discard(slot)
            self.fresh.discard(slot)
            if self.vacant.pop(slot, None) is not None:
                self.starter.close_slot(slot)
        self._retire_closed()
        self.recover(None)  # vacant slots with room start now

    def _open_slots(self, workers: int) -> None:
        """Open the lowest unused slots until there are ``workers``; each is vacant until it has
        room and its worker starts (:meth:`recover`)."""
        slot = 0
        while len(self.slots) < workers:
            if slot not in self.slots:
                self.starter.open_slot(slot)
                self.slots.add(slot)
                self.fresh.add(slot)
                self.vacant[slot] = time.monotonic()
            slot += 1

    def _retire_closed(self) -> None:
        """Stop the serving workers whose slots closed, after the pools stopped using them and
        they finished their requests; the bus then re-forms without them."""
        leaving = [w for w in self.actors.inference if _slot(w.name) not in self.slots]
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
            self.starter.close_slot(_slot(worker.name))
            worker.kill()
        self.actors.inference = staying
        self._reform_bus()

    # ------------------------------------------------------------------ recovery

    def recover(self, failure: ActorFailure | None, reform_bus: bool = False) -> None:
        """Restart every lost actor in dependency order (module docstring); re-form the bus
        when a worker was restarted or ``reform_bus``."""
        lost = {failure.name} if failure is not None and failure.name else set()
        if failure is not None and failure.name is None:  # a peer of the callee: which one?
            lost |= {w.name for w in self.actors.inference if w.unreachable(PING_TIMEOUT_S)}
        if not self._alive(self.actors.learner, lost):
            raise LearnerDied(self._learner_message(failure))
        if not self._alive(self.actors.buffer, lost):
            self._restart_buffer()
        dead = [w for w in self.actors.inference if not self._alive(w, lost)]
        for worker in dead:
            self._replace_inference(worker)
        placed = [slot for slot in self.vacant if self.starter.has_room(f"inference-{slot}")]
        for slot in placed:
            self._refill(slot)
        if dead or placed or isinstance(failure, BusFailure) or (failure is not None and reform_bus):
            self._reform_bus()
        if self.actors.reference is not None and not self._alive(self.actors.reference, lost):
            self._restart_reference()
        for j, pool in enumerate(self.actors.env_pools):
            if not self._alive(pool, lost):
                self._restart_pool(j)
        if self.collecting:
            self._replace_failed_pools()

    def _alive(self, client: Any, lost: set[str]) -> bool:
        """False for the actors a failure named or that cannot be reached (killed to be sure: a
        silent actor is as good as dead) and for any actor Ray's record says is dead or
        restarting (:func:`rlpost.clients.actor_state`)."""
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
        return f"the learner died during step {self.step}{cause}; {where}"

    def _restart_buffer(self) -> None:
        """A new buffer from the ledger; every live pool puts again what it keeps."""
        log.warning("the buffer died; starting it again and asking the env pools for the groups it held")
        start = time.monotonic()
        self.actors.buffer.kill()
        buffer = self.starter.buffer()
        acknowledged = dict(self.ledger.acknowledged)
        buffer.restore(BufferSnapshot([], {}, last_seqs=acknowledged, acknowledged=acknowledged))
        self.actors.buffer = buffer
        self.counts["restarts_buffer"] += 1
        for j, pool in enumerate(self.actors.env_pools):
            if pool.alive():
                count = pool.set_buffer(buffer.rb, timeout_s=CALL_TIMEOUT_S)
                log.warning("env-pool-%d put %d groups the learner had not received into the new buffer", j, count)
        _replaced("buffer", start)

    def _replace_inference(self, lost: InferenceClient) -> None:
        """Start a dead worker again in its slot; with no room for it in the cluster (within
        ``resources.replacement_wait_s``) and another worker serving, leave its slot vacant."""
        slot = _slot(lost.name)
        lost.kill()
        others = [w for w in self.actors.inference if w is not lost]
        if others and not self._wait_for_room(lost.name):
            self.actors.inference = others
            self.vacant[slot] = time.monotonic()
            log.warning(
                "%s died and the cluster has no room for it: going on with %d of %d inference workers; it "
                "starts again once its bundle is placed (a node added or replaced)",
                lost.name, len(others), len(self.slots),
            )  # fmt: skip
            return
        log.warning("%s died; starting it again", lost.name)
        self._start_inference(slot)

    def _refill(self, slot: int) -> None:
        """A vacant slot whose bundle is placed (again): its worker starts and joins."""
        waited = time.monotonic() - self.vacant.pop(slot)
        if slot in self.fresh:
            log.warning("the cluster has room for inference-%d (a new slot, %.0f s); starting it", slot, waited)
        else:
            log.warning("the cluster has room for inference-%d again (vacant %.0f s); starting it", slot, waited)
        self._start_inference(slot)

    def _start_inference(self, slot: int) -> None:
        """Start ``inference-<slot>`` (a replacement, or the first worker of a new slot)."""
        name = f"inference-{slot}"
        if slot not in self.fresh:
            self.restarted_at[name] = time.monotonic()
        worker = self.starter.inference(slot)
        worker.wait_ready(STARTUP_TIMEOUT_S)
        workers = [w for w in self.actors.inference if w.name != name] + [worker]
        self.actors.inference = sorted(workers, key=lambda w: _slot(w.name))
        if slot in self.fresh:
            self.fresh.discard(slot)
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
        """The serving workers, the vacant slots and the slots the fleet has (metrics.jsonl, each
        line; the run's mailbox)."""
        return {
            "inference_workers": len(self.actors.inference),
            "inference_workers_vacant": len(self.vacant),
            "inference_workers_target": len(self.slots),
        }

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

    def _restart_reference(self) -> None:
        log.warning("the reference actor died; starting it again")
        start = time.monotonic()
        self.actors.reference.kill()
        self.actors.reference = self.starter.reference()
        self.counts["restarts_reference"] += 1
        _replaced("reference", start)

    def _restart_pool(self, j: int) -> None:
        """A new ``env-pool-<j>`` (next epoch) from the position of its predecessor's last put."""
        name = f"env-pool-{j}"
        start = time.monotonic()
        self.actors.env_pools[j].kill()
        self.epochs[j] += 1
        pool = self.starter.env_pool(j, self.actors.inference, self.actors.buffer, epoch=self.epochs[j])
        state = self.actors.buffer.fence(name, self.epochs[j])
        if state is None and self.ledger.acknowledged.get(name):
            raise ResumeNeeded(f"{name} was lost together with the buffer that held its position")
        if state is not None:
            pool.load_state_dict(state, timeout_s=STARTUP_TIMEOUT_S)
        if self.collecting:
            pool.start(None, timeout_s=STARTUP_TIMEOUT_S)
        log.warning(
            "%s started again (epoch %d) from its last put: %s prompts collected",
            name,
            self.epochs[j],
            state["num_prompts_collected"] if state else 0,
        )
        self.actors.env_pools[j] = pool
        self.counts["restarts_env_pool"] += 1
        _replaced(name, start)

    def _replace_failed_pools(self) -> None:
        """Async mode: a pool whose collection ended with an error is replaced (its error is
        logged); one that fails this way MAX_POOL_FAILURES times stops the run with it."""
        for j, pool in enumerate(self.actors.env_pools):
            try:
                ended = pool.wait(0.0)
            except ActorFailure:
                raise
            except Exception as exc:
                self.pool_failures[j] += 1
                if self.pool_failures[j] >= MAX_POOL_FAILURES:
                    raise
                log.warning("env-pool-%d stopped collecting (%s); replacing it", j, first_line(exc))
                self._restart_pool(j)
                continue
            if ended:
                log.warning("env-pool-%d stopped collecting; replacing it", j)
                self._restart_pool(j)

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
        if int(published["policy_version"]) != self.version:
            raise RuntimeError(
                f"the learner published version {int(published['policy_version'])}, the loop expected {self.version}"
            )
        return {
            "weight_sync_s": sync_s,
            "weight_sync_bytes": published.get("bytes"),
            "weight_load_s": published.get("weight_load_s"),
        }  # the slowest engine's reload (of the update before, when that one was not waited for)

    @property
    def publish_timeout_s(self) -> float:
        """Bound of one publish call on the learner: it may confirm an earlier update and then
        publish its own, each up to two bus waits of ``weight_sync.timeout_s`` and the workers'
        grace (the learner's own bounds end it first)."""
        return 4 * self.cfg.weight_sync.timeout_s + 180
