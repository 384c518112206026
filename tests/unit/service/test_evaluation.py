"""Evaluation's pure parts: pass@k arithmetic, the eval config, the arithmetic tasks' held-out split."""

from __future__ import annotations

import pytest

from rlpost.config import ConfigError, load_config
from rlpost.envs.arithmetic import is_held_out, make_arithmetic_rows, make_tool_arithmetic_rows
from rlpost.service.evaluation import append_eval_line, eval_job_config, pass_metrics, resolve_checkpoint

pytestmark = pytest.mark.unit


def test_pass_at_1_is_the_mean_share_and_pass_at_k_the_share_of_prompts_with_a_pass():
    rewards = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 0.0], [0.0, 0.2, 0.0, 0.0]]
    got = pass_metrics(rewards, threshold=1.0)
    assert got["eval_pass_at_1"] == pytest.approx((0.25 + 0.5 + 0.0) / 3)
    assert got["eval_pass_at_k"] == pytest.approx(2 / 3)
    assert pass_metrics(rewards, threshold=0.5)["eval_pass_at_1"] == pytest.approx((0.25 + 0.75 + 0.0) / 3)
    single = pass_metrics([[1.0], [0.0], [1.0], [1.0]], threshold=1.0)
    assert single == {"eval_pass_at_1": 0.75}  # no pass@k for one completion per prompt
    with pytest.raises(ValueError, match="at least one prompt"):
        pass_metrics([], threshold=1.0)


def test_the_held_out_questions_never_reach_the_train_split():
    train = make_arithmetic_rows(3000, seed=0, split="train")
    test = make_arithmetic_rows(200, seed=0, split="test")
    train_questions, test_questions = {r["question"] for r in train}, {r["question"] for r in test}
    assert not train_questions & test_questions
    assert all(is_held_out(q) for q in test_questions) and not any(is_held_out(q) for q in train_questions)
    # an eighth of the 242 possible questions is held out; the split covers them, the rest train
    assert 20 <= len(test_questions) <= 40 and len(train_questions) + len(test_questions) >= 235
    assert all(str(eval(r["question"][8:-1])) == r["answer"] for r in test)  # noqa: S307 (our own rows)
    assert make_arithmetic_rows(50, seed=3, split="test") == make_arithmetic_rows(50, seed=3, split="test")
    assert make_arithmetic_rows(50, seed=3) == make_arithmetic_rows(50, seed=3, split=None)  # all questions
    tool_test = make_tool_arithmetic_rows(20, seed=1, split="test")
    assert all(is_held_out(r["question"]) for r in tool_test)
    with pytest.raises(ValueError, match="split must be one of"):
        make_arithmetic_rows(5, split="validation")


def test_the_eval_config_points_the_data_at_the_eval_split():
    cfg = load_config(
        "configs/tiny-cpu.yaml",
        [
            "eval.interval=5",
            "eval.num_prompts=12",
            "eval.samples_per_prompt=3",
            "eval.greedy=false",
            "data.group_size=4",
        ],
    )
    ev = eval_job_config(cfg)
    assert ev.data.split == "test" and ev.data.group_size == 3 and ev.data.shuffle is False
    assert ev.data.num_synthetic_rows == 12
    assert cfg.data.split == "train" and cfg.data.group_size == 4  # the training config is untouched
    with pytest.raises(ConfigError, match="eval.greedy=false for pass@k"):
        load_config("configs/tiny-cpu.yaml", ["eval.samples_per_prompt=2"])
    with pytest.raises(ConfigError, match="eval.num_prompts"):
        load_config("configs/tiny-cpu.yaml", ["eval.num_prompts=0"])


def test_eval_lines_append_and_checkpoints_resolve(tmp_path):
    append_eval_line(tmp_path, 0, {"eval_reward_mean": 0.5})
    append_eval_line(tmp_path, 2, {"eval_reward_mean": 0.75})
    assert (tmp_path / "eval.jsonl").read_text().splitlines() == [
        '{"step": 0, "eval_reward_mean": 0.5}',
        '{"step": 2, "eval_reward_mean": 0.75}',
    ]
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match="neither a run directory"):
        resolve_checkpoint(run)
    for step in (2, 10):
        (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step}" / "config.json").write_text("{}")
    (run / "config.yaml").write_text("{}")
    assert resolve_checkpoint(run) == (run / "checkpoints" / "step_10", run)  # the latest
    assert resolve_checkpoint(run / "checkpoints" / "step_2") == (run / "checkpoints" / "step_2", run)
    loose = tmp_path / "model"
    loose.mkdir()
    (loose / "config.json").write_text("{}")
    assert resolve_checkpoint(loose) == (loose, None)
