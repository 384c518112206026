"""A learner's checkpoint on the real tiny model (rlpost.actors.learner.checkpoint): saved after
each step, pruned to the newest, and loaded back to the same weights, AdamW moments, schedule,
version and RNG state."""

from __future__ import annotations

import pytest
import torch

from rlpost.actors.learner import Learner
from rlpost.record.run_dir import list_checkpoints
from tests.integration.actors.learner.test_learner import BAD, GOOD, completion, make_cfg, on_policy_groups

pytestmark = pytest.mark.integration


def _snapshot(learner: Learner) -> dict:
    opt = learner.optimizer.state_dict()
    return {
        "params": {k: v.clone() for k, v in learner.model.state_dict().items()},
        "exp_avg": [s["exp_avg"].clone() for s in opt["state"].values()],
        "opt_steps": [float(s["step"]) for s in opt["state"].values()],
        "version": learner.version,
        "lr_epoch": learner.scheduler.last_epoch,
        "rng": torch.get_rng_state(),
    }


def test_checkpoint_round_trip(tiny_model_path, tiny_tokenizer, prompt_ids, tmp_path):
    learner = Learner(
        make_cfg(tiny_model_path, optimizer={"lr": 1e-3, "warmup_steps": 4}, trainer={"keep_checkpoints": 2})
    )
    replies, rewards = [[completion(tiny_tokenizer, GOOD), completion(tiny_tokenizer, BAD)]], [[1.0, 0.0]]
    for step in (1, 2, 3):
        learner.train_step(on_policy_groups(learner, prompt_ids, replies, rewards))
        path = learner.save_checkpoint(tmp_path, step, rollout_state={"step": step, "groups": replies})
    assert (
        [p.name for p in list_checkpoints(tmp_path)]
        == ["step_2", "step_3"]
        == [p.name for p in (tmp_path / "checkpoints").iterdir()]
    )  # no temporary folders left behind
    saved = _snapshot(learner)
    learner.train_step(on_policy_groups(learner, prompt_ids, replies, rewards))
    assert learner.version == 4 and not torch.equal(
        learner.model.state_dict()["model.norm.weight"], saved["params"]["model.norm.weight"]
    )
    assert learner.load_checkpoint(path) == {"step": 3, "version": 3, "rollout_state": {"step": 3, "groups": replies}}
    restored = _snapshot(learner)
    assert restored["version"] == 3 and restored["opt_steps"] == saved["opt_steps"] == [3.0] * len(saved["opt_steps"])
    assert restored["lr_epoch"] == saved["lr_epoch"] == 3
    assert torch.equal(restored["rng"], saved["rng"])
    for name, tensor in saved["params"].items():
        assert torch.equal(restored["params"][name], tensor), name
    for got, want in zip(restored["exp_avg"], saved["exp_avg"]):
        assert torch.equal(got, want)
