"""The controller: the one place a run is wired (it runs on the driver).

            prompts (HF datasets)                          new weights (versioned)
                  |                                  +------------------------------+
                  v                                  |  weight-sync bus             |
 +-------------------------+   generate(n samples)   |  torch.distributed group     |
 | env-pool actors (M)     | ----------------------> | inference workers (N) ------+|
 | ChatEnv + transforms    | <---------------------- | vLLM engine each            ||
 | LLMCollector, rewards,  |   tokens + log-probs +  +-----------------------------+|
 | tools, PolicyVersion    |   policy version                  ^                    |
 +-------------------------+                                   | broadcast (NCCL on |
        | completed groups (+ advantages)                      | GPU, gloo on CPU)  |
        |        +------------------------+                    |                    |
        +------> | reference actor        |  (only when KL on) |                    |
        |        | frozen model, RetrieveKL|                    |                    |
        |        +------------------------+                    |                    |
        v                                                      |                    |
 +-------------------------+   batches    +-------------------------+               |
 | buffer (queue-backed,   | -----------> | learner actor           | --------------+
 | bounded, staleness cap) |              | GRPOLoss + optimizer,   |
 +-------------------------+              | checkpoints             |
                                          +-------------------------+

What each loop waits on:
- sync: every env pool collects its share of ``prompts_per_step`` groups with the current weights
  and puts them in the buffer (the controller waits on those calls); the controller takes the
  whole step from the buffer (staleness 0), the reference actor annotates it (KL on), the learner
  trains one step, and every ``weight_sync_interval`` steps the learner publishes while every
  inference worker receives (the controller waits on all of them, bounded by
  ``weight_sync.timeout_s``); then a probe sequence scored by a worker and by the learner gives
  ``sync_logprob_diff``.
- async: env pools run on their own (threads inside their actors), blocking only on the buffer
  when it is full; the controller waits on ``buffer.get`` (bounded), which drops groups more than
  ``max_staleness`` versions behind the learner; training and publishing as in sync. A worker
  applies an update between two generate calls.
Every wait is bounded; on an error or Ctrl-C the controller stops every actor and keeps the last
checkpoint (a final one is written on a clean finish).

Failures (the controller polls while it waits, and checks the actors' names every few seconds):
- an inference worker dies: it is started again under its name in its placement bundle, the bus
  re-forms with every worker, the current weights are published, and the env pools get the new
  handles; a request that was in flight on the dead worker is re-issued (RemoteVLLMClient).
- an env pool dies: it is started again from the position its last buffer put recorded (see
  rlpost.transport.buffer), so no completed group is lost or repeated; in sync mode it collects
  what is left of its share of the step.
- the reference actor dies: it is started again (it is stateless) and the step's groups annotated.
- the learner dies: LearnerDied names the last checkpoint and the resume command; with
  ``trainer.auto_resume`` the run restarts every actor from that checkpoint by itself.
- a bus peer dies mid-broadcast: the collective times out (``weight_sync.timeout_s``), the dead
  worker is restarted, the bus re-forms and the update is sent again.
Restarts are logged and counted in metrics.jsonl (``restarts_inference``, ``restarts_env_pool``,
``restarts_reference``, ``bus_reforms``, ``learner_resumes``).

Resume (``rlpost train --resume RUN_DIR``): the learner loads the latest checkpoint (weights,
optimizer, step, version, RNG), the workers receive those weights, the buffer gets back the
groups it held and each env pool its position; training goes on at the next step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from pathlib import Path
from statistics import mean, pstdev

from rlpost.config import JobConfig
from rlpost.metrics import MetricsWriter, RayMetrics, plot_metrics, read_metrics
from rlpost.runs import latest_checkpoint, supersede_metrics_after

log = logging.getLogger("rlpost")
SYNC_LOGPROB_WARN = 1e-3


@dataclasses.dataclass
class Actors:
    buffer: object
    inference: list
    env_pools: list
    learner: object
    reference: object | None
    placement_group: object | None = None
    place: object = None  # name -> the actor's scheduling strategy in the placement group


class LearnerDied(RuntimeError):
    """The learner actor is gone; the message says how to resume."""


MAX_AUTO_RESUMES = 3


def run_training(cfg: JobConfig, run_dir: Path, resume: bool = False) -> int:
    """Run the job (or, with ``resume``, continue it from its latest checkpoint); returns the
    process exit code (0 on success). With ``trainer.auto_resume`` a dead learner restarts the
    run from its last checkpoint, at most MAX_AUTO_RESUMES times."""
    import ray

    logging.basicConfig(level=logging.INFO, format="%(asctime)s rlpost %(levelname)s %(message)s")
    started_ray = _init_ray(cfg)
    learner_resumes = 0
    try:
        while True:
            actors = None
            try:
                actors = start_actors(cfg)
                controller = Controller(cfg, run_dir, actors, resume=resume)
                controller.learner_resumes = learner_resumes
                controller.run()
                return 0
            except LearnerDied as exc:
                if not (cfg.trainer.auto_resume and learner_resumes < MAX_AUTO_RESUMES and latest_checkpoint(run_dir)):
                    raise
                learner_resumes += 1
                log.warning("%s; auto_resume: restarting the run from its last checkpoint (%d of %d)",
                            exc, learner_resumes, MAX_AUTO_RESUMES)
                resume = True
            finally:
                if actors is not None:
                    stop_actors(actors)
    finally:
        if started_ray:
            ray.shutdown()


def _init_ray(cfg: JobConfig) -> bool:
    import ray

    namespace = f"rlpost-{cfg.logging.run_name}"
    address = cfg.resources.address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return False
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", **cfg.resources.env_vars}}
    if address:
        _use_ray_token_if_present()
        ray.init(address=address, namespace=namespace, runtime_env=env, log_to_driver=True)
    else:
        ray.init(namespace=namespace, runtime_env=env, include_dashboard=False, log_to_driver=False)
    return True


def _use_ray_token_if_present() -> None:
    """Authenticate to an existing cluster the way Ray's CLI does.

    Ray 2.60 clusters use token authentication by default, but a driver that connects to one only
    sends a token when RAY_AUTH_MODE=token. When the mode is unset and a token is available
    (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token written by `ray start`), turn it on.
    """
    if os.environ.get("RAY_AUTH_MODE"):
        return
    token_path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if os.environ.get("RAY_AUTH_TOKEN") or token_path.is_file():
        os.environ["RAY_AUTH_MODE"] = "token"
        # Ray caches its config at import (vLLM imports Ray early): re-read it, as Ray's CLI does
        from ray._raylet import Config

        Config.initialize("")


def start_actors(cfg: JobConfig) -> Actors:
    """Start every role's actors under their DESIGN names in the run's placement group, wire the
    weight bus, and wait until the engines are up."""
    import ray

    from rlpost.actors.buffer import start_buffer
    from rlpost.actors.learner import LearnerActor

    res = cfg.resources
    pg, place = make_placement_group(cfg, timeout_s=cfg.resources.placement_timeout_s)
    run = cfg.logging.run_name or ""
    buffer = start_buffer(_buffer_capacity(cfg), _staleness_cap(cfg), num_cpus=res.buffer.num_cpus, run_name=run)
    inference = [new_inference_worker(cfg, i, place) for i in range(cfg.rollout.num_inference_workers)]
    learner = ray.remote(LearnerActor).options(**_options("learner", res.learner, place)).remote(cfg)
    reference = new_reference(cfg, place) if cfg.reference.enabled else None
    env_pools = [new_env_pool(cfg, i, inference, buffer, place) for i in range(cfg.rollout.num_env_pools)]
    ray.get([w.get_version.remote() for w in inference], timeout=STARTUP_TIMEOUT_S)
    _connect_bus(cfg, learner, inference, timeout_s=STARTUP_TIMEOUT_S)
    return Actors(buffer, inference, env_pools, learner, reference, pg, place)


def new_inference_worker(cfg: JobConfig, index: int, place):
    """Start the actor ``inference-<index>`` (its engine loads ``model.name_or_path``)."""
    import ray

    from rlpost.actors.inference import InferenceActor

    return (
        ray.remote(InferenceActor)
        .options(**_options(f"inference-{index}", cfg.resources.inference, place))
        .remote(cfg.model.name_or_path, cfg.rollout.engine, dtype=cfg.model.dtype, index=index,
                run_name=cfg.logging.run_name or "")
    )


def new_reference(cfg: JobConfig, place):
    """Start the actor ``reference`` (the frozen initial model; stateless, so a restart is whole)."""
    import ray

    from rlpost.actors.reference import ReferenceActor

    return ray.remote(ReferenceActor).options(**_options("reference", cfg.resources.reference, place)).remote(cfg)


def new_env_pool(cfg: JobConfig, index: int, inference: list, buffer, place):
    """Start the actor ``env-pool-<index>`` over the inference workers ``inference``."""
    import ray

    from rlpost.actors.env_pool import EnvPoolActor
    from rlpost.actors.inference import RemoteVLLMClient

    return (
        ray.remote(EnvPoolActor)
        .options(**_options(f"env-pool-{index}", cfg.resources.env_pool, place, max_concurrency=4))
        .remote(cfg, index, RemoteVLLMClient(inference), buffer)
    )


def _options(name: str, role, place, **extra) -> dict:
    return dict(name=name, num_cpus=role.num_cpus, num_gpus=role.num_gpus, scheduling_strategy=place(name), **extra)


def role_plan(cfg: JobConfig) -> list[tuple[str, object]]:
    """(actor name, its RoleResources) for every actor of the run, in start order."""
    res = cfg.resources
    plan = [(f"inference-{i}", res.inference) for i in range(cfg.rollout.num_inference_workers)]
    plan.append(("learner", res.learner))
    if cfg.reference.enabled:
        plan.append(("reference", res.reference))
    plan += [(f"env-pool-{i}", res.env_pool) for i in range(cfg.rollout.num_env_pools)]
    return plan


def make_placement_group(cfg: JobConfig, timeout_s: float = 120.0):
    """One placement group for the run: a bundle per actor that reserves CPUs or GPUs.

    Returns the group and ``place(name)``, the scheduling strategy of an actor (None for an
    actor that reserves nothing). The strategy (PACK/SPREAD/...) comes from
    ``resources.placement_strategy``: PACK keeps an inference worker's GPUs with the learner's
    on few nodes, SPREAD puts them on different nodes. If the cluster cannot hold the bundles in
    ``timeout_s`` (``resources.placement_timeout_s``) the run stops, naming what it asked for
    and what the cluster has.
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundles, index = [], {}
    for name, role in role_plan(cfg):
        bundle = {k: v for k, v in (("CPU", role.num_cpus), ("GPU", role.num_gpus)) if v > 0}
        if bundle:
            index[name] = len(bundles)
            bundles.append(bundle)
    if not bundles:
        return None, lambda name: None
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

    def place(name: str):
        if name not in index:
            return None
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index[name])

    return pg, place


def _connect_bus(cfg: JobConfig, learner, inference: list, timeout_s: float) -> None:
    import ray

    ws = cfg.weight_sync
    host = ray.util.get_node_ip_address() if cfg.resources.address else "127.0.0.1"
    spec = ray.get(
        learner.connect_publisher.remote(len(inference) + 1, host, 0, ws.backend, ws.bucket_mb, ws.timeout_s),
        timeout=timeout_s,
    )
    spec = dataclasses.asdict(spec) if dataclasses.is_dataclass(spec) else spec
    ray.get([w.join_bus.remote(spec, rank) for rank, w in enumerate(inference, start=1)], timeout=timeout_s)


def stop_actors(actors: Actors) -> None:
    """Stop collection, shut engines down, kill every actor (best effort, bounded)."""
    import ray

    for pool in actors.env_pools:
        _quietly(lambda: ray.get(pool.stop.remote(), timeout=30))
    for worker in actors.inference:
        _quietly(lambda: ray.get(worker.shutdown.remote(), timeout=60))
    handles = actors.env_pools + actors.inference + [actors.learner, actors.buffer.handle]
    for handle in handles + ([actors.reference] if actors.reference is not None else []):
        _quietly(lambda: ray.kill(handle))
    if actors.placement_group is not None:
        _quietly(lambda: ray.util.remove_placement_group(actors.placement_group))


def _quietly(fn) -> None:
    try:
        fn()
    except Exception as exc:  # shutdown must reach every actor even when one is already gone
        log.debug("shutdown step failed: %s", exc)


def _buffer_capacity(cfg: JobConfig) -> int:
    """Groups the buffer holds: one step in sync mode; in async mode ``max_staleness`` steps.

    A bigger buffer only ages its groups past the staleness cap: with room for 3 steps and
    ``max_staleness: 1`` a 600-step demo dropped 7568 stale groups (44% of all it generated).
    Groups generated while the learner trains a step are at most ``max_staleness`` behind when
    taken, so the producers' backpressure paces them to what the learner can use.
    """
    steps_ahead = 1 if cfg.trainer.mode == "sync" else max(1, cfg.trainer.max_staleness)
    return cfg.trainer.prompts_per_step * steps_ahead


def _staleness_cap(cfg: JobConfig) -> int:
    return 0 if cfg.trainer.mode == "sync" else cfg.trainer.max_staleness


class Controller:
    """Runs the sync or async loop over started actors, keeps them alive, records the metrics."""

    def __init__(self, cfg: JobConfig, run_dir: Path, actors: Actors, resume: bool = False):
        self.cfg, self.run_dir, self.actors = cfg, Path(run_dir), actors
        self.writer = MetricsWriter(run_dir)
        self.ray_metrics = RayMetrics(cfg.logging.run_name)
        self.start_time = time.perf_counter()
        self.version = 0
        self.step = 0  # the step being trained
        self.first_step = 1
        self.probe: list[int] | None = None
        self.counts = {"restarts_inference": 0, "restarts_env_pool": 0, "restarts_reference": 0, "bus_reforms": 0}
        self.learner_resumes = 0
        # each pool's prompts collected at the start of the current step (sync mode's shares)
        self.pool_prompts = [0] * len(actors.env_pools)
        self.last_health_check = time.monotonic()
        if resume:
            self._resume()

    # ----------------------------------------------------------------------------- the loops

    def run(self) -> None:
        import ray

        cfg = self.cfg
        steps = cfg.trainer.steps
        if self.first_step > steps:
            print(f"rlpost: {self.run_dir} already trained {steps} steps (raise trainer.steps to continue)")
            return
        progress = _Progress(steps, cfg.logging.progress, initial=self.first_step - 1)
        if cfg.trainer.mode == "async":
            ray.get([p.start.remote(None) for p in self.actors.env_pools], timeout=60)  # until stopped
        for step in range(self.first_step, steps + 1):
            self.step = step
            step_start = time.perf_counter()
            groups = self._collect_step()
            collected = time.perf_counter()
            record = self._train(groups, step)
            record.update(collect_s=collected - step_start, train_s=time.perf_counter() - collected)
            if step % cfg.trainer.weight_sync_interval == 0 or step == steps:
                record.update(self._sync_weights())
            record.update(self._timing(groups, step_start))
            self._record(step, record)
            progress.update(record)
            if cfg.trainer.checkpoint_interval and step % cfg.trainer.checkpoint_interval == 0 and step != steps:
                self._checkpoint(step)
        progress.close()
        self._checkpoint(steps)
        out = plot_metrics(read_metrics(self.run_dir / "metrics.jsonl"), self.run_dir / "reward.png", cfg.logging.run_name)
        print(f"rlpost: run finished: {self.run_dir} (metrics.jsonl, {out.name}, checkpoints/)")

    def _collect_step(self) -> list:
        import ray

        n = self.cfg.trainer.prompts_per_step
        if self.cfg.trainer.mode == "sync":
            self._collect_shares()
            n = max(1, self.actors.buffer.stats().size)  # the DAPO filter may have dropped groups
        groups = self._get_groups(n)
        if self.actors.reference is not None:
            groups = self._annotate(groups)
        return groups

    def _annotate(self, groups: list) -> list:
        """Reference log-probs for ``groups``; a dead reference actor is started again first."""
        import ray

        try:
            return ray.get(self.actors.reference.annotate.remote(groups), timeout=COLLECT_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            log.warning("the reference actor died; starting it again")
            self.actors.reference = new_reference(self.cfg, self.actors.place)
            self.counts["restarts_reference"] += 1
            return ray.get(self.actors.reference.annotate.remote(groups), timeout=STARTUP_TIMEOUT_S + COLLECT_TIMEOUT_S)

    def _collect_shares(self) -> None:
        """Sync mode: every pool collects its share of the step into the buffer.

        The controller polls the pools instead of blocking on them, so a dead inference worker
        or env pool is restarted while the step is collected; a restarted pool collects what is
        left of its share (its last put recorded how far it got).
        """
        share = self.cfg.trainer.prompts_per_step // self.cfg.rollout.num_env_pools
        pending = set(range(len(self.actors.env_pools)))
        for j in pending:
            self._call_pool(j, "start", share)
        deadline = time.monotonic() + COLLECT_TIMEOUT_S
        while pending:
            for j in list(pending):
                if self._call_pool(j, "wait", POLL_S, timeout_s=POLL_S + 60):
                    pending.discard(j)
            if not pending:
                break
            for j in self._check_health(force=True):  # restarted pools
                left = share - (self._recorded_prompts(j) - self.pool_prompts[j])
                if left > 0:
                    self._call_pool(j, "start", left)
                else:
                    pending.discard(j)
            if time.monotonic() > deadline:
                raise TimeoutError(f"env pools {sorted(pending)} did not finish collecting within {COLLECT_TIMEOUT_S:.0f}s")
        self.pool_prompts = [count + share for count in self.pool_prompts]

    def _call_pool(self, j: int, method: str, *args, timeout_s: float = 60.0):
        """Call env pool ``j``; None if it is dead (the next health check restarts it)."""
        import ray

        try:
            return ray.get(getattr(self.actors.env_pools[j], method).remote(*args), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return None

    def _get_groups(self, n: int) -> list:
        """Take ``n`` groups from the buffer, checking the actors' health while waiting."""
        from rlpost.transport.buffer import BufferTimeout

        deadline = time.monotonic() + COLLECT_TIMEOUT_S
        while True:
            self._check_health()
            try:
                return self.actors.buffer.get(n, timeout_s=POLL_S, current_version=self.version)
            except BufferTimeout:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the buffer did not receive {n} groups within {COLLECT_TIMEOUT_S:.0f}s") from None
                self._check_health(force=True)

    def _train(self, groups: list, step: int) -> dict:
        metrics = self._learner("train_step", groups, timeout_s=COLLECT_TIMEOUT_S)
        self.version = int(metrics["policy_version"])
        rewards = [r for g in groups for r in g.rewards]
        record = dict(metrics)
        record["learner_step_s"] = record.pop("step_time_s")  # the learner's own compute; train_s adds the transfer
        record.update(step=step, policy_version=self.version, reward_mean=mean(rewards), reward_std=pstdev(rewards))
        record.setdefault("kl_to_ref", None)
        return record

    def _learner(self, method: str, *args, timeout_s: float):
        """Call the learner; its death becomes LearnerDied, naming the checkpoint to resume from."""
        import ray

        try:
            return ray.get(getattr(self.actors.learner, method).remote(*args), timeout=timeout_s)
        except ray.exceptions.RayActorError as exc:
            last = latest_checkpoint(self.run_dir)
            where = (f"the last checkpoint is {last}; resume with: rlpost train --resume {self.run_dir}"
                     if last else "no checkpoint was written yet (trainer.checkpoint_interval), so the run must start again")
            raise LearnerDied(f"the learner died during step {self.step} ({_first_line(exc)}); {where}") from exc

    # ----------------------------------------------------------------------- weights and the bus

    def _sync_weights(self) -> dict:
        """Publish the learner's weights to every worker; on a failure recover the bus and resend.

        A dead or silent worker makes the collective fail within ``weight_sync.timeout_s`` (the
        bus names the suspect ranks). The controller restarts dead workers, opens the bus's next
        generation with every worker and publishes the same version again; a second failure
        stops the run with the cause.
        """
        import ray

        try:
            return self._sync_once()
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("weight sync of version %d failed: %s; re-forming the bus", self.version, _first_line(exc))
            return self._recover_bus()

    def _recover_bus(self) -> dict:
        """Restart dead workers, re-form the bus with all workers, publish the current version,
        and give the env pools the (new) worker handles. Returns the sync's metrics."""
        import ray

        self._restart_dead_workers()
        workers = self.actors.inference
        spec = self._learner("reform_publisher", len(workers) + 1, timeout_s=60)
        spec = dataclasses.asdict(spec) if dataclasses.is_dataclass(spec) else spec
        ray.get([w.join_bus.remote(spec, rank) for rank, w in enumerate(workers, start=1)], timeout=60)
        self.counts["bus_reforms"] += 1
        log.warning("weight bus re-formed (generation %s) with %d workers", spec["generation"], len(workers))
        try:
            record = self._sync_once()
        except (ray.exceptions.RayError, TimeoutError) as again:
            raise RuntimeError(f"weight sync failed again after re-forming the bus: {_first_line(again)}") from again
        for pool in self.actors.env_pools:
            try:
                ray.get(pool.set_inference.remote(workers), timeout=60)
            except ray.exceptions.RayActorError:
                pass  # a dead pool is restarted with the current workers
        return record

    def _sync_once(self) -> dict:
        import ray

        timeout = self.cfg.weight_sync.timeout_s
        receives = [w.update_weights.remote(timeout) for w in self.actors.inference]
        start = time.perf_counter()
        published = self._learner("publish", timeout_s=timeout + 30)
        infos = ray.get(receives, timeout=timeout + 60)
        sync_s = time.perf_counter() - start
        versions = {int(i["version"]) for i in infos}
        if versions != {self.version}:
            raise RuntimeError(f"after the weight sync the workers hold versions {sorted(versions)}, learner {self.version}")
        return {"weight_sync_s": sync_s, "weight_sync_bytes": published.get("bytes"),
                "weight_load_s": max(float(i["load_s"]) for i in infos),  # the engines' in-place reload
                "sync_logprob_diff": self._probe_diff()}

    def _probe_diff(self) -> float:
        """Max |log-prob difference| between a worker and the learner on a fixed probe sequence."""
        import ray

        if self.probe is None:
            self.probe = probe_sequence(self.cfg)
        temperature = self.cfg.rollout.temperature
        served = ray.get(self.actors.inference[0].score.remote([self.probe], temperature), timeout=120)[0]
        learned = self._learner("score", [self.probe], timeout_s=120)[0]
        diff = max(abs(a - b) for a, b in zip(served, learned))
        if diff > SYNC_LOGPROB_WARN and self.cfg.model.dtype == "float32":
            log.warning("sync_logprob_diff %.2e exceeds %.0e: inference and learner weights disagree", diff, SYNC_LOGPROB_WARN)
        return diff

    # ------------------------------------------------------------------------------ restarts

    def _check_health(self, force: bool = False) -> list[int]:
        """Restart dead inference workers and env pools (looked up by name: a dead actor's name
        is free); at most every HEALTH_CHECK_S unless ``force``. Returns the restarted pools."""
        if not force and time.monotonic() - self.last_health_check < HEALTH_CHECK_S:
            return []
        self.last_health_check = time.monotonic()
        if any(not _alive(f"inference-{i}", w) for i, w in enumerate(self.actors.inference)):
            self._recover_bus()
        return self._restart_dead_pools()

    def _restart_dead_workers(self) -> None:
        import ray

        for i, worker in enumerate(self.actors.inference):
            if _alive(f"inference-{i}", worker):
                continue
            log.warning("inference-%d died; starting it again", i)
            self.actors.inference[i] = new_inference_worker(self.cfg, i, self.actors.place)
            self.counts["restarts_inference"] += 1
        ray.get([w.get_version.remote() for w in self.actors.inference], timeout=STARTUP_TIMEOUT_S)

    def _restart_dead_pools(self) -> list[int]:
        import ray

        restarted = []
        for j, pool in enumerate(self.actors.env_pools):
            if _alive(f"env-pool-{j}", pool):
                continue
            state = self.actors.buffer.producer_state(f"env-pool-{j}")
            log.warning("env-pool-%d died; starting it again from its last put (%s prompts collected)",
                        j, state["num_prompts_collected"] if state else 0)
            pool = new_env_pool(self.cfg, j, self.actors.inference, self.actors.buffer, self.actors.place)
            if state is not None:
                ray.get(pool.load_state_dict.remote(state), timeout=STARTUP_TIMEOUT_S)
            if self.cfg.trainer.mode == "async":
                ray.get(pool.start.remote(None), timeout=STARTUP_TIMEOUT_S)
            self.actors.env_pools[j] = pool
            self.counts["restarts_env_pool"] += 1
            restarted.append(j)
        return restarted

    def _recorded_prompts(self, j: int) -> int:
        state = self.actors.buffer.producer_state(f"env-pool-{j}")
        return state["num_prompts_collected"] if state else 0

    # ------------------------------------------------------------------ checkpoints and resume

    def _checkpoint(self, step: int) -> None:
        """The learner writes its checkpoint with the rollout state: the groups waiting in the
        buffer and every pool's position after its last put (one consistent snapshot)."""
        snapshot = self.actors.buffer.snapshot()
        rollout_state = {
            "buffer_groups": snapshot.groups,
            "producer_states": snapshot.producer_states,
            "pool_prompts": self.pool_prompts,
            "counts": dict(self.counts),
            "elapsed_s": time.perf_counter() - self.start_time,
        }
        path = self._learner("save_checkpoint", str(self.run_dir), step, rollout_state, timeout_s=600)
        log.info("checkpoint written: %s (%d groups from the buffer)", path, len(snapshot.groups))

    def _resume(self) -> None:
        """Continue from the run's latest checkpoint (see the module docstring)."""
        import ray

        from rlpost.transport.buffer import BufferSnapshot

        path = latest_checkpoint(self.run_dir)
        if path is None:
            raise FileNotFoundError(f"no checkpoint to resume from in {self.run_dir / 'checkpoints'}")
        info = self._learner("load_checkpoint", str(path), timeout_s=600)
        self.version, self.first_step = int(info["version"]), int(info["step"]) + 1
        state = info["rollout_state"] or {}
        if state:
            self.actors.buffer.restore(BufferSnapshot(state["buffer_groups"], state["producer_states"]))
            for j, pool in enumerate(self.actors.env_pools):
                pool_state = state["producer_states"].get(f"env-pool-{j}")
                if pool_state is not None:
                    ray.get(pool.load_state_dict.remote(pool_state), timeout=60)
            self.pool_prompts = list(state["pool_prompts"])
            self.counts.update(state["counts"])
            self.start_time -= state["elapsed_s"]
        moved = supersede_metrics_after(self.run_dir, info["step"])
        self._sync_weights()  # the workers serve the checkpoint's weights at its version
        log.info("resumed from %s: step %d, policy version %d, %d groups back in the buffer%s", path, info["step"],
                 self.version, len(state.get("buffer_groups", [])),
                 f"; {moved} metrics lines of later steps moved to metrics.superseded.jsonl" if moved else "")

    # ------------------------------------------------------------------------------- metrics

    def _timing(self, groups: list, step_start: float) -> dict:
        elapsed_step = time.perf_counter() - step_start
        samples = sum(len(g.samples) for g in groups)
        tokens = sum(s.num_generated for g in groups for s in g.samples)
        stats = self.actors.buffer.stats()
        return {
            "step_time_s": elapsed_step,
            "samples_per_s": samples / elapsed_step,
            "tokens_per_s": tokens / elapsed_step,
            "elapsed_s": time.perf_counter() - self.start_time,
            "buffer_size": stats.size,
            "groups_dropped_stale": stats.num_dropped_stale,
            "samples_generated": samples,
            "tokens_generated": tokens,
        }

    def _record(self, step: int, record: dict) -> None:
        record.setdefault("weight_sync_s", None)
        record.setdefault("sync_logprob_diff", None)
        record.setdefault("staleness_mean", 0.0)
        record.update(self.counts, learner_resumes=self.learner_resumes)
        self.writer.write(record)
        self.ray_metrics.record(record)


def _alive(name: str, handle) -> bool:
    """Whether the actor ``handle`` named ``name`` is alive. Asked of Ray's control store (a dead
    actor's name is free again), not of the actor, whose queue may be busy with a long call."""
    import ray

    try:
        return ray.get_actor(name) == handle
    except ValueError:
        return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


def probe_sequence(cfg: JobConfig) -> list[int]:
    """A fixed chat (system, question, answer) as token ids: the same ids every sync."""
    from transformers import AutoTokenizer

    from rlpost.envs.arithmetic import ARITHMETIC_SYSTEM_PROMPT

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path)
    chat = [
        {"role": "system", "content": cfg.data.system_prompt or ARITHMETIC_SYSTEM_PROMPT},
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "<answer>2</answer>"},
    ]
    return tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]


# A generous bound on one step's collection, reference scoring or training call: a stuck actor
# surfaces as a clear timeout instead of a hang.
COLLECT_TIMEOUT_S = 600.0
STARTUP_TIMEOUT_S = 600.0  # an actor's start (a vLLM engine loads its model)
POLL_S = 2.0  # how long one wait on the pools or the buffer lasts before the health check
HEALTH_CHECK_S = 5.0  # actors' names are looked up at most this often while things go well


class _Progress:
    def __init__(self, steps: int, enabled: bool, initial: int = 0):
        from tqdm import tqdm

        self.bar = tqdm(total=steps, initial=initial, desc="rlpost", unit="step", disable=not enabled, file=sys.stderr)

    def update(self, record: dict) -> None:
        self.bar.set_postfix(
            reward=f"{record['reward_mean']:.3f}", loss=f"{record['loss']:.3f}", v=record["policy_version"],
            sps=f"{record['samples_per_s']:.1f}", refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()

