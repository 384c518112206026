"""The run-directory side of resume: picking the checkpoint and config, keeping metrics.jsonl one
line per step, and the CLI's errors (whole resumed runs are in tests/e2e/test_fault_tolerance.py)."""

import json

import pytest

from rlpost.config import ConfigError, load_config
from rlpost.ops.cli import main
from rlpost.record.run_dir import (
    create_run_dir,
    latest_checkpoint,
    list_checkpoints,
    open_run_for_resume,
    supersede_metrics_after,
)

pytestmark = pytest.mark.unit


@pytest.fixture
def run_dir(tmp_path):
    cfg = load_config("configs/tiny-cpu.yaml", ["trainer.steps=10"])
    return create_run_dir(cfg, tmp_path / "run")


def test_checkpoints_are_ordered_by_step_not_by_name(run_dir):
    for step in (2, 10, 4):
        (run_dir / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (run_dir / "checkpoints" / ".tmp-step_12-abc").mkdir()  # a write that never finished
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_2", "step_4", "step_10"]
    assert latest_checkpoint(run_dir).name == "step_10"


def test_resume_takes_the_runs_config_plus_overrides_and_records_them(run_dir):
    (run_dir / "checkpoints" / "step_4").mkdir(parents=True)
    cfg = open_run_for_resume(run_dir, None, ["trainer.steps=20"])
    assert cfg.trainer.steps == 20 and cfg.logging.run_name == "run"
    assert load_config(run_dir / "config.yaml").trainer.steps == 20  # the folder says how it goes on


def test_resume_errors_name_the_folder(tmp_path, run_dir):
    with pytest.raises(ConfigError, match="not a run directory"):
        open_run_for_resume(tmp_path / "nothing", None, [])
    with pytest.raises(ConfigError, match="no checkpoint in .*checkpoint_interval"):
        open_run_for_resume(run_dir, None, [])


def test_metrics_of_steps_after_the_checkpoint_move_aside(run_dir):
    lines = [json.dumps({"step": s, "reward_mean": s / 10}) for s in range(1, 8)] + ['{"step": 8, "rew']  # torn
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert supersede_metrics_after(run_dir, 5) == 3
    kept = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert kept == [1, 2, 3, 4, 5]
    moved = (run_dir / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in moved[:2]] == [6, 7] and moved[2] == '{"step": 8, "rew'
    assert supersede_metrics_after(run_dir, 5) == 0  # nothing more to move


def test_evaluations_after_the_checkpoint_move_aside_too(run_dir):
    (run_dir / "eval.jsonl").write_text(
        "".join(json.dumps({"step": s, "eval_pass_at_1": 0.5}) + "\n" for s in (0, 4, 8))
    )
    supersede_metrics_after(run_dir, 5)
    kept = [json.loads(line)["step"] for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert kept == [0, 4]
    assert [json.loads(line)["step"] for line in (run_dir / "eval.superseded.jsonl").read_text().splitlines()] == [8]


@pytest.mark.parametrize(
    "args, message",
    [
        (["train"], "train needs a CONFIG file (or --resume RUN_DIR)"),
        (["train", "--resume", "RUN", "--run-dir", "other"], "--resume RUN_DIR and --run-dir cannot be combined"),
        (["train", "--resume", "RUN", "trainer.steps"], "config file not found: trainer.steps"),
    ],
)
def test_resume_command_line_errors(args, message, capsys, run_dir):
    (run_dir / "checkpoints" / "step_1").mkdir(parents=True)
    args = [str(run_dir) if a == "RUN" else a for a in args]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_resume_without_a_checkpoint_exits_2(capsys, run_dir):
    assert main(["train", "--resume", str(run_dir), "trainer.steps=20"]) == 2
    assert "no checkpoint in" in capsys.readouterr().err
