"""Ray Jobs end to end: `rlpost submit | logs | status | stop` against a real `ray start --head`
with its dashboard and token authentication (the tier's shared cluster, conftest.py: the token in
a file of its own, found through RAY_AUTH_TOKEN_PATH with RAY_AUTH_MODE unset, as a user's shell
would have it). The submitted job is also the tier's check of a whole sync run: evaluations,
checkpoints, metrics, trackers and plots."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlpost.ops import jobs
from rlpost.record.metrics import REQUIRED_KEYS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cluster(ray_head):
    return ray_head


def rlpost(cluster, *args, env=None, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "rlpost.ops.cli", *args, "--address", cluster.dashboard],
        cwd=REPO,
        env=env or cluster.env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tiny_run(tiny_model_path, tmp_path, name, steps):
    return [
        "configs/tiny-cpu.yaml",
        f"model.name_or_path={tiny_model_path}",
        f"trainer.steps={steps}",
        "trainer.prompts_per_step=4",
        "logging.progress=false",
        f"logging.run_dir={tmp_path}",
        f"logging.run_name={name}",
    ]


def test_a_bad_config_key_exits_2_and_submits_nothing(cluster):
    client = jobs.connect(cluster.dashboard, environ=cluster.env)
    before = len(client.list_jobs())
    out = rlpost(cluster, "submit", "configs/tiny-cpu.yaml", "trainer.stepz=2")
    assert out.returncode == 2
    assert out.stderr.strip() == "rlpost: error: unknown config key: trainer.stepz"
    assert len(client.list_jobs()) == before


def test_an_unknown_job_id_exits_2(cluster):
    out = rlpost(cluster, "status", "no-such-job")
    assert out.returncode == 2
    assert out.stderr.strip() == f"rlpost: error: no job no-such-job on {cluster.dashboard}"


def test_without_the_right_token_the_cluster_refuses_with_a_clear_error(cluster, tmp_path):
    wrong = {**cluster.env, "RAY_AUTH_TOKEN": "not-the-token"}
    out = rlpost(cluster, "status", "no-such-job", env=wrong)
    assert out.returncode == 1
    assert (
        f"the Ray dashboard at {cluster.dashboard} rejected the authentication token from RAY_AUTH_TOKEN" in out.stderr
    )
    none = {k: v for k, v in cluster.env.items() if k != "RAY_AUTH_TOKEN_PATH"} | {"HOME": str(tmp_path)}
    out = rlpost(cluster, "status", "no-such-job", env=none)
    assert out.returncode == 1
    assert "requires token authentication and no token was found" in out.stderr


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_submitted_sync_run_trains_evaluates_checkpoints_then_resumes_as_a_new_job_scaled_and_stopped(
    cluster, tiny_model_path, tmp_path
):
    job = "rlpost-jobs-e2e"
    out = rlpost(
        cluster,
        "submit",
        *tiny_run(tiny_model_path, tmp_path, "jobs-e2e", steps=4),
        "trainer.checkpoint_interval=2",
        "eval.interval=2",
        "eval.before_training=true",
        "eval.num_prompts=8",
        "resources.env_vars.RLPOST_E2E_MARK=from-config",
        "--follow",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = tmp_path / "jobs-e2e"
    assert out.stdout.splitlines()[0] == f"rlpost: submitted job {job} to {cluster.dashboard}"
    assert f"dashboard:   {cluster.dashboard}/#/jobs/{job}" in out.stdout
    assert f"rlpost: run finished: {run_dir}" in out.stdout  # the followed logs
    assert f"rlpost: job {job} SUCCEEDED" in out.stderr

    # the run: what `rlpost train` of this config writes, wherever its driver runs
    rows = read(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert set(REQUIRED_KEYS) <= set(r)
        assert r["sync_logprob_diff"] <= 1e-3  # inference and learner hold the same weights
        assert r["staleness_mean"] == 0  # sync mode is on-policy
        assert 0 <= r["reward_mean"] <= 1 and r["samples_per_s"] > 0
        # where the step's time went: the parts are positive and add up to at most the whole
        parts = [r["collect_s"], r["train_s"], r["weight_sync_s"]]
        assert min(parts) > 0 and sum(parts) <= r["step_time_s"]
        assert 0 < r["learner_step_s"] <= r["train_s"] and 0 < r["weight_load_s"] <= r["weight_sync_s"]
    # held-out evaluations: before training, then at steps 2 and 4 with that step's weights
    evals = read(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 4] and [e["eval_policy_version"] for e in evals] == [0, 2, 4]
    for e in evals:
        assert 0 <= e["eval_pass_at_1"] <= 1 and 0 <= e["eval_reward_mean"] <= 1 and e["eval_num_prompts"] == 8
        assert 0 < e["eval_length_mean"] <= 16 and e["eval_s"] > 0
    assert [("eval_pass_at_1" in r) for r in rows] == [False, True, False, True]
    assert rows[3]["eval_reward_mean"] == evals[2]["eval_reward_mean"]
    assert "evaluation before training" in out.stdout
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))  # the default tracker wrote
    assert (run_dir / "reward.png").stat().st_size > 1000 and (run_dir / "step_time.png").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_2", "step_4"]
    assert (run_dir / "checkpoints" / "step_4" / "config.json").is_file()

    status = rlpost(cluster, "status", job)
    assert status.returncode == 0
    assert status.stdout.startswith(f"{job}: SUCCEEDED")
    logs = rlpost(cluster, "logs", job)
    assert logs.returncode == 0 and "rlpost: run finished" in logs.stdout

    info = jobs.connect(cluster.dashboard, environ=cluster.env).get_job_info(job)
    assert info.runtime_env["env_vars"]["RLPOST_E2E_MARK"] == "from-config"
    assert info.runtime_env["working_dir"].startswith("gcs://")  # the checkout went up as a package
    assert info.entrypoint.startswith("rlpost train configs/tiny-cpu.yaml ")

    # the run goes on as a new job (`rlpost train --resume RUN_DIR` from its final checkpoint), which
    # is then scaled and stopped while it runs: one more job start, not two
    resumed = f"{job}-resume"
    out = rlpost(
        cluster, "submit", "--resume", str(run_dir), "trainer.steps=1000", "trainer.checkpoint_interval=1000",
        "--job-id", resumed,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    client = jobs.connect(cluster.dashboard, environ=cluster.env)
    deadline = time.monotonic() + 240
    while len(read(run_dir / "metrics.jsonl")) < 5:  # its actors are up and it trains from step_4 on
        assert time.monotonic() < deadline, client.get_job_logs(resumed)[-3000:]
        time.sleep(0.5)

    # `rlpost scale JOB`: a short job beside the run leaves the request in its mailbox (the count
    # it has, so no engine starts here; growing and shrinking a fleet is the long tier's test)
    out = rlpost(cluster, "scale", resumed, "inference=1", "--wait", "120")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "asked for 1 inference workers" in out.stdout and "1 serving of 1 wanted" in out.stdout
    fleet = rlpost(cluster, "status", resumed, "--fleet")  # asked of the run by a short job beside it
    assert fleet.returncode == 0 and fleet.stdout.startswith(f"{resumed}: RUNNING"), fleet.stdout[-3000:]
    assert "inference workers: 1 serving of 1 wanted" in fleet.stdout, fleet.stdout[-3000:]
    assert "env pools: 1 serving of 1 wanted" in fleet.stdout, fleet.stdout[-3000:]
    bad = rlpost(cluster, "scale", resumed, "inference=0")
    assert bad.returncode == 2 and "at least one inference worker" in bad.stderr, bad.stderr
    unknown = rlpost(cluster, "scale", "no-such-job", "inference=2")
    assert unknown.returncode == 2 and "no job no-such-job" in unknown.stderr, unknown.stderr
    out = rlpost(cluster, "stop", resumed)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"rlpost: job {resumed} STOPPED" in out.stdout
    status = rlpost(cluster, "status", resumed)
    assert status.returncode == 1 and status.stdout.startswith(f"{resumed}: STOPPED")
    steps = [r["step"] for r in read(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 5  # steps 1-4, then the resumed job's


def test_doctor_compares_ray_with_the_clusters(cluster):
    out = rlpost(cluster, "doctor")
    assert (
        "ok    cluster" in out.stdout and f"{cluster.dashboard} runs Ray " in out.stdout and ", as here" in out.stdout
    )
