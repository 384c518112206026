"""The pure parts of `rlpost submit`: the auth token, the runtime env and its excludes, the
entrypoint, the working dir and the address; and the errors of an unreachable or silent cluster."""

import json
import shlex
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rlpost.config import ConfigError, load_config
from rlpost.ops import jobs

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


# ------------------------------------------------------------------------------ the token


def test_token_sources_in_rays_order(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-path\n")
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("from-home")
    both = {"RAY_AUTH_TOKEN": " from-env ", "RAY_AUTH_TOKEN_PATH": str(token_file)}

    assert jobs.find_auth_token(both, tmp_path) == jobs.AuthToken("from-env", "RAY_AUTH_TOKEN")
    assert jobs.find_auth_token({"RAY_AUTH_TOKEN_PATH": str(token_file)}, tmp_path).value == "from-path"
    assert jobs.find_auth_token({}, tmp_path) == jobs.AuthToken("from-home", str(tmp_path / ".ray" / "auth_token"))
    assert jobs.find_auth_token({}, tmp_path / "nobody") is None
    assert jobs.find_auth_token({**both, "RAY_AUTH_MODE": "disabled"}, tmp_path) is None
    assert jobs.AuthToken("abc", "x").header() == {"Authorization": "Bearer abc"}


def test_a_token_path_without_a_token_is_an_error_as_in_ray(tmp_path):
    with pytest.raises(ConfigError, match=f"RAY_AUTH_TOKEN_PATH={tmp_path / 'missing'}: no token there"):
        jobs.find_auth_token({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")}, tmp_path)
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ConfigError, match="no token there"):
        jobs.find_auth_token({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "empty")}, tmp_path)


def test_the_token_is_the_one_rays_own_loader_reads(tmp_path):
    """Ray's AuthenticationTokenLoader (what `ray job submit` uses) on the same environments."""
    token_file = tmp_path / "token"
    token_file.write_text("from-path")
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("from-home")
    cases = [
        {"RAY_AUTH_TOKEN": "from-env", "RAY_AUTH_TOKEN_PATH": str(token_file)},
        {"RAY_AUTH_TOKEN_PATH": str(token_file)},
        {},
    ]
    script = (
        "import json, os, sys\n"
        "from ray._raylet import AuthenticationTokenLoader\n"
        "loader, found = AuthenticationTokenLoader.instance(), []\n"
        "for case in json.loads(sys.argv[1]):\n"
        "    for k in ('RAY_AUTH_TOKEN', 'RAY_AUTH_TOKEN_PATH'): os.environ.pop(k, None)\n"
        "    os.environ.update(case); loader.reset_cache()\n"
        "    found.append(loader.get_raw_token(ignore_auth_mode=True))\n"
        "print(json.dumps(found))\n"
    )
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rays = json.loads(out.stdout.strip().splitlines()[-1])
    assert (
        rays == [jobs.find_auth_token(case, tmp_path).value for case in cases] == ["from-env", "from-path", "from-home"]
    )


# ------------------------------------------------------------------------------ entrypoint and runtime env


def test_entrypoint_quotes_every_argument():
    overrides = ["data.system_prompt=Think step by step; answer with 'x'", "trainer.steps=3"]
    entrypoint = jobs.build_entrypoint("configs/my run.yaml", overrides)
    assert shlex.split(entrypoint) == ["rlpost", "train", "configs/my run.yaml", *overrides]
    assert (
        jobs.build_entrypoint("configs/tiny-cpu.yaml", ["trainer.steps=2"])
        == "rlpost train configs/tiny-cpu.yaml trainer.steps=2"
    )


def test_runtime_env_carries_the_config_env_vars_and_the_excludes(tmp_path):
    cfg = load_config("configs/tiny-cpu.yaml", ["resources.env_vars.HF_HOME=/data/hf", "logging.run_dir=outputs/grpo"])
    env = jobs.build_runtime_env(cfg, tmp_path)
    assert env["working_dir"] == str(tmp_path)
    assert env["env_vars"] == {
        "PYTHONUNBUFFERED": "1",
        "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1",
        "HF_HOME": "/data/hf",
        "PYTHONHASHSEED": "0",
    }  # the job's driver starts with the run's hash seed
    assert {".venv", ".git", "runs", ".cache", "__pycache__", "*.egg-info"} <= set(env["excludes"])
    assert env["excludes"][-1] == "/outputs"  # a custom run_dir's earlier runs are not uploaded
    assert "working_dir" not in jobs.build_runtime_env(cfg, None)


def test_rays_packer_leaves_out_venv_runs_caches_and_build_outputs(tmp_path):
    """The excludes as Ray's own working-dir packer applies them."""
    from ray._private.runtime_env.packaging import create_package

    tree = tmp_path / "project"
    for name in [
        "pyproject.toml",
        "configs/a.yaml",
        "rlpost/ops/cli.py",
        "rlpost/record/run_dir.py",
        ".venv/bin/python",
        ".git/HEAD",
        "runs/old/metrics.jsonl",
        ".cache/tiny-teacher/config.json",
        "rlpost/__pycache__/cli.pyc",
        "rlpost.egg-info/PKG-INFO",
        ".pytest_cache/v",
        "build/lib/x.py",
        "outputs/run/metrics.jsonl",
        "docs/build/index.md",
    ]:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text("x")
    cfg = load_config("configs/tiny-cpu.yaml", ["logging.run_dir=outputs"])
    package = tmp_path / "pkg.zip"
    create_package(str(tree), package, include_gitignore=True, excludes=jobs.build_runtime_env(cfg, tree)["excludes"])
    files = {n for n in zipfile.ZipFile(package).namelist() if not n.endswith("/")}
    assert files == {
        "pyproject.toml",
        "configs/a.yaml",
        "rlpost/ops/cli.py",
        "rlpost/record/run_dir.py",
        "docs/build/index.md",
    }


# ------------------------------------------------------------------------------ planning a submission


def test_plan_names_the_job_after_the_run_and_passes_the_config_relative_to_the_working_dir(tmp_path):
    plan = jobs.plan_submission(
        "configs/tiny-cpu.yaml", ["model.name_or_path=/models/tiny", "trainer.steps=2"], working_dir=REPO, cwd=REPO
    )
    name = plan.run_name
    assert plan.job_id == f"rlpost-{name}" and plan.metadata["rlpost_run_name"] == name
    assert shlex.split(plan.entrypoint) == [
        "rlpost",
        "train",
        "configs/tiny-cpu.yaml",
        "model.name_or_path=/models/tiny",
        "trainer.steps=2",
        f"logging.run_name={name}",
    ]
    assert any("model.name_or_path=/models/tiny is an absolute path" in n for n in plan.notes)
    assert any("logging.run_dir=runs is relative" in n for n in plan.notes)
    # from a subfolder the config path is still given relative to the working dir
    sub = jobs.plan_submission(
        "../configs/tiny-cpu.yaml",
        ["model.name_or_path=/m", "logging.run_name=r1"],
        working_dir=REPO,
        cwd=REPO / "rlpost",
        job_id="my-job",
    )
    assert sub.job_id == "my-job" and shlex.split(sub.entrypoint)[2] == "configs/tiny-cpu.yaml"


def test_a_serve_job_runs_rlpost_serve_with_its_checked_config():
    plan = jobs.plan_serve("configs/serve-tiny-cpu.yaml", ["host=0.0.0.0", "port=8080"], working_dir=REPO, cwd=REPO)
    assert shlex.split(plan.entrypoint) == ["rlpost", "serve", "configs/serve-tiny-cpu.yaml", "host=0.0.0.0",
                                            "port=8080"]  # fmt: skip
    assert plan.job_id.startswith("rlpost-serve-") and plan.runtime_env["working_dir"] == str(REPO)
    assert "/serve-storage" in plan.runtime_env["excludes"]
    assert any("port 8080 of the node" in note for note in plan.notes)
    local = jobs.plan_serve(None, [], working_dir=None, job_id="svc")
    assert local.entrypoint == "rlpost serve" and local.job_id == "svc"
    assert any("set host=0.0.0.0" in note for note in local.notes)
    with pytest.raises(ConfigError, match="unknown config key: prot"):
        jobs.plan_serve(None, ["prot=1"], working_dir=None)


def test_plan_refuses_what_the_cluster_would_not_see(tmp_path):
    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    (project / "models" / "tiny-model").mkdir(parents=True)
    (project / ".cache" / "tiny-teacher").mkdir(parents=True)
    (project / "configs" / "tiny.yaml").write_text((REPO / "configs" / "tiny-cpu.yaml").read_text())
    outside = tmp_path / "mine.yaml"
    outside.write_text((REPO / "configs" / "tiny-cpu.yaml").read_text())

    def plan(config, *overrides, **kwargs):
        return jobs.plan_submission(config, list(overrides), working_dir=project, cwd=project, **kwargs)

    with pytest.raises(ConfigError, match=f"config: {outside} is outside the working dir {project}"):
        plan(outside, "model.name_or_path=/m")
    # the config's default model, shipped in models/, goes with the working dir; a local cache never does
    assert plan("configs/tiny.yaml").entrypoint.startswith("rlpost train configs/tiny.yaml")
    with pytest.raises(
        ConfigError, match=r"model.name_or_path: .cache/tiny-teacher is not uploaded with the working dir"
    ):
        plan("configs/tiny.yaml", "model.name_or_path=.cache/tiny-teacher")
    with pytest.raises(ConfigError, match=f"data.dataset: ./none.jsonl is not in the working dir {project}"):
        plan("configs/tiny.yaml", "model.name_or_path=/m", "data.dataset=./none.jsonl")
    with pytest.raises(ConfigError, match="--job-id: job id 'a b'"):
        plan("configs/tiny.yaml", "model.name_or_path=/m", job_id="a b")
    with pytest.raises(ConfigError, match="logging.run_name: job id 'rlpost-a/b'"):
        plan("configs/tiny.yaml", "model.name_or_path=/m", "logging.run_name=a/b")
    with pytest.raises(ConfigError, match="unknown config key: trainer.stepz"):
        plan("configs/tiny.yaml", "trainer.stepz=1")


def test_without_a_working_dir_the_config_path_goes_as_given():
    plan = jobs.plan_submission(
        "configs/gsm8k-qwen2.5-1.5b.yaml", ["logging.run_dir=/data/runs"], working_dir=None, cwd=REPO
    )
    assert shlex.split(plan.entrypoint)[:3] == ["rlpost", "train", "configs/gsm8k-qwen2.5-1.5b.yaml"]
    assert "working_dir" not in plan.runtime_env and plan.notes == []


def test_the_working_dir_is_the_rlpost_checkout(tmp_path):
    assert jobs.choose_working_dir(None, cwd=REPO / "configs") == REPO
    assert jobs.choose_working_dir(None, upload=False) is None
    assert jobs.choose_working_dir(str(tmp_path)) == tmp_path.resolve()
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\n')
    with pytest.raises(ConfigError, match="not inside an rlpost source checkout"):
        jobs.choose_working_dir(None, cwd=tmp_path)
    with pytest.raises(ConfigError, match="--working-dir /no/such: not a folder"):
        jobs.choose_working_dir("/no/such")


# ------------------------------------------------------------------------------ the address and the client


def test_address_explicit_first_then_the_environment():
    env = {"RAY_API_SERVER_ADDRESS": "http://api:8265", "RAY_ADDRESS": "http://ray:8265"}
    assert jobs.resolve_address("head:8265/", env) == "http://head:8265"
    assert jobs.resolve_address(None, env) == "http://api:8265"
    assert jobs.resolve_address(None, {"RAY_ADDRESS": "https://ray:8265"}) == "https://ray:8265"
    with pytest.raises(ConfigError, match="no cluster address"):
        jobs.resolve_address(None, {"RAY_ADDRESS": "head:6379"})  # a GCS address, not the dashboard
    with pytest.raises(ConfigError, match="give the dashboard's http"):
        jobs.resolve_address("ray://head:10001", {})
    assert jobs.dashboard_url("http://head:8265", "rlpost-x") == "http://head:8265/#/jobs/rlpost-x"
    assert jobs.status_exit_code("SUCCEEDED") == jobs.status_exit_code("RUNNING") == 0
    assert jobs.status_exit_code("FAILED") == jobs.status_exit_code("STOPPED") == 1


def test_an_unreachable_cluster_is_a_clear_error_naming_the_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    out = subprocess.run(
        [sys.executable, "-m", "rlpost.ops.cli", "status", "some-job", "--address", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert out.stderr.strip() == (
        f"rlpost: failed: cannot reach the Ray dashboard at http://127.0.0.1:{port} (Connection "
        "refused); is the cluster up, and is this its dashboard address (http://HEAD:8265)?"
    )


def test_a_silent_cluster_times_out_instead_of_hanging():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()  # connections complete, but nothing ever answers
        address = f"http://127.0.0.1:{server.getsockname()[1]}"
        with pytest.raises(jobs.ClusterError, match=f"the Ray dashboard at {address} did not answer within 1 s"):
            jobs.connect(address, timeout_s=1.0, environ={})


@pytest.mark.parametrize("command", ["submit", "status", "logs", "stop", "doctor"])
def test_help_of_the_cluster_commands(command):
    out = subprocess.run(
        [sys.executable, "-m", "rlpost.ops.cli", command, "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and f"usage: rlpost {command}" in out.stdout


class FakeClient:
    """What follow_logs uses of a JobSubmissionClient: a log stream and status calls."""

    rlpost_address = "http://fake:8265"

    def __init__(self, chunks, statuses, hang=False, status_error=None):
        self.chunks, self.statuses, self.hang, self.status_error = chunks, list(statuses), hang, status_error

    async def tail_job_logs(self, job_id):
        import asyncio

        for chunk in self.chunks:
            yield chunk
        if self.hang:  # a stream that never closes
            await asyncio.sleep(3600)

    def get_job_status(self, job_id):
        if self.status_error:
            raise self.status_error
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]

    def get_job_info(self, job_id):
        class Info:
            status = self.get_job_status(job_id)

        return Info()


def test_follow_prints_the_stream_and_returns_the_final_status():
    import io

    out = io.StringIO()
    client = FakeClient(["a\n", "b\n"], ["RUNNING", "SUCCEEDED"])
    assert jobs.follow_logs(client, "j", out, poll_s=0.05) == "SUCCEEDED"
    assert out.getvalue() == "a\nb\n"


def test_follow_ends_when_the_job_ends_even_if_the_stream_stays_open():
    import io

    client = FakeClient(["a\n"], ["RUNNING", "RUNNING", "FAILED"], hang=True)
    assert jobs.follow_logs(client, "j", io.StringIO(), poll_s=0.05) == "FAILED"


def test_follow_reports_a_vanished_cluster_instead_of_waiting():
    import io

    client = FakeClient([], ["RUNNING"], hang=True)
    client.get_job_info = lambda job_id: type("Info", (), {"status": "RUNNING"})()
    client.status_error = jobs.ClusterError("cannot reach the Ray dashboard at http://fake:8265 (gone)")
    with pytest.raises(jobs.ClusterError, match=r"^cannot reach the Ray dashboard at http://fake:8265 \(gone\)$"):
        jobs.follow_logs(client, "j", io.StringIO(), poll_s=0.05)


def test_plan_resume_of_a_run_visible_here_validates_its_config(tmp_path):
    from rlpost.config import load_config, save_config

    run_dir = tmp_path / "runs" / "r7"
    cfg = load_config("configs/tiny-cpu.yaml", ["logging.run_name=r7", "resources.env_vars.MARK=kept"])
    save_config(cfg, run_dir / "config.yaml")
    plan = jobs.plan_resume(run_dir, ["trainer.steps=900"], working_dir=None, job_id="again")
    assert shlex.split(plan.entrypoint) == ["rlpost", "train", "--resume", str(run_dir), "trainer.steps=900"]
    assert plan.job_id == "again" and plan.run_name == "r7" and plan.notes == []
    assert plan.runtime_env["env_vars"]["MARK"] == "kept"
    with pytest.raises(ConfigError, match="unknown config key: trainer.stepz"):
        jobs.plan_resume(run_dir, ["trainer.stepz=1"], working_dir=None)
    default = jobs.plan_resume(run_dir, [], working_dir=REPO)
    assert default.job_id.startswith("rlpost-r7-resume-") and default.runtime_env["working_dir"] == str(REPO)


def test_plan_resume_of_a_run_only_the_cluster_sees_and_bad_input(tmp_path):
    plan = jobs.plan_resume("/data/runs/r8", [], working_dir=None)
    assert shlex.split(plan.entrypoint) == ["rlpost", "train", "--resume", "/data/runs/r8"]
    assert plan.run_name == "r8" and "is not visible here" in plan.notes[0]
    with pytest.raises(ConfigError, match="give the run directory's absolute path"):
        jobs.plan_resume("runs/r8", [], working_dir=None)
    with pytest.raises(ConfigError, match="override 'trainer.steps' is not of the form"):
        jobs.plan_resume("/data/runs/r8", ["trainer.steps"], working_dir=None)


@pytest.mark.parametrize(
    "args, message",
    [
        (["submit", "--address", "http://127.0.0.1:1"], "submit needs a CONFIG file (or --resume RUN_DIR)"),
        (
            ["submit", "--resume", "/data/runs/r", "configs/tiny-cpu.yaml", "--address", "http://127.0.0.1:1"],
            "submit --resume RUN_DIR takes the run's own config.yaml",
        ),
    ],
)
def test_submit_command_line_errors(args, message, capsys):
    from rlpost.ops.cli import main

    assert main(args) == 2
    assert message in capsys.readouterr().err
