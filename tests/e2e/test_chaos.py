"""The chaos harness, short: real `rlpost train` runs of the tiny job that lose actors.

scripts/chaos.py ends actors at random moments in random ways (`make chaos`: 20 runs). Here
three fixed plans cover the roles whose loss costs the most state, each way of dying once: an
inference worker's process killed by SIGKILL (bus re-form, request re-issue), the buffer ended
as Ray ends a crashed actor (rebuilt from the ledger and the pools' outboxes), and the learner
killed by SIGKILL followed by an env pool's process exiting on SIGTERM (auto-resume from a
checkpoint, then a pool restart); ``ray.kill`` is the e2e fault tests'.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from chaos_script import load_chaos  # tests/chaos_script.py

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(1500)]
REPO = Path(__file__).resolve().parents[2]


def test_runs_finish_with_consistent_accounting_when_actors_are_killed(tmp_path, tiny_model_path):
    chaos = load_chaos()
    plans = [
        chaos.Plan("chaos-inference", "sync", [chaos.Kill("inference-0", 2, 0.6, "SIGKILL")]),
        chaos.Plan("chaos-buffer", "async", [chaos.Kill("buffer", 2, 0.3, "ray.kill(no_restart=False)")]),
        # resumed steps take ~0.5 s here: the pool's kill comes early enough that the run is
        # still going (a kill planned after line 6 + 0.8 s could find the run finished)
        chaos.Plan(
            "chaos-learner-pool",
            "sync",
            [chaos.Kill("learner", 3, 0.2, "SIGKILL"), chaos.Kill("env-pool-0", 5, 0.2, "SIGTERM")],
        ),
    ]
    for plan in plans:
        outcome = chaos.run_plan(plan, tmp_path, tiny_model_path, steps=8, timeout_s=480)
        assert outcome.killed == [k.victim for k in plan.kills], outcome
        assert outcome.passed, (plan.name, outcome.problems)
        rows = [json.loads(line) for line in (tmp_path / plan.name / "metrics.jsonl").read_text().splitlines()]
        if plan.mode == "sync":  # every prompt of every step trained once, none dropped
            assert rows[-1]["groups_trained"] == 8 * 8 and rows[-1]["groups_put"] == 8 * 8
            assert all(r["groups_dropped_stale"] == 0 and r["groups_in_buffer"] == 0 for r in rows)
        assert all(r["sync_logprob_diff"] <= 1e-3 for r in rows)


def test_sigterm_writes_a_final_checkpoint_and_the_run_resumes_from_it(tmp_path, tiny_model_path):
    run_dir = tmp_path / "stopped"
    args = [
        sys.executable,
        "-m",
        "rlpost.cli",
        "train",
        "configs/tiny-cpu.yaml",
        f"model.name_or_path={tiny_model_path}",
        "trainer.prompts_per_step=4",
        "logging.progress=false",
    ]
    proc = subprocess.Popen(
        [*args, "trainer.steps=40", "--run-dir", str(run_dir)],
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 143, err[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and last < 40
    assert f"stopped after step {last}" in err and "rlpost: stopped by SIGTERM" in err
    assert (run_dir / "checkpoints" / f"step_{last}" / "trainer_state.pt").is_file()

    resumed = subprocess.run(
        [sys.executable, "-m", "rlpost.cli", "train", "--resume", str(run_dir), f"trainer.steps={last + 2}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, last + 3))
    assert [r["policy_version"] for r in rows] == list(range(1, last + 3))
    assert not (run_dir / "metrics.superseded.jsonl").exists()  # nothing trained twice
    assert f"steps: {last + 2}" in (run_dir / "config.yaml").read_text()  # the folder records the new length
