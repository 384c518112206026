"""Ray clusters of several nodes on one machine, for the chaos harness and the tests.

Each node is a ``ray start ... --block`` process with its own temp dir and ports, so it never
meets another cluster on the machine. Trap: ``ray stop`` is never used (it kills every Ray process
of the machine); a node stops on SIGTERM to its ``ray start``, and what is left of its tree is
killed by pid. A node is lost as a host fails, by killing its raylet (``node.raylet().kill()``);
the head declares it dead after its health checks (~15 s by default).

    with head_node(num_cpus=2, resources={"slot": 1}) as head:
        with worker_node(head, num_cpus=0, resources={"slot": 1}, name="node2") as node2:
            subprocess.run(["rlpost", "train", CONFIG, "--address", head.gcs_address], env=head.env)

A cluster whose nodes come and go through Ray's autoscaler, as on a cloud (:func:`autoscaling_head`):

    with autoscaling_head(worker_types={"ray.worker.elastic": {"resources": {"CPU": 1, "elastic": 1},
                                                               "min_workers": 0, "max_workers": 2}}) as head:
        ...  # a placement group asking for {"elastic": 1} makes the autoscaler launch a node
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

START_TIMEOUT_S = 180.0  # a node's `ray start` until it says it runs (and the dashboard answers)
STOP_TIMEOUT_S = 60.0  # a node's `ray start` after SIGTERM, before SIGKILL


@dataclasses.dataclass
class RayHead:
    """A cluster's head node."""

    gcs_address: str  # for ray.init / rlpost train --address
    dashboard: str | None  # http://127.0.0.1:PORT, for the Jobs API (None: started without it)
    env: dict[str, str]  # the environment the cluster was started with; its clients use it too
    process: subprocess.Popen
    temp_dir: Path


@dataclasses.dataclass
class RayNode:
    """A node joined to a head."""

    process: subprocess.Popen
    log: Path

    def raylet(self):
        """The node's raylet process (a psutil.Process): killing it loses the node."""
        import psutil

        return next(p for p in psutil.Process(self.process.pid).children(recursive=True) if p.name() == "raylet")


def free_ports(count: int) -> list[int]:
    """``count`` TCP ports nothing listens on now."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


@contextlib.contextmanager
def head_node(*, dashboard: bool = False, env: dict[str, str] | None = None, num_cpus: int = 2,
              resources: dict[str, float] | None = None) -> Iterator[RayHead]:  # fmt: skip
    """A head node (``ray start --head``) with ``num_cpus`` and custom ``resources``, and its
    dashboard when ``dashboard``; started with ``env`` (default: this process's environment, less
    RAY_ADDRESS), with this Python's bin folder first on PATH (so `rlpost` runs as a job
    entrypoint). Stopped with everything it started when the block ends."""
    with _head(dashboard=dashboard, env=env, num_cpus=num_cpus, resources=resources) as head:
        yield head


HEAD_NODE_TYPE = "ray.head.default"  # the type FakeMultiNodeProvider gives the head it finds


@contextlib.contextmanager
def autoscaling_head(*, worker_types: dict[str, dict], head_cpus: int = 2,
                     head_resources: dict[str, float] | None = None, idle_timeout_s: float = 6.0,
                     env: dict[str, str] | None = None, dashboard: bool = False) -> Iterator[RayHead]:  # fmt: skip
    """A head node as :func:`head_node`'s, with Ray's own autoscaler (the head's monitor process)
    and Ray's fake multi-node provider (``FakeMultiNodeProvider``): the fleet grows and shrinks
    through Ray's autoscaler, as on a cloud, with each node it launches a raylet of this machine.

    ``worker_types`` maps a node type's name to ``{"resources": {"CPU": 1, "elastic": 1},
    "min_workers": 0, "max_workers": 2}`` (the autoscaler's ``available_node_types``; CPU, GPU and
    object_store_memory are the node's, the rest its custom resources). A node with nothing
    running on it for ``idle_timeout_s`` is terminated; the autoscaler looks every second.

    Ray's ``AutoscalingCluster`` (ray.cluster_utils) does the same but cannot serve: its config is
    built from an example.yaml the wheel does not ship, and its start and shutdown run ``ray stop
    --force``. The provider starts each node from the monitor's process (``ray._private.node.Node``),
    so its processes are in the head's process tree and stop with the head; its node IP is the
    machine's, as the head's (Ray turns the head's --node-ip-address=127.0.0.1 into it), and its
    ports are ones the OS picks; it inherits the monitor's environment, so it authenticates as the
    head does (a head that finds a token, ~/.ray/auth_token among them, turns token mode on for
    the processes it starts). Launching a node takes ~3 s; an idle one goes ~1 s after
    ``idle_timeout_s``. A driver counts the nodes of a type by their resources
    (:func:`alive_nodes`). The autoscaler's log is ``session_latest/logs/monitor.log`` in the
    temp dir; the nodes' logs are there too, numbered (``raylet.1.out``)."""
    node_types = {HEAD_NODE_TYPE: {"resources": {"CPU": head_cpus, **(head_resources or {})}, "node_config": {},
                                   "max_workers": 0}}  # fmt: skip
    for name, spec in worker_types.items():
        node_types[name] = {"node_config": {}, "min_workers": 0, **spec}
    config = {
        "cluster_name": "rlpost-fake-multinode",
        "max_workers": sum(spec["max_workers"] for spec in worker_types.values()),
        # the provider's nodes join the GCS at gcs_address (default: port 6379 of this machine's IP)
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True},  # fmt: skip
        "available_node_types": node_types,
        "head_node_type": HEAD_NODE_TYPE,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_s / 60,
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }  # fmt: skip
    # RAY_FAKE_CLUSTER: the provider refuses to run without it; the autoscaler's period is 5 s by default
    env = {**(env or os.environ), "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    with _head(dashboard=dashboard, env=env, num_cpus=head_cpus, resources=head_resources, autoscaling=config) as head:
        yield head


@contextlib.contextmanager
def driver_token(head: RayHead) -> Iterator[None]:
    """This process authenticates with ``head``'s token (its ``RAY_AUTH_TOKEN_PATH``) while the block
    runs, for a ``ray.init`` of its own. Ray's cached config and token are reset on the way in and
    out (the C++ token loader keeps the first token it read), so a cluster started later by this
    process uses its own again."""
    from unittest import mock

    from ray._private.authentication_test_utils import reset_auth_token_state

    token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": head.env["RAY_AUTH_TOKEN_PATH"]}
    try:
        with mock.patch.dict(os.environ, token):  # the environment as it was, on the way out
            os.environ.pop("RAY_AUTH_TOKEN", None)
            reset_auth_token_state()
            yield
    finally:
        reset_auth_token_state()


def alive_nodes(resource: str) -> list[dict]:
    """The alive nodes that declare ``resource`` (``ray.nodes()`` entries), as this process's
    driver sees them: the autoscaler names a node's type nowhere a driver reads, its resources do."""
    import ray

    return [node for node in ray.nodes() if node["Alive"] and node["Resources"].get(resource)]


@contextlib.contextmanager
def _head(*, dashboard: bool, env: dict[str, str] | None, num_cpus: int, resources: dict[str, float] | None,
          autoscaling: dict | None = None) -> Iterator[RayHead]:  # fmt: skip
    """:func:`head_node`, and :func:`autoscaling_head` with its autoscaler's config ``autoscaling``
    (its provider's gcs_address set here: the GCS port is chosen here)."""
    # short: Ray's unix socket paths under the temp dir must stay below 108 characters
    temp_dir = Path(tempfile.mkdtemp(prefix="rlpost-ray-", dir="/tmp"))
    env = dict(env or os.environ)
    env.pop("RAY_ADDRESS", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    gcs, dash, client, agent_http, agent_grpc, metrics, runtime_env = free_ports(7)
    args = [
        sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={gcs}",
        "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}", f"--num-cpus={num_cpus}", "--disable-usage-stats",
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime_env}",
    ]  # fmt: skip
    if resources:
        args.append(f"--resources={json.dumps(resources)}")
    if dashboard:
        args += ["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}"]
    else:
        args.append("--include-dashboard=false")
    if autoscaling is not None:
        config = temp_dir / "autoscaling.json"
        autoscaling = {**autoscaling, "provider": {**autoscaling["provider"], "gcs_address": f"127.0.0.1:{gcs}"}}
        config.write_text(json.dumps(autoscaling, indent=1))
        args.append(f"--autoscaling-config={config}")
    log = temp_dir / "ray-start.log"
    with log.open("w") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=temp_dir)
    head = RayHead(f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}" if dashboard else None, env, process, temp_dir)
    try:
        _wait_until_up(head, log)
        yield head
    finally:
        if autoscaling is not None:
            _freeze_autoscaler(head)
        stop_tree(head.process)
        shutil.rmtree(head.temp_dir, ignore_errors=True)


def _freeze_autoscaler(head: RayHead) -> None:
    """Suspends (SIGSTOP) the head's autoscaler, so that it launches no node while the head stops:
    a node it launched after :func:`stop_tree` listed the head's tree would outlive the cluster (its
    raylet dies ~1 min after the GCS, its log monitor lives on)."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        for proc in psutil.Process(head.process.pid).children():
            if any(arg.endswith("autoscaler/_private/monitor.py") for arg in proc.cmdline()):
                proc.suspend()


@contextlib.contextmanager
def worker_node(head: RayHead, *, num_cpus: int, resources: dict[str, float], name: str) -> Iterator[RayNode]:
    """Another node of ``head``'s cluster on this machine (``ray start --address``), with its
    own ports, ``num_cpus`` and ``resources``; its log is ``ray-start-<name>.log`` in the head's
    temp dir. Stopped (its whole process tree) when the block ends, whatever was killed of it."""
    agent_http, agent_grpc, metrics, runtime_env = free_ports(4)
    args = [
        sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
        f"--address={head.gcs_address}", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}",
        f"--resources={json.dumps(resources)}", "--disable-usage-stats",
        f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env}",
    ]  # fmt: skip
    log = head.temp_dir / f"ray-start-{name}.log"
    # a node joining a cluster with token authentication sends the token only in token mode
    env = {**head.env, "RAY_AUTH_MODE": "token"} if "RAY_AUTH_TOKEN_PATH" in head.env else head.env
    with log.open("w") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=head.temp_dir)
    node = RayNode(process, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Ray runtime started" not in log.read_text():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the node {name} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield node
    finally:
        stop_tree(process)


def _wait_until_up(head: RayHead, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if head.process.poll() is not None:
            raise RuntimeError(f"ray start exited with {head.process.returncode}:\n{log.read_text()[-3000:]}")
        if "Ray runtime started" in log.read_text() and (head.dashboard is None or _dashboard_answers(head)):
            return
        time.sleep(1)
    raise RuntimeError(f"the Ray head did not come up in {START_TIMEOUT_S:.0f} s:\n{log.read_text()[-3000:]}")


def _dashboard_answers(head: RayHead) -> bool:
    try:
        urllib.request.urlopen(f"{head.dashboard}/api/version", timeout=5).close()
    except urllib.error.HTTPError:
        pass  # it answers (401 without a token)
    except OSError:
        return False
    return True


def stop_tree(process: subprocess.Popen) -> None:
    """SIGTERM to a ``ray start --block`` (it stops what it started), then SIGKILL to any
    process left of its tree."""
    import psutil

    try:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    process.terminate()
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
    for proc in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.is_running():  # also guards against a reused pid
                proc.kill()
    psutil.wait_procs(tree, timeout=30)
