"""The reward-model role's pure parts: its config, the judge's template and verdict parsing, the
transform that combines the score with the task's rule (over a stand-in scorer), the reward's
parts and tasks through the collector's bookkeeping, and the metrics made of them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from tensordict import TensorDict

from rlpost.actors.reward import judge_template, parse_verdict
from rlpost.collect.episodes import reward_parts, row_tasks
from rlpost.config import ConfigError, load_config
from rlpost.data import ChatHistory, History
from rlpost.data.samples import Group, Sample
from rlpost.envs import ArithmeticEnv, make_env
from rlpost.envs.reward_model import RemoteRewardModel, RewardModelReward
from rlpost.record.metrics import reward_breakdown

pytestmark = pytest.mark.unit


@dataclass
class Result:
    scores: list[float]
    errors: dict[str, int] = field(default_factory=dict)


class StandInScorer:
    """Scores a conversation by the length of its response; records what it was sent."""

    def __init__(self, errors: dict[str, int] | None = None):
        self.calls: list[tuple[list, list]] = []
        self.errors = errors or {}

    def score(self, conversations, answers):
        self.calls.append((conversations, answers))
        return Result([len(c[-1]["content"]) / 100 for c in conversations], dict(self.errors))


def respond(env, td, completions):
    prompt = td["history"].prompt
    k = prompt.batch_size[0]
    reply = History(role=["assistant"] * k, content=completions, batch_size=[k])
    td.set("history", ChatHistory(prompt=prompt, full=prompt.append(reply, inplace=False), batch_size=[k]))
    return env.step(td)


# ---------------------------------------------------------------------------- config


def test_the_reward_model_section_and_its_errors_name_the_keys():
    cfg = load_config(None, ["reward_model.name_or_path=models/tiny-reward-model", "reward_model.weight=0.5"])
    assert cfg.reward_model.kind == "classifier" and cfg.reward_model.rule_weight == 1.0
    assert cfg.resources.reward.num_cpus == 0.25
    assert load_config().reward_model is None
    cases = {
        "reward_model.weight=0": "reward_model.weight and reward_model.rule_weight are both 0",
        "reward_model.kind=judge": "reward_model.kind",
        "reward_model.judge.pattern=Score": "reward_model.judge.pattern: Value error, needs a group",
        "reward_model.judge.pattern=(": "reward_model.judge.pattern: Value error, not a regular expression",
        "reward_model.judge.scale=0": "reward_model.judge.scale",
        "reward_model.batchsize=4": "unknown config key: reward_model.batchsize",
    }
    for override, message in cases.items():
        extra = ["reward_model.rule_weight=0"] if override == "reward_model.weight=0" else []
        with pytest.raises(ConfigError) as info:
            load_config(None, ["reward_model.name_or_path=rm", override, *extra])
        assert message in str(info.value), (override, str(info.value))
    with pytest.raises(ConfigError, match="reward_model.name_or_path: Field required"):
        load_config(None, ["reward_model.kind=classifier"])
    with pytest.raises(ConfigError, match=r"reward_model.judge.max_tokens \(600\) must be below"):
        load_config(None, ["reward_model.name_or_path=rm", "reward_model.kind=generative",
                           "reward_model.judge.max_tokens=600"])  # fmt: skip


def test_the_judge_template_must_show_the_completion_and_may_come_from_a_file(tmp_path):
    assert judge_template("Q: {prompt} A: {completion} ({answer})") == "Q: {prompt} A: {completion} ({answer})"
    path = tmp_path / "judge.txt"
    path.write_text("Grade {completion}.")
    assert judge_template(str(path)) == "Grade {completion}."
    for bad in ("Grade {prompt}.", "Grade {completion} for {question}."):
        with pytest.raises(ValueError, match="must contain {completion} and may use only"):
            judge_template(bad)


def test_verdicts_are_the_last_match_read_as_a_number_or_looked_up():
    pattern = r"Score:\s*(-?\d+(?:\.\d+)?)"
    assert parse_verdict("Score: 3 ... no, Score: 7.5", pattern, None) == 7.5
    assert parse_verdict("I cannot rate this", pattern, None) is None
    assert parse_verdict("Verdict: YES", r"Verdict:\s*(\w+)", {"yes": 1.0, "no": 0.0}) == 1.0
    assert parse_verdict("Verdict: maybe", r"Verdict:\s*(\w+)", {"yes": 1.0, "no": 0.0}) is None
    assert parse_verdict("Score: nan", r"Score:\s*(\w+)", None) is None


# ---------------------------------------------------------------------------- the transform


def test_the_score_joins_the_rule_on_the_step_an_episode_ends():
    """Two steps: rows 0 and 1 answer on step 1 (done, scored), rows 2 and 3 answer on step 2."""
    scorer = StandInScorer(errors={"unparsed_verdict": 1})
    env = ArithmeticEnv(num_envs=4, repeats=4, seed=0, max_steps=2)
    env.append_transform(RewardModelReward(scorer, weight=2.0, rule_weight=0.5))
    td = env.reset()
    answer = td["answer"][0]
    first = respond(env, td, [f"<answer>{answer}</answer>", "<answer>-1</answer>", "thinking", "hmm"])["next"]
    rule = [1.0, 0.1, 0.0, 0.0]
    scores = [len(f"<answer>{answer}</answer>") / 100, len("<answer>-1</answer>") / 100, 0.0, 0.0]
    expected = [0.5 * r + 2.0 * s for r, s in zip(rule, scores)]
    assert first["reward"].view(-1).tolist() == pytest.approx(expected)
    assert first["done"].view(-1).tolist() == [True, True, False, False]
    (conversations, answers), = scorer.calls  # fmt: skip
    question = td["row"][0]["question"]
    assert conversations[0] == [{"role": "user", "content": question},
                                {"role": "assistant", "content": f"<answer>{answer}</answer>"}]  # fmt: skip
    assert answers == [answer, answer]
    parts = reward_parts(first, 4)
    assert [p["rule"] for p in parts] == pytest.approx(rule)
    assert [p["reward_model"] for p in parts] == pytest.approx(scores)
    assert env.reward_errors == Counter({"unparsed_verdict": 1})


def test_make_env_puts_the_reward_model_last_and_defaults_to_the_run_actor():
    cfg = load_config(None, ["reward_model.name_or_path=rm", "tools.python.enabled=true", "rollout.max_turns=2"])
    scorer = StandInScorer()
    env = make_env(cfg, None, 4, reward_scorer=scorer)
    assert isinstance(env.transforms[-1], RewardModelReward) and env.transforms[-1].scorer is scorer
    remote = make_env(cfg, None, 4).transforms[-1].scorer
    assert isinstance(remote, RemoteRewardModel) and remote.actor_name == "reward"
    assert (remote.timeout_s, remote.restart_wait_s) == (120.0, 180.0)


# ---------------------------------------------------------------------------- bookkeeping and metrics


def test_row_tasks_read_the_rows_task_column():
    from tensordict import NonTensorData, NonTensorStack

    td = TensorDict(batch_size=[3])
    td.set("row", NonTensorStack(*[NonTensorData(r) for r in ({"task": "a"}, {"task": "b"}, {"x": 1})], batch_size=[3]))
    assert row_tasks(td, 3) == ["a", "b", None]
    assert row_tasks(TensorDict(batch_size=[2]), 2) == [None, None]
    assert reward_parts(TensorDict({"reward": torch.zeros(2, 1)}, batch_size=[2]), 2) == [{}, {}]


def sample(reward, task=None, parts=None):
    return Sample(0, [1, 2], [0.0, 0.0], [False, True], 1, reward, 0, True, reward_parts=parts, task=task)


def test_reward_breakdown_per_task_and_part():
    groups = [
        Group(0, [sample(1.0, "chain_sum", {"rule": 1.0}), sample(0.0, "chain_sum", {"rule": 0.0})], [1, -1], 0),
        Group(1, [sample(0.5, "basic_arithmetic", {"rule": 0.5, "reward_model": 0.2})], [0.0], 0,
              info={"sampled_rewards": [0.5, 0.1]}),
        Group(2, [sample(0.3)], [0.0], 0),
    ]  # fmt: skip
    out = reward_breakdown(groups, prefix="eval_")
    assert out == pytest.approx({
        "eval_reward_mean/chain_sum": 0.5, "eval_reward_mean/basic_arithmetic": 0.3,
        "eval_reward_part/rule": 0.5, "eval_reward_part/reward_model": 0.2,
    })  # fmt: skip
    assert reward_breakdown([Group(0, [sample(1.0)], [0.0], 0)]) == {}
