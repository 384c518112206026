"""Run metrics: metrics.jsonl (one object per learner step) and its trackers, the figures
(reward.png and the others of ``rlpost plot``), Ray metrics.

metrics.jsonl is a contract with the tools (plots, benchmarks, tests) that read it: every line
has at least the keys in :data:`REQUIRED_KEYS`; keys may be added, never renamed.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rlpost.record.trackers import Tracker, numeric_values

log = logging.getLogger("rlpost")

REQUIRED_KEYS = ("step", "policy_version", "reward_mean", "reward_std", "loss", "kl_to_ref", "clip_fraction",
                 "staleness_mean", "samples_per_s", "tokens_per_s", "weight_sync_s", "sync_logprob_diff",
                 "elapsed_s")  # fmt: skip


class MetricsWriter:
    """Appends one JSON object per step to ``<run_dir>/metrics.jsonl`` (flushed every line; never
    truncated, so a resumed run continues the file) and hands it to the run's trackers. A tracker
    whose ``log`` raises is closed and dropped with one warning; the others go on. Records written
    after :meth:`close` go to the file only."""

    def __init__(self, run_dir: str | Path, trackers: Sequence[Tracker] = ()):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.trackers: list[Tracker] = list(trackers)

    def write(self, record: dict[str, Any]) -> None:
        missing = [k for k in REQUIRED_KEYS if k not in record]
        if missing:
            raise ValueError(f"metrics record for step {record.get('step')} lacks required keys {missing}")
        with self.path.open("a") as f:
            f.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        if self.trackers:
            self._to_trackers(numeric_values(record), int(record["step"]))

    def log(self, values: dict[str, Any], step: int) -> None:
        """Hand ``values`` to the trackers only, at ``step`` (e.g. the evaluation before step 1,
        which has no metrics.jsonl line)."""
        if self.trackers:
            self._to_trackers(numeric_values(values), step)

    def _to_trackers(self, values: dict[str, float], step: int) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.log(values, step)
            except Exception as exc:
                log.warning("tracker %s failed at step %d (%s: %s); it is off for the rest of the run",
                            tracker.name, step, type(exc).__name__, exc)  # fmt: skip
                self.trackers.remove(tracker)
                _close_tracker(tracker)

    def close(self) -> None:
        """Close every tracker (a failing close is a warning); safe to call twice."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            _close_tracker(tracker)


def _close_tracker(tracker: Tracker) -> None:
    try:
        tracker.close()
    except Exception as exc:
        log.warning("tracker %s failed to close (%s: %s)", tracker.name, type(exc).__name__, exc)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read metrics.jsonl; a torn last line (a crash mid-write) is skipped, any other bad line is an error."""
    path = Path(path)
    lines = path.read_text().splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON object") from None
    return records


def plot_metrics(records: Iterable[dict[str, Any]], out_path: str | Path, title: str = "") -> Path:
    """reward.png: reward mean (with std band) against step, plus the eval reward
    (``eval_reward_mean``) and pass@1 (``eval_pass_at_1``) at the steps that have them; loss below."""
    from matplotlib.figure import Figure

    records = list(records)
    steps = [r["step"] for r in records]
    reward = [_as_float(r.get("reward_mean")) for r in records]
    std = [_as_float(r.get("reward_std")) for r in records]
    loss = [_as_float(r.get("loss")) for r in records]
    fig = Figure(figsize=(7, 6))
    ax_r, ax_l = fig.subplots(2, 1, sharex=True)
    ax_r.plot(steps, reward, color="tab:blue", label="reward mean")
    ax_r.fill_between(steps, [r - s for r, s in zip(reward, std)], [r + s for r, s in zip(reward, std)],
                      color="tab:blue", alpha=0.15, label="± std")  # fmt: skip
    evals = (("eval_reward_mean", "eval reward", "tab:green"), ("eval_pass_at_1", "eval pass@1", "tab:purple"))
    for key, label, color in evals:
        values = _series(records, key)
        if values is not None:
            _plot_finite(ax_r, steps, values, label=label, color=color, marker="o")
    ax_r.set_ylabel("reward")
    ax_r.legend(loc="lower right")
    ax_l.plot(steps, loss, color="tab:red")
    ax_l.set_ylabel("loss")
    ax_l.set_xlabel("learner step")
    fig.suptitle(title or "rlpost run")
    fig.tight_layout()
    out_path = Path(out_path)
    fig.savefig(out_path, dpi=100)
    return out_path


# the parts of step_time_s that step_time.png stacks
STEP_TIME_PARTS = ("collect_s", "train_s", "weight_sync_s")


def plot_run(records: Iterable[dict[str, Any]], run_dir: str | Path, title: str = "",
             reward_path: str | Path | None = None) -> list[Path]:  # fmt: skip
    """Every figure of a run; returns the paths written. ``reward.png`` (at ``reward_path``,
    default ``run_dir/reward.png``) always; beside it in ``run_dir``, each only when the records
    hold its metrics (older runs lack some):

    - ``kl.png``: ``kl_to_ref`` (and ``kl_to_inference``, the learner's KL to the sampling policy);
    - ``length.png``: completion length, ``completion_len_mean`` or else
      ``tokens_generated / samples_generated``;
    - ``staleness.png``: ``staleness_mean`` (and ``staleness_max``);
    - ``step_time.png``: ``collect_s``, ``train_s`` and ``weight_sync_s`` stacked, under the
      whole ``step_time_s`` (the gap is the probe and the bookkeeping).
    """
    records = list(records)
    run_dir = Path(run_dir)
    title = title or "rlpost run"
    written = [plot_metrics(records, reward_path or run_dir / "reward.png", title)]
    steps = [r["step"] for r in records]
    figures = {  # file name: (figure title, y label, lines)
        "kl.png": ("KL", "KL", [(k, _series(records, k)) for k in ("kl_to_ref", "kl_to_inference")]),
        "length.png": ("completion length", "tokens", [("completion length", _completion_lengths(records))]),
        "staleness.png": ("staleness", "policy versions behind",
                          [(k, _series(records, k)) for k in ("staleness_mean", "staleness_max")]),
    }  # fmt: skip
    for name, (what, ylabel, lines) in figures.items():
        drawn = [(label, values) for label, values in lines if values is not None]
        if drawn:
            written.append(_line_figure(steps, drawn, ylabel, f"{title}: {what}", run_dir / name))
    step_time = _step_time_figure(records, steps, f"{title}: step time", run_dir / "step_time.png")
    if step_time is not None:
        written.append(step_time)
    return written


def _series(records: list[dict[str, Any]], key: str) -> list[float] | None:
    """``key``'s value per record (NaN where missing or not a number); None when no record has a number."""
    values = [_as_float(r.get(key)) for r in records]
    return values if any(math.isfinite(v) for v in values) else None


def _as_float(value: Any) -> float:
    """A plottable float: NaN for None, non-numbers and bools."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return float("nan")
    return float(value)


def _completion_lengths(records: list[dict[str, Any]]) -> list[float] | None:
    """Mean completion tokens per step: ``completion_len_mean``, or ``tokens_generated /
    samples_generated`` for records without it; None when neither gives a number."""
    values = []
    for r in records:
        value = _as_float(r.get("completion_len_mean"))
        if not math.isfinite(value):
            tokens, samples = _as_float(r.get("tokens_generated")), _as_float(r.get("samples_generated"))
            ok = math.isfinite(tokens) and math.isfinite(samples) and samples > 0
            value = tokens / samples if ok else float("nan")
        values.append(value)
    return values if any(math.isfinite(v) for v in values) else None


def _plot_finite(ax: Any, steps: list[int], values: list[float], **style: Any) -> None:
    """Plot the points whose value is a number (a line across gaps, e.g. eval every few steps)."""
    points = [(s, v) for s, v in zip(steps, values) if math.isfinite(v)]
    ax.plot([s for s, _ in points], [v for _, v in points], **style)


def _line_figure(steps: list[int], lines: list[tuple[str, list[float]]], ylabel: str, title: str, out: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.5))
    ax = fig.subplots()
    for label, values in lines:
        _plot_finite(ax, steps, values, label=label)
    return _save_figure(fig, ax, ylabel, title, out)


def _save_figure(fig: Any, ax: Any, ylabel: str, title: str, out: Path) -> Path:
    ax.set_ylabel(ylabel)
    ax.set_xlabel("learner step")
    ax.legend(loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out


def _step_time_figure(records: list[dict[str, Any]], steps: list[int], title: str, out: Path) -> Path | None:
    """step_time.png: the parts of ``STEP_TIME_PARTS`` the records hold, stacked (a missing
    value counts 0, e.g. ``weight_sync_s`` on a step without a sync), and ``step_time_s`` as a
    line; None (nothing written) when the records hold none of them."""
    from matplotlib.figure import Figure

    parts = [(key, _series(records, key)) for key in STEP_TIME_PARTS]
    parts = [(key, [v if math.isfinite(v) else 0.0 for v in values]) for key, values in parts if values is not None]
    total = _series(records, "step_time_s")
    if not parts and total is None:
        return None
    fig = Figure(figsize=(7, 3.5))
    ax = fig.subplots()
    if parts:
        ax.stackplot(steps, *[values for _, values in parts], labels=[key for key, _ in parts], alpha=0.7)
    if total is not None:
        _plot_finite(ax, steps, total, label="step_time_s", color="black")
    return _save_figure(fig, ax, "seconds", title, out)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # 0-d tensors and numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; None reads as "not available"
    return value


def reward_breakdown(groups: Iterable[Any], prefix: str = "") -> dict[str, float]:
    """The reward per task and per part, from groups (``rlpost.data.samples.Group``) whose samples
    say their ``task`` (a task mixture) or carry ``reward_parts`` (a reward model's score beside
    the rule): ``<prefix>reward_mean/<task>`` over every sampled answer of that task's groups
    (expert iteration's ``info["sampled_rewards"]`` included), ``<prefix>reward_part/<part>``
    over the samples that have the part."""
    by_task: dict[str, list[float]] = {}
    by_part: dict[str, list[float]] = {}
    for group in groups:
        task = group.samples[0].task if group.samples else None
        if task is not None:
            by_task.setdefault(task, []).extend(group.info.get("sampled_rewards", group.rewards))
        for sample in group.samples:
            for part, value in (sample.reward_parts or {}).items():
                by_part.setdefault(part, []).append(value)
    out = {f"{prefix}reward_mean/{task}": sum(v) / len(v) for task, v in sorted(by_task.items()) if v}
    out.update({f"{prefix}reward_part/{part}": sum(v) / len(v) for part, v in sorted(by_part.items())})
    return out


def episode_metrics(groups: Iterable[Any]) -> dict[str, float]:
    """Per-step episode figures from the trained groups: per sample (``turns_mean``,
    ``tool_calls_mean``), of the tool calls (``tool_error_fraction``, 0 without calls), summed
    (``tool_time_s``, ``reward_errors`` of the batches they came from), and
    :func:`reward_breakdown`."""
    groups = list(groups)
    samples = [s for g in groups for s in g.samples]
    calls = sum(s.num_tool_calls for s in samples)
    return {
        **reward_breakdown(groups),
        "turns_mean": sum(s.num_turns for s in samples) / max(len(samples), 1),
        "tool_calls_mean": calls / max(len(samples), 1),
        "tool_error_fraction": sum(s.num_tool_errors for s in samples) / calls if calls else 0.0,
        "tool_time_s": sum(s.tool_time_s for s in samples),
        "reward_errors": sum(sum(g.info.get("reward_errors", {}).values()) for g in groups),
        "length_truncated": sum(g.info.get("num_length_truncated", 0) for g in groups),
    }


class RayMetrics:
    """The run's metrics in Ray's metrics system (dashboard, Prometheus), tagged by run name:
    gauges set from the driver once per step; names are stable (``rlpost_<name>``)."""

    GAUGES = {
        "reward_mean": "Mean reward of the step's samples",
        "reward_std": "Standard deviation of the step's rewards",
        "policy_version": "Learner policy version",
        "last_step_time_s": "Unix time at which the last learner step was recorded",
        "buffer_size": "Groups waiting in the buffer",
        "staleness_mean": "Mean policy-version lag of trained samples",
        "staleness_max": "Largest policy-version lag of the step's trained samples",
        "inflight_token_fraction": "Share of trained tokens generated after a weight update landed mid-completion",
        "weight_sync_s": "Seconds of the last weight publication",
        "weight_sync_bytes": "Bytes the last weight sync sent",
        "weight_load_s": "Seconds the slowest engine took to reload the last update",
        "weight_sync_receivers_shm": "Receivers of the last sync reading from shared memory",
        "weight_sync_receivers_bus": "Receivers of the last sync on the collective bus",
        "sync_logprob_diff": "Max log-prob difference between a worker and the learner after the last probed sync",
        "loss": "Learner loss",
        "kl_to_ref": "KL to the reference model",
        "kl_to_inference": "The learner's KL to the sampling policy",
        "clip_fraction": "Share of clipped tokens",
        "entropy": "Entropy of the loss's entropy term (runs with loss.entropy_coef > 0)",
        "entropy_sampled": "-log p of the generated tokens under the sampling policy",
        "completion_len_mean": "Mean generated tokens per trained sample",
        "samples_per_s": "Trained samples per second of the step",
        "tokens_per_s": "Trained tokens per second of the step",
        "step_time_s": "Seconds per learner step",
        "collect_s": "Seconds of the step spent waiting for its groups",
        "train_s": "Seconds of the step spent in the learner call",
        "restarts_inference": "Inference workers restarted so far",
        "restarts_env_pool": "Env pools restarted so far",
        "restarts_reference": "Reference actors restarted so far",
        "restarts_reward": "Reward actors restarted so far",
        "restarts_buffer": "Buffer actors restarted so far",
        "bus_reforms": "Weight-bus re-formations so far",
        "watchdog_kills": "Actors the watchdog found frozen or hung and killed (then replaced) so far",
        "learner_resumes": "Times the learner was resumed from a checkpoint in this run",
        "inference_workers": "Inference workers serving (fewer than the target while the cluster has no room)",
        "inference_workers_vacant": "Inference workers waiting for room in the cluster",
        "inference_workers_target": "Inference workers the run wants (its config's top, or what rlpost scale asked)",
        "env_pools": "Env pools collecting (fewer than the target while the cluster has no room)",
        "env_pools_vacant": "Env pools waiting for room in the cluster",
        "env_pools_target": "Env pools the run wants (its config's top, or what rlpost scale asked)",
        "buffer_fill": "Groups in the buffer over its capacity at the step's end",
        "autoscale_wait_share": "Share of the step the learner waited for its groups (the load policy's signal)",
        "autoscale_engine_busy": "Share of the generating time the inference engines were busy (the load policy's)",
        # the accounting: groups_put == groups_trained + groups_dropped_stale + groups_in_buffer
        "groups_put": "Groups the env pools put in the buffer so far",
        "groups_trained": "Groups trained so far",
        "groups_dropped_stale": "Groups dropped for staleness so far",
        "groups_in_buffer": "Groups waiting in the buffer",
        "turns_mean": "Assistant turns per trained sample",
        "tool_calls_mean": "Tool calls per trained sample",
        "tool_error_fraction": "Share of the step's tool calls that failed",
        "tool_time_s": "Seconds the step's samples spent in tools",
        "reward_errors": "Failed reward computations in the step's batches",
        "length_truncated": "Episodes ended because their next prompt would not fit the engine",
        "eval_reward_mean": "Mean reward on the held-out prompts at the last evaluation",
        "eval_pass_at_1": "pass@1 on the held-out prompts at the last evaluation",
        "eval_pass_at_k": "pass@k (k = eval.samples_per_prompt) at the last evaluation",
        "eval_length_mean": "Mean completion tokens at the last evaluation",
        "eval_s": "Seconds the last evaluation took",
    }
    COUNTERS = {
        "samples_generated": "Completions generated",
        "tokens_generated": "Completion tokens generated",
    }
    DECISIONS = "autoscale_decisions"  # a counter tagged with the role and the reason too

    def __init__(self, run_name: str):
        from ray.util import metrics

        self.tags = {"run": run_name}
        self.gauges = {
            k: metrics.Gauge(f"rlpost_{k}", description=d, tag_keys=("run",)) for k, d in self.GAUGES.items()
        }
        self.counters = {
            k: metrics.Counter(f"rlpost_{k}", description=d, tag_keys=("run",)) for k, d in self.COUNTERS.items()
        }
        self.decisions = metrics.Counter(
            f"rlpost_{self.DECISIONS}", tag_keys=("run", "role", "reason"),
            description="The load policy's resizes, by role and reason (rlpost.service.autoscale.REASONS)",
        )  # fmt: skip

    def record(self, values: dict[str, Any]) -> None:
        for key, gauge in self.gauges.items():
            value = values.get(key)
            if value is not None and math.isfinite(float(value)):
                gauge.set(float(value), tags=self.tags)
        for key, counter in self.counters.items():
            value = values.get(key)
            if value:
                counter.inc(float(value), tags=self.tags)
        if values.get("autoscale_reason"):
            tags = {**self.tags, "role": values["autoscale_role"], "reason": values["autoscale_reason"]}
            self.decisions.inc(1.0, tags=tags)


class RoleMetrics:
    """Metrics one role reports from its own actor process (Ray metrics: dashboard, Prometheus):
    ``rlpost_<role>_<name>`` (Prometheus adds Ray's ``ray_`` prefix), tagged with the run and the
    actor, e.g. ``rlpost_inference_tokens_generated{run=..., actor="inference-0"}``. Gauges take
    the last value, counters add up."""

    _LEARNER = ("loss", "kl_to_ref", "clip_fraction", "step_time_s", "policy_version", "staleness_mean",
                "weight_sync_s")  # fmt: skip
    ROLES = {  # role: (gauges, counters)
        "inference": ({"policy_version": "Weights version served",
                       "weight_load_s": "Seconds to receive and load the last update"}, dict(RayMetrics.COUNTERS)),
        "env_pool": ({"reward_mean": "Mean reward of the last collected batch",
                      "groups_filtered": "Groups this pool dropped so far for having every reward equal (DAPO "
                                         "filter, expert iteration)"},
                     {"groups_collected": "GRPO groups collected", "samples_collected": "Samples collected"}),
        "learner": (dict(zip(_LEARNER, map(RayMetrics.GAUGES.get, _LEARNER))), {}),
        "buffer": ({"size": "Groups waiting in the buffer",
                    "groups_dropped_stale": "Groups dropped for staleness (total)"}, {}),
        "reference": ({}, {"samples_scored": "Samples scored by the reference model"}),
        "reward": ({}, {"samples_scored": "Final responses scored by the reward model or judge",
                        "unparsed_verdicts": "Judge replies without a readable verdict (scored 0)"}),
    }  # fmt: skip

    def __init__(self, role: str, run_name: str, actor: str):
        from ray.util import metrics

        gauges, counters = self.ROLES[role]
        tags = ("run", "actor")
        self.tags = {"run": run_name or "", "actor": actor}
        self.gauges = {k: metrics.Gauge(f"rlpost_{role}_{k}", description=d, tag_keys=tags) for k, d in gauges.items()}
        self.counters = {
            k: metrics.Counter(f"rlpost_{role}_{k}", description=d, tag_keys=tags) for k, d in counters.items()
        }

    def record(self, **values: Any) -> None:
        for key, value in values.items():
            if value is None or not math.isfinite(float(value)):
                continue
            if key in self.gauges:
                self.gauges[key].set(float(value), tags=self.tags)
            elif key in self.counters and value > 0:
                self.counters[key].inc(float(value), tags=self.tags)


class ServiceMetrics:
    """``rlpost serve``'s metrics (Ray metrics: dashboard, Prometheus): what it holds, and each
    tenant's requests, failures and tokens. Names ``rlpost_serve_<name>``; the counters are
    tagged with the tenant (and the request's kind, the failure's category)."""

    GAUGES = {
        "serve_sessions": "Client sessions opened since the service started",
        "serve_models": "Client models (LoRA adapters) the trainer holds",
        "serve_samplers": "Samplers (adapter snapshots, base-model samplers) clients hold",
        "serve_pending_requests": "Requests accepted and not finished yet",
        "serve_logprob_diff": "Largest log-prob difference between an engine and the trainer at the last parity check",
    }
    COUNTERS = {
        "serve_requests": "Requests accepted, by tenant and kind",
        "serve_request_errors": "Requests that failed, by tenant, kind and category (user: the client's mistake)",
        "serve_tokens_trained": "Tokens of forward and forward_backward requests, by tenant",
        "serve_tokens_sampled": "Tokens sampled, by tenant",
        "serve_busy_seconds": "Seconds an actor (trainer, inference-<i>) spent on a tenant's calls, by tenant and actor",
    }
    TENANT_GAUGES = {
        "serve_tenant_pending": "Requests of the tenant accepted and not finished (its queue depth)",
    }
    # where the trainer holds the models' adapters (AdapterTrainer.memory)
    ADAPTERS = "serve_trainer_adapters"
    ADAPTER_PLACES = ("resident", "in_memory", "on_disk")
    _TAGS = {"serve_requests": ("tenant", "kind"), "serve_request_errors": ("tenant", "kind", "category"),
             "serve_tokens_trained": ("tenant",), "serve_tokens_sampled": ("tenant",),
             "serve_busy_seconds": ("tenant", "actor")}  # fmt: skip

    def __init__(self):
        from ray.util import metrics

        self.gauges = {k: metrics.Gauge(f"rlpost_{k}", description=d) for k, d in self.GAUGES.items()}
        self.gauges |= {
            k: metrics.Gauge(f"rlpost_{k}", description=d, tag_keys=("tenant",)) for k, d in self.TENANT_GAUGES.items()
        }
        self.gauges[self.ADAPTERS] = metrics.Gauge(
            f"rlpost_{self.ADAPTERS}", tag_keys=("where",),
            description="Client models' adapters in the trainer's model (resident), parked in its memory, on disk",
        )  # fmt: skip
        self.counters = {
            k: metrics.Counter(f"rlpost_{k}", description=d, tag_keys=self._TAGS[k]) for k, d in self.COUNTERS.items()
        }

    def count(self, key: str, amount: float = 1.0, **tags: str) -> None:
        if amount > 0:
            self.counters[key].inc(float(amount), tags=tags)

    def state(self, **values: float) -> None:
        for key, value in values.items():
            self.gauges[f"serve_{key}"].set(float(value))

    def tenant_pending(self, tenant: str, count: int) -> None:
        self.gauges["serve_tenant_pending"].set(float(count), tags={"tenant": tenant})

    def trainer_adapters(self, memory: dict[str, int]) -> None:
        for where in self.ADAPTER_PLACES:
            self.gauges[self.ADAPTERS].set(float(memory[where]), tags={"where": where})
