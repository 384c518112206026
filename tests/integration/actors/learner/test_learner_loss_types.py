"""The learner's loss types on the real tiny model (``loss.type`` dapo, cispo, sft and
``loss.distillation``): the loss module each builds, and a few steps that move the model the way
the loss says."""

from __future__ import annotations

import pytest
import torch

from rlpost.actors.learner import Learner
from rlpost.data.samples import Group
from rlpost.objectives import DAPO, CISPOLoss, GRPOLoss
from tests.integration.actors.learner.test_learner import (
    BAD,
    GOOD,
    completion,
    completion_logprob,
    make_cfg,
    make_sample,
    on_policy_groups,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("loss_type", "module"), [("dapo", DAPO), ("cispo", CISPOLoss)])
def test_dapo_and_cispo_prefer_the_rewarded_completion(loss_type, module, tiny_model_path, tiny_tokenizer, prompt_ids):
    learner = Learner(make_cfg(tiny_model_path, loss={"type": loss_type}, optimizer={"lr": 3e-4}))
    assert type(learner.loss_fn) is module
    if loss_type == "dapo":  # DAPO's clip-higher, from the config's type
        assert float(learner.loss_fn.clip_epsilon_high) == pytest.approx(0.28)
    good, bad = completion(tiny_tokenizer, GOOD), completion(tiny_tokenizer, BAD)
    gap = completion_logprob(learner, prompt_ids, good) - completion_logprob(learner, prompt_ids, bad)
    for _ in range(3):
        metrics = learner.train_step(
            on_policy_groups(learner, prompt_ids, [[good, bad, good, bad]], [[1.0, 0.0, 1.0, 0.0]])
        )
    assert "clip_fraction" in metrics
    assert completion_logprob(learner, prompt_ids, good) - completion_logprob(learner, prompt_ids, bad) > gap + 0.5


def test_sft_imitates_the_kept_samples_whatever_their_advantage(tiny_model_path, tiny_tokenizer, prompt_ids):
    """Expert iteration's learner step: the NLL of the group's kept samples (the env pool chose
    them); their advantages, here 0, play no part. The kept completion is one the tiny model
    finds unlikely (a wrong sum), so that imitating it shows."""
    learner = Learner(make_cfg(tiny_model_path, loss={"type": "sft", "top_k": 2}, optimizer={"lr": 1e-4}))
    assert type(learner.loss_fn) is GRPOLoss and learner.loss_fn.loss_function.__name__ == "sft_loss"
    kept = completion(tiny_tokenizer, BAD)
    before = completion_logprob(learner, prompt_ids, kept)
    samples = [make_sample(prompt_ids, kept, reward=1.0) for _ in range(2)]
    metrics = learner.train_step([Group(prompt_id=0, samples=samples, advantages=[0.0, 0.0], policy_version=0)])
    # the loss is the mean NLL of the kept completions' tokens (less the first, which has no context), before the step
    assert metrics["loss"] == pytest.approx(-before / len(kept), rel=1e-3)
    for _ in range(2):
        learner.train_step([Group(prompt_id=0, samples=samples, advantages=[0.0, 0.0], policy_version=0)])
    assert completion_logprob(learner, prompt_ids, kept) > before + 1.0


def test_distillation_moves_the_student_toward_the_teacher(tiny_model_path, tiny_tokenizer, prompt_ids):
    """Pure on-policy distillation (no reward): the teacher's log-probs, written on the samples
    as the reference actor writes them, favour GOOD over BAD; the per-token advantages
    ``teacher - sampled`` move the student the same way, and kl_to_ref is the KL to the teacher."""
    learner = Learner(
        make_cfg(
            tiny_model_path,
            loss={"distillation": {"coef": 1.0, "use_reward": False}},
            reference={"enabled": True},
            optimizer={"lr": 3e-4},
        )
    )
    good, bad = completion(tiny_tokenizer, GOOD), completion(tiny_tokenizer, BAD)
    gap = completion_logprob(learner, prompt_ids, good) - completion_logprob(learner, prompt_ids, bad)

    def groups() -> list[Group]:
        made = on_policy_groups(learner, prompt_ids, [[good, bad]], [[0.0, 0.0]])  # equal rewards: advantage 0
        for sample in made[0].samples:
            lift = 1.0 if sample.token_ids[len(prompt_ids) :] == good else -1.0
            sample.ref_logprobs = [0.0] * len(prompt_ids) + [lp + lift for lp in sample.logprobs[len(prompt_ids) :]]
        return made

    metrics = learner.train_step(groups())
    assert metrics["kl_to_ref"] > 0
    for _ in range(2):
        learner.train_step(groups())
    assert completion_logprob(learner, prompt_ids, good) - completion_logprob(learner, prompt_ids, bad) > gap + 0.5


def test_distillation_without_teacher_log_probs_fails_the_step_naming_the_reference(
    tiny_model_path, tiny_tokenizer, prompt_ids
):
    learner = Learner(make_cfg(tiny_model_path, loss={"distillation": {"coef": 1.0}}, reference={"enabled": True}))
    samples = [make_sample(prompt_ids, completion(tiny_tokenizer, GOOD), reward=r) for r in (0.0, 1.0)]
    with pytest.raises(RuntimeError, match="teacher's log-probs"):
        learner.train_step([Group(prompt_id=0, samples=samples, advantages=[-1.0, 1.0], policy_version=0)])
    assert torch.isfinite(torch.tensor(completion_logprob(learner, prompt_ids, completion(tiny_tokenizer, GOOD))))
