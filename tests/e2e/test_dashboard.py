"""A local `rlpost train` with Ray's dashboard: the start line gives the dashboard's URL, the
namespace and the metrics URL; the dashboard's state API lists the run's named actors and the
node's Prometheus endpoint serves the run's ``rlpost_*`` metrics, tagged with the run's name."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
START_LINE = re.compile(
    r"^rlpost: Ray dashboard at (?P<dashboard>http://127\.0\.0\.1:\d+) \(namespace (?P<namespace>\S+)\); "
    r"metrics at (?P<metrics>http://127\.0\.0\.1:\d+/metrics)",
    re.M,
)
RUN_ACTORS = {"inference-0", "learner", "env-pool-0", "buffer"}


def wait_for(what: str, probe, timeout_s: float, process: subprocess.Popen, stderr: Path):
    """Call ``probe()`` every 2 s until it returns something other than None, and return that;
    fail when ``timeout_s`` passes or the run's process ends first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the run ended ({process.returncode}) before {what}:\n{stderr.read_text()[-3000:]}")
        found = probe()
        if found is not None:
            return found
        time.sleep(2)
    pytest.fail(f"no {what} within {timeout_s} s:\n{stderr.read_text()[-3000:]}")


def dashboard_headers() -> dict[str, str]:
    """The bearer token Ray's dashboard asks for under token authentication (Ray's default for a
    new local cluster): RAY_AUTH_TOKEN, else the file at RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token
    (which the run's ``ray.init`` writes when it is missing). No header when there is no token."""
    token = os.environ.get("RAY_AUTH_TOKEN")
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if not token and path.is_file():
        token = path.read_text().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def fetch(url: str, headers: dict[str, str] | None = None) -> str | None:
    """The body of a GET, or None while the server does not serve it yet (connection refused, or
    an HTTP error other than 401 and 403: those, a missing or wrong token, fail the test at once)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as response:
            return response.read().decode()
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise AssertionError(f"{url} answered {exc.code}: {exc.read().decode()[:300]}") from None
        return None
    except OSError:
        return None


def alive_actors(dashboard: str, namespace: str) -> dict[str, dict] | None:
    """The ALIVE named actors of ``namespace`` by name, from the dashboard's state API (rows of
    ``GET /api/v0/actors`` filtered on ray_namespace); None until all of RUN_ACTORS are there."""
    query = urllib.parse.urlencode(
        {"limit": 1000, "filter_keys": "ray_namespace", "filter_predicates": "=", "filter_values": namespace}
    )
    body = fetch(f"{dashboard}/api/v0/actors?{query}", dashboard_headers())
    if body is None:
        return None
    reply = json.loads(body)
    assert reply["result"] is True, reply.get("msg")
    rows = reply["data"]["result"]["result"]
    named = {row["name"]: row for row in rows if row.get("name") and row["state"] == "ALIVE"}
    return named if RUN_ACTORS <= set(named) else None


def run_samples(metrics_url: str, run_name: str) -> dict[str, float] | None:
    """``{metric name: value}`` of the samples tagged ``run="<run_name>"`` on the Prometheus
    endpoint (Ray shows the names with its ``ray_`` prefix); None until the driver's
    ``rlpost_policy_version`` gauge is there (Ray exports every few seconds)."""
    text = fetch(metrics_url)
    if text is None:
        return None
    samples = {}
    for match in re.finditer(r"^(ray_rlpost_\w+)\{([^}]*)\} (\S+)(?: \d+)?$", text, re.M):
        if f'run="{run_name}"' in match.group(2):
            samples[match.group(1)] = float(match.group(3))
    return samples if "ray_rlpost_policy_version" in samples else None


def stop_run(process: subprocess.Popen) -> None:
    """SIGTERM (the run stops its actors and Ray), then SIGKILL after 120 s; whatever is left of
    its process tree (Ray's processes included) is killed by pid."""
    import psutil

    try:
        tree = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.is_running():  # also guards against a reused pid
                proc.kill()
    psutil.wait_procs(tree, timeout=30)


def test_a_local_run_shows_its_named_actors_and_rlpost_metrics_on_the_dashboard(tmp_path, tiny_model_path,
                                                                                fast_metrics):  # fmt: skip
    run_name = f"e2e-dashboard-{os.getpid()}"
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"} | fast_metrics
    args = [
        sys.executable,
        "-m",
        "rlpost.cli",
        "train",
        "configs/tiny-cpu.yaml",
        f"model.name_or_path={tiny_model_path}",
        "trainer.steps=500",
        "trainer.prompts_per_step=2",
        "rollout.max_tokens=8",
        "logging.progress=false",
        f"logging.run_name={run_name}",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    with stdout.open("w") as out, stderr.open("w") as err:
        process = subprocess.Popen(args, stdout=out, stderr=err, env=env, cwd=REPO)
    try:
        start = wait_for("start line", lambda: START_LINE.search(stdout.read_text()), 120, process, stderr)
        assert start["namespace"] == f"rlpost-{run_name}"

        actors = wait_for(
            "named actors on the dashboard",
            lambda: alive_actors(start["dashboard"], start["namespace"]),
            120,
            process,
            stderr,
        )
        assert {row["ray_namespace"] for row in actors.values()} == {f"rlpost-{run_name}"}

        samples = wait_for(
            "rlpost metrics of the run", lambda: run_samples(start["metrics"], run_name), 120, process, stderr
        )
        assert samples["ray_rlpost_policy_version"] >= 1  # the driver's gauges after a trained step
        assert samples["ray_rlpost_groups_trained"] >= 2  # trainer.prompts_per_step groups a step
        assert 0 <= samples["ray_rlpost_reward_mean"] <= 1
    finally:
        stop_run(process)
    assert process.returncode == 128 + signal.SIGTERM, stderr.read_text()[-3000:]  # stopped cleanly by SIGTERM


FALLBACK_SCRIPT = """
import logging, socket, sys
import ray
from rlpost.config import load_config
from rlpost.ray_start import init_ray

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen()
for override in [f"logging.dashboard_port={taken.getsockname()[1]}", "logging.dashboard=false"]:
    cfg = load_config("configs/tiny-cpu.yaml", ["logging.run_name=e2e-no-dashboard", override])
    assert init_ray(cfg) is True
    ray.shutdown()
    print("done:", override, flush=True)
"""


def test_a_dashboard_that_cannot_start_or_is_turned_off_leaves_ray_running_without_it():
    """A taken ``logging.dashboard_port``: Ray logs why, rlpost warns and Ray starts anyway;
    ``logging.dashboard=false``: no dashboard and no warning. Both print the namespace and the
    metrics URL."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    out = subprocess.run(
        [sys.executable, "-c", FALLBACK_SCRIPT], capture_output=True, text=True, timeout=180, env=env, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith(("rlpost:", "done:"))]
    no_dashboard = re.compile(
        r"^rlpost: no Ray dashboard \(namespace rlpost-e2e-no-dashboard\); "
        r"metrics at http://127\.0\.0\.1:\d+/metrics$"
    )
    assert len(lines) == 4 and all(no_dashboard.match(line) for line in lines[::2]), out.stdout
    assert lines[1].startswith("done: logging.dashboard_port=") and lines[3] == "done: logging.dashboard=false"
    warnings = [line for line in out.stderr.splitlines() if "Ray's dashboard did not start" in line]
    assert warnings == [
        "WARNING Ray's dashboard did not start (see Ray's error above: the port taken, or the dashboard "
        "process failing); the run goes on without it"
    ], out.stderr[-3000:]
    assert "because it's already occupied" in out.stderr  # Ray's own error names the cause
