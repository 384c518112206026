"""Ray clusters for the e2e tier.

Most e2e runs share one cluster, :func:`ray_head` (a pytest session fixture): a ``ray start
--head`` with its dashboard and token authentication, which CLI runs join with ``--address``,
Ray Jobs are submitted to, and in-process controllers connect to (:func:`connect_driver`). A run
on it skips the start and stop of a cluster of its own (~10 s of the 2 cores each). A test that is
about a cluster of its own (a local run's dashboard, say) starts one with ``start_ray_head``, or
lets ``rlpost train`` start a local one.

`ray stop` kills every Ray process on the machine (other test sessions and training runs
included), so a cluster runs as `ray start --head --block` in its own temp dir with its own
ports; at the end that process gets SIGTERM (it stops what it started) and any process left of
its tree (workers, job drivers, vLLM engines) is killed by pid.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from unittest import mock

import pytest

# Ray's processes report their metrics every 10 s by default; the clusters the tests start report
# every second, so that a test waiting for a run's metrics on Prometheus waits ~1 s, not ~10.
FAST_METRICS = {"RAY_metrics_report_interval_ms": "1000"}


@dataclasses.dataclass
class RayHead:
    gcs_address: str  # for ray.init / rlpost train --address
    dashboard: str | None  # http://127.0.0.1:PORT, for the Jobs API
    env: dict[str, str]  # the environment the cluster was started with; clients use it too
    process: subprocess.Popen
    temp_dir: Path


def free_ports(count: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


@contextlib.contextmanager
def ray_head_cluster(*, dashboard: bool = False, env: dict[str, str] | None = None, num_cpus: int = 2,
                     resources: dict[str, float] | None = None):  # fmt: skip
    # short: Ray's unix socket paths under the temp dir must stay below 108 characters
    temp_dir = Path(tempfile.mkdtemp(prefix="rlpost-ray-", dir="/tmp"))
    env = dict(env or os.environ)
    env.pop("RAY_ADDRESS", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `rlpost` for job entrypoints
    gcs, dash, client, agent_http, agent_grpc, metrics, runtime_env = free_ports(7)
    args = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        "--block",
        f"--port={gcs}",
        "--node-ip-address=127.0.0.1",
        f"--temp-dir={temp_dir}",
        f"--num-cpus={num_cpus}",
        "--disable-usage-stats",
        f"--ray-client-server-port={client}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime_env}",
    ]
    if resources:
        args.append(f"--resources={json.dumps(resources)}")
    args += (
        ["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}"]
        if dashboard
        else ["--include-dashboard=false"]
    )
    log = temp_dir / "ray-start.log"
    with log.open("w") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=temp_dir)
    head = RayHead(f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}" if dashboard else None, env, process, temp_dir)
    try:
        _wait_until_up(head, log, timeout_s=180)
        yield head
    finally:
        _stop(head)


@dataclasses.dataclass
class RayNode:
    """A node joined to a head with ``ray start --address --block`` (its own process tree)."""

    process: subprocess.Popen
    log: Path

    def raylet(self):
        """The node's raylet process (psutil)."""
        import psutil

        return next(p for p in psutil.Process(self.process.pid).children(recursive=True) if p.name() == "raylet")


@contextlib.contextmanager
def ray_worker_node(head: RayHead, *, num_cpus: int, resources: dict[str, float], name: str):
    """Another node of ``head``'s cluster on this machine, with its own ports and ``resources``;
    stopped (its whole process tree) at the end, whatever was killed of it before."""
    agent_http, agent_grpc, metrics, runtime_env = free_ports(4)
    args = [
        sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
        f"--address={head.gcs_address}", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}",
        f"--resources={json.dumps(resources)}", "--disable-usage-stats",
        f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env}",
    ]  # fmt: skip
    log = head.temp_dir / f"ray-start-{name}.log"
    env = {**head.env, "RAY_AUTH_MODE": "token"} if "RAY_AUTH_TOKEN_PATH" in head.env else head.env
    with log.open("w") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=head.temp_dir)
    node = RayNode(process, log)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the node {name} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield node
    finally:
        _stop_tree(process)


def _wait_until_up(head: RayHead, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.process.poll() is not None:
            raise RuntimeError(f"ray start exited with {head.process.returncode}:\n{log.read_text()[-3000:]}")
        if "Ray runtime started" in log.read_text() and (head.dashboard is None or _dashboard_answers(head)):
            return
        time.sleep(1)
    raise RuntimeError(f"the Ray head did not come up in {timeout_s} s:\n{log.read_text()[-3000:]}")


def _dashboard_answers(head: RayHead) -> bool:
    try:
        urllib.request.urlopen(f"{head.dashboard}/api/version", timeout=5).close()
    except urllib.error.HTTPError:
        pass  # it answers (401 without a token)
    except OSError:
        return False
    return True


def _stop(head: RayHead) -> None:
    _stop_tree(head.process)
    shutil.rmtree(head.temp_dir, ignore_errors=True)


def _stop_tree(process: subprocess.Popen) -> None:
    """SIGTERM to a ``ray start --block`` (it stops what it started), then SIGKILL to any
    process left of its tree."""
    import psutil

    try:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.is_running():  # also guards against a reused pid
                proc.kill()
    psutil.wait_procs(tree, timeout=30)


@pytest.fixture(scope="module")
def start_ray_head():
    """``start_ray_head(dashboard=..., env=...) -> RayHead``; every cluster stops when the module ends."""
    with contextlib.ExitStack() as stack:
        yield lambda **kwargs: stack.enter_context(ray_head_cluster(**kwargs))


@pytest.fixture
def fast_metrics() -> dict[str, str]:
    """:data:`FAST_METRICS`, for a test that starts Ray through a run of its own."""
    return dict(FAST_METRICS)


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """The tier's shared cluster: dashboard on, token authentication with a token file of its own,
    found through RAY_AUTH_TOKEN_PATH with RAY_AUTH_MODE unset in its clients' environment
    (``head.env``), as a user's shell would have it. Runs on it stop their actors when they end
    (the CLI, the controller's ``stop_actors``, a job's driver), so one run leaves the cluster's
    CPUs free for the next."""
    token = tmp_path_factory.mktemp("auth") / "token"
    token.write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(FAST_METRICS, RAY_AUTH_TOKEN_PATH=str(token))
    with ray_head_cluster(dashboard=True, env=env) as head:
        yield head


@contextlib.contextmanager
def _token_of(head: RayHead):
    """This process authenticates with ``head``'s token while the block runs. Ray's cached config
    and token are reset on the way in and out (the C++ token loader keeps the first token it
    read), so a cluster started later by this process uses its own again."""
    from ray._private.authentication_test_utils import reset_auth_token_state as reset_ray_auth

    token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": head.env["RAY_AUTH_TOKEN_PATH"]}
    try:
        with mock.patch.dict(os.environ, token):  # the environment as it was, on the way out
            os.environ.pop("RAY_AUTH_TOKEN", None)
            reset_ray_auth()
            yield
    finally:
        reset_ray_auth()


@pytest.fixture
def connect_driver(ray_head):
    """``connect_driver(namespace) -> ray``: this test process joins the shared cluster as a
    driver in ``namespace`` (as ``ray.init(address=...)`` in a user's script); it leaves at the
    end of the test, and Ray then ends the actors it owned that are still alive."""
    import ray

    with contextlib.ExitStack() as stack:

        def connect(namespace: str):
            stack.enter_context(_token_of(ray_head))
            ray.init(address=ray_head.gcs_address, namespace=namespace, log_to_driver=False)
            stack.callback(ray.shutdown)
            return ray

        yield connect


@pytest.fixture(autouse=True)
def no_ray_connection_from_an_earlier_tier():
    """e2e tests join the tier's cluster or start their own; the integration tier's session
    cluster, which this process is still connected to when the tiers run in one session, would
    make their ``ray.init`` fail."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    yield
