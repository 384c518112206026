"""``loss.type``, ``loss.top_k`` and ``loss.distillation`` in a job config, and expert
iteration's selection of each group's best samples in the env pools' grouping."""

from __future__ import annotations

import pytest

from rlpost.collect.episodes import WholeEpisodes, assemble_groups
from rlpost.config import ConfigError, validate_config
from rlpost.data.samples import Sample

pytestmark = pytest.mark.unit


def test_dapo_brings_its_defaults_unless_the_config_sets_them():
    cfg = validate_config({"loss": {"type": "dapo"}})
    assert (cfg.loss.clip_eps_high, cfg.loss.filter_equal_rewards) == (0.28, True)
    cfg = validate_config({"loss": {"type": "dapo", "clip_eps_high": 0.25, "filter_equal_rewards": False}})
    assert (cfg.loss.clip_eps_high, cfg.loss.filter_equal_rewards) == (0.25, False)
    assert validate_config({}).loss.clip_eps_high == 0.2  # grpo keeps its own


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"loss": {"type": "ppo"}}, "loss.type"),
        ({"loss": {"type": "dapo", "clip_eps_low": 0.3, "clip_eps_high": 0.2}}, "clip_eps_high \\(0.2\\) must be >="),
        ({"loss": {"top_k": 2}}, "top_k selects samples for sft"),
        ({"loss": {"type": "sft", "off_policy_correction": "tis"}}, "no importance ratio"),
        ({"loss": {"type": "sft", "kl_to_inference_coef": 0.1}}, "kl_to_inference_coef must be 0"),
        ({"loss": {"type": "cispo", "custom_fn": "m:f"}}, "custom_fn replaces grpo"),
        ({"loss": {"distillation": {"coef": 1.0}}}, "reference.enabled=true"),
        (
            {"loss": {"distillation": {"coef": 1.0}}, "reference": {"enabled": True, "kl_in": "reward"}},
            "reference.kl_in=loss",
        ),
        (
            {"loss": {"type": "sft", "distillation": {"coef": 1.0}}, "reference": {"enabled": True}},
            "SFT has no advantage",
        ),
        ({"loss": {"distillation": {"use_reward": False}}}, "nothing would be trained"),
        ({"loss": {"type": "sft", "top_k": 0}}, "loss.top_k"),
    ],
)
def test_bad_loss_settings_are_config_errors_naming_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(raw)


def test_a_distillation_config_with_its_teacher_validates():
    cfg = validate_config(
        {"loss": {"distillation": {"coef": 0.5}}, "reference": {"enabled": True, "model": "path/to/teacher"}}
    )
    assert (cfg.loss.distillation.coef, cfg.loss.distillation.use_reward, cfg.reference.model) == (
        0.5,
        True,
        "path/to/teacher",
    )


def sample(prompt_id: int, reward: float) -> Sample:
    return Sample(prompt_id=prompt_id, token_ids=[1, 2], logprobs=[0.0, -1.0], loss_mask=[False, True], prompt_len=1,
                  reward=reward, policy_version=0, finished=True)  # fmt: skip


def test_expert_iteration_keeps_each_groups_best_above_its_median():
    samples = [sample(0, r) for r in (0.0, 1.0, 0.5, 1.0)] + [sample(1, 1.0) for _ in range(4)]
    settings = WholeEpisodes(group_size=4, max_turns=1, keep_top=True, top_k=1)
    groups, dropped = assemble_groups(samples, settings)
    assert dropped == 1  # prompt 1: every reward equal, nothing is better
    (group,) = groups
    assert [s.reward for s in group.samples] == [1.0] and group.samples[0] is samples[1]
    assert group.info["sampled_rewards"] == [0.0, 1.0, 0.5, 1.0]  # what the policy sampled, for the reward metric
    assert len(group.advantages) == 1
    every = assemble_groups(samples[:4], WholeEpisodes(group_size=4, max_turns=1, keep_top=True))[0][0]
    assert [s.reward for s in every.samples] == [1.0, 1.0]  # top_k None: all above the median
    plain = assemble_groups(samples[:4], WholeEpisodes(group_size=4, max_turns=1))[0][0]
    assert len(plain.samples) == 4 and "sampled_rewards" not in plain.info
