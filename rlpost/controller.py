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


def run_training(cfg: JobConfig, run_dir: Path) -> int:
    """Run the job; returns the process exit code (0 on success)."""
    import ray

    logging.basicConfig(level=logging.INFO, format="%(asctime)s rlpost %(levelname)s %(message)s")
    started_ray = _init_ray(cfg)
    actors = None
    try:
        actors = start_actors(cfg)
        Controller(cfg, run_dir, actors).run()
        return 0
    finally:
        if actors is not None:
            stop_actors(actors)
        if started_ray:
            ray.shutdown()


def _init_ray(cfg: JobConfig) -> bool:
    import ray

    namespace = f"rlpost-{cfg.logging.run_name}"
    address = cfg.resources.address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return False
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
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
    from rlpost.actors.env_pool import EnvPoolActor
    from rlpost.actors.inference import InferenceActor, RemoteVLLMClient
    from rlpost.actors.learner import LearnerActor
    from rlpost.actors.reference import ReferenceActor

    res = cfg.resources
    pg, place = make_placement_group(cfg)

    def options(name: str, role, **extra) -> dict:
        return dict(name=name, num_cpus=role.num_cpus, num_gpus=role.num_gpus, scheduling_strategy=place(name), **extra)

    run = cfg.logging.run_name or ""
    buffer = start_buffer(_buffer_capacity(cfg), _staleness_cap(cfg), num_cpus=res.buffer.num_cpus, run_name=run)
    inference = [
        ray.remote(InferenceActor)
        .options(**options(f"inference-{i}", res.inference))
        .remote(cfg.model.name_or_path, cfg.rollout.engine, dtype=cfg.model.dtype, index=i, run_name=run)
        for i in range(cfg.rollout.num_inference_workers)
    ]
    learner = ray.remote(LearnerActor).options(**options("learner", res.learner)).remote(cfg)
    reference = None
    if cfg.reference.enabled:
        reference = ray.remote(ReferenceActor).options(**options("reference", res.reference)).remote(cfg)
    env_pools = [
        ray.remote(EnvPoolActor)
        .options(**options(f"env-pool-{i}", res.env_pool, max_concurrency=4))
        .remote(cfg, i, RemoteVLLMClient(inference), buffer)
        for i in range(cfg.rollout.num_env_pools)
    ]
    startup_s = 600.0
    ray.get([w.get_version.remote() for w in inference], timeout=startup_s)
    _connect_bus(cfg, learner, inference, timeout_s=startup_s)
    return Actors(buffer, inference, env_pools, learner, reference, pg)


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
    ``timeout_s`` the run stops, naming what it asked for and what the cluster has.
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
    """Runs the sync or async loop over started actors and records the run's metrics."""

    def __init__(self, cfg: JobConfig, run_dir: Path, actors: Actors):
        self.cfg, self.run_dir, self.actors = cfg, Path(run_dir), actors
        self.writer = MetricsWriter(run_dir)
        self.ray_metrics = RayMetrics(cfg.logging.run_name)
        self.start_time = time.perf_counter()
        self.version = 0
        self.probe: list[int] | None = None
        self.bus_reforms = 0

    def run(self) -> None:
        import ray

        cfg = self.cfg
        steps = cfg.trainer.steps
        progress = _Progress(steps, cfg.logging.progress)
        if cfg.trainer.mode == "async":
            per_pool = None  # run until stopped
            ray.get([p.start.remote(per_pool) for p in self.actors.env_pools], timeout=60)
        for step in range(1, steps + 1):
            step_start = time.perf_counter()
            groups = self._collect_step()
            record = self._train(groups, step)
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

        cfg = self.cfg
        n = cfg.trainer.prompts_per_step
        if cfg.trainer.mode == "sync":
            # each pool collects its share with the current weights into the buffer; the DAPO
            # filter may drop groups, so the step is whatever arrived (at least one group)
            share = n // cfg.rollout.num_env_pools
            pools = self.actors.env_pools
            ray.get([p.start.remote(share) for p in pools], timeout=60)
            done = ray.get([p.wait.remote(COLLECT_TIMEOUT_S) for p in pools], timeout=COLLECT_TIMEOUT_S + 30)
            if not all(done):
                raise TimeoutError(f"env pools did not finish collecting within {COLLECT_TIMEOUT_S}s")
            n = max(1, self.actors.buffer.stats().size)
        groups = self.actors.buffer.get(n, timeout_s=COLLECT_TIMEOUT_S, current_version=self.version)
        if self.actors.reference is not None:
            groups = ray.get(self.actors.reference.annotate.remote(groups), timeout=COLLECT_TIMEOUT_S)
        return groups

    def _train(self, groups: list, step: int) -> dict:
        import ray

        metrics = ray.get(self.actors.learner.train_step.remote(groups), timeout=COLLECT_TIMEOUT_S)
        self.version = int(metrics["policy_version"])
        rewards = [r for g in groups for r in g.rewards]
        record = dict(metrics)
        record.update(step=step, policy_version=self.version, reward_mean=mean(rewards), reward_std=pstdev(rewards))
        record.setdefault("kl_to_ref", None)
        return record

    def _sync_weights(self) -> dict:
        """Publish the learner's weights to every worker; on a failure re-form the bus and resend.

        A dead or silent worker makes the collective fail within ``weight_sync.timeout_s`` (the
        bus names the suspect ranks). The controller then opens the bus's next generation with
        the workers still alive and publishes the same version again; a second failure stops the
        run with the cause.
        """
        import ray

        try:
            return self._sync_once()
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("weight sync of version %d failed: %s; re-forming the bus", self.version, _first_line(exc))
            self._reform_bus()
            try:
                record = self._sync_once()
            except (ray.exceptions.RayError, TimeoutError) as again:
                raise RuntimeError(f"weight sync failed again after re-forming the bus: {_first_line(again)}") from again
            record["bus_reforms"] = self.bus_reforms
            return record

    def _reform_bus(self) -> None:
        import ray

        alive = [w for w in self.actors.inference if _answers(w)]
        if not alive:
            raise RuntimeError("no inference worker is alive to receive weights")
        spec = ray.get(self.actors.learner.reform_publisher.remote(len(alive) + 1), timeout=60)
        spec = dataclasses.asdict(spec) if dataclasses.is_dataclass(spec) else spec
        ray.get([w.join_bus.remote(spec, rank) for rank, w in enumerate(alive, start=1)], timeout=60)
        dropped = len(self.actors.inference) - len(alive)
        self.actors.inference = alive
        self.bus_reforms += 1
        log.warning("weight bus re-formed (generation %s) with %d workers; %d dropped", spec["generation"], len(alive), dropped)

    def _sync_once(self) -> dict:
        import ray

        timeout = self.cfg.weight_sync.timeout_s
        receives = [w.update_weights.remote(timeout) for w in self.actors.inference]
        start = time.perf_counter()
        published = ray.get(self.actors.learner.publish.remote(), timeout=timeout + 30)
        infos = ray.get(receives, timeout=timeout + 60)
        sync_s = time.perf_counter() - start
        versions = {int(i["version"]) for i in infos}
        if versions != {self.version}:
            raise RuntimeError(f"after the weight sync the workers hold versions {sorted(versions)}, learner {self.version}")
        return {"weight_sync_s": sync_s, "weight_sync_bytes": published.get("bytes"),
                "sync_logprob_diff": self._probe_diff()}

    def _probe_diff(self) -> float:
        """Max |log-prob difference| between a worker and the learner on a fixed probe sequence."""
        import ray

        if self.probe is None:
            self.probe = probe_sequence(self.cfg)
        temperature = self.cfg.rollout.temperature
        served = ray.get(self.actors.inference[0].score.remote([self.probe], temperature), timeout=120)[0]
        learned = ray.get(self.actors.learner.score.remote([self.probe]), timeout=120)[0]
        diff = max(abs(a - b) for a, b in zip(served, learned))
        if diff > SYNC_LOGPROB_WARN and self.cfg.model.dtype == "float32":
            log.warning("sync_logprob_diff %.2e exceeds %.0e: inference and learner weights disagree", diff, SYNC_LOGPROB_WARN)
        return diff

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
        self.writer.write(record)
        self.ray_metrics.record(record)

    def _checkpoint(self, step: int) -> None:
        import ray

        path = ray.get(self.actors.learner.save_checkpoint.remote(str(self.run_dir), step), timeout=600)
        log.info("checkpoint written: %s", path)


def _answers(handle, timeout_s: float = 30.0) -> bool:
    import ray

    try:
        ray.get(handle.get_version.remote(), timeout=timeout_s)
        return True
    except (ray.exceptions.RayError, TimeoutError):
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


class _Progress:
    def __init__(self, steps: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=steps, desc="rlpost", unit="step", disable=not enabled, file=sys.stderr)

    def update(self, record: dict) -> None:
        self.bar.set_postfix(
            reward=f"{record['reward_mean']:.3f}", loss=f"{record['loss']:.3f}", v=record["policy_version"],
            sps=f"{record['samples_per_s']:.1f}", refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()

