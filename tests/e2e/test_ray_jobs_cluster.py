"""Ray Jobs end to end: `rlpost submit | logs | status | stop` against a real `ray start --head`
with its dashboard and token authentication (the token in a file of the test's own, found through
RAY_AUTH_TOKEN_PATH with RAY_AUTH_MODE unset, as a user's shell would have it)."""

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlpost import jobs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(start_ray_head, tmp_path_factory):
    token = tmp_path_factory.mktemp("auth") / "token"
    token.write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_AUTH_TOKEN_PATH"] = str(token)
    return start_ray_head(dashboard=True, env=env)


def rlpost(cluster, *args, env=None, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "rlpost.cli", *args, "--address", cluster.dashboard],
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


def test_submit_follow_status_and_logs_of_a_tiny_run(cluster, tiny_model_path, tmp_path):
    job = "rlpost-jobs-e2e"
    out = rlpost(
        cluster,
        "submit",
        *tiny_run(tiny_model_path, tmp_path, "jobs-e2e", steps=2),
        "resources.env_vars.RLPOST_E2E_MARK=from-config",
        "--follow",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.splitlines()[0] == f"rlpost: submitted job {job} to {cluster.dashboard}"
    assert f"dashboard:   {cluster.dashboard}/#/jobs/{job}" in out.stdout
    assert f"rlpost: run finished: {tmp_path / 'jobs-e2e'}" in out.stdout  # the followed logs
    assert f"rlpost: job {job} SUCCEEDED" in out.stderr

    status = rlpost(cluster, "status", job)
    assert status.returncode == 0
    assert status.stdout.startswith(f"{job}: SUCCEEDED")
    logs = rlpost(cluster, "logs", job)
    assert logs.returncode == 0 and "rlpost: run finished" in logs.stdout
    metrics = (tmp_path / "jobs-e2e" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 2

    info = jobs.connect(cluster.dashboard, environ=cluster.env).get_job_info(job)
    assert info.runtime_env["env_vars"]["RLPOST_E2E_MARK"] == "from-config"
    assert info.runtime_env["working_dir"].startswith("gcs://")  # the checkout went up as a package
    assert info.entrypoint.startswith("rlpost train configs/tiny-cpu.yaml ")

    # the run goes on as a new job: `rlpost train --resume RUN_DIR` from its final checkpoint
    run_dir = tmp_path / "jobs-e2e"
    resumed = rlpost(
        cluster, "submit", "--resume", str(run_dir), "trainer.steps=3", "--job-id", f"{job}-resume", "--follow"
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"rlpost: job {job}-resume SUCCEEDED" in resumed.stderr
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3


def test_stop_ends_a_running_job(cluster, tiny_model_path, tmp_path):
    job = "rlpost-jobs-e2e-stop"
    out = rlpost(cluster, "submit", *tiny_run(tiny_model_path, tmp_path, "jobs-e2e-stop", steps=1000))
    assert out.returncode == 0, out.stderr[-3000:]
    client = jobs.connect(cluster.dashboard, environ=cluster.env)
    deadline = time.monotonic() + 120
    while "rlpost: run directory" not in client.get_job_logs(job) and time.monotonic() < deadline:
        time.sleep(1)  # the driver has started and installed its SIGTERM handler
    assert str(client.get_job_status(job)) == "RUNNING"

    out = rlpost(cluster, "stop", job)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"rlpost: job {job} STOPPED" in out.stdout
    status = rlpost(cluster, "status", job)
    assert status.returncode == 1 and status.stdout.startswith(f"{job}: STOPPED")


def test_doctor_compares_ray_with_the_clusters(cluster):
    out = rlpost(cluster, "doctor")
    assert (
        "ok    cluster" in out.stdout and f"{cluster.dashboard} runs Ray " in out.stdout and ", as here" in out.stdout
    )
