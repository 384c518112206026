"""A cluster whose fleet grows and shrinks through Ray's own autoscaler, on one machine
(:func:`rlpost.ops.local_cluster.autoscaling_head`: Ray's fake multi-node provider launches each
node as raylets of this machine). Two placement groups asking for a resource only the worker type
declares make the autoscaler launch two nodes; removing a group makes its node idle, and the
autoscaler terminates it after the idle timeout while the other group's node stays; the last goes
with the last group. A node still up when the block ends stops with the head: no process of the
cluster is left. Each phase's time is printed (pytest -s) and bounded."""

from __future__ import annotations

import os
import secrets
import time

import pytest

from rlpost.ops.local_cluster import alive_nodes, autoscaling_head, driver_token

pytestmark = [pytest.mark.integration, pytest.mark.long, pytest.mark.timeout(300)]

ELASTIC = {"ray.worker.elastic": {"resources": {"CPU": 1, "elastic": 1}, "min_workers": 0, "max_workers": 2}}
IDLE_S = 2.0  # the autoscaler's idle timeout
LAUNCH_BOUND_S = 60.0  # two nodes launched one after the other (~3 s each) on a loaded machine
RELEASE_BOUND_S = IDLE_S + 30.0  # the idle timeout, the autoscaler's period (1 s), and the GCS marking it dead


def wait_for(what: str, condition, bound_s: float) -> float:
    """Seconds until ``condition()`` holds; fails after ``bound_s``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > bound_s:
            raise AssertionError(f"{what}: not within {bound_s:.0f} s")
        time.sleep(0.2)
    took = time.monotonic() - start
    print(f"{what}: {took:.1f} s")
    return took


def elastic_ids() -> set[str]:
    return {node["NodeID"] for node in alive_nodes("elastic")}


def running(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_autoscaler_launches_nodes_for_pending_groups_and_releases_idle_ones(tmp_path):
    import psutil
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    if ray.is_initialized():  # the tier's session cluster: ray.init would refuse another address
        ray.shutdown()
    # Trap: a Ray 2.60 head turns token authentication on when it finds a token, ~/.ray/auth_token
    # among them (a local ray.init writes one), and a driver sends it only with RAY_AUTH_MODE=token;
    # a token of the cluster's own, found through RAY_AUTH_TOKEN_PATH, makes both sides certain. The
    # nodes the autoscaler launches inherit the head's token mode and path.
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"RAY_AUTH_TOKEN_PATH": str(token)}
    with (
        autoscaling_head(worker_types=ELASTIC, head_cpus=1, idle_timeout_s=IDLE_S, env=env) as head,
        driver_token(head),
    ):
        ray.init(address=head.gcs_address, log_to_driver=False)
        try:
            assert elastic_ids() == set() and ray.cluster_resources().get("elastic") is None
            groups = [placement_group([{"elastic": 1}]) for _ in range(2)]  # the head holds none
            wait_for("two nodes launched, both groups placed", lambda: all(
                placement_group_table(group)["state"] == "CREATED" for group in groups), LAUNCH_BOUND_S)  # fmt: skip
            nodes = [placement_group_table(group)["bundles_to_node_id"][0] for group in groups]
            assert len(set(nodes)) == 2 and elastic_ids() == set(nodes), (nodes, elastic_ids())

            remove_placement_group(groups[0])
            wait_for("the first group's node released", lambda: nodes[0] not in elastic_ids(), RELEASE_BOUND_S)
            assert elastic_ids() == {nodes[1]}  # the other group's node stays

            remove_placement_group(groups[1])
            wait_for("the second group's node released", lambda: not elastic_ids(), RELEASE_BOUND_S)

            # a node still up when the cluster stops goes with it
            group = placement_group([{"elastic": 1}])
            wait_for("a node launched again", lambda: placement_group_table(group)["state"] == "CREATED",
                     LAUNCH_BOUND_S)  # fmt: skip
            assert len(elastic_ids()) == 1
        finally:
            ray.shutdown()
        tree = psutil.Process(head.process.pid).children(recursive=True)
        assert sum(proc.name() == "raylet" for proc in tree) == 2, [proc.name() for proc in tree]  # head's and node's
        start = time.monotonic()
    print(f"the cluster stopped: {time.monotonic() - start:.1f} s")
    left = [proc for proc in tree if running(proc)]
    assert not left, [(proc.pid, proc.name()) for proc in left]
