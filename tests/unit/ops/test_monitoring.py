"""rlpost's Grafana dashboard and alert rules (rlpost.ops.dashboards) and `rlpost monitor`'s pieces
(rlpost.ops.prometheus): the shipped files are the generator's, every query reads a metric the code
exports, and the command's errors name what to do. A real Prometheus evaluating every query of a
real run is tests/e2e/test_monitor_prometheus.py (long tier)."""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
from pathlib import Path

import pytest
import yaml

from rlpost.config import ConfigError
from rlpost.ops import dashboards, prometheus
from rlpost.ops.cli import main
from rlpost.record.metrics import RayMetrics, RoleMetrics, ServiceMetrics

pytestmark = pytest.mark.unit


def exported_names() -> set[str]:
    """Every metric name the code exports, as Prometheus shows it (Ray's prefix; counters with _total)."""
    names = {f"ray_rlpost_{k}" for k in RayMetrics.GAUGES} | {f"ray_rlpost_{k}_total" for k in RayMetrics.COUNTERS}
    names.add(f"ray_rlpost_{RayMetrics.DECISIONS}_total")
    for role, (gauges, counters) in RoleMetrics.ROLES.items():
        names |= {f"ray_rlpost_{role}_{k}" for k in gauges} | {f"ray_rlpost_{role}_{k}_total" for k in counters}
    service = [*ServiceMetrics.GAUGES, *ServiceMetrics.TENANT_GAUGES, ServiceMetrics.ADAPTERS]
    names |= {f"ray_rlpost_{k}" for k in service} | {f"ray_rlpost_{k}_total" for k in ServiceMetrics.COUNTERS}
    return names


def test_the_deploy_files_are_the_generators(tmp_path):
    written = dashboards.write_deploy_files(tmp_path)
    assert [p.name for p in written] == [dashboards.DASHBOARD_FILE, dashboards.ALERTS_FILE,
                                         dashboards.SERVE_DASHBOARD_FILE, dashboards.PROMETHEUS_RULE_FILE]  # fmt: skip
    for path in written:
        shipped = dashboards.DEPLOY_DIR / path.name
        assert shipped.read_text() == path.read_text(), f"{shipped} is out of date: run python -m rlpost.ops.dashboards"


def test_every_panel_and_alert_reads_metrics_the_code_exports():
    exported = exported_names()
    exprs = [expr for _, expr in dashboards.panel_queries() + dashboards.panel_queries(dashboards.SERVE_ROWS)]
    exprs += list(dashboards.alert_expressions().values())
    for expr in exprs:
        for name in re.findall(r"\bray_rlpost_\w+", expr):
            assert name in exported, (name, expr)
    restarts = {n for n in exported if n.startswith("ray_rlpost_restarts_")}
    assert restarts == {f"ray_rlpost_restarts_{r}" for r in dashboards.RESTART_ROLES}  # the storm counts them all


def test_the_dashboard_covers_each_view_filtered_by_run():
    board = dashboards.dashboard()
    assert board["uid"] == dashboards.DASHBOARD_UID
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["run"]["query"] == "label_values(ray_rlpost_policy_version, run)"
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == ["Training", "Throughput", "Pipeline", "Weight sync", "Workers"]
    panels = [p for p in board["panels"] if p["type"] == "timeseries"]
    titles = {p["title"] for p in panels}
    for wanted in ("Reward", "Evaluation", "Loss", "KL", "Clip fraction", "Entropy", "Response length",
                   "Samples per second", "Tokens per second", "Step time", "Buffer", "Staleness", "Groups dropped",
                   "In-flight tokens", "Sync time", "Bytes per sync", "Route", "Sync log-prob difference",
                   "Generation rate", "Restarts", "Tool errors", "Reward-function errors"):  # fmt: skip
        assert wanted in titles, wanted
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert 'run=~"$run"' in target["expr"], (panel["title"], target["expr"])
    step_time = next(p for p in panels if p["title"] == "Step time")
    assert [t["expr"] for t in step_time["targets"]] == [
        f'ray_rlpost_{k}{{run=~"$run"}}' for k in ("step_time_s", "collect_s", "train_s", "weight_sync_s")
    ]


def test_the_service_dashboard_shows_each_tenant_and_what_the_service_holds():
    board = dashboards.serve_dashboard()
    assert board["uid"] == dashboards.SERVE_DASHBOARD_UID
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["tenant"]["query"] == "label_values(ray_rlpost_serve_requests_total, tenant)"
    assert [p["title"] for p in board["panels"] if p["type"] == "row"] == ["Tenants", "Service"]
    titles = [p["title"] for p in board["panels"] if p["type"] == "timeseries"]
    assert titles == ["Requests per second", "Errors per second", "Queue depth", "Tokens trained per second",
                      "Tokens sampled per second", "Share of each actor's time", "Sessions, models, samplers",
                      "Trainer adapters", "Engine log-prob difference"]  # fmt: skip
    for title, expr in dashboards.panel_queries({"Tenants": dashboards.SERVE_ROWS["Tenants"]}):
        assert 'tenant=~"$tenant"' in expr, (title, expr)


def test_alert_rules_take_their_thresholds():
    settings = dashboards.AlertSettings(stall_after_s=15, restarts=5, restart_window_s=120, sync_logprob_diff=1e-4)
    rules = {r["alert"]: r for r in dashboards.alert_rules(settings)["groups"][0]["rules"]}
    assert set(rules) == {"RlpostNoLearnerStep", "RlpostRunStopped", "RlpostRestartStorm", "RlpostSyncDrift",
                          "RlpostRewardCollapse"}  # fmt: skip
    assert rules["RlpostNoLearnerStep"]["expr"].endswith("> 15")
    assert rules["RlpostRestartStorm"]["expr"].endswith("(delta(ray_rlpost_restarts_buffer[120s])) >= 5")
    assert rules["RlpostSyncDrift"]["expr"].endswith("> 0.0001")
    assert all(r["labels"]["severity"] in ("info", "warning", "critical") for r in rules.values())
    shipped = yaml.safe_load((dashboards.DEPLOY_DIR / dashboards.ALERTS_FILE).read_text())
    assert shipped == dashboards.alert_rules()  # the shipped file holds the defaults
    rule = yaml.safe_load((dashboards.DEPLOY_DIR / dashboards.PROMETHEUS_RULE_FILE).read_text())
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"] == shipped


def test_prometheus_config_scrapes_rays_node_list_with_the_rules(tmp_path):
    settings = prometheus.MonitorSettings(ray_temp_dir=tmp_path / "ray", scrape_interval_s=1.0)
    config = prometheus.prometheus_config(settings, tmp_path / "rules.yml")
    assert config["global"] == {"scrape_interval": "1s", "evaluation_interval": "1s"}
    assert config["rule_files"] == [str(tmp_path / "rules.yml")]
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "ray"
    assert job["file_sd_configs"][0]["files"] == [str(tmp_path / "ray" / "prom_metrics_service_discovery.json")]


def test_run_name_comes_from_the_run_directory(tmp_path):
    (tmp_path / "config.yaml").write_text("logging:\n  run_name: exp-7\n")
    assert prometheus.run_name_of(tmp_path) == "exp-7"
    with pytest.raises(ConfigError, match="has no config.yaml"):
        prometheus.run_name_of(tmp_path / "missing")


def test_a_missing_prometheus_names_the_install_command(capsys):
    code = main(["monitor", "--prometheus", "/nonexistent/prometheus"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Prometheus not found" in err and "apt-get install prometheus" in err


def test_a_taken_port_and_bad_options_are_input_errors(capsys, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1 is taken .*pick another with --grafana-port"):
            prometheus.check_port_free(port, "Grafana", "--grafana-port")
    assert main(["monitor", "--port", "70000"]) == 2
    assert main(["monitor", str(tmp_path / "no-such-run")]) == 2
    assert "does not exist" in capsys.readouterr().err


def ray_session(temp_dir: Path) -> Path:
    """The Grafana folder a Ray session's dashboard writes: grafana.ini and dashboards/."""
    grafana = temp_dir / "session_latest" / "metrics" / "grafana"
    (grafana / "dashboards").mkdir(parents=True)
    (grafana / "grafana.ini").write_text("[paths]\n")
    return grafana


def test_the_dashboard_is_provisioned_beside_rays(tmp_path):
    board, _, _ = dashboards.write_files(tmp_path / "work")
    assert prometheus.provision_dashboard(tmp_path, board) is None  # no session yet
    grafana = ray_session(tmp_path)
    path = prometheus.provision_dashboard(tmp_path, board)
    assert path == grafana / "dashboards" / dashboards.DASHBOARD_FILE
    assert json.loads(path.read_text())["uid"] == dashboards.DASHBOARD_UID
    settings = prometheus.MonitorSettings(ray_temp_dir=tmp_path, grafana_port=3123)
    command = prometheus.grafana_command("/usr/sbin/grafana", settings, tmp_path / "work")
    assert command[:3] == ["/usr/sbin/grafana", "server", f"--config={grafana / 'grafana.ini'}"]
    assert "cfg:server.http_port=3123" in command and f"cfg:paths.data={tmp_path / 'work' / 'grafana'}" in command


FAKE_PROMETHEUS = """\
#!{python}
# answers every GET (Prometheus's /-/ready, Grafana's /api/health) on the port of its command
# line (Prometheus's --web.listen-address, Grafana's cfg:server.http_port) and records its arguments
import http.server, sys, pathlib
args = sys.argv[1:]
pathlib.Path({record!r}).write_text("\\n".join(args))
port = int(next(a for a in args if a.startswith(("--web.listen-address=", "cfg:server.http_port="))).rsplit(":", 1)[-1]
           .rsplit("=", 1)[-1])
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ready")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Ready).serve_forever()
"""


def test_monitor_starts_prometheus_on_its_config_and_stops_it(tmp_path, monkeypatch):
    """The lifecycle with a stand-in binary (the real one: the long tier): the config and rules it
    writes, the URLs it prints, and the process it stops when told to."""
    import psutil

    from rlpost.ops.local_cluster import free_ports

    record = tmp_path / "args"
    binary = tmp_path / "prometheus"
    binary.write_text(FAKE_PROMETHEUS.format(python=sys.executable, record=str(record)))
    binary.chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("logging:\n  run_name: exp-7\n")
    (port,) = free_ports(1)
    settings = prometheus.MonitorSettings(run_dir=run_dir, port=port, ray_temp_dir=tmp_path / "ray",
                                       prometheus=str(binary), grafana=None)  # fmt: skip
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        if line.endswith("Ctrl-C stops it"):  # started: ask it to stop, as SIGTERM would
            monitor_stop.set()

    monitor_stop = threading.Event()
    monkeypatch.setattr(prometheus, "_stop_on_sigterm", lambda: _Yield(monitor_stop))
    assert prometheus.run_monitor(settings, say=say) == 0
    args = record.read_text().splitlines()
    work = run_dir / "prometheus"
    assert f"--config.file={work / 'prometheus.yml'}" in args and f"--storage.tsdb.path={work / 'data'}" in args
    config = yaml.safe_load((work / "prometheus.yml").read_text())
    assert config["rule_files"] == [str(work / dashboards.ALERTS_FILE)]
    assert (work / dashboards.ALERTS_FILE).read_text() == (dashboards.DEPLOY_DIR / dashboards.ALERTS_FILE).read_text()
    text = "\n".join(lines)
    assert f"Prometheus at http://127.0.0.1:{port}" in text and "/alerts" in text
    assert "ray_rlpost_reward_mean%7Brun%3D%22exp-7%22%7D" in text  # the run's reward, URL-encoded
    assert "RAY_PROMETHEUS_HOST" in text  # not on 9090: how Ray's dashboard finds it
    pid = int(re.search(r"pid (\d+)", text).group(1))
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


class _Yield:
    """A context manager yielding ``value`` (stands in for the signal handlers)."""

    def __init__(self, value):
        self.value = value

    def __enter__(self):
        return self.value

    def __exit__(self, *exc):
        return False


def test_the_monitor_command_line_documents_its_options():
    from rlpost.ops.cli import _build_parser

    sub = next(a for a in _build_parser()._actions if a.dest == "command")
    help_text = sub.choices["monitor"].format_help()
    for option in ("--port", "--scrape-interval", "--ray-temp-dir", "--data-dir", "--prometheus", "--no-grafana",
                   "--grafana-port", "--stall-after"):  # fmt: skip
        assert option in help_text, option


def test_the_pod_monitor_scrapes_every_ray_pod_of_the_clusters():
    deploy = dashboards.DEPLOY_DIR.parent
    (monitor_spec,) = yaml.safe_load_all((dashboards.DEPLOY_DIR / "podmonitor.yaml").read_text())
    assert (monitor_spec["apiVersion"], monitor_spec["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    wanted = monitor_spec["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor_spec["spec"]["podMetricsEndpoints"]
    (cluster,) = yaml.safe_load_all((deploy / "raycluster.yaml").read_text())
    (job,) = yaml.safe_load_all((deploy / "rayjob.yaml").read_text())
    for spec in (cluster["spec"], job["spec"]["rayClusterSpec"]):
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            template = group["template"]
            assert wanted.items() <= template["metadata"]["labels"].items()
            ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c["ports"]}
            assert ports[endpoint["port"]] == int(group["rayStartParams"]["metrics-export-port"])


@pytest.mark.parametrize("stop", ["SIGINT", "SIGKILL"])
def test_what_the_command_started_ends_with_it_even_when_it_is_killed(tmp_path, stop):
    """`rlpost monitor` as a user runs it: Ctrl-C (SIGINT) stops Prometheus and exits 0; a monitor
    killed by SIGKILL takes its Prometheus with it (the kernel's parent-death signal)."""
    import os
    import signal
    import subprocess
    import time

    import psutil

    from rlpost.ops.local_cluster import free_ports

    binary = tmp_path / "prometheus"
    binary.write_text(FAKE_PROMETHEUS.format(python=sys.executable, record=str(tmp_path / "args")))
    binary.chmod(0o755)
    (port,) = free_ports(1)
    log = tmp_path / "prometheus.log"
    with log.open("w") as out:
        command = subprocess.Popen(
            [sys.executable, "-m", "rlpost.ops.cli", "monitor", "--prometheus", str(binary), "--port", str(port),
             "--ray-temp-dir", str(tmp_path / "ray"), "--data-dir", str(tmp_path / "work"), "--no-grafana"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while "Ctrl-C stops it" not in log.read_text():
        assert command.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    pid = int(re.search(r"Prometheus at \S+ \(pid (\d+)", log.read_text()).group(1))
    os.kill(command.pid, getattr(signal, stop))
    code = command.wait(30)
    if stop == "SIGINT":
        assert code == 0 and "rlpost monitor: stopping" in log.read_text(), log.read_text()
    else:
        assert code == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"Prometheus (pid {pid}) outlived the monitor"
        time.sleep(0.1)


def test_grafana_starts_on_rays_configuration_when_it_is_installed(tmp_path, monkeypatch):
    from rlpost.ops.local_cluster import free_ports

    binaries = {}
    for name in ("prometheus", "grafana"):
        binaries[name] = tmp_path / name
        binaries[name].write_text(FAKE_PROMETHEUS.format(python=sys.executable, record=str(tmp_path / f"{name}.args")))
        binaries[name].chmod(0o755)
    grafana_dir = ray_session(tmp_path / "ray")
    prometheus_port, grafana_port = free_ports(2)
    settings = prometheus.MonitorSettings(port=prometheus_port, ray_temp_dir=tmp_path / "ray", data_dir=tmp_path / "work",
                                       prometheus=str(binaries["prometheus"]), grafana=str(binaries["grafana"]),
                                       grafana_port=grafana_port)  # fmt: skip
    lines: list[str] = []
    stop = threading.Event()

    def say(line: str) -> None:
        lines.append(line)
        if line.endswith("Ctrl-C stops it"):
            stop.set()

    monkeypatch.setattr(prometheus, "_stop_on_sigterm", lambda: _Yield(stop))
    assert prometheus.run_monitor(settings, say=say) == 0
    args = (tmp_path / "grafana.args").read_text().splitlines()
    assert args[:2] == ["server", f"--config={grafana_dir / 'grafana.ini'}"]
    assert f"cfg:server.http_port={grafana_port}" in args
    assert (grafana_dir / "dashboards" / dashboards.DASHBOARD_FILE).is_file()
    assert any(f"Grafana at http://127.0.0.1:{grafana_port}/d/{dashboards.DASHBOARD_UID}" in line for line in lines)
    assert not any("not installed" in line for line in lines)
