"""Run metrics: metrics.jsonl (one object per learner step), reward.png, Ray metrics, progress.

metrics.jsonl is a DESIGN.md contract: every line has at least the keys in
:data:`REQUIRED_KEYS`; keys may be added, never renamed. Tools (plots, benchmarks, tests) read it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

REQUIRED_KEYS = (
    "step",
    "policy_version",
    "reward_mean",
    "reward_std",
    "loss",
    "kl_to_ref",
    "clip_fraction",
    "staleness_mean",
    "samples_per_s",
    "tokens_per_s",
    "weight_sync_s",
    "sync_logprob_diff",
    "elapsed_s",
)


class MetricsWriter:
    """Appends one JSON object per step to ``<run_dir>/metrics.jsonl`` (flushed every line).

    Appending (never truncating) lets a resumed run continue the same file.
    """

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        missing = [k for k in REQUIRED_KEYS if k not in record]
        if missing:
            raise ValueError(f"metrics record for step {record.get('step')} lacks required keys {missing}")
        with self.path.open("a") as f:
            f.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")


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
    """reward.png: reward mean (with std band) and loss against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = list(records)
    steps = [r["step"] for r in records]
    reward = [_num(r.get("reward_mean")) for r in records]
    std = [_num(r.get("reward_std")) for r in records]
    loss = [_num(r.get("loss")) for r in records]
    fig, (ax_r, ax_l) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_r.plot(steps, reward, color="tab:blue", label="reward mean")
    ax_r.fill_between(steps, [r - s for r, s in zip(reward, std)], [r + s for r, s in zip(reward, std)],
                      color="tab:blue", alpha=0.15, label="± std")
    ax_r.set_ylabel("reward")
    ax_r.legend(loc="lower right")
    ax_l.plot(steps, loss, color="tab:red")
    ax_l.set_ylabel("loss")
    ax_l.set_xlabel("learner step")
    fig.suptitle(title or "rlpost run")
    fig.tight_layout()
    out_path = Path(out_path)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def _num(value: Any) -> float:
    return float("nan") if value is None else float(value)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # 0-d tensors and numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; None reads as "not available"
    return value


def episode_metrics(groups: Iterable[Any]) -> dict[str, float]:
    """Per-step episode figures from the trained groups (``rlpost.types.Group``): ``turns_mean``
    and ``tool_calls_mean`` per sample, ``tool_error_fraction`` of the tool calls (0 without
    calls), ``tool_time_s`` summed over the samples, and ``reward_errors``: failed reward
    computations in the batches these groups came from."""
    groups = list(groups)
    samples = [s for g in groups for s in g.samples]
    calls = sum(s.num_tool_calls for s in samples)
    return {
        "turns_mean": sum(s.num_turns for s in samples) / max(len(samples), 1),
        "tool_calls_mean": calls / max(len(samples), 1),
        "tool_error_fraction": sum(s.num_tool_errors for s in samples) / calls if calls else 0.0,
        "tool_time_s": sum(s.tool_time_s for s in samples),
        "reward_errors": sum(sum(g.info.get("reward_errors", {}).values()) for g in groups),
        "length_truncated": sum(g.info.get("num_length_truncated", 0) for g in groups),
    }


class RayMetrics:
    """The run's metrics in Ray's metrics system (dashboard, Prometheus), tagged by run name.

    Gauges are set from the driver once per step; names are stable (``rlpost_<name>``).
    """

    GAUGES = {
        "reward_mean": "Mean reward of the step's samples",
        "policy_version": "Learner policy version",
        "buffer_size": "Groups waiting in the buffer",
        "staleness_mean": "Mean policy-version lag of trained samples",
        "weight_sync_s": "Seconds of the last weight publication",
        "loss": "Learner loss",
        "kl_to_ref": "KL to the reference model",
        "clip_fraction": "Share of clipped tokens",
        "step_time_s": "Seconds per learner step",
        "restarts_inference": "Inference workers restarted so far",
        "restarts_env_pool": "Env pools restarted so far",
        "restarts_reference": "Reference actors restarted so far",
        "restarts_buffer": "Buffer actors restarted so far",
        "bus_reforms": "Weight-bus re-formations so far",
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
    }
    COUNTERS = {
        "samples_generated": "Completions generated",
        "tokens_generated": "Completion tokens generated",
    }

    def __init__(self, run_name: str):
        from ray.util import metrics

        self.tags = {"run": run_name}
        self.gauges = {k: metrics.Gauge(f"rlpost_{k}", description=d, tag_keys=("run",)) for k, d in self.GAUGES.items()}
        self.counters = {k: metrics.Counter(f"rlpost_{k}", description=d, tag_keys=("run",)) for k, d in self.COUNTERS.items()}

    def record(self, values: dict[str, Any]) -> None:
        for key, gauge in self.gauges.items():
            value = values.get(key)
            if value is not None and math.isfinite(float(value)):
                gauge.set(float(value), tags=self.tags)
        for key, counter in self.counters.items():
            value = values.get(key)
            if value:
                counter.inc(float(value), tags=self.tags)


class RoleMetrics:
    """Metrics one role reports from its own actor process (Ray metrics: dashboard, Prometheus).

    Names are ``rlpost_<role>_<name>`` (Prometheus shows them with Ray's ``ray_`` prefix), tagged
    with the run name and the actor's name, e.g. ``rlpost_inference_tokens_generated{run=...,
    actor="inference-0"}``. Gauges take the last value, counters add up.
    """

    ROLES = {
        "inference": ({"policy_version": "Weights version served", "weight_load_s": "Seconds to receive and load the last update"},
                      {"samples_generated": "Completions generated", "tokens_generated": "Completion tokens generated"}),
        "env_pool": ({"reward_mean": "Mean reward of the last collected batch"},
                     {"groups_collected": "GRPO groups collected", "samples_collected": "Samples collected"}),
        "learner": ({"loss": "Learner loss", "kl_to_ref": "KL to the reference model", "clip_fraction": "Share of clipped tokens",
                     "step_time_s": "Seconds per learner step", "policy_version": "Learner policy version",
                     "staleness_mean": "Mean policy-version lag of trained samples",
                     "weight_sync_s": "Seconds of the last weight publication"}, {}),
        "buffer": ({"size": "Groups waiting in the buffer", "groups_dropped_stale": "Groups dropped for staleness (total)"}, {}),
        "reference": ({}, {"samples_scored": "Samples scored by the reference model"}),
    }

    def __init__(self, role: str, run_name: str, actor: str):
        from ray.util import metrics

        gauges, counters = self.ROLES[role]
        tags = ("run", "actor")
        self.tags = {"run": run_name or "", "actor": actor}
        self.gauges = {k: metrics.Gauge(f"rlpost_{role}_{k}", description=d, tag_keys=tags) for k, d in gauges.items()}
        self.counters = {k: metrics.Counter(f"rlpost_{role}_{k}", description=d, tag_keys=tags) for k, d in counters.items()}

    def record(self, **values: Any) -> None:
        for key, value in values.items():
            if value is None or not math.isfinite(float(value)):
                continue
            if key in self.gauges:
                self.gauges[key].set(float(value), tags=self.tags)
            elif key in self.counters and value > 0:
                self.counters[key].inc(float(value), tags=self.tags)
