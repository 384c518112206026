"""Where and how a run's actors start: the placement and the :class:`ActorStarter`.

The run's placement group (:func:`make_placement_group`) holds a bundle per actor that reserves
CPUs, GPUs or custom resources; slots opened beyond it (``rlpost scale``, a range's top) get
one-bundle groups of their own. :class:`ActorStarter` starts each role's actor in its bundle with
its role's settings only. The :class:`~rlpost.service.fleet.Fleet` holds what it starts.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from rlpost.actors import REWARD_ACTOR, learner_name
from rlpost.actors.calls import wait_all, wait_stoppably
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


def slot_of(name: str) -> int:
    """The slot of ``inference-<i>`` or ``env-pool-<j>``: i or j."""
    return int(name.rsplit("-", 1)[1])


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
    """(actor name, its placement bundle) for every actor that reserves something."""
    return [(name, bundle) for name, role in role_plan(cfg) if (bundle := bundle_of(role))]


def bundle_of(role) -> dict[str, float]:
    """What one actor of a role (a RoleResources) reserves: its CPUs, GPUs and custom resources."""
    return {k: v for k, v in (("CPU", role.num_cpus), ("GPU", role.num_gpus)) if v > 0} | role.resources


def make_placement_group(cfg: JobConfig, timeout_s: float = 120.0):
    """The run's placement group (None when no actor reserves anything) and each reserving
    actor's bundle index. ``resources.placement_strategy``: PACK keeps an inference worker's GPUs
    with the learner's on few nodes, SPREAD puts them on different nodes. If the cluster cannot
    hold the bundles in ``timeout_s`` (``resources.placement_timeout_s``) the run stops, naming
    what it asked for and what the cluster has."""
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
    """Starts each actor with its role's start function (``rlpost.actors.<role>``), given only its
    role's settings, in its bundle."""

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
        """Whether actor ``name``'s bundle is placed on a node (after a node's loss Ray moves its
        bundles to other nodes where they fit, or waits for one)."""
        held = self._group_of(name)
        if held is None:
            return True
        from ray.util.placement_group import placement_group_table

        group, index = held
        return bool(placement_group_table(group)["bundles_to_node_id"].get(index))

    def open_slot(self, name: str) -> None:
        """Make ``name`` (``inference-<i>``, ``env-pool-<j>``) a slot: beyond the run's placement
        group it gets a one-bundle group of its own, placed whenever the cluster has room (an
        autoscaler sees pending demand and adds a node); :meth:`has_room` says when."""
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
        """``name`` leaves: a worker's replica stops and the slot's own group is removed (a slot of
        the run's group keeps its bundle: Ray cannot take one bundle out of a group)."""
        import ray

        if name.startswith("inference-"):
            self.fleet.stop_replica(slot_of(name))
        group = self.slot_groups.pop(name, None)
        if group is not None:
            ray.util.remove_placement_group(group)

    def _role_resources(self, name: str):
        return self.cfg.resources.inference if name.startswith("inference-") else self.cfg.resources.env_pool

    def _inference_fleet(self):
        """The workers as an :class:`~rlpost.actors.async_vllm.AsyncVLLM` fleet (replica ``i`` is
        ``inference-<i>``). The supervisor, not Ray, restarts a replica (it re-forms the bus and
        tells the pools)."""
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
        """``buffer``: no bundle; on the head node (:func:`on_the_head`) unless
        ``resources.buffer.resources`` sends it elsewhere, so another node's loss keeps its groups."""
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

    def env_pool(self, index: int, inference: list[InferenceClient], buffer: RayBuffer,
                 epoch: int = 0) -> EnvPoolClient:  # fmt: skip
        from rlpost.actors.env_pool import EnvPoolSettings, start_env_pool
        from rlpost.policies import RemoteVLLMClient

        name = f"env-pool-{index}"
        release_names([name], NAME_RELEASE_TIMEOUT_S)
        # the buffer goes to the pool as a copy that does not own the actor
        engines = RemoteVLLMClient([w.handle for w in inference])
        handle = start_env_pool(EnvPoolSettings.from_job(self.cfg), index, engines, buffer, epoch=epoch,
                                scheduling_strategy=self.place(name))  # fmt: skip
        return EnvPoolClient(name, handle)

    def control(self) -> ControlClient:
        """``control``, the run's mailbox for ``rlpost scale``, on the head node (:func:`on_the_head`)."""
        from rlpost.service.mailbox import CONTROL_ACTOR, start_control

        release_names([CONTROL_ACTOR], NAME_RELEASE_TIMEOUT_S)
        rollout = self.cfg.rollout
        auto = tuple(rollout.autoscale_ranges()) if rollout.autoscale.enabled else ()  # what KEY=auto may name
        control = start_control(rollout.scale_bounds(), auto_keys=auto, scheduling_strategy=on_the_head())
        return ControlClient(CONTROL_ACTOR, control)

    def start_all(self) -> dict[str, Any]:
        """Every actor, engines up: the clients by role (``Fleet``'s arguments). A stop signal while
        engines and models load ends the start within a second; a start that fails or is stopped
        kills every actor it started and removes the placement groups before it raises."""
        cfg = self.cfg
        started: list[ActorClient] = []

        def keep(client):
            started.append(client)
            return client

        try:
            buffer = keep(self.buffer())
            inference = [keep(self.inference(i)) for i in range(cfg.rollout.num_inference_workers)]
            clients = {
                "buffer": buffer,
                "inference": inference,
                "learner": keep(self.learner()),
                "reference": keep(self.reference()) if cfg.reference.enabled else None,
                "reward": keep(self.reward()) if cfg.reward_model is not None else None,
                "env_pools": [keep(self.env_pool(j, inference, buffer)) for j in range(cfg.rollout.num_env_pools)],
                "control": keep(self.control()),
            }
            wait_all([w.submit("get_version") for w in inference], STARTUP_TIMEOUT_S, stoppable=True)
        except BaseException:
            for client in started:
                client.kill()
            self.remove_placement_groups()
            raise
        return clients

    def connect_bus(self, learner: LearnerClient, inference: list[InferenceClient]) -> None:
        """Form the weight bus: the learner's vLLMUpdater joins every inference worker to it."""
        import ray

        ws = self.cfg.weight_sync
        host = ray.util.get_node_ip_address() if self.cfg.resources.address else "127.0.0.1"
        learner.connect_workers(
            [w.handle for w in inference], host, ws.backend, ws.bucket_mb, ws.timeout_s, timeout_s=STARTUP_TIMEOUT_S,
            shared_memory=ws.shared_memory,
        )  # fmt: skip

    def remove_placement_groups(self) -> None:
        """Remove the run's placement group and every slot's own, best effort."""
        import ray

        for group in [self.placement_group, *self.slot_groups.values()]:
            if group is not None:
                quietly(functools.partial(ray.util.remove_placement_group, group))


def on_the_head():
    """Pin an actor that reserves nothing but holds the run's state (the buffer, the mailbox) to the
    head node (``node:__internal_head__``; without one, the driver's): its loss ends the run
    anyway, while any other node may go. Trap: not soft: Ray's soft affinity placed half of such
    actors elsewhere on a two-node cluster, where a node's loss took the buffer with it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    heads = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {})]
    node = heads[0] if heads else ray.get_runtime_context().get_node_id()
    return NodeAffinitySchedulingStrategy(node, soft=False)


def quietly(fn: Callable[[], Any]) -> None:
    """Run ``fn``; a failure is logged at debug level (a shutdown step must not stop the others)."""
    try:
        fn()
    except Exception as exc:  # shutdown must reach every actor even when one is already gone
        log.debug("shutdown step failed: %s", exc)
