"""rlpost's Grafana dashboard and Prometheus alert rules, written from the metrics the run exports.

Prometheus scrapes the roles' Ray metrics (:mod:`rlpost.record.metrics`) with Ray's ``ray_``
prefix and labels, plus rlpost's ``run`` (and ``actor``). This module writes three files:

- the dashboard (``DASHBOARD_FILE``), built with Grafana's Foundation SDK: one row per view
  (training, throughput, pipeline, weight sync, workers), every panel filtered by the ``run``
  variable and reading the ``datasource`` variable, as Ray's own dashboards do;
- ``rlpost serve``'s dashboard (``SERVE_DASHBOARD_FILE``): its tenants (requests, errors, queue
  depth, tokens, share of each actor's time; the ``tenant`` variable) and what it holds;
- the alert rules (``ALERTS_FILE``), a Prometheus rule group: a run with no learner step, a
  restart storm, drifting weight syncs, a run whose metrics stopped, reward collapse.

``deploy/monitoring/`` holds the three with the default settings, and the rules as a Prometheus
Operator ``PrometheusRule`` (``python -m rlpost.ops.dashboards`` rewrites the four; a test checks
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
        _gauges("percentunit", "Load", "The load policy's signals (rollout.autoscale): the share of the step the "
                "learner waited for data, and the engines' busy share of the generating time.",
                "autoscale_wait_share", "autoscale_engine_busy"),
        Panel("Load policy decisions",
              "The load policy's resizes in the last 5 minutes, by role and reason (engines_bound, env_bound: "
              "grown; learner_bound: shrunk; no_gain, no_room: a grow undone).",
              ((f"sum by (run, role, reason) (increase({metric('autoscale_decisions_total')}[5m]))",
                "{{role}} {{reason}} {{run}}"),)),
        _gauges("percentunit", "Tool errors", "Share of the step's tool calls that failed.", "tool_error_fraction"),
        _gauges("short", "Reward-function errors", "Failed reward computations in the step's batches.",
                "reward_errors"),
    ],
}
# fmt: on


# ``rlpost serve``'s dashboard (rlpost.record.metrics.ServiceMetrics), filtered by tenant.
SERVE_DASHBOARD_UID = "rlpost-serve"
SERVE_DASHBOARD_FILE = "rlpost_serve_grafana_dashboard.json"
TENANT = '{tenant=~"$tenant"}'  # the service dashboard's filter: the tenants picked in its `tenant` variable


def _per_tenant(title: str, description: str, counter: str, by: str = "tenant", unit: str = "short") -> Panel:
    """A panel of a service counter's rate per second, one line per tenant (and ``by``'s other labels)."""
    legend = " ".join(f"{{{{{label.strip()}}}}}" for label in by.split(","))
    return Panel(title, description, ((f"sum by ({by}) (rate(ray_rlpost_serve_{counter}_total{TENANT}[1m]))",
                                       legend),), unit)  # fmt: skip


def _serve_gauges(title: str, description: str, *names: str, unit: str = "short") -> Panel:
    return Panel(title, description, tuple((f"sum(ray_rlpost_serve_{n})", n) for n in names), unit)


# fmt: off
SERVE_ROWS: dict[str, list[Panel]] = {
    "Tenants": [
        _per_tenant("Requests per second", "Requests accepted per second, by tenant and kind.", "requests",
                    "tenant, kind"),
        _per_tenant("Errors per second", "Failed requests per second, by tenant and category (user: the client's "
                    "mistake; server: the service's).", "request_errors", "tenant, category"),
        Panel("Queue depth", "Requests each tenant has accepted and not finished (bounded by "
              "max_pending_per_tenant; past it the tenant is told to try again later).",
              ((f"sum by (tenant) (ray_rlpost_serve_tenant_pending{TENANT})", "{{tenant}}"),)),
        _per_tenant("Tokens trained per second", "Tokens of forward and forward_backward requests per second.",
                    "tokens_trained"),
        _per_tenant("Tokens sampled per second", "Tokens sampled per second.", "tokens_sampled"),
        Panel("Share of each actor's time",
              "Share of the trainer's and each engine's busy time spent on each tenant's calls (with K tenants "
              "busy, fair queuing gives each 1/K).",
              ((f"sum by (tenant, actor) (rate(ray_rlpost_serve_busy_seconds_total{TENANT}[1m])) / ignoring(tenant) "
                "group_left sum by (actor) (rate(ray_rlpost_serve_busy_seconds_total[1m]))", "{{tenant}} {{actor}}"),),
              "percentunit"),
    ],
    "Service": [
        _serve_gauges("Sessions, models, samplers", "What clients hold now, and the requests accepted and not "
                      "finished.", "sessions", "models", "samplers", "pending_requests"),
        Panel("Trainer adapters", "Client models' adapters in the trainer's model (resident), parked in its memory "
              "and in files (adapters.trainer_resident, trainer_in_memory).",
              (("sum by (where) (ray_rlpost_serve_trainer_adapters)", "{{where}}"),)),
        _serve_gauges("Engine log-prob difference", "Largest log-prob difference between an engine and the trainer "
                      "at the last parity check of an adapter snapshot (above parity_warn: the engine samples from "
                      "another model than the one trained).", "logprob_diff"),
    ],
}
# fmt: on


def panel_queries(rows: dict[str, list[Panel]] | None = None) -> list[tuple[str, str]]:
    """Every ``(panel title, PromQL)`` of a dashboard's rows (the run dashboard's by default)."""
    rows = ROWS if rows is None else rows
    return [(panel.title, expr) for panels in rows.values() for panel in panels for expr, _ in panel.queries]


# ------------------------------------------------------------------------------------- dashboard


def dashboard() -> dict[str, Any]:
    """The run dashboard as a JSON object (Grafana's dashboard model)."""
    return _board("rlpost", DASHBOARD_UID, "An rlpost run: training, throughput, pipeline, weight sync and workers, "
                  "per run", ("run", "Run", "logging.run_name of the runs shown", "ray_rlpost_policy_version"), ROWS)  # fmt: skip


def serve_dashboard() -> dict[str, Any]:
    """``rlpost serve``'s dashboard: its tenants' requests, errors, queues, tokens and shares of the
    actors' time, and what the service holds."""
    return _board("rlpost serve", SERVE_DASHBOARD_UID, "An rlpost service: each tenant's requests, errors, queue, "
                  "tokens and share of the actors' time; the sessions, models and adapters it holds",
                  ("tenant", "Tenant", "The tenants shown (the names the API keys map to)",
                   "ray_rlpost_serve_requests_total"), SERVE_ROWS)  # fmt: skip


def _board(title: str, uid: str, description: str, variable: tuple[str, str, str, str],
           rows: dict[str, list[Panel]]) -> dict[str, Any]:  # fmt: skip
    """A dashboard of ``rows``, with a data-source variable and ``variable`` = (name, label,
    description, the metric whose label of that name lists its values)."""
    from grafana_foundation_sdk.builders import dashboard as gd
    from grafana_foundation_sdk.builders import prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort

    name, label, about, listed_by = variable
    source = DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (
        gd.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["rlpost", "ray"])
        .editable()
        .refresh("10s")
        .time("now-1h", "now")
        .with_variable(gd.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            gd.QueryVariable(name)
            .label(label)
            .description(about)
            .datasource(source)
            .query(f"label_values({listed_by}, {name})")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_DESC)
            .multi(True)
            .include_all(True)
        )
    )
    for row, panels in rows.items():
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
    """Write the run dashboard, the alert rules and the service dashboard into ``folder``; returns
    their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    board, rules, serve = folder / DASHBOARD_FILE, folder / ALERTS_FILE, folder / SERVE_DASHBOARD_FILE
    board.write_text(json.dumps(dashboard(), indent=2, sort_keys=True) + "\n")
    rules.write_text(_HEADER + yaml.safe_dump(alert_rules(settings), sort_keys=False, width=120))
    serve.write_text(json.dumps(serve_dashboard(), indent=2, sort_keys=True) + "\n")
    return [board, rules, serve]


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
