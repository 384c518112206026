"""rlpost's Grafana dashboard and Prometheus alert rules, written from the metrics the run exports.

Prometheus scrapes the roles' Ray metrics (:mod:`rlpost.record.metrics`) with Ray's ``ray_``
prefix and labels, plus rlpost's ``run`` (and ``actor``). This module writes two files:

- the dashboard (``DASHBOARD_FILE``), built with Grafana's Foundation SDK: one row per view
  (training, throughput, pipeline, weight sync, workers), every panel filtered by the ``run``
  variable and reading the ``datasource`` variable, as Ray's own dashboards do;
- the alert rules (``ALERTS_FILE``), a Prometheus rule group: a run with no learner step, a
  restart storm, drifting weight syncs, a run whose metrics stopped, reward collapse.

``deploy/monitoring/`` holds both with the default settings, and the rules as a Prometheus
Operator ``PrometheusRule`` (``python -m rlpost.ops.dashboards`` rewrites the three; a test checks
them); ``rlpost monitor`` writes them for its own Prometheus.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from rlpost.record.metrics import RayMetrics

DASHBOARD_UID = "rlpost-run"
DASHBOARD_FILE = "rlpost_grafana_dashboard.json"
ALERTS_FILE = "rlpost_alerts.yml"
PROMETHEUS_RULE_FILE = "rlpost_prometheusrule.yaml"  # the same rules as a Prometheus Operator resource
DEPLOY_DIR = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
RUN = '{run=~"$run"}'  # the dashboard's filter: the runs picked in its `run` variable


def metric(name: str, selector: str = RUN) -> str:
    """A run-level gauge of the driver (``rlpost.record.metrics.RayMetrics``) as Prometheus names it."""
    return f"ray_rlpost_{name}{selector}"


@dataclasses.dataclass(frozen=True)
class Panel:
    """One time-series panel: its title, what it shows, its unit (Grafana's unit ids), and its
    queries as ``(PromQL, legend)`` pairs."""

    title: str
    description: str
    queries: tuple[tuple[str, str], ...]
    unit: str = "short"


def _gauges(unit: str, title: str, description: str, *names: str) -> Panel:
    """A panel of run-level gauges, one line per run and gauge."""
    return Panel(title, description, tuple((metric(n), f"{n} {{{{run}}}}") for n in names), unit)


# The dashboard's rows, top to bottom; each panel lists the metrics it reads.
# fmt: off
ROWS: dict[str, list[Panel]] = {
    "Training": [
        _gauges("short", "Reward", "Mean reward of the step's samples and its spread (standard deviation).",
                "reward_mean", "reward_std"),
        _gauges("percentunit", "Evaluation", "pass@1 and the mean reward on the held-out prompts, at each evaluation.",
                "eval_pass_at_1", "eval_reward_mean"),
        _gauges("short", "Loss", "The learner's loss (objective, KL and entropy terms).", "loss"),
        _gauges("short", "KL", "KL to the reference model, and the learner's KL to the sampling policy.", "kl_to_ref",
                "kl_to_inference"),
        _gauges("percentunit", "Clip fraction", "Share of the loss tokens whose ratio was clipped.", "clip_fraction"),
        _gauges("short", "Entropy",
                "entropy_sampled: -log p of the generated tokens under the sampling policy (every run); "
                "entropy: the loss's entropy (runs with loss.entropy_coef > 0).", "entropy_sampled", "entropy"),
        _gauges("short", "Response length", "Mean generated tokens per trained sample.", "completion_len_mean"),
    ],
    "Throughput": [
        _gauges("short", "Samples per second", "Trained samples per second of the step.", "samples_per_s"),
        _gauges("short", "Tokens per second", "Trained (generated) tokens per second of the step.", "tokens_per_s"),
        _gauges("s", "Step time",
                "step_time_s = collect_s (waiting for the step's groups) + train_s (the learner call) + "
                "weight_sync_s (publish and receive) + the sync probe.",
                "step_time_s", "collect_s", "train_s", "weight_sync_s"),
    ],
    "Pipeline": [
        _gauges("short", "Buffer", "Groups waiting in the buffer.", "buffer_size"),
        _gauges("short", "Staleness", "Policy versions between a trained sample and the learner (mean, max).",
                "staleness_mean", "staleness_max"),
        Panel("Groups dropped",
              "Groups dropped so far, by reason: stale (older than trainer.max_staleness) and filtered "
              "(the DAPO filter: every reward of the group equal).",
              ((metric("groups_dropped_stale"), "stale {{run}}"),
               (f"sum by (run) ({metric('env_pool_groups_filtered')})", "filtered {{run}}"))),
        _gauges("percentunit", "In-flight tokens",
                "Share of the trained tokens generated after a weight update landed mid-completion.",
                "inflight_token_fraction"),
    ],
    "Weight sync": [
        _gauges("s", "Sync time", "Seconds the step spent in the weight sync, and the engines' reload.",
                "weight_sync_s", "weight_load_s"),
        _gauges("bytes", "Bytes per sync", "Bytes the last weight sync sent.", "weight_sync_bytes"),
        _gauges("short", "Route", "Receivers of the last sync by route: shared memory (same node) or the bus.",
                "weight_sync_receivers_shm", "weight_sync_receivers_bus"),
        _gauges("short", "Sync log-prob difference",
                "Max |log-prob| difference between a worker and the learner on a fixed probe after a sync "
                "(above 1e-3: the workers do not serve the learner's weights).", "sync_logprob_diff"),
    ],
    "Workers": [
        Panel("Generation rate", "Completion tokens per second, per inference worker.",
              ((f"sum by (run, actor) (rate({metric('inference_tokens_generated_total')}[1m]))",
                "{{actor}} {{run}}"),)),
        _gauges("short", "Restarts",
                "Actors restarted so far, by role; weight-bus re-formations; learner resumes; actors the watchdog "
                "found frozen or hung (and killed, to be replaced).", "restarts_inference", "restarts_env_pool",
                "restarts_reference", "restarts_buffer", "bus_reforms", "learner_resumes", "watchdog_kills"),
        _gauges("short", "Fleet", "Inference workers and env pools serving, and the targets they scale to.",
                "inference_workers", "inference_workers_target", "env_pools", "env_pools_target"),
        _gauges("percentunit", "Tool errors", "Share of the step's tool calls that failed.", "tool_error_fraction"),
        _gauges("short", "Reward-function errors", "Failed reward computations in the step's batches.",
                "reward_errors"),
    ],
}
# fmt: on


def panel_queries() -> list[tuple[str, str]]:
    """Every ``(panel title, PromQL)`` of the dashboard, with the ``run`` filter as written."""
    return [(panel.title, expr) for panels in ROWS.values() for panel in panels for expr, _ in panel.queries]


# ------------------------------------------------------------------------------------- dashboard


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard as a JSON object (Grafana's dashboard model)."""
    from grafana_foundation_sdk.builders import dashboard as gd
    from grafana_foundation_sdk.builders import prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort

    source = DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (
        gd.Dashboard("rlpost")
        .uid(DASHBOARD_UID)
        .description("An rlpost run: training, throughput, pipeline, weight sync and workers, per run")
        .tags(["rlpost", "ray"])
        .editable()
        .refresh("10s")
        .time("now-1h", "now")
        .with_variable(gd.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            gd.QueryVariable("run")
            .label("Run")
            .description("logging.run_name of the runs shown")
            .datasource(source)
            .query("label_values(ray_rlpost_policy_version, run)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_DESC)
            .multi(True)
            .include_all(True)
        )
    )
    for row, panels in ROWS.items():
        board = board.with_row(gd.Row(row))
        for panel in panels:
            built = (
                timeseries.Panel()
                .title(panel.title)
                .description(panel.description)
                .unit(panel.unit)
                .datasource(source)
                .span(8)  # three panels side by side
                .height(8)
            )
            for ref, (expr, legend) in zip("ABCDEFGH", panel.queries):
                built = built.with_target(
                    prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(source)
                )
            board = board.with_panel(built)
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


# ----------------------------------------------------------------------------------------- alerts


@dataclasses.dataclass(frozen=True)
class AlertSettings:
    """The thresholds of the alert rules (``rlpost monitor`` takes them as options)."""

    stall_after_s: float = 600.0  # no learner step for this long: RlpostNoLearnerStep
    restarts: int = 3  # restarts of any role within restart_window_s: RlpostRestartStorm
    restart_window_s: float = 600.0
    sync_logprob_diff: float = 1e-3  # RlpostSyncDrift
    reward_drop: float = 0.5  # share of the best 10-minute reward mean lost: RlpostRewardCollapse


DEFAULT_ALERTS = AlertSettings()  # the thresholds of the files in deploy/monitoring
# the roles of the driver's restarts_<role> gauges
RESTART_ROLES = tuple(k.removeprefix("restarts_") for k in RayMetrics.GAUGES if k.startswith("restarts_"))


def _duration(seconds: float) -> str:
    """A PromQL duration: whole seconds."""
    return f"{max(int(round(seconds)), 1)}s"


def alert_rules(settings: AlertSettings = DEFAULT_ALERTS) -> dict[str, Any]:
    """The Prometheus rule file (one group, ``rlpost``) as a YAML-ready object."""
    stall, window = _duration(settings.stall_after_s), _duration(settings.restart_window_s)
    last_step = "max by (run) (max_over_time(ray_rlpost_last_step_time_s[1h]))"
    reward_10m = "avg_over_time(ray_rlpost_reward_mean[10m])"
    best = f"max_over_time({reward_10m}[2h:1m])"
    rules = [
        _alert(
            "RlpostNoLearnerStep",
            f"time() - {last_step} > {settings.stall_after_s:g}",
            "warning",
            f"run {{{{ $labels.run }}}}: no learner step for more than {stall}",
            "The run's last finished learner step is {{ $value | humanizeDuration }} old: the run stalled, "
            "stopped or failed (its metrics.jsonl and driver log say which). Alerts for an hour after the "
            "last step.",
        ),
        _alert(
            "RlpostRunStopped",
            "max by (run) (max_over_time(ray_rlpost_policy_version[1h])) unless max by (run) (ray_rlpost_policy_version)",
            "info",
            "run {{ $labels.run }} stopped exporting metrics",
            "The run's driver no longer reports: it finished, was stopped, or failed within the last hour.",
        ),
        _alert(
            "RlpostRestartStorm",
            " + ".join(f"sum by (run) (delta(ray_rlpost_restarts_{role}[{window}]))" for role in RESTART_ROLES)
            + f" >= {settings.restarts}",
            "warning",
            f"run {{{{ $labels.run }}}}: {settings.restarts} or more actor restarts within {window}",
            "Actors of the run keep dying (the Restarts panel says which role): out of memory, a lost "
            "node, a crashing engine.",
        ),
        _alert(
            "RlpostSyncDrift",
            f"max by (run) (ray_rlpost_sync_logprob_diff) > {settings.sync_logprob_diff:g}",
            "critical",
            "run {{ $labels.run }}: the workers do not serve the learner's weights",
            "After the last probed weight sync a worker's log-probs differ from the learner's by "
            "{{ $value }} (limit " + f"{settings.sync_logprob_diff:g}): the samples are off-policy.",
        ),
        _alert(
            "RlpostRewardCollapse",
            f"{best} > 0 and ({best} - {reward_10m}) > {settings.reward_drop:g} * {best}",
            "warning",
            "run {{ $labels.run }}: the reward collapsed",
            f"The 10-minute mean reward fell by more than {settings.reward_drop:.0%} of its best in the last 2 hours.",
            for_="10m",
        ),
    ]
    return {"groups": [{"name": "rlpost", "rules": rules}]}


def _alert(name: str, expr: str, severity: str, summary: str, description: str, for_: str = "0s") -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {"summary": summary, "description": description},
    }


def alert_expressions(settings: AlertSettings = DEFAULT_ALERTS) -> dict[str, str]:
    """Each alert's name and PromQL expression."""
    return {rule["alert"]: rule["expr"] for rule in alert_rules(settings)["groups"][0]["rules"]}


# ------------------------------------------------------------------------------------------ files


def prometheus_rule(settings: AlertSettings = DEFAULT_ALERTS) -> dict[str, Any]:
    """The alert rules as a PrometheusRule, the Prometheus Operator's resource (kube-prometheus-stack
    picks up those labelled with its Helm release, ``release: prometheus`` by default)."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "rlpost-alerts", "labels": {"app.kubernetes.io/name": "rlpost", "release": "prometheus"}},
        "spec": alert_rules(settings),
    }


_HEADER = "# Written by `python -m rlpost.ops.dashboards` (rlpost/ops/dashboards.py): edit that, not this file.\n"


def write_files(folder: str | Path, settings: AlertSettings = DEFAULT_ALERTS) -> list[Path]:
    """Write the dashboard and the alert rules into ``folder``; returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    board, rules = folder / DASHBOARD_FILE, folder / ALERTS_FILE
    board.write_text(json.dumps(dashboard(), indent=2, sort_keys=True) + "\n")
    rules.write_text(_HEADER + yaml.safe_dump(alert_rules(settings), sort_keys=False, width=120))
    return [board, rules]


def write_deploy_files(folder: str | Path = DEPLOY_DIR) -> list[Path]:
    """The files of ``deploy/monitoring``: :func:`write_files`' with the default thresholds, and
    the PrometheusRule for Kubernetes."""
    written = write_files(folder)
    rule = Path(folder) / PROMETHEUS_RULE_FILE
    rule.write_text(_HEADER + yaml.safe_dump(prometheus_rule(), sort_keys=False, width=120))
    return [*written, rule]


if __name__ == "__main__":
    for path in write_deploy_files():
        print(f"wrote {path}")
