"""A local run with Ray's dashboard, started as `rlpost train` starts it (``init_ray``): the start
line gives the dashboard's URL, the namespace and the metrics URL; the dashboard's state API lists
the run's named actors and the node's Prometheus endpoint serves the ``rlpost_*`` metrics of every
role, the run's own tagged with its name. The run is an async one with the reference model's KL
in the reward (each env pool has its batches penalised by the reference actor before computing
their advantages), and that actor dies mid-run: the pools wait for its replacement, which the
supervisor starts, staleness stays bounded and no step is lost.
A dashboard that cannot start, or is turned off, leaves Ray running without it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
START_LINE = re.compile(
    r"^rlpost: Ray dashboard at (?P<dashboard>http://127\.0\.0\.1:\d+) \(namespace (?P<namespace>\S+)\); "
    r"metrics at (?P<metrics>http://127\.0\.0\.1:\d+/metrics)",
    re.M,
)
RUN_ACTORS = {"inference-0", "learner", "env-pool-0", "buffer", "reference"}
# what each role reports from its own process, plus the driver's run-level gauges
EXPECTED_METRICS = {
    "rlpost_inference_tokens_generated",
    "rlpost_inference_policy_version",
    "rlpost_env_pool_reward_mean",
    "rlpost_learner_loss",
    "rlpost_learner_clip_fraction",
    "rlpost_buffer_size",
    "rlpost_reference_samples_scored",
    "rlpost_reward_mean",
    "rlpost_weight_sync_s",
}


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def poll(what: str, probe, timeout_s: float):
    """Call ``probe()`` every second until it returns something other than None, and return that;
    fail when ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = probe()
        if found is not None:
            return found
        time.sleep(1)
    pytest.fail(f"no {what} within {timeout_s} s")


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


def rlpost_metrics(metrics_url: str, run_name: str) -> tuple[set[str], dict[str, float]]:
    """What the Prometheus endpoint serves of rlpost: the metric names (Ray's ``ray_`` prefix and a
    counter's ``_total`` suffix off), and ``{full name: value}`` of the samples tagged
    ``run="<run_name>"``. Empty while the endpoint does not answer (Ray exports every second here)."""
    text = fetch(metrics_url) or ""
    names = {m.group(1) for m in re.finditer(r"^ray_(rlpost_\w+?)(?:_total)?\{", text, re.M)}
    samples = {}
    for match in re.finditer(r"^(ray_rlpost_\w+)\{([^}]*)\} (\S+)(?: \d+)?$", text, re.M):
        if f'run="{run_name}"' in match.group(2):
            samples[match.group(1)] = float(match.group(3))
    return names, samples


def test_an_async_local_run_shows_on_the_dashboard_bounds_staleness_and_restarts_the_reference(
    tmp_path, tiny_model_path, fast_metrics, monkeypatch, capsys
):
    import signal

    import ray

    from rlpost.config import load_config
    from rlpost.record.run_dir import create_run_dir
    from rlpost.runtime.actors import actor_record
    from rlpost.runtime.ray_start import init_ray
    from rlpost.service.loop import Controller
    from rlpost.service.run import start_run

    run_name = f"e2e-async-{os.getpid()}"
    cfg = load_config(
        "configs/tiny-cpu.yaml",
        [
            f"model.name_or_path={tiny_model_path}",
            "trainer.mode=async",
            "trainer.max_staleness=1",
            "trainer.steps=6",
            "trainer.prompts_per_step=4",
            "reference.enabled=true",
            "reference.kl_coef=0.01",
            "reference.kl_in=reward",
            "weight_sync.probe_every=2",  # syncs 2 and 4 overlap the next step (train_during_reload)
            "logging.progress=false",
            f"logging.run_name={run_name}",
        ],
    )
    run_dir = create_run_dir(cfg, tmp_path / "async")

    class KillTheReferenceOnce(Controller):
        def _collect_step(self):
            if self.step == 3:  # it dies (SIGKILL of its process, a crash) under the pools' calls:
                os.kill(
                    actor_record(self.fleet.reference.handle)["Pid"], signal.SIGKILL
                )  # started again once the health check sees it, no step lost
            return super()._collect_step()

    # a local cluster of its own, as `rlpost train` starts one (the Ray processes it starts read
    # the environment: metrics exported every second)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for key, value in fast_metrics.items():
        monkeypatch.setenv(key, value)
    assert init_ray(cfg) is True
    supervisor = None
    try:
        start = START_LINE.search(capsys.readouterr().out)
        assert start is not None and start["namespace"] == f"rlpost-{run_name}"
        supervisor = start_run(cfg, run_dir)
        names = {
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == start["namespace"]
        }
        assert RUN_ACTORS <= names
        on_dashboard = poll(
            "named actors on the dashboard", lambda: alive_actors(start["dashboard"], start["namespace"]), 120
        )
        assert {row["ray_namespace"] for row in on_dashboard.values()} == {start["namespace"]}

        KillTheReferenceOnce(cfg, run_dir, supervisor).run()

        deadline, (exported, samples) = time.monotonic() + 60, rlpost_metrics(start["metrics"], run_name)
        while not (EXPECTED_METRICS <= exported and "ray_rlpost_policy_version" in samples):
            assert time.monotonic() < deadline, f"missing in Prometheus: {EXPECTED_METRICS - exported}, {samples}"
            time.sleep(1)
            exported, samples = rlpost_metrics(start["metrics"], run_name)
    finally:
        if supervisor is not None:
            supervisor.close()
        ray.shutdown()
    assert 1 <= samples["ray_rlpost_policy_version"] <= 6  # the driver's gauges, tagged with the run
    assert samples["ray_rlpost_groups_trained"] >= 4  # trainer.prompts_per_step groups a step
    assert -1 <= samples["ray_rlpost_reward_mean"] <= 1  # a task reward in [0, 1] less a small KL penalty

    rows = read(run_dir / "metrics.jsonl")
    assert len(rows) == 6
    restarts = [r["restarts_reference"] for r in rows]
    assert restarts[:2] == [0, 0] and restarts[-1] == 1 and restarts == sorted(restarts)
    assert all(r["kl_to_ref"] is not None for r in rows)  # the pools' samples came back scored by the reference
    # the probed syncs wait for the reload; the ones between are confirmed by the next sync, whose
    # probe (steps 3 and 5) then finds the workers serving exactly the learner's weights
    assert [r["step"] for r in rows if r["sync_logprob_diff"] is not None] == [1, 3, 5]
    for r in rows:
        assert r["staleness_max"] <= 1  # never beyond trainer.max_staleness
        assert r["sync_logprob_diff"] is None or r["sync_logprob_diff"] <= 1e-3
        assert r["weight_load_s"] > 0  # the latest reload confirmed (the one before, where overlapped)
        assert r["kl_to_ref"] is not None and r["kl_to_ref"] >= 0
        # tokens record their own versions: an update mid-completion makes them newer than the sample
        assert r["token_staleness_mean"] <= r["staleness_mean"] + 1e-9 and 0 <= r["inflight_token_fraction"] <= 1
    print("in-flight token fractions:", [r["inflight_token_fraction"] for r in rows])


FALLBACK_SCRIPT = """
import logging, socket, sys
import ray
from rlpost.config import load_config
from rlpost.runtime.ray_start import init_ray

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


@pytest.mark.long  # two Ray starts in a process of its own (14 s): make test-long
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
