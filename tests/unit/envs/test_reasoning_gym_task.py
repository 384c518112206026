"""The reasoning_gym task: generated rows (determinism, mixture shares, per-task options, the
test split), the errors of a bad task mapping, and the reward parser through the env (the
package's own scores, missing tags, failing scorers, done flags)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from pathlib import Path

import pytest
import reasoning_gym
import reasoning_gym.factory
from reasoning_gym.dataset import ProceduralDataset
from transformers import AutoTokenizer

from rlpost.data import ChatHistory, History
from rlpost.envs.reasoning_gym import (
    REASONING_GYM_SYSTEM_PROMPT,
    ReasoningGymEnv,
    ReasoningGymRewardParser,
    reasoning_gym_rows,
    reasoning_gym_task_names,
)

pytestmark = pytest.mark.unit

TINY_MODEL = Path(__file__).resolve().parents[3] / "models" / "tiny-model"
# chain_sum with two one-digit terms: "a + b" or "a - b", 200 distinct questions
SMALL_CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL)


def respond(env, td, completions: list[str]):
    """Act as the policy (history mode): one assistant message per env, then step; the step's ``next``."""
    prompt = td["history"].prompt
    k = prompt.batch_size[0]
    reply = History(role=["assistant"] * k, content=list(completions), batch_size=[k])
    td.set("history", ChatHistory(prompt=prompt, full=prompt.append(reply, inplace=False), batch_size=[k]))
    return env.step(td)["next"]


# ---------------------------------------------------------------------------- a fake task


@dataclasses.dataclass
class FakeConfig:
    """Config of a registered stand-in task: ``score`` is what its scorer returns, ``limit`` the
    number of entries its generator can make."""

    score: float = 1.0
    limit: int = 1_000_000
    seed: int | None = None
    size: int = 500

    def validate(self) -> None:
        assert self.size > 0, "size must be positive"


class FakeDataset(ProceduralDataset):
    def __init__(self, config: FakeConfig) -> None:
        super().__init__(config=config, seed=config.seed, size=config.size)

    def __getitem__(self, idx: int) -> dict:
        if idx >= self.config.limit:
            raise IndexError(f"only {self.config.limit} puzzles")
        return {"question": f"fake question {self.seed}/{idx}", "answer": "x", "metadata": {"idx": idx}}

    def score_answer(self, answer: str | None, entry: dict) -> float:
        if answer == "boom":
            raise ZeroDivisionError("scorer bug")
        return self.config.score


@pytest.fixture
def fake_task(monkeypatch):
    monkeypatch.setitem(reasoning_gym.factory.DATASETS, "fake_task", (FakeDataset, FakeConfig))
    return "fake_task"


# ---------------------------------------------------------------------------- rows


def test_rows_are_deterministic_sized_and_complete():
    tasks = {"chain_sum": 1, "basic_arithmetic": {"weight": 1}}
    rows = reasoning_gym_rows(tasks, size=40, seed=3)
    assert len(rows) == 40
    assert rows == reasoning_gym_rows(tasks, size=40, seed=3)
    assert rows == reasoning_gym_rows(dict(reversed(tasks.items())), size=40, seed=3)  # the mapping's order is moot
    assert [r["question"] for r in rows] != [r["question"] for r in reasoning_gym_rows(tasks, size=40, seed=4)]
    for row in rows:
        assert set(row) == {"question", "answer", "task", "entry"}
        assert row["question"] == row["entry"]["question"] and row["answer"] == row["entry"]["answer"]
        assert row["entry"]["metadata"]["source_dataset"] == row["task"]


def test_a_weighted_mixture_draws_tasks_near_their_weights():
    rows = reasoning_gym_rows({"chain_sum": 3, "basic_arithmetic": 1, "gcd": {"weight": 4}}, size=800, seed=0)
    shares = {task: count / 800 for task, count in Counter(row["task"] for row in rows).items()}
    assert shares == pytest.approx({"chain_sum": 3 / 8, "basic_arithmetic": 1 / 8, "gcd": 4 / 8}, abs=0.05)


def test_per_task_options_reach_the_generator():
    rows = reasoning_gym_rows({"chain_sum": {"weight": 2, **SMALL_CHAIN_SUM}}, size=30, seed=1)
    for row in rows:
        metadata = row["entry"]["metadata"]
        assert (metadata["num_terms"], metadata["num_digits"]) == (2, 1)
        match = re.fullmatch(r"(\d) ([+-]) (\d)", metadata["expression"])
        assert match, metadata["expression"]
        a, op, b = int(match[1]), match[2], int(match[3])
        assert row["answer"] == str(a + b if op == "+" else a - b)


def test_a_task_without_reference_answer_gets_an_empty_answer():
    (row,) = reasoning_gym_rows({"graph_color": 1}, size=1, seed=0)
    assert row["answer"] == "" and row["entry"]["answer"] is None


def test_test_split_holds_no_train_question():
    tasks = {"chain_sum": SMALL_CHAIN_SUM}  # 200 possible questions: the two splits must collide
    train = reasoning_gym_rows(tasks, size=100, seed=0)
    test = reasoning_gym_rows(tasks, size=100, seed=0, split="test")
    assert test == reasoning_gym_rows(tasks, size=100, seed=0, split="test")
    assert 0 < len(test) < 100  # the colliding rows were dropped
    assert not {row["question"] for row in test} & {row["question"] for row in train}


def test_test_split_of_a_large_problem_space_keeps_its_size():
    train = reasoning_gym_rows({"chain_sum": 1}, size=50, seed=2)
    test = reasoning_gym_rows({"chain_sum": 1}, size=50, seed=2, split="test")
    assert len(test) == 50 and not {r["question"] for r in test} & {r["question"] for r in train}


# ---------------------------------------------------------------------------- errors


def test_unknown_task_is_named_with_suggestions_and_the_task_count():
    with pytest.raises(ValueError, match="chain_sums") as info:
        reasoning_gym_rows({"chain_sums": 1}, size=1, seed=0)
    message = str(info.value)
    assert "did you mean 'chain_sum'" in message
    assert f"has {len(reasoning_gym_task_names())} tasks" in message


@pytest.mark.parametrize("weight", [0, -1.5, "two", True, float("nan")])
def test_bad_weight_names_the_task(weight):
    with pytest.raises(ValueError, match=r"task 'gcd': weight must be a positive number"):
        reasoning_gym_rows({"chain_sum": 1, "gcd": weight}, size=1, seed=0)
    with pytest.raises(ValueError, match=r"task 'gcd': weight must be a positive number"):
        reasoning_gym_rows({"gcd": {"weight": weight}}, size=1, seed=0)


def test_unknown_option_names_the_task_and_the_option():
    with pytest.raises(ValueError, match=r"task 'chain_sum' has no option 'min_term' \(did you mean 'min_terms'\?\)"):
        reasoning_gym_rows({"chain_sum": {"min_term": 2}}, size=1, seed=0)


def test_option_refused_by_validation_names_the_task_and_the_option():
    with pytest.raises(ValueError, match=r"task 'chain_sum' refuses options .*'max_terms': 2.*max_terms must be"):
        reasoning_gym_rows({"chain_sum": {"min_terms": 3, "max_terms": 2}}, size=1, seed=0)


@pytest.mark.parametrize("option", ["seed", "size"])
def test_seed_and_size_are_not_task_options(option):
    with pytest.raises(ValueError, match=rf"task 'chain_sum': option '{option}' is set by rlpost"):
        reasoning_gym_rows({"chain_sum": {option: 5}}, size=1, seed=0)


def test_composite_empty_mapping_bad_size_and_split_are_refused():
    with pytest.raises(ValueError, match="'composite' is not supported"):
        reasoning_gym_rows({"composite": 1}, size=1, seed=0)
    with pytest.raises(ValueError, match="non-empty mapping"):
        reasoning_gym_rows({}, size=1, seed=0)
    with pytest.raises(ValueError, match="size must be an integer >= 1, got 0"):
        reasoning_gym_rows({"chain_sum": 1}, size=0, seed=0)
    with pytest.raises(ValueError, match="split must be one of .* got 'validation'"):
        reasoning_gym_rows({"chain_sum": 1}, size=1, seed=0, split="validation")


def test_a_task_that_yields_fewer_rows_than_asked_is_refused(fake_task):
    assert len(reasoning_gym_rows({fake_task: {"limit": 5}}, size=5, seed=0)) == 5
    with pytest.raises(ValueError, match=r"task 'fake_task' .*yielded only 5 of the 8 rows asked"):
        reasoning_gym_rows({fake_task: {"limit": 5}}, size=8, seed=0)


def test_env_takes_no_dataset():
    with pytest.raises(ValueError, match="takes no dataset"):
        ReasoningGymEnv(tasks={"chain_sum": 1}, dataset=[{"question": "q", "answer": "a"}])


# ---------------------------------------------------------------------------- the reward through the env


def test_env_scores_with_the_package_scorer_and_ends_answered_episodes(tokenizer):
    env = ReasoningGymEnv(
        tasks={"chain_sum": SMALL_CHAIN_SUM}, size=20, num_envs=4, seed=1, tokenizer=tokenizer, max_steps=3
    )
    td = env.reset()
    assert td["history"].prompt.to_chats()[0][0] == {"role": "system", "content": REASONING_GYM_SYSTEM_PROMPT}
    rows = td["row"]
    assert all(row in reasoning_gym_rows({"chain_sum": SMALL_CHAIN_SUM}, size=20, seed=1) for row in rows)
    answers = [row["answer"] for row in rows]
    completions = [
        f"<think>add</think><answer>{answers[0]}</answer>",  # right: 1.0
        f"<answer>1{answers[1]}</answer>",  # the reference inside a longer answer: partial credit
        "<answer>seven hundred</answer>",  # wrong: 0.0
        f"The answer is {answers[3]}.",  # no tag: 0.0 (the scorer is not asked)
    ]
    nxt = respond(env, td, completions)
    partial = reasoning_gym.get_score_answer_fn("chain_sum")(f"1{answers[1]}", rows[1]["entry"])
    assert partial == pytest.approx(len(answers[1]) / (len(answers[1]) + 1))
    assert nxt["reward"].view(-1).tolist() == pytest.approx([1.0, partial, 0.0, 0.0])
    assert nxt["terminated"].view(-1).tolist() == [True, True, True, False]
    assert nxt["done"].view(-1).tolist() == [True, True, True, False]
    assert env.reward_errors == Counter()


def test_a_task_without_reference_is_scored_by_its_rules(tokenizer):
    env = ReasoningGymEnv(tasks={"graph_color": 1}, size=4, num_envs=2, seed=0, tokenizer=tokenizer)
    td = env.reset()
    rows = td["row"]
    coloring = json.dumps({str(v): c for v, c in rows[0]["entry"]["metadata"]["possible_answer"].items()})
    nxt = respond(env, td, [f"<answer>{coloring}</answer>", "<answer>{}</answer>"])
    assert nxt["reward"].view(-1).tolist() == pytest.approx([1.0, 0.01])  # the package's format credit


def test_a_raising_scorer_gives_zero_and_is_counted(tokenizer, fake_task, caplog):
    # a real case: prime_factorization's scorer raises ValueError on an answer that is not a product
    env = ReasoningGymEnv(tasks={"prime_factorization": 1}, size=4, num_envs=2, seed=0, tokenizer=tokenizer)
    td = env.reset()
    nxt = respond(env, td, ["<answer>no idea</answer>", f"<answer>{td['row'][1]['answer']}</answer>"])
    assert nxt["reward"].view(-1).tolist() == pytest.approx([0.0, 1.0])
    assert nxt["done"].all()
    assert env.reward_errors == Counter({"ValueError": 1})

    env = ReasoningGymEnv(tasks={fake_task: 1}, size=4, num_envs=3, seed=0, tokenizer=tokenizer)
    with caplog.at_level("WARNING", logger="rlpost.envs.reasoning_gym"):
        for _ in range(2):
            nxt = respond(env, env.reset(), ["<answer>boom</answer>", "<answer>x</answer>", "<answer>boom</answer>"])
            assert nxt["reward"].view(-1).tolist() == [0.0, 1.0, 0.0]
    assert env.reward_errors == Counter({"ZeroDivisionError": 4})
    assert sum("ZeroDivisionError" in record.getMessage() for record in caplog.records) == 1  # logged once per type


def test_scores_outside_the_unit_interval_are_clamped_or_zeroed_and_counted(fake_task):
    row = {"task": fake_task, "entry": {"question": "q", "answer": "x", "metadata": {}}}
    expected = {2.5: (1.0, "ScoreOutOfRange"), -1.0: (0.0, "ScoreOutOfRange"), float("nan"): (0.0, "NonFiniteReward")}
    for score, (reward, error) in expected.items():
        # the scorer is built with the task's options: here the score it returns
        parser = ReasoningGymRewardParser(tasks={fake_task: {"score": score}})
        assert parser.score("<answer>x</answer>", row) == reward
        assert parser.errors == Counter({error: 1})
    parser = ReasoningGymRewardParser()
    assert parser.score("<answer>x</answer>", {"entry": {}}) == 0.0  # a row without its task
    assert parser.errors == Counter({"KeyError": 1})


def test_strict_format_scores_text_after_the_answer_zero():
    (row,) = reasoning_gym_rows({"chain_sum": 1}, size=1, seed=0)
    completion = f"<answer>{row['answer']}</answer> and more"
    assert ReasoningGymRewardParser().score(completion, row) == 1.0
    assert ReasoningGymRewardParser(strict_format=True).score(completion, row) == 0.0
