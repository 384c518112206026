"""``rlpost monitor``: a Prometheus (and Grafana, where installed) for the runs of one machine.

It starts the ``prometheus`` binary with Ray's scrape configuration (the node list Ray keeps in
``<ray temp dir>/prom_metrics_service_discovery.json``, so it may start before the cluster and
follows it across restarts) and rlpost's alert rules (:mod:`rlpost.ops.dashboards`); it copies
rlpost's dashboard beside Ray's and starts Grafana with Ray's configuration when ``grafana`` is on
PATH. Ctrl-C (or SIGTERM) stops what it started, which the kernel also stops should the command
be killed.

Ray's dashboard charts its Metrics tab from the Prometheus at ``RAY_PROMETHEUS_HOST`` (default
http://localhost:9090, the port this command takes by default) and the Grafana at
``RAY_GRAFANA_HOST`` (default http://localhost:3000, Grafana's own default).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

from rlpost.config import ConfigError
from rlpost.ops import dashboards
from rlpost.runtime.shutdown import die_with_parent

DISCOVERY_FILE = "prom_metrics_service_discovery.json"  # Ray's name for its node list
PROMETHEUS_INSTALL = (
    "install it with `sudo apt-get install prometheus` (Debian, Ubuntu) or from https://prometheus.io/download/, "
    "or name the binary with --prometheus PATH"
)
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


def default_ray_temp_dir() -> Path:
    """Where a local Ray cluster keeps its files: Ray's default, ``$RAY_TMPDIR/ray`` or ``/tmp/ray``."""
    return Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray"


@dataclasses.dataclass
class MonitorSettings:
    """What ``rlpost monitor`` starts, and how."""

    run_dir: Path | None = None  # a run to point the URLs at; its Prometheus data goes in RUN_DIR/prometheus
    port: int = 9090  # Prometheus's port on 127.0.0.1 (Ray's dashboard looks at 9090)
    scrape_interval_s: float = 10.0  # Ray's own configuration scrapes every 10 s
    ray_temp_dir: Path = dataclasses.field(default_factory=default_ray_temp_dir)
    data_dir: Path | None = None  # Prometheus's storage; default RUN_DIR/prometheus, else a temporary folder
    prometheus: str = "prometheus"  # the binary (a name on PATH or a path)
    grafana: str | None = "grafana"  # None: never start Grafana
    grafana_home: Path = Path("/usr/share/grafana")  # Grafana's --homepath (its packages install there)
    grafana_port: int = 3000  # Grafana's default, where Ray's dashboard looks for it (RAY_GRAFANA_HOST)
    alerts: dashboards.AlertSettings = dataclasses.field(default_factory=dashboards.AlertSettings)


def run_name_of(run_dir: Path) -> str:
    """``logging.run_name`` of the run in ``run_dir`` (its ``config.yaml``)."""
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise ConfigError(f"{run_dir} is not a run directory: it has no config.yaml")
    name = ((yaml.safe_load(config.read_text()) or {}).get("logging") or {}).get("run_name")
    if not name:
        raise ConfigError(f"{config} has no logging.run_name")
    return str(name)


def prometheus_config(settings: MonitorSettings, rules: Path) -> dict:
    """Prometheus's configuration: Ray's scrape job over its node list, and rlpost's rules."""
    interval = f"{max(settings.scrape_interval_s, 1):g}s"
    discovery = settings.ray_temp_dir / DISCOVERY_FILE
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": "ray", "file_sd_configs": [{"files": [str(discovery)], "refresh_interval": "5s"}]}
        ],
    }


def find_binary(name: str, what: str, install: str) -> str:
    """The path of ``name`` (on PATH, or a path); a ConfigError saying how to install it."""
    found = shutil.which(name)
    if found is None:
        raise ConfigError(f"{what} not found ({name!r} is not an executable on PATH): {install}")
    return found


def check_port_free(port: int, what: str, option: str, hint: str = "") -> None:
    """A ConfigError naming ``option`` when something listens on ``port`` of 127.0.0.1."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            raise ConfigError(
                f"port {port} on 127.0.0.1 is taken (another {what}?{hint}); pick another with {option}"
            ) from None


def grafana_folder(ray_temp_dir: Path) -> Path:
    """The Grafana configuration Ray's dashboard writes for its latest session."""
    return ray_temp_dir / "session_latest" / "metrics" / "grafana"


def provision_dashboard(ray_temp_dir: Path, board: Path) -> Path | None:
    """Copy the dashboard file ``board`` into the Grafana dashboards folder of Ray's latest
    session (which Ray's dashboard writes anew at each cluster start); the path written, None
    without a session."""
    folder = grafana_folder(ray_temp_dir) / "dashboards"
    if not folder.is_dir():
        return None
    target = folder / board.name
    if not target.exists():
        shutil.copyfile(board, target)
    return target


def grafana_command(binary: str, settings: MonitorSettings, data_dir: Path) -> list[str] | None:
    """Grafana's command line on Ray's configuration (its provisioning lists Ray's dashboards and
    rlpost's), keeping its data in ``data_dir``; None while no Ray session wrote one."""
    ini = grafana_folder(settings.ray_temp_dir) / "grafana.ini"
    if not ini.is_file():
        return None
    return [
        binary,
        "server",
        f"--config={ini}",
        f"--homepath={settings.grafana_home}",
        f"cfg:paths.data={data_dir / 'grafana'}",
        "cfg:server.http_addr=127.0.0.1",
        f"cfg:server.http_port={settings.grafana_port}",
    ]


def _get(url: str, timeout_s: float = 5.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read().decode()
    except OSError:
        return None


def wait_until_ready(process: subprocess.Popen, url: str, log: Path, what: str) -> None:
    """Wait until ``url`` answers; a process that exits first, or a timeout, raises with its log's tail."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} while starting: {_tail(log)}")
        if _get(url, timeout_s=2.0) is not None:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not answer {url} within {START_TIMEOUT_S:g} s: {_tail(log)}")


def _tail(log: Path, lines: int = 8) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    return " | ".join(text[-lines:]) or f"nothing in {log}"


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after STOP_TIMEOUT_S."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(STOP_TIMEOUT_S)


def graph_url(base: str, expr: str) -> str:
    return f"{base}/graph?" + urllib.parse.urlencode({"g0.expr": expr, "g0.tab": "0", "g0.range_input": "1h"})


@contextlib.contextmanager
def _stop_on_sigterm() -> Iterator[threading.Event]:
    """An event set by SIGTERM (and by SIGINT, Ctrl-C) while the block runs."""
    stop = threading.Event()
    handler = lambda *_: stop.set()  # noqa: E731
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run_monitor(settings: MonitorSettings, say: Callable[[str], None] = print) -> int:
    """Start Prometheus (and Grafana), print the URLs, wait for SIGTERM / Ctrl-C, stop them.
    Returns 0, or 1 when Prometheus exited on its own."""
    run_name = run_name_of(settings.run_dir) if settings.run_dir is not None else None
    prometheus = find_binary(settings.prometheus, "Prometheus", PROMETHEUS_INSTALL)
    check_port_free(
        settings.port, "Prometheus", "--port", " a distribution's service starts one: `sudo systemctl stop prometheus`"
    )
    with contextlib.ExitStack() as stack:
        if settings.data_dir is not None:
            work = settings.data_dir
        elif settings.run_dir is not None:
            work = settings.run_dir / "prometheus"
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rlpost-monitor-")))
        work.mkdir(parents=True, exist_ok=True)
        board, rules, _ = dashboards.write_files(work, settings.alerts)  # the service's board: deploy/monitoring
        config = work / "prometheus.yml"
        config.write_text(yaml.safe_dump(prometheus_config(settings, rules), sort_keys=False))
        base = f"http://127.0.0.1:{settings.port}"
        log = work / "prometheus.log"
        with log.open("w") as out:
            process = subprocess.Popen(
                [prometheus, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
                 f"--web.listen-address=127.0.0.1:{settings.port}"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
            )  # fmt: skip
        stack.callback(stop_process, process)
        wait_until_ready(process, f"{base}/-/ready", log, "Prometheus")
        say(f"rlpost monitor: Prometheus at {base} (pid {process.pid}; data and log in {work})")
        say(f"rlpost monitor: scraping the Ray nodes listed in {settings.ray_temp_dir / DISCOVERY_FILE}")
        say(f"rlpost monitor: alerts at {base}/alerts (rules: {rules})")
        if run_name is not None:
            say(
                f"rlpost monitor: run {run_name}: {graph_url(base, f'ray_rlpost_reward_mean{{run={json.dumps(run_name)}}}')}"
            )
        if settings.port != 9090:
            say(f"rlpost monitor: Ray's dashboard charts from it when Ray starts with RAY_PROMETHEUS_HOST={base}")
        if settings.grafana is not None and shutil.which(settings.grafana) is not None:
            _start_grafana(settings, stack, work, board, say)
        elif settings.grafana is not None:
            say("rlpost monitor: Grafana is not installed (https://grafana.com/docs/grafana/latest/setup-grafana/"
                "installation/); Prometheus's own pages chart every query of the dashboard")  # fmt: skip
        say("rlpost monitor: Ctrl-C stops it")
        with _stop_on_sigterm() as stop:
            while not stop.wait(2.0):
                provision_dashboard(settings.ray_temp_dir, board)  # a cluster (re)started since
                if process.poll() is not None:
                    say(f"rlpost monitor: Prometheus exited with code {process.returncode}: {_tail(log)}")
                    return 1
        say("rlpost monitor: stopping")
    return 0


def _start_grafana(settings: MonitorSettings, stack: contextlib.ExitStack, work: Path, board: Path,
                   say: Callable[[str], None]) -> None:  # fmt: skip
    """Start Grafana (its binary on PATH) on Ray's configuration, with ``board`` provisioned beside
    Ray's dashboards, when a Ray session wrote that configuration."""
    command = grafana_command(shutil.which(settings.grafana), settings, work)
    if command is None or provision_dashboard(settings.ray_temp_dir, board) is None:
        say(f"rlpost monitor: no Ray session in {settings.ray_temp_dir} yet: Grafana not started (start the "
            "cluster or the run first)")  # fmt: skip
        return
    check_port_free(settings.grafana_port, "Grafana", "--grafana-port")
    log = work / "grafana.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
        )
    stack.callback(stop_process, process)
    base = f"http://127.0.0.1:{settings.grafana_port}"
    wait_until_ready(process, f"{base}/api/health", log, "Grafana")
    say(f"rlpost monitor: Grafana at {base}/d/{dashboards.DASHBOARD_UID} (pid {process.pid}; Ray's dashboards "
        "in its Ray folder)")  # fmt: skip
