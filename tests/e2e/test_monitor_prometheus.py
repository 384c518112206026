"""`rlpost monitor` with a real Prometheus (the distribution's `prometheus` package) watching a real
run: every query of the shipped dashboard and every alert expression of the shipped rules,
evaluated through Prometheus's HTTP API, and the stalled-run and stopped-run alerts firing once
the run stopped.

The run is a short one of the tiny model on a cluster of its own (`rlpost train --address`), with
an evaluation every 2 steps, an entropy term and the load policy set to grow an env pool at once,
so that every panel has its metric. Ray's
processes report every second (the fast_metrics fixture) and Prometheus scrapes every second.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from rlpost.ops import dashboards
from rlpost.ops.local_cluster import free_ports, head_node

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
RUN = "monitored"
STALL_AFTER_S = 10


def api(base: str, path: str, **params) -> dict:
    """Prometheus's HTTP API: the ``data`` of a successful answer; a failed one (a query that does
    not parse, 400 / 422) fails the test with Prometheus's error and the parameters."""
    url = f"{base}/api/v1/{path}?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{path} {params}: HTTP {exc.code}: {exc.read().decode()[:500]}") from None
    assert body["status"] == "success", body
    return body["data"]


def wait_for(what: str, probe, timeout_s: float, log: Path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(1)
    raise AssertionError(f"no {what} within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def test_prometheus_evaluates_every_panel_and_alert_of_a_real_run(tmp_path, tiny_model_path, fast_metrics):
    if shutil.which("prometheus") is None or shutil.which("promtool") is None:
        pytest.fail("the prometheus package is not installed: `apt-get install prometheus` (.ci/run installs it)")
    rules = dashboards.DEPLOY_DIR / dashboards.ALERTS_FILE
    checked = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True)
    assert checked.returncode == 0 and "SUCCESS: 5 rules found" in checked.stdout, checked.stdout + checked.stderr

    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env |= fast_metrics | {"RAY_AUTH_TOKEN_PATH": str(token)}
    (port,) = free_ports(1)
    base = f"http://127.0.0.1:{port}"
    with head_node(dashboard=True, env=env) as head:
        monitor_log = tmp_path / "monitor.log"
        with monitor_log.open("w") as out:
            watcher = subprocess.Popen(
                [sys.executable, "-m", "rlpost.ops.cli", "monitor", "--port", str(port), "--scrape-interval", "1",
                 "--ray-temp-dir", str(head.temp_dir), "--data-dir", str(tmp_path / "prometheus"), "--no-grafana",
                 "--stall-after", str(STALL_AFTER_S)],
                cwd=REPO, env=head.env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            started = time.time()
            text = wait_for("Prometheus start", lambda: "Ctrl-C stops it" in monitor_log.read_text(), 90, monitor_log)
            text = monitor_log.read_text()
            prometheus_pid = int(re.search(r"Prometheus at \S+ \(pid (\d+)", text).group(1))
            # the dashboard copied beside the ones Ray's dashboard wrote for its session
            grafana = head.temp_dir / "session_latest" / "metrics" / "grafana" / "dashboards"
            wait_for("the provisioned dashboard", lambda: (grafana / dashboards.DASHBOARD_FILE).is_file(), 30,
                     monitor_log)  # fmt: skip
            assert (grafana / "default_grafana_dashboard.json").is_file()

            run_log = tmp_path / "run.log"
            args = [
                sys.executable, "-m", "rlpost.ops.cli", "train", "configs/tiny-cpu.yaml",
                f"model.name_or_path={tiny_model_path}", "trainer.steps=10", "trainer.prompts_per_step=4",
                "eval.interval=2", "eval.num_prompts=8", "loss.entropy_coef=0.001", "logging.progress=false",
                # the load policy on, set to grow an env pool after the first step (its panels have data)
                "rollout.num_env_pools=1..2", "rollout.autoscale.enabled=true", "rollout.autoscale.window_steps=1",
                "rollout.autoscale.grow_wait=0.01", "rollout.autoscale.shrink_wait=0", "rollout.autoscale.busy_share=1",
                f"logging.run_dir={tmp_path}", f"logging.run_name={RUN}", "--address", head.gcs_address,
            ]  # fmt: skip
            with run_log.open("w") as out:
                run = subprocess.run(args, cwd=REPO, env=head.env, stdout=out, stderr=subprocess.STDOUT, timeout=400)
            assert run.returncode == 0, run_log.read_text()[-3000:]
            rows = [json.loads(line) for line in (tmp_path / RUN / "metrics.jsonl").read_text().splitlines()]
            assert len(rows) == 10
            assert rows[0]["autoscale_reason"] == "env_bound" and rows[0]["env_pools_target"] == 2, rows[0]

            # every panel's query returns data for the run over the run's time
            def series(expr: str) -> list:
                end = time.time()
                return api(base, "query_range", query=expr, start=started, end=end, step="1")["result"]

            empty = []
            for title, expr in dashboards.panel_queries():
                found = series(expr.replace("$run", RUN))
                if not found:
                    empty.append((title, expr))
                for one in found:
                    assert one["metric"].get("run") == RUN, (title, one["metric"])
            assert not empty, f"panel queries without data: {empty}"
            # the last reward Prometheus holds is the run's last line
            reward = series(f'ray_rlpost_reward_mean{{run="{RUN}"}}')[0]["values"][-1][1]
            assert float(reward) == pytest.approx(rows[-1]["reward_mean"], rel=1e-6)

            # every alert expression parses and evaluates; the stalled-run one fires on the stopped run
            for expr in dashboards.alert_expressions().values():
                api(base, "query", query=expr)
            groups = api(base, "rules", type="alert")["groups"]
            assert {r["name"] for g in groups for r in g["rules"]} == set(dashboards.alert_expressions())

            def firing(name: str):
                alerts = api(base, "alerts")["alerts"]
                return [a for a in alerts if a["labels"]["alertname"] == name
                        and a["labels"].get("run") == RUN and a["state"] == "firing"]  # fmt: skip

            (alert,) = wait_for("RlpostNoLearnerStep firing", lambda: firing("RlpostNoLearnerStep"),
                                STALL_AFTER_S + 60, monitor_log)  # fmt: skip
            assert alert["labels"]["severity"] == "warning"
            assert float(alert["value"]) > STALL_AFTER_S
            # the driver's series left Prometheus with its process: the stopped-run alert fires too
            wait_for("RlpostRunStopped firing", lambda: firing("RlpostRunStopped"), 60, monitor_log)
            assert not api(base, "query", query=f'ray_rlpost_policy_version{{run="{RUN}"}}')["result"]
        finally:
            watcher.send_signal(signal.SIGINT)
            code = watcher.wait(30)
        assert code == 0, monitor_log.read_text()
        assert "rlpost monitor: stopping" in monitor_log.read_text()
        with pytest.raises(ProcessLookupError):  # Prometheus stopped with it
            os.kill(prometheus_pid, 0)
