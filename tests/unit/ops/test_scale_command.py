"""The pure parts of `rlpost scale` and `rlpost status RUN_DIR`: the worker range in the config,
the request's words, the job beside a submitted run, and the exit codes of bad requests (the
real fleet changes are tests/unit/test_supervisor.py's over stand-ins and tests/e2e/test_autoscaling.py's)."""

import json
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlpost.config import ConfigError, load_config, save_config
from rlpost.ops import jobs
from rlpost.service.mailbox import describe_fleet, fleet_reached, parse_scale_request

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "rlpost.ops.cli", *args], capture_output=True, text=True, cwd=REPO)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["rollout.num_inference_workers=1..4"], (1, 4, (1, 4), 4)),
        (["rollout.num_inference_workers=2..2"], (2, 2, (2, 2), 2)),
        (["rollout.num_inference_workers=3"], (3, None, (1, None), 3)),
        (["rollout.num_inference_workers=2", "rollout.max_inference_workers=5"], (2, 5, (2, 5), 5)),
    ],
)
def test_a_worker_range_is_a_start_and_a_top(overrides, expected, tmp_path):
    cfg = load_config("configs/tiny-cpu.yaml", overrides)
    roll = cfg.rollout
    got = (roll.num_inference_workers, roll.max_inference_workers, roll.inference_worker_bounds(),
           roll.inference_worker_target())  # fmt: skip
    assert got == expected
    save_config(cfg, tmp_path / "config.yaml")  # the saved config says the same
    again = load_config(tmp_path / "config.yaml").rollout
    assert (again.num_inference_workers, again.max_inference_workers) == expected[:2]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("4..1", "the range '4..1' needs 1 <= A <= B"),
        ("0..2", "the range '0..2' needs 1 <= A <= B"),
        ("a..b", "a range is two whole numbers A..B, got 'a..b'"),
    ],
)
def test_a_bad_range_names_the_key(value, message):
    with pytest.raises(ConfigError, match="num_inference_workers") as err:
        load_config("configs/tiny-cpu.yaml", [f"rollout.num_inference_workers={value}"])
    assert message in str(err.value)


def test_a_top_below_the_start_is_refused():
    with pytest.raises(ConfigError, match=r"max_inference_workers \(1\) is below num_inference_workers \(2\)"):
        load_config("configs/tiny-cpu.yaml", ["rollout.num_inference_workers=2", "rollout.max_inference_workers=1"])
    with pytest.raises(ConfigError, match=r"max_env_pools \(1\) is below num_env_pools \(2\)"):
        load_config("configs/tiny-cpu.yaml", ["rollout.num_env_pools=2", "rollout.max_env_pools=1"])
    with pytest.raises(ConfigError, match=r"num_env_pools: the range '3\.\.1' needs 1 <= A <= B"):
        load_config("configs/tiny-cpu.yaml", ["rollout.num_env_pools=3..1"])


@pytest.mark.parametrize(
    ("overrides", "pools", "bounds"),
    [
        (["rollout.num_env_pools=1..4", "trainer.prompts_per_step=4"], (1, 4, 4), (1, 4)),
        (["rollout.num_env_pools=2", "trainer.prompts_per_step=4"], (2, None, 2), (1, 2)),
        ([], (1, None, 1), (1, 1)),
    ],
)
def test_env_pools_have_a_range_and_as_many_prompt_shards_as_its_top(overrides, pools, bounds):
    """The prompt stream's shards are the most env pools the run may have; scaling goes from the
    range's start (else one) up to them."""
    roll = load_config("configs/tiny-cpu.yaml", overrides).rollout
    assert (roll.num_env_pools, roll.max_env_pools, roll.env_pool_shards()) == pools
    assert roll.scale_bounds()["env_pools"] == bounds


@pytest.mark.parametrize(
    ("words", "error"),
    [
        (["inference=3"], {"inference": 3}),
        (["inference=2", "env_pools=3"], {"inference": 2, "env_pools": 3}),
        (["env_pools=1"], {"env_pools": 1}),
        (["inference=auto", "env_pools=2"], {"inference": "auto", "env_pools": 2}),
        (["inference=x"], "a whole number"),
        (["inference"], "give inference=N and/or env_pools=M"),
        (["learner=2"], "give inference=N"),
        ([], "nothing to change"),
    ],
)
def test_the_request_words(words, error):
    if isinstance(error, dict):
        assert parse_scale_request(words) == error
    else:
        with pytest.raises(ValueError, match=error):
            parse_scale_request(words)


def test_auto_hands_a_role_back_to_the_load_policy_of_a_run_that_has_one():
    from rlpost.service.mailbox import RunControl, describe_request

    control = RunControl({"inference": (1, 4), "env_pools": (1, 2)}, auto_keys=("inference",))
    assert control.request(inference="auto")["requested"] == {"inference": "auto"}
    with pytest.raises(ValueError, match="env_pools=auto: the run's load policy does not size its env pools"):
        control.request(env_pools="auto")
    with pytest.raises(ValueError, match="inference=auto: the run's load policy does not size"):
        RunControl({"inference": (1, 4)}).request(inference="auto")  # a run without the policy
    assert describe_request({"inference": "auto", "env_pools": 2}) == "inference workers by load and 2 env pools"
    taken = {"requested": None, "inference_workers": 3, "inference_workers_target": 3}
    assert fleet_reached(taken, {"inference": "auto"})  # reached once the run took it


def test_the_fleet_in_words():
    assert describe_fleet({}) == "not reported yet"
    assert describe_fleet({"inference_workers": 2, "inference_workers_target": 3, "inference_workers_vacant": 1}) == (
        "2 serving of 3 wanted, 1 waiting for room in the cluster"
    )
    pools = {"env_pools": 1, "env_pools_target": 2, "env_pools_vacant": 1}
    assert describe_fleet(pools, "env_pools") == "1 serving of 2 wanted, 1 waiting for room in the cluster"
    reached = {"requested": None, "inference_workers": 2, "inference_workers_target": 2, "env_pools": 1,
               "env_pools_target": 1}  # fmt: skip
    assert fleet_reached(reached, {"inference": 2}) and fleet_reached(reached, {"inference": 2, "env_pools": 1})
    assert not fleet_reached({**reached, "requested": {"inference": 3}}, {"inference": 2})
    assert not fleet_reached({**reached, "inference_workers": 1}, {"inference": 2})
    assert not fleet_reached(reached, {"env_pools": 2})


def test_a_submitted_job_is_scaled_by_a_short_job_beside_it_in_its_environment():
    info = SimpleNamespace(status="RUNNING", metadata={"rlpost_run_name": "r1"},
                           runtime_env={"working_dir": "gcs://_ray_pkg_1.zip", "env_vars": {"A": "1"}})  # fmt: skip
    plan = jobs.plan_scale(info, "rlpost-r1", ["inference=3"], wait_s=60)
    assert plan.entrypoint == "rlpost scale --namespace rlpost-r1 rlpost-r1 inference=3 --wait 60"
    assert plan.runtime_env == info.runtime_env and plan.runtime_env is not info.runtime_env
    assert plan.job_id.startswith("rlpost-r1-scale-") and plan.metadata == {"rlpost_scale_of": "rlpost-r1"}
    with pytest.raises(ConfigError, match="job j is SUCCEEDED: only a running job can be scaled"):
        jobs.plan_scale(SimpleNamespace(status="SUCCEEDED", metadata={}, runtime_env={}), "j", ["inference=2"])
    with pytest.raises(ConfigError, match="was not submitted by `rlpost submit`"):
        jobs.plan_scale(SimpleNamespace(status="RUNNING", metadata={}, runtime_env={}), "j", ["inference=2"])
    fleet = jobs.plan_beside(info, "rlpost-r1", "status", [], "asked for its fleet")  # rlpost status JOB --fleet
    assert fleet.entrypoint == "rlpost status --namespace rlpost-r1 rlpost-r1" and fleet.runtime_env == info.runtime_env
    assert fleet.job_id.startswith("rlpost-r1-status-") and fleet.metadata == {"rlpost_status_of": "rlpost-r1"}
    with pytest.raises(ConfigError, match="job j is STOPPED: only a running job can be asked for its fleet"):
        jobs.plan_beside(SimpleNamespace(status="STOPPED", metadata={}, runtime_env={}), "j", "status", [],
                         "asked for its fleet")  # fmt: skip


@pytest.mark.parametrize(
    ("status", "message", "code"),
    [
        ("SUCCEEDED", "", 0),
        ("FAILED", "Job entrypoint command failed with exit code 2, last available logs ...", 2),
        ("FAILED", "Job entrypoint command failed with exit code 1", 1),
        ("STOPPED", "Job was intentionally stopped.", 1),
    ],
)
def test_the_exit_code_of_an_ended_job(status, message, code):
    assert jobs.entrypoint_exit_code(SimpleNamespace(status=status, message=message)) == code


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_bad_requests_exit_2_naming_the_problem(tmp_path):
    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    cfg = load_config("configs/tiny-cpu.yaml", ["rollout.num_inference_workers=1..2", "logging.run_name=r1"])
    save_config(cfg, run_dir / "config.yaml")
    cases = [
        ([str(tmp_path / "none"), "inference=2"], "not a run directory"),
        ([str(run_dir), "inference=0"], "at least one inference worker"),
        ([str(run_dir), "inference=2"], "the run never started (no ray_address file)"),
    ]
    for args, message in cases:
        out = run_cli("scale", *args)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
    (run_dir / "ray_address").write_text(f"127.0.0.1:{_closed_port()}\n")
    out = run_cli("scale", str(run_dir), "inference=3")  # outside the range: refused before connecting
    assert out.returncode == 2 and "outside the run's range 1..2" in out.stderr, out.stderr
    out = run_cli("scale", str(run_dir), "env_pools=2")  # one pool, one shard of the prompts
    assert out.returncode == 2 and "env_pools=2 is outside the run's range 1..1" in out.stderr, out.stderr
    out = run_cli("scale", str(run_dir), "inference=2")
    assert out.returncode == 2 and "does not answer: the run is not running" in out.stderr, out.stderr


def test_status_of_a_run_directory_shows_its_last_step_and_fleet(tmp_path):
    run_dir = tmp_path / "r1"
    run_dir.mkdir()
    save_config(load_config("configs/tiny-cpu.yaml"), run_dir / "config.yaml")
    out = run_cli("status", str(run_dir))
    assert out.returncode == 0 and out.stdout.strip() == f"{run_dir}: no step trained yet"
    rows = [
        {"step": 1, "reward_mean": 0.25, "elapsed_s": 3.0, "inference_workers": 2, "inference_workers_target": 2,
         "inference_workers_vacant": 0, "restarts_inference": 0, "bus_reforms": 0},
        {"step": 2, "reward_mean": 0.5, "elapsed_s": 7.4, "inference_workers": 1, "inference_workers_target": 2,
         "inference_workers_vacant": 1, "restarts_inference": 1, "bus_reforms": 2, "stopped": True,
         "env_pools": 1, "env_pools_target": 2, "env_pools_vacant": 0},
    ]  # fmt: skip
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = run_cli("status", str(run_dir))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"{run_dir}: stopped 2, reward 0.500, elapsed 7 s",
        "  inference workers: 1 serving of 2 wanted, 1 waiting for room in the cluster",
        "  env pools: 1 serving of 2 wanted",
        "  restarts: inference 1, bus_reforms 2",
    ]
    out = run_cli("status", str(tmp_path))
    assert out.returncode == 2 and "not a run directory" in out.stderr
