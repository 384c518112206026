"""Whole runs of the service with the tiny model (real vLLM, real bus), on the tier's shared Ray cluster
(conftest.py) or on a local one of their own."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.long  # two engines and a restart: ~75 s, more than make test's budget has room for
def test_a_worker_lost_before_a_weight_sync_is_restarted_and_the_bus_reformed(tmp_path, tiny_model_path):
    import ray

    from rlpost.config import load_config
    from rlpost.record.run_dir import create_run_dir
    from rlpost.service.loop import Controller
    from rlpost.service.run import start_run

    cfg = load_config(
        "configs/tiny-cpu.yaml",
        [
            f"model.name_or_path={tiny_model_path}",
            "rollout.num_inference_workers=2",
            "trainer.steps=4",
            "trainer.prompts_per_step=4",
            "weight_sync.timeout_s=10",
            "logging.progress=false",
            "resources.inference.num_cpus=0.25",
            "logging.run_name=e2e-reform",
        ],
    )
    run_dir = create_run_dir(cfg, tmp_path / "reform")

    class KillOneWorker(Controller):
        def _train(self, groups, step):
            record = super()._train(groups, step)
            if step == 2:  # dies between training and the weight sync of step 2
                ray.kill(self.fleet.inference[1].handle)
            return record

    ray.init(num_cpus=2, include_dashboard=False, namespace="rlpost-e2e-reform", log_to_driver=False)
    supervisor = None
    try:
        supervisor = start_run(cfg, run_dir)
        KillOneWorker(cfg, run_dir, supervisor).run()
    finally:
        if supervisor is not None:
            supervisor.close()
        ray.shutdown()
    rows = read(run_dir / "metrics.jsonl")
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4]
    assert rows[1]["bus_reforms"] == 1  # the sync of step 2 failed, re-formed and was resent
    assert [r["restarts_inference"] for r in rows] == [0, 1, 1, 1]  # inference-1 was started again
    assert all(r["sync_logprob_diff"] <= 1e-3 for r in rows)


@pytest.mark.long  # a whole run through `rlpost train` (30-35 s): make test-long
def test_a_tool_using_run_joins_an_existing_token_authenticated_cluster(tmp_path, tiny_tool_model_path, ray_head):
    """`rlpost train --address` on the tier's `ray start --head` cluster (token authentication on,
    as Ray 2.60 has it by default; the token found through RAY_AUTH_TOKEN_PATH, RAY_AUTH_MODE
    unset), with the tool variant of the tiny model. It calls the sandboxed Python tool in about
    half of its samples from step 1: multi-turn episodes run through the env-pool actor (bwrap
    inside Ray) and their counts reach metrics.jsonl."""
    run_dir = tmp_path / "tools"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlpost.ops.cli",
            "train",
            "configs/tiny-cpu-tools.yaml",
            f"model.name_or_path={tiny_tool_model_path}",
            "trainer.steps=3",
            "trainer.prompts_per_step=4",
            "logging.progress=false",
            "--address",
            ray_head.gcs_address,
            "--run-dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=540,
        env=ray_head.env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"rlpost: Ray cluster at {ray_head.gcs_address}; " in out.stdout  # it joined, started no cluster
    rows = read(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0.1 < r["tool_calls_mean"] <= 1.0  # at most one code block per episode here
        assert 1.0 < r["turns_mean"] <= 2.0  # rollout.max_turns=2
        assert 0.0 <= r["tool_error_fraction"] <= 1.0 and r["tool_time_s"] > 0
        assert r["reward_errors"] == 0
        assert r["sync_logprob_diff"] <= 1e-3
    assert "tools: python; model-written code runs in sandbox bwrap" in out.stderr  # the log says what guards it
