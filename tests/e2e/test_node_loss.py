"""A node of a two-node cluster is lost mid-run, and a node takes its place.

Two raylets on this machine, each started with `ray start` and declaring one `rollout_slot` and
one `pool_slot`; the run's two inference workers each reserve a `rollout_slot` and its two env
pools a `pool_slot` (and no CPU), so each node has a worker and a pool, and every other actor
needs CPUs, which only the head has (the buffer, which reserves nothing, runs on the head node).
The second node's raylet is killed after step 2: its worker and its pool die with it and no node
has room for them, so the run goes on with one worker and one pool (`inference_workers` and
`env_pools` 1 in metrics.jsonl; the pool left collects each step's prompts alone) rather than
wait. A third node with both slots then joins: Ray places the lost bundles there, a health check
starts the worker and the pool again (the pool from its last put), and the bus takes the worker
back (both 2). Every metrics line keeps the accounting, and every step trains its prompts. The run
is then stopped with SIGTERM, as an operator would. In sync mode, where a lost pool's share of
each step must pass to the pool left; `make chaos`'s node runs lose nodes in both modes, and the
supervisor's unit tests lose pools without room in async mode too.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlpost.ops.local_cluster import head_node, worker_node

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
SLOT = {"rollout_slot": 1}
POOL_SLOT = {"pool_slot": 1}
NODE = SLOT | POOL_SLOT  # what each node declares


def rows_of(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def back_on_node3(rows: list[dict]) -> bool:
    """The last line serves two workers and two pools again, each restarted once."""
    last = rows[-1]
    serving = (last["inference_workers"], last["env_pools"])
    return serving == (2, 2) and (last["restarts_inference"], last["restarts_env_pool"]) == (1, 1)


def wait_for(metrics: Path, run: subprocess.Popen, log: Path, what: str, ok, timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = rows_of(metrics)
        if ok(rows):
            return rows
        if run.poll() is not None:
            raise AssertionError(f"the run ended ({run.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        time.sleep(1)
    raise AssertionError(f"no {what} within {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


def test_a_lost_node_leaves_the_fleet_and_a_new_node_brings_the_worker_back(tmp_path, tiny_model_path):
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"RAY_AUTH_TOKEN_PATH": str(token)}
    # a silent node is declared dead after ~3 s instead of ~15 s: the test waits less, nothing else changes
    env |= {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
    with (
        head_node(env=env, num_cpus=2, resources=NODE) as head,
        worker_node(head, num_cpus=0, resources=NODE, name="node2") as node2,
    ):
        log = tmp_path / "run.log"
        args = [
            sys.executable, "-m", "rlpost.ops.cli", "train", "configs/tiny-cpu.yaml",
            f"model.name_or_path={tiny_model_path}", "trainer.mode=sync", "trainer.steps=500", "trainer.prompts_per_step=4",
            "rollout.num_inference_workers=2", "resources.inference.num_cpus=0",
            f"resources.inference.resources={json.dumps(SLOT)}", "resources.replacement_wait_s=3",
            "rollout.num_env_pools=2", "resources.env_pool.num_cpus=0", f"resources.env_pool.resources={json.dumps(POOL_SLOT)}",
            "eval.interval=0", "logging.progress=false", f"logging.run_dir={tmp_path}", "logging.run_name=node-loss",
            "--address", head.gcs_address,
        ]  # fmt: skip
        with log.open("w") as out:
            run = subprocess.Popen(args, cwd=REPO, env=head.env, stdout=out, stderr=subprocess.STDOUT)
        metrics = tmp_path / "node-loss" / "metrics.jsonl"
        try:
            rows = wait_for(metrics, run, log, "step 2", lambda r: len(r) >= 2, 300)
            assert (rows[-1]["inference_workers"], rows[-1]["env_pools"]) == (2, 2)
            node2.raylet().kill()  # the node is gone: its raylet, and with it its worker and pool
            rows = wait_for(metrics, run, log, "a step with one worker and one pool",
                            lambda r: any((x["inference_workers"], x["env_pools"]) == (1, 1) for x in r), 180)  # fmt: skip
            assert (rows[-1]["inference_workers_vacant"], rows[-1]["env_pools_vacant"]) == (1, 1)
            with worker_node(head, num_cpus=0, resources=NODE, name="node3"):
                rows = wait_for(metrics, run, log, "the worker and the pool back on the new node", back_on_node3, 300)
                back = len(rows)
                wait_for(metrics, run, log, "two steps more", lambda r: len(r) >= back + 2, 120)
                run.send_signal(signal.SIGTERM)
                assert run.wait(timeout=180) == 128 + signal.SIGTERM, log.read_text()[-4000:]
        finally:
            if run.poll() is None:
                run.kill()
    rows = rows_of(metrics)
    text = log.read_text()
    assert "going on with 1 of 2 inference workers" in text  # either worker may have been on node2
    assert "going on with 1 of 2 env pools" in text
    assert re.search(r"the cluster has room for inference-\d again", text)
    assert re.search(r"the cluster has room for env-pool-\d again", text)
    for key in ("inference_workers", "env_pools"):
        fleet = [r[key] for r in rows]
        assert fleet[0] == 2 and 1 in fleet and fleet[-1] == 2, (key, fleet)
    for r in rows:  # nothing completed lost silently or counted twice, on every step's line
        assert r["groups_put"] == r["groups_trained"] + r["groups_dropped_stale"] + r["groups_in_buffer"], r
    assert rows[-1]["restarts_inference"] == rows[-1]["restarts_env_pool"] == 1 and rows[-1]["learner_resumes"] == 0
    # the pool left collected every step's prompts: none was trained short
    assert all(r["groups_trained"] == 4 * r["step"] for r in rows if not r.get("stopped")), rows
