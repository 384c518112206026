"""`rlpost scale` on a running job: the fleet grows and shrinks while it trains.

A sync run on the tiny model with `rollout.num_inference_workers: 1..2` and
`rollout.num_env_pools: 1..2` starts one worker and one pool and grows to two of each by itself
(the machine has room for the second). An operator then asks for one of each (`rlpost scale
RUN_DIR inference=1 env_pools=1 --wait`): the second worker finishes its requests, stops, and
the bus re-forms without it; the second pool stops after its batch and leaves, and the first
collects each step's prompts alone; a request outside the range exits 2 and changes nothing;
`rlpost status RUN_DIR` shows the fleet; the run trains on with one of each. (A new worker
joining a running job: the start here, and tests/e2e/test_autoscaling.py, where the load policy
grows the fleet; a pool taking up its shard where it stopped: tests/e2e/test_node_loss.py.)
Every metrics line keeps the accounting, every step trains its prompts, and the run stops on
SIGTERM as an operator would stop it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]


def rows_of(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rlpost(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlpost.ops.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_an_operator_shrinks_and_grows_the_inference_fleet_of_a_running_job(tmp_path, tiny_model_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run_dir = tmp_path / "scaled"
    log = tmp_path / "run.log"
    args = [
        sys.executable, "-m", "rlpost.ops.cli", "train", "configs/tiny-cpu.yaml", f"model.name_or_path={tiny_model_path}",
        "trainer.steps=2000", "trainer.prompts_per_step=4", "rollout.num_inference_workers=1..2",
        "rollout.num_env_pools=1..2", "eval.interval=0",
        "logging.progress=false", f"logging.run_dir={tmp_path}", "logging.run_name=scaled",
    ]  # fmt: skip
    with log.open("w") as out:
        run = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    metrics = run_dir / "metrics.jsonl"

    def wait_for(what: str, ok, timeout_s: float = 240) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rows = rows_of(metrics)
            if rows and ok(rows[-1]):
                return rows
            assert run.poll() is None, f"the run ended ({run.returncode}) before {what}:\n{log.read_text()[-4000:]}"
            time.sleep(1)
        raise AssertionError(f"no {what} within {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")

    try:
        first = wait_for("a first step", lambda row: True)[0]
        # the ranges' tops; it started with their minimums
        assert (first["inference_workers_target"], first["env_pools_target"]) == (2, 2)
        wait_for("the second worker and pool", lambda row: (row["inference_workers"], row["env_pools"]) == (2, 2))
        text = log.read_text()
        assert "the cluster has room for inference-1 (a new slot" in text and "env-pool-1 started (a new slot" in text

        out = rlpost("scale", str(run_dir), "inference=1", "env_pools=1", "--wait", "180")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "asked for 1 inference workers and 1 env pools" in out.stdout, out.stdout
        assert "inference workers: 1 serving of 1 wanted; env pools: 1 serving of 1 wanted" in out.stdout, out.stdout
        wait_for("a step with one worker and one pool",
                 lambda row: (row["inference_workers"], row["inference_workers_target"], row["env_pools"]) == (1, 1, 1))  # fmt: skip

        refused = rlpost("scale", str(run_dir), "inference=3")
        assert refused.returncode == 2 and "outside the run's range 1..2" in refused.stderr, refused.stderr
        refused = rlpost("scale", str(run_dir), "env_pools=3")
        assert refused.returncode == 2 and "env_pools=3 is outside the run's range 1..2" in refused.stderr
        status = rlpost("status", str(run_dir))
        assert status.returncode == 0 and "inference workers: 1 serving of 1 wanted" in status.stdout, status.stdout
        assert "env pools: 1 serving of 1 wanted" in status.stdout, status.stdout
        steps_at_one = rows_of(metrics)[-1]["step"]
        wait_for("two more steps", lambda row: row["step"] >= steps_at_one + 2)
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGTERM)
        code = run.wait(timeout=180)
    assert code == 143, log.read_text()[-4000:]  # stopped by SIGTERM, as an operator stops it
    rows = rows_of(metrics)
    for row in rows:  # nothing completed is lost or counted twice, on every line
        assert row["groups_put"] == row["groups_trained"] + row["groups_dropped_stale"] + row["groups_in_buffer"], row
    assert [row["step"] for row in rows] == list(range(1, len(rows) + 1))
    assert all(row["staleness_mean"] == 0.0 for row in rows)  # sync mode stays on-policy through the changes
    # every step trained its 4 prompts, with one pool or two
    assert all(row["groups_trained"] == 4 * row["step"] for row in rows if not row.get("stopped")), rows
    assert rows[-1]["restarts_inference"] == rows[-1]["restarts_env_pool"] == 0  # scaling is not a failure
    text = log.read_text()
    for fleet in ("inference", "env-pool"):
        assert f"scaling the {fleet} fleet from 2 to 1" in text
