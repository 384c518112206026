"""The load policy grows a run's fleet through Ray's autoscaler and gives the nodes back.

A cluster of this machine with Ray's own autoscaler and its fake multi-node provider
(:func:`rlpost.ops.local_cluster.autoscaling_head`): the head has the CPUs, and the inference
workers reserve an ``elastic`` resource that only the autoscaler's worker nodes declare (none at
first; at most two). The run (sync, ``rollout.num_inference_workers: 1..2`` with
``rollout.autoscale``) starts by asking for one worker, so the autoscaler launches the first node.
Generation dominates its steps (the learner waits for data a third to a half of each step while the
engine is busy: the test's thresholds suit the tiny model, whose learner step is ~0.15 s), so
the policy grows the fleet to two: the new slot's placement group is pending until the autoscaler
launches a second node, then the worker starts there while the run trains on, loads the current
weights and joins the bus. The test makes the learner the bottleneck meanwhile
(``tests/slow_learner_loss.py``: each learner step sleeps 2 s): once the new worker has served,
the policy shrinks the fleet to one, the leaving worker finishes its requests,
its group is removed, and the autoscaler ends the idle node.

An operator then takes over (`rlpost scale`, as on any running job): `inference=2 --wait` pins two
workers although the learner is the bottleneck (the autoscaler launches a node again, the worker
joins, the policy leaves the pinned role alone), a request outside the range exits 2 and changes
nothing, `rlpost status RUN_DIR` shows the fleet, and `inference=1 --wait` shrinks it: the leaving
worker finishes its requests and the bus re-forms without it. Every metrics line keeps the
accounting, every step trains its prompts once (sync, on-policy throughout), nothing is counted
as a failure, and the run stops on SIGTERM as an operator stops it. (`rlpost scale` of the
service's engines: tests/e2e/test_serve_command.py; env pools leaving a shrink and a lost pool's
share passing to the one left: the supervisor's unit tests and tests/e2e/test_node_loss.py.)
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlpost.ops.local_cluster import alive_nodes, autoscaling_head, driver_token

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
ELASTIC = {"ray.worker.elastic": {"resources": {"CPU": 0, "elastic": 1}, "min_workers": 0, "max_workers": 2}}


def rows_of(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_load_policy_grows_the_fleet_onto_new_nodes_and_releases_them(tmp_path, tiny_model_path):
    import ray

    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    slow = tmp_path / "slow-learner"  # while it exists, each learner step first sleeps the seconds it holds
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env |= {"RAY_AUTH_TOKEN_PATH": str(token), "RLPOST_SLOW_LOSS_FLAG": str(slow), "PYTHONPATH": str(REPO)}
    log = tmp_path / "run.log"
    metrics = tmp_path / "elastic" / "metrics.jsonl"
    with autoscaling_head(worker_types=ELASTIC, head_cpus=2, idle_timeout_s=3.0, env=env) as head, driver_token(head):
        ray.init(address=head.gcs_address, log_to_driver=False)
        args = [
            sys.executable, "-m", "rlpost.ops.cli", "train", "configs/tiny-cpu.yaml",
            f"model.name_or_path={tiny_model_path}", "trainer.mode=sync", "trainer.steps=1000",
            "trainer.prompts_per_step=4", "rollout.max_tokens=64", "rollout.num_inference_workers=1..2",
            "resources.inference.num_cpus=0", 'resources.inference.resources={"elastic": 1}',
            "rollout.autoscale.enabled=true", "rollout.autoscale.window_steps=2", "rollout.autoscale.cooldown_s=5",
            "rollout.autoscale.grow_wait=0.35", "rollout.autoscale.shrink_wait=0.3", "rollout.autoscale.busy_share=0.5",
            "loss.custom_fn=tests.slow_learner_loss:loss_slowed_by_a_flag",
            "eval.interval=0", "logging.progress=false", f"logging.run_dir={tmp_path}", "logging.run_name=elastic",
            "--address", head.gcs_address,
        ]  # fmt: skip
        with log.open("w") as out:
            run = subprocess.Popen(args, cwd=REPO, env=head.env, stdout=out, stderr=subprocess.STDOUT)

        def wait_for(what: str, ok, timeout_s: float = 240) -> list[dict]:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                rows = rows_of(metrics)
                if rows and ok(rows):
                    return rows
                assert run.poll() is None, f"the run ended ({run.returncode}) before {what}:\n{log.read_text()[-4000:]}"
                time.sleep(1)
            raise AssertionError(f"no {what} within {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")

        try:
            rows = wait_for("a first step", lambda rows: True)
            assert (rows[0]["inference_workers"], rows[0]["inference_workers_target"]) in ((1, 1), (1, 2))
            assert len(alive_nodes("elastic")) == 1  # the autoscaler launched a node for the first worker
            rows = wait_for("the policy's grow", lambda rows: any(r.get("autoscale_reason") for r in rows))
            grown = [r for r in rows if r.get("autoscale_reason")]
            assert [(r["autoscale_role"], r["autoscale_reason"]) for r in grown] == [("inference", "engines_bound")]
            slow.write_text("2")  # the learner is the bottleneck from now on (the new worker still loads)
            rows = wait_for("the grown fleet serving", lambda rows: rows[-1]["inference_workers"] == 2)
            assert len(alive_nodes("elastic")) == 2  # a second node, launched for the new worker's group
            rows = wait_for("the fleet shrunk back", lambda rows: rows[-1]["inference_workers_target"] == 1)
            deadline = time.monotonic() + 60
            while len(alive_nodes("elastic")) > 1 and time.monotonic() < deadline:
                time.sleep(1)
            assert len(alive_nodes("elastic")) == 1, "the autoscaler did not end the idle node"
            trained = len(rows_of(metrics))
            wait_for("a step after the node left", lambda rows: len(rows) > trained)

            def rlpost(*words: str) -> subprocess.CompletedProcess:
                return subprocess.run([sys.executable, "-m", "rlpost.ops.cli", *words], cwd=REPO, env=head.env,
                                      capture_output=True, text=True, timeout=400)  # fmt: skip

            run_dir = str(tmp_path / "elastic")
            grown = rlpost("scale", run_dir, "inference=2", "--wait", "300")
            assert grown.returncode == 0, grown.stdout + grown.stderr
            assert "inference workers: 2 serving of 2 wanted" in grown.stdout, grown.stdout
            assert len(alive_nodes("elastic")) == 2  # the pinned worker's node, launched again
            wait_for("a step with both workers", lambda rows: rows[-1]["inference_workers"] == 2)  # what status reads
            refused = rlpost("scale", run_dir, "inference=3")
            assert refused.returncode == 2 and "outside the run's range 1..2" in refused.stderr, refused.stderr
            status = rlpost("status", run_dir)
            assert status.returncode == 0 and "inference workers: 2 serving of 2 wanted" in status.stdout, status.stdout
            pinned = len(rows_of(metrics))
            rows = wait_for("three steps with the pin", lambda rows: len(rows) >= pinned + 3)
            assert all(r["inference_workers_target"] == 2 for r in rows[pinned:])  # the slow learner shrinks nothing
            shrunk = rlpost("scale", run_dir, "inference=1", "--wait", "180")
            assert shrunk.returncode == 0 and "inference workers: 1 serving of 1 wanted" in shrunk.stdout, shrunk
            wait_for("a step with one worker", lambda rows: (rows[-1]["inference_workers"],
                                                             rows[-1]["inference_workers_target"]) == (1, 1))  # fmt: skip
        finally:
            if run.poll() is None:
                run.send_signal(signal.SIGTERM)
            code = run.wait(timeout=180)
    text = log.read_text()
    assert code == 143, text[-4000:]  # stopped by SIGTERM, as an operator stops it
    rows = rows_of(metrics)
    decisions = [(r["step"], r["autoscale_reason"], r["inference_workers_target"]) for r in rows
                 if r.get("autoscale_reason")]  # fmt: skip
    assert [(reason, target) for _, reason, target in decisions] == [("engines_bound", 2), ("learner_bound", 1)], (
        decisions
    )
    grew_at = decisions[0][0]
    window = rows[grew_at - 2 : grew_at]  # the two steps the grow read: the learner waited for data
    assert sum(r["autoscale_wait_share"] for r in window) / 2 >= 0.35 and all(
        r["autoscale_engine_busy"] for r in window
    )
    for row in rows:  # nothing completed is lost or counted twice, on every line
        assert row["groups_put"] == row["groups_trained"] + row["groups_dropped_stale"] + row["groups_in_buffer"], row
        assert row.get("stopped") or 0.0 <= row["autoscale_wait_share"] <= 1.0  # a stop's row has no step time
    assert [row["step"] for row in rows] == list(range(1, len(rows) + 1))
    assert all(row["groups_trained"] == 4 * row["step"] for row in rows if not row.get("stopped")), rows
    assert all(row["staleness_mean"] == 0.0 for row in rows)  # sync mode stays on-policy through the changes
    assert rows[-1]["restarts_inference"] == 0  # growing and shrinking are not failures
    assert "load policy: grow inference workers 1 -> 2: the learner waited" in text
    assert "load policy: shrink inference workers 2 -> 1: the learner waited" in text
    assert "the cluster has room for inference-1 (a new slot" in text and "inference-1 is up (" in text
    assert "scaling the inference fleet from 2 to 1" in text
