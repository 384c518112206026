"""Whole runs of the real tasks and the reward-model role, on the tier's shared cluster (both in
the long tier: make test keeps their parts in tests/integration/actors/test_reward_actor.py,
tests/integration/envs/test_code_grading.py and the supervisor's stand-ins).

- reasoning-gym with a reward model: the shipped reasoning-gym config (a mixture of two of the
  package's tasks) with the tiny reward model beside the package's verifiers; the ``reward`` actor
  is killed with SIGKILL (as the OOM killer would end it) while step 2 is collected. The
  supervisor starts it again, the env pools' calls wait for it, every step trains, and the
  metrics report the reward per task and per part.
- code: the shipped code config, the tiny model's completions graded by each
  problem's unit tests in the bwrap sandbox inside the env pool's actor.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


REPO = Path(__file__).resolve().parents[2]


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.long  # ~40 s; make test keeps the reward actor's death and wait in tests/integration/actors/test_reward_actor.py
def test_a_reasoning_gym_run_with_a_reward_model_survives_the_reward_actors_death(
    tmp_path, tiny_model_path, tiny_reward_model_path, connect_driver
):
    from rlpost.config import load_config
    from rlpost.record.run_dir import create_run_dir
    from rlpost.runtime.actors import actor_record
    from rlpost.service.loop import Controller
    from rlpost.service.run import start_run

    connect_driver("rlpost-e2e-reward-model")
    cfg = load_config("configs/tiny-cpu-reasoning-gym.yaml", [
        f"model.name_or_path={tiny_model_path}", f"reward_model.name_or_path={tiny_reward_model_path}",
        "reward_model.weight=0.5", "trainer.steps=3", "trainer.prompts_per_step=4", "eval.interval=3",
        "eval.num_prompts=8", "logging.progress=false", "logging.run_name=e2e-reward-model",
        "reward_model.restart_wait_s=120", "data.reasoning_gym.size=300",
    ])  # fmt: skip
    run_dir = create_run_dir(cfg, tmp_path / "run")
    killed = []

    class KillTheRewardActor(Controller):
        def _collect_shares(self, targets):
            if self.step == 2 and not killed:
                killed.append(True)
                pid = actor_record(self.supervisor.fleet.reward.handle)["Pid"]
                threading.Timer(0.05, os.kill, args=(pid, signal.SIGKILL)).start()
            super()._collect_shares(targets)

    supervisor = start_run(cfg, run_dir)
    try:
        KillTheRewardActor(cfg, run_dir, supervisor).run()
    finally:
        supervisor.close()
    rows = read(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["restarts_reward"] == 1 and rows[-1]["restarts_env_pool"] == 0
    tasks = {k for r in rows for k in r if k.startswith("reward_mean/")}
    assert tasks and tasks <= {"reward_mean/basic_arithmetic", "reward_mean/chain_sum"}
    for r in rows:  # reward = rule + 0.5 * score, each part logged
        assert r["reward_mean"] == pytest.approx(r["reward_part/rule"] + 0.5 * r["reward_part/reward_model"])
        assert r["reward_errors"] == 0
    evals = read(run_dir / "eval.jsonl")
    assert [e["step"] for e in evals] == [3]
    assert {"eval_reward_part/rule", "eval_reward_part/reward_model"} <= set(evals[0])
    assert any(k.startswith("eval_pass_at_1/") for k in evals[0])


@pytest.mark.long  # ~35 s; make test keeps the code task's env and grader in tests/integration/envs/test_code_grading.py
def test_the_code_config_grades_completions_in_the_sandbox(tmp_path, tiny_model_path, connect_driver):
    from rlpost.config import load_config
    from rlpost.record.run_dir import create_run_dir
    from rlpost.service.loop import Controller
    from rlpost.service.run import start_run

    connect_driver("rlpost-e2e-code")
    cfg = load_config("configs/tiny-cpu-code.yaml", [
        f"model.name_or_path={tiny_model_path}", f"data.dataset={REPO / 'configs/data/tiny-code.jsonl'}",
        "trainer.steps=2", "eval.interval=2", "eval.split=train", "eval.num_prompts=4", "logging.progress=false",
        "logging.run_name=e2e-code",
    ])  # fmt: skip
    run_dir = create_run_dir(cfg, tmp_path / "code")
    supervisor = start_run(cfg, run_dir)
    try:
        Controller(cfg, run_dir, supervisor).run()
    finally:
        supervisor.close()
    rows = read(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["reward_errors"] == 0  # graded, never a grader failure
    evaluation = read(run_dir / "eval.jsonl")[0]
    assert evaluation["eval_num_prompts"] == 4.0 and "eval_pass_at_k" in evaluation
