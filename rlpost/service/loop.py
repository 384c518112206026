"""The controller: the training loop, run on the driver over the actors' clients.

README.md draws the actors and the data between them; docs/architecture.md follows a prompt
through them. The loop (sync and async, what each waits on) is :meth:`Controller.run`'s docstring.

Failures are the supervisor's (:mod:`rlpost.service.supervisor`): each part of a step runs through
``Supervisor.run``, which restarts lost actors and runs the part again, and the waits call
``Supervisor.check`` so a death is noticed while the loop waits. A lost learner ends the loop
with LearnerDied; :func:`rlpost.service.run.run_training` then restarts the run from its last
checkpoint when ``trainer.auto_resume`` is on. SIGTERM or Ctrl-C stops every actor after a final
checkpoint (when the learner is alive); a second signal exits at once.

Accounting (metrics.jsonl, after every step, across restarts of any actor): ``groups_put ==
groups_trained + groups_dropped_stale + groups_in_buffer``.

Resume (``rlpost train --resume RUN_DIR``): the learner loads the latest checkpoint (weights,
optimizer, step, version, RNG), the workers receive those weights, the buffer gets back the
groups it held and each env pool its position; training goes on at the next step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from statistics import mean, pstdev

from rlpost.actors.calls import ActorFailure
from rlpost.config import JobConfig
from rlpost.record.metrics import MetricsWriter, RayMetrics, episode_metrics, plot_run, read_metrics
from rlpost.record.progress import Progress
from rlpost.record.run_dir import latest_checkpoint, supersede_metrics_after
from rlpost.record.trackers import make_trackers
from rlpost.runtime.shutdown import raise_if_stopping
from rlpost.service.evaluation import Evaluator, append_eval_line
from rlpost.service.fleet import Fleet
from rlpost.service.run_state import Ledger
from rlpost.service.starter import slot_of
from rlpost.service.supervisor import Supervisor
from rlpost.transport.buffer import BufferSnapshot, BufferTimeout

log = logging.getLogger("rlpost")
SYNC_LOGPROB_WARN = 1e-3
COLLECT_TIMEOUT_S = 600.0  # a step's collection, reference scoring or train call: a stuck actor is a timeout
CHECKPOINT_TIMEOUT_S = 600.0
POLL_S = 2.0  # how long one wait on the pools or the buffer lasts before the health check
EVAL_WORKER_WAIT_S = 5.0  # an evaluation whose every worker died gives up this soon (the run goes on)

__all__ = ["Controller", "probe_sequence"]


class Controller:
    """Runs the sync or async loop over a supervisor's actors and records the metrics."""

    def __init__(self, cfg: JobConfig, run_dir: Path, supervisor: Supervisor, resume: bool = False,
                 evaluator: Evaluator | None = None):  # fmt: skip
        self.cfg, self.run_dir, self.supervisor = cfg, Path(run_dir), supervisor
        self.state = supervisor.state  # the loop writes it (step, version, ledger); the supervisor reads it
        self.ray_metrics = RayMetrics(cfg.logging.run_name)
        self.start_time = time.perf_counter()
        self.trained_step = 0  # the last step the learner finished training
        self.first_step = 1
        self.probe: list[int] | None = None
        self.syncs = 0  # weight syncs done by this process (weight_sync.probe_every counts them)
        self.learner_resumes = 0
        self.taken: list = []  # groups of the current step taken from the buffer, not yet trained
        # the trained step's row while it is finished (sync, timing): a stop in between still records it
        self.unrecorded: dict | None = None
        self.recorded_step = 0  # the last step whose metrics row this process wrote
        self.pool_prompts = [0] * cfg.rollout.env_pool_shards()  # shard j's prompts collected before this step
        self.resumed = resume
        if resume:
            self._resume()
        # made after _resume, which sets first_step: a resumed TensorBoard run purges from there
        self.writer = MetricsWriter(
            run_dir,
            trackers=make_trackers(
                cfg.logging, self.run_dir, cfg.logging.run_name or self.run_dir.name, self.first_step
            ),
        )
        if evaluator is None and cfg.eval.enabled:
            evaluator = Evaluator(cfg)
        self.evaluator = evaluator

    @property
    def fleet(self) -> Fleet:
        """The run's actors; the supervisor replaces the lost ones in it."""
        return self.supervisor.fleet

    @property
    def ledger(self) -> Ledger:
        return self.state.ledger

    @property
    def version(self) -> int:
        """The learner's policy version (``state.version``)."""
        return self.state.version

    @property
    def step(self) -> int:
        """The step being trained (``state.step``)."""
        return self.state.step

    # ----------------------------------------------------------------------------- the loop

    def run(self) -> None:
        """Train up to ``trainer.steps`` (resumed: from the checkpoint's next step), then write the
        final checkpoint and the figures. Each step::

            groups = collect             sync: the pools collect this step's prompts, then take
                                         async: take from the buffer the pools keep filling
            annotate groups              the reference actor adds its log-probs (KL in the
                                         loss; a KL in the reward is the env pools')
            train one step               the learner; policy version += epochs_per_batch
            sync weights                 every weight_sync_interval steps, the last step, and
                                         before an evaluation
            evaluate                     every eval.interval steps
            record the metrics row       metrics.jsonl, trackers, Ray metrics, progress
            checkpoint                   every trainer.checkpoint_interval steps

        What each mode waits on (every wait is bounded and checks the actors' health between
        polls of ``POLL_S``):

        - sync: every env pool collects its share of ``prompts_per_step`` with the current
          weights; the loop polls the pools until each has put its share, then takes the whole
          step (staleness 0). Nothing is generated while the learner trains.
        - async: the pools collect on their own threads from the start, blocking only on a full
          buffer (``max_staleness`` steps); the loop waits on ``buffer.take``, which drops groups
          more than ``max_staleness`` versions behind. A weight update reaching a worker
          mid-generation is applied between two engine steps (``weight_sync.inflight_updates``)
          and each token records its version.
        - both: the train call (``COLLECT_TIMEOUT_S``); the weight sync (``weight_sync.timeout_s``),
          then on the syncs ``weight_sync.probe_every`` picks, a probe scored by a worker and the
          learner (``sync_logprob_diff``); an evaluation through the inference workers.

        Sync mode is not async mode with ``max_staleness: 0``: there the pools would generate the
        next step with the old weights while the learner trains, and the buffer would drop nearly
        all of it (on the demo: twice the groups generated, 25-38% slower). A fresh run starts
        with :meth:`_start_up_sync`.
        """
        cfg, steps = self.cfg, self.cfg.trainer.steps
        if self.first_step > steps:
            self.writer.close()
            print(f"rlpost: {self.run_dir} already trained {steps} steps (raise trainer.steps to continue)")
            return
        progress = Progress(steps, cfg.logging.progress, initial=self.first_step - 1)
        try:
            if not self.resumed:  # a resumed run's workers were synced to its checkpoint
                self._start_up_sync()
            if cfg.eval.before_training and self.first_step == 1:
                self._evaluate_initial()
            if cfg.trainer.mode == "async":
                self.supervisor.run("start collection", self.supervisor.start_collection)
            for step in range(self.first_step, steps + 1):
                raise_if_stopping()
                self.state.step = step
                step_start = time.perf_counter()
                groups = self._collect_step()
                collected = time.perf_counter()
                record = self.unrecorded = self._train(groups, step)
                record.update(collect_s=collected - step_start, train_s=time.perf_counter() - collected)
                evaluate = cfg.eval.interval > 0 and step % cfg.eval.interval == 0
                if step % cfg.trainer.weight_sync_interval == 0 or step == steps or evaluate:
                    # an evaluation scores the step's weights, and the run ends with them served
                    record.update(self._sync_weights(wait=evaluate or step == steps))
                record.update(self._timing(groups, step_start))
                if evaluate:
                    record.update(self._evaluate(step))
                record.update(self.supervisor.autoscale(record))  # the load policy reads the step
                self._record(step, record)
                progress.update(record)
                if cfg.trainer.checkpoint_interval and step % cfg.trainer.checkpoint_interval == 0 and step != steps:
                    self._checkpoint(step)
        finally:
            progress.close()
        self.writer.close()  # a stop closes it after its last row (_run_once)
        self._checkpoint(steps)
        figures = plot_run(read_metrics(self.run_dir / "metrics.jsonl"), self.run_dir, cfg.logging.run_name)
        print(
            f"rlpost: run finished: {self.run_dir} (metrics.jsonl, {', '.join(f.name for f in figures)}, checkpoints/)"
        )

    # ----------------------------------------------------------------------------- evaluating

    def _evaluate(self, step: int) -> dict:
        """Score the weights the workers serve now (:mod:`rlpost.service.evaluation`; also to
        eval.jsonl) while async pools keep collecting. A failure is a warning, never the run's
        end: its keys are left out of the step's line."""
        from rlpost.policies import RemoteVLLMClient

        client = RemoteVLLMClient([w.handle for w in self.fleet.inference], request_timeout_s=COLLECT_TIMEOUT_S,
                                  worker_wait_s=EVAL_WORKER_WAIT_S)  # fmt: skip
        try:
            metrics = self.evaluator.run(client, policy_version=self.version)
        except Exception as exc:  # the run goes on; the next health check restarts a lost worker
            log.warning("the evaluation at step %d failed (%s: %s); training goes on", step, type(exc).__name__, exc)
            return {}
        append_eval_line(self.run_dir, step, metrics)
        return metrics

    def _evaluate_initial(self) -> None:
        """``eval.before_training``: step 0 in eval.jsonl, the trackers and the log (metrics.jsonl starts at 1)."""
        metrics = self._evaluate(0)
        if metrics:
            self.writer.log(metrics, 0)
            self.ray_metrics.record(metrics)
            print(
                f"rlpost: evaluation before training: reward {metrics['eval_reward_mean']:.3f}, "
                f"pass@1 {metrics['eval_pass_at_1']:.3f} on {int(metrics['eval_num_prompts'])} held-out prompts"
            )

    # ----------------------------------------------------------------------------- collecting

    def _collect_step(self) -> list:
        """The step's groups from the buffer (sync: after every pool collected its share),
        annotated by the reference when the KL is in the loss (in the reward, the pools applied it)."""
        if self.cfg.trainer.mode == "sync":
            targets = self._step_targets()
            self.taken = self.supervisor.run("collect", lambda: self._collect_sync(targets))
            self.pool_prompts = targets
        else:
            self.taken = self.supervisor.run("take", lambda: self._take(self.cfg.trainer.prompts_per_step))
        if self.cfg.reference.kl_goes_to != "loss":  # no reference, or the pools had it penalise the rewards
            return self.taken
        return self.supervisor.run("reference", lambda: self.fleet.reference.annotate(self.taken, COLLECT_TIMEOUT_S))

    def _step_targets(self) -> list[int]:
        """Sync mode: each shard's prompts collected once this step is done: ``prompts_per_step``
        over the serving pools (:meth:`_spread`); a shard without a serving pool stays where it is."""
        targets = list(self.pool_prompts)
        self._spread(targets, self.cfg.trainer.prompts_per_step)
        return targets

    def _spread(self, targets: list[int], prompts: int) -> list[int]:
        """Add ``prompts`` to the serving pools' ``targets`` in equal shares, the remainder to
        the lowest slots; returns those slots."""
        serving = sorted(slot_of(pool.name) for pool in self.fleet.env_pools)
        share, extra = divmod(prompts, len(serving))
        for rank, slot in enumerate(serving):
            targets[slot] += share + (rank < extra)
        return serving

    def _collect_sync(self, targets: list[int]) -> list:
        self._collect_shares(targets)
        size = self.fleet.buffer.stats().size
        return self._take(max(1, size))  # the DAPO filter may have dropped groups

    def _collect_shares(self, targets: list[int]) -> None:
        """Sync mode: every serving pool collects until its shard has ``targets[j]`` prompts in all,
        polled with health checks between polls. Run again after a recovery, each pool starts on
        what is left of its share (as far as the buffer recorded its puts), so a restarted pool
        neither skips nor repeats prompts; a pool that stops serving mid-step hands the rest of
        its share to the others (:meth:`_hand_over_shares`)."""
        deadline = time.monotonic() + COLLECT_TIMEOUT_S
        finished: set[tuple[str, int]] = set()  # (pool, target) whose share is in the buffer
        while True:
            self._hand_over_shares(targets)
            pending = []
            for pool in self.fleet.env_pools:
                share = (pool.name, targets[slot_of(pool.name)])
                if share in finished:
                    continue
                if self._start_share(pool, share[1]):
                    pending.append(pool)
                else:
                    finished.add(share)
            if not pending:
                return
            for pool in pending:
                pool.wait(POLL_S)
            self.supervisor.check()
            if time.monotonic() > deadline:
                names = [pool.name for pool in pending]
                raise TimeoutError(f"env pools {names} did not finish collecting within {COLLECT_TIMEOUT_S:.0f}s")

    def _hand_over_shares(self, targets: list[int]) -> None:
        """A shard without a serving pool keeps the prompts its last put recorded; what is left
        of its share goes to the serving pools (``targets`` is changed in place)."""
        serving = {slot_of(pool.name) for pool in self.fleet.env_pools}
        for slot, target in enumerate(targets):
            if slot in serving or target <= self.pool_prompts[slot]:
                continue
            state = self.fleet.buffer.producer_state(f"env-pool-{slot}")
            done = max(state["num_prompts_collected"] if state else 0, self.pool_prompts[slot])
            left, targets[slot] = target - done, done
            if left > 0:
                others = self._spread(targets, left)
                log.warning("env-pool-%d is not serving: the %d prompts left of its share of step %d go to env "
                            "pools %s", slot, left, self.state.step, others)  # fmt: skip

    def _start_share(self, pool, target: int) -> bool:
        """Start ``pool`` on what is left of its share (``target``: its shard's total at the step's
        end); False when nothing is left; True (left alone) while it still collects."""
        if not pool.wait(0.0):
            return True
        state = self.fleet.buffer.producer_state(pool.name)
        left = target - (state["num_prompts_collected"] if state else 0)
        if left <= 0:
            return False
        if state is not None:  # back to its last put (a collection that failed went further)
            pool.load_state_dict(state)
        pool.start(left)
        return True

    def _take(self, num_groups: int) -> list:
        """``num_groups`` groups from the buffer, with health checks while waiting; into the ledger."""
        deadline = time.monotonic() + COLLECT_TIMEOUT_S
        while True:
            self.supervisor.check()
            try:
                taken = self.fleet.buffer.take(num_groups, POLL_S, self.version, self.ledger.acknowledged)
            except BufferTimeout:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the buffer did not receive {num_groups} groups within {COLLECT_TIMEOUT_S:.0f}s"
                    ) from None
                continue
            self.ledger.record(taken)
            return taken.groups

    # ----------------------------------------------------------------------------- training

    def _train(self, groups: list, step: int) -> dict:
        """One learner step. Not run again after a failure (it would train twice): a lost
        learner becomes LearnerDied (the supervisor's recovery raises it)."""
        try:
            metrics = self.fleet.learner.train_step(groups, timeout_s=COLLECT_TIMEOUT_S)
        except ActorFailure as failure:
            self.supervisor.recover(failure)
            raise
        self.state.version = int(metrics["policy_version"])
        self.trained_step, self.taken = step, []
        # the reward of what the policy sampled (expert iteration trains on a group's best only)
        rewards = [r for g in groups for r in g.info.get("sampled_rewards", g.rewards)]
        record = dict(metrics)
        record["learner_step_s"] = record.pop("step_time_s")  # the learner's own compute; train_s adds the transfer
        record.update(step=step, policy_version=self.version, reward_mean=mean(rewards), reward_std=pstdev(rewards))
        record.update(episode_metrics(groups))
        record.setdefault("kl_to_ref", None)
        record.setdefault("clip_fraction", None)  # a custom loss (loss.custom_fn) may not report it
        return record

    def _start_up_sync(self) -> None:
        """Before a fresh run's first step: the workers load the learner's version 0 and, unless
        ``weight_sync.probe_every`` is 0, the probe checks both sides (not counted in the syncs it
        schedules). A process's first sync pays one-time work (the shared segment's pages, the
        engine's first CPU kernel packing, the first scoring calls: 5.8 s against ~1 s later on 2
        CPU cores with the 0.5B-shaped model); paid here, a broken weight path fails before any step."""
        start = time.perf_counter()
        check = bool(self.cfg.weight_sync.probe_every)
        record = self.supervisor.run("weight sync", lambda: self._sync_once(wait=True, probe=check), bus=True)
        checked = record.get("sync_logprob_diff")
        log.info(
            "start-up weight sync: the inference workers serve the learner's version %d (%.1f s, reload %.2f s%s)",
            self.version, time.perf_counter() - start, record.get("weight_load_s") or 0.0,
            "" if checked is None else f", sync_logprob_diff {checked:.1e}",
        )  # fmt: skip

    def _sync_weights(self, wait: bool) -> dict:
        """Publish the weights to every worker, then score the probe; a failure re-forms the bus
        and the sync runs again. Async with ``weight_sync.train_during_reload`` (unless ``wait``
        or a probe): returns once the weights are sent; the workers reload while the learner
        trains, and the next sync waits for that reload first."""
        ws = self.cfg.weight_sync
        probe = bool(ws.probe_every) and self.syncs % ws.probe_every == 0  # the run's first sync, then every N-th
        record = self.supervisor.run("weight sync", lambda: self._sync_once(wait, probe), bus=True)
        self.syncs += 1
        return record

    def _sync_once(self, wait: bool, probe: bool) -> dict:
        """One attempt of :meth:`_sync_weights`."""
        ws = self.cfg.weight_sync
        overlap = self.cfg.trainer.mode == "async" and ws.train_during_reload and not (wait or probe)
        record = self.fleet.publish(wait=not overlap)
        version = record.pop("policy_version")
        if version != self.version:
            raise RuntimeError(f"the learner published version {version}, the loop expected {self.version}")
        if probe:
            record["sync_logprob_diff"] = self._probe_diff()
        return record

    def _probe_diff(self) -> float:
        """Max |log-prob difference| between a worker and the learner on a fixed probe sequence."""
        if self.probe is None:
            self.probe = probe_sequence(self.cfg)
        served = self.fleet.inference[0].score([self.probe], self.cfg.rollout.temperature, timeout_s=120)[0]
        learned = self.fleet.learner.score([self.probe], timeout_s=120)[0]
        diff = max(abs(a - b) for a, b in zip(served, learned))
        if diff > SYNC_LOGPROB_WARN and self.cfg.model.dtype == "float32":
            log.warning(
                "sync_logprob_diff %.2e exceeds %.0e: inference and learner weights disagree", diff, SYNC_LOGPROB_WARN
            )
        return diff

    # ------------------------------------------------------------------ checkpoints and resume

    def _checkpoint(self, step: int) -> None:
        self.supervisor.run("checkpoint", lambda: self._write_checkpoint(step))

    def _write_checkpoint(self, step: int) -> None:
        """The learner's checkpoint with the rollout state as one consistent snapshot: the groups
        taken but not trained, then those in the buffer, each pool's last put's position, the ledger."""
        snapshot = self.fleet.buffer.snapshot()
        ledger = Ledger(
            self.ledger.groups_taken - len(self.taken), self.ledger.groups_dropped_stale, dict(self.ledger.acknowledged)
        )
        rollout_state = {
            "buffer_groups": list(self.taken) + snapshot.groups,
            "producer_states": snapshot.producer_states,
            "last_seqs": snapshot.last_seqs,
            "ledger": dataclasses.asdict(ledger),
            "pool_prompts": self.pool_prompts,
            "counts": dict(self.supervisor.counts),
            "fleet": self.fleet.wanted(),
            "fleet_pins": sorted(self.supervisor.policy.pins) if self.supervisor.policy is not None else [],
            "elapsed_s": time.perf_counter() - self.start_time,
        }
        learner, timeout_s = self.fleet.learner, CHECKPOINT_TIMEOUT_S
        path = learner.save_checkpoint(str(self.run_dir), step, rollout_state, timeout_s=timeout_s)
        log.info("checkpoint written: %s (%d groups from the buffer)", path, len(rollout_state["buffer_groups"]))

    def checkpoint_on_stop(self) -> None:
        """After SIGTERM / Ctrl-C: a final checkpoint of the last trained step when the learner is
        alive (an interrupted train call finishes first: the learner runs one call at a time, and
        its version says whether it did)."""
        if not self.fleet.learner.alive():
            log.warning("stopping: the learner is gone, so no final checkpoint (the last one on disk stays)")
            return
        try:
            version = self.fleet.learner.version(timeout_s=CHECKPOINT_TIMEOUT_S)
            if version != self.version:  # the interrupted step was trained after all
                self.unrecorded = self._interrupted_row(self.taken, version)
                self.state.version = version
                self.trained_step, self.taken = self.state.step, []
            if self.trained_step < self.first_step:
                log.warning("stopping before the first step was trained: no checkpoint written")
                return
            # the file, not recorded_step: the signal may land after _record wrote the row and
            # before it noted so (while the trackers log it)
            rows = read_metrics(self.writer.path) if self.writer.path.is_file() else []
            last_written = max(self.recorded_step, int(rows[-1]["step"]) if rows else 0)
            if self.unrecorded is not None and self.unrecorded["step"] > last_written:
                # trained, but stopped before its row was written
                row = {**self.unrecorded, "stopped": True, **self._elapsed(), **self._accounting_at_stop()}
                self._record(self.trained_step, row)
            self._write_checkpoint(self.trained_step)
            log.warning("stopped after step %d; resume with: rlpost train --resume %s", self.trained_step, self.run_dir)
        except Exception as exc:  # the stop goes on: the previous checkpoint stays on disk
            log.error("stopping: the final checkpoint failed (%s); the last complete one stays", exc)

    def _interrupted_row(self, groups: list, version: int) -> dict:
        """The row of a step the learner trained after the stop interrupted its call: rewards and
        version (its loss is lost)."""
        rewards = [r for g in groups for r in g.rewards]
        row = dict(step=self.state.step, policy_version=version, loss=None, kl_to_ref=None, clip_fraction=None)
        row.update(reward_mean=mean(rewards) if rewards else None, reward_std=pstdev(rewards) if rewards else None)
        return row

    def _accounting_at_stop(self) -> dict:
        """A stop's row's accounting as the checkpoint holds it: groups taken but not trained count
        as in the buffer (the checkpoint puts them back). Empty when the buffer does not answer."""
        try:
            stats = self.fleet.buffer.stats()
        except Exception as exc:  # noqa: BLE001 (the stop goes on; the row says less)
            log.warning("stopping: the buffer did not answer (%s); the last row has no accounting", exc)
            return {}
        counts = self.ledger.accounting(stats.size + len(self.taken), stats.last_seqs)
        counts["groups_trained"] -= len(self.taken)
        return {**counts, "buffer_size": stats.size}

    def _elapsed(self) -> dict:
        """Timing keys of a row finished by a stop (rates unknown)."""
        row = {"elapsed_s": time.perf_counter() - self.start_time}
        for key in ("samples_per_s", "tokens_per_s"):
            row[key] = (self.unrecorded or {}).get(key)
        return row

    def _resume(self) -> None:
        """Continue from the run's latest checkpoint (see the module docstring)."""
        path = latest_checkpoint(self.run_dir)
        if path is None:
            raise FileNotFoundError(f"no checkpoint to resume from in {self.run_dir / 'checkpoints'}")
        info = self.fleet.learner.load_checkpoint(str(path), timeout_s=CHECKPOINT_TIMEOUT_S)
        self.state.version, self.first_step = int(info["version"]), int(info["step"]) + 1
        self.trained_step = int(info["step"])
        state = info["rollout_state"] or {}
        if state:
            ledger = self.state.ledger = Ledger(**state.get("ledger", {}))
            snapshot = BufferSnapshot(state["buffer_groups"], state["producer_states"], state.get("last_seqs", {}),
                                      dict(ledger.acknowledged))  # fmt: skip
            self.fleet.buffer.restore(snapshot)
            for pool in self.fleet.env_pools:
                pool_state = state["producer_states"].get(pool.name)
                if pool_state is not None:
                    pool.load_state_dict(pool_state)
            saved = list(state["pool_prompts"])
            self.pool_prompts = saved + [0] * (len(self.pool_prompts) - len(saved))
            self.supervisor.restore_counts(state["counts"])
            self.start_time -= state["elapsed_s"]
            if state.get("fleet"):  # an operator's rlpost scale outlives the restart
                self.supervisor.restore_fleet(state["fleet"], state.get("fleet_pins"))
        moved = supersede_metrics_after(self.run_dir, info["step"])
        self._sync_weights(wait=True)  # the workers serve the checkpoint's weights at its version
        log.info(
            "resumed from %s: step %d, policy version %d, %d groups back in the buffer%s", path, info["step"],
            self.version, len(state.get("buffer_groups", [])),
            f"; {moved} metrics lines of later steps moved to metrics.superseded.jsonl" if moved else "",
        )  # fmt: skip

    # ------------------------------------------------------------------------------- metrics

    def _timing(self, groups: list, step_start: float) -> dict:
        elapsed_step = time.perf_counter() - step_start
        samples = sum(len(g.samples) for g in groups)
        tokens = sum(s.num_generated for g in groups for s in g.samples)
        stats = self.supervisor.run("buffer stats", lambda: self.fleet.buffer.stats())
        return {
            "step_time_s": elapsed_step,
            "samples_per_s": samples / elapsed_step,
            "tokens_per_s": tokens / elapsed_step,
            "elapsed_s": time.perf_counter() - self.start_time,
            "buffer_size": stats.size,
            "buffer_fill": stats.size / stats.capacity,
            "samples_generated": samples,
            "tokens_generated": tokens,
            **self.ledger.accounting(stats.size, stats.last_seqs),
        }

    def _record(self, step: int, record: dict) -> None:
        record.setdefault("weight_sync_s", None)
        record.setdefault("sync_logprob_diff", None)
        record.setdefault("staleness_mean", 0.0)
        record.update(self.supervisor.counts, learner_resumes=self.learner_resumes)
        record.update(self.fleet.sizes())
        self.writer.write(record)
        self.recorded_step = step
        self.ray_metrics.record({**record, "last_step_time_s": time.time()})  # the stalled-run alert's clock


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
