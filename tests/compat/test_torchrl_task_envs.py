"""TorchRL's tests and documented examples of its MATH and Countdown tasks and of ``IFEvalData``
(``TestMATHRewardParser`` and ``TestCountdownRewardParser`` in TorchRL's LLM env tests, the
``MATHEnv`` / ``CountdownEnv`` docstring examples, the ``IFEvalData`` primers of its
``IFEvalEnv``), run against rlpost.

Substitutions: rlpost's imports; the offline tiny model's tokenizer (ChatML, like the Qwen
tokenizer TorchRL uses); in-memory MATH rows instead of the hub dataset. TorchRL's tests call
the private ``_single_correctness_reward(reference, answer, think)`` and
``_parse_ground_truth``; here the same cases go through the public ``score(completion,
answer_field)`` and ``parse_ground_truth``. Where rlpost deliberately deviates, the test says so.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from rlpost.data import ChatHistory, History
from rlpost.envs.countdown import CountdownEnv, CountdownRewardParser, countdown_answer
from rlpost.envs.ifeval import IFEvalData, IFEvalEnv
from rlpost.envs.math import MATHEnv, MATHRewardParser

pytestmark = pytest.mark.compat

MATH_ROWS = [
    {"problem": "What is $6 \\times 7$?", "level": "Level 1", "type": "Prealgebra", "solution": "$\\boxed{42}$"},
    {"problem": "Half of one?", "level": "Level 1", "type": "Prealgebra", "solution": "$\\boxed{\\frac{1}{2}}$"},
]

# TorchRL's constructor parameters (name, default), in its order
TORCHRL_DATASET_ENV = [
    ("shuffle", True), ("num_envs", 1), ("repeats", None), ("batch_size_dl", 1), ("seed", None),
    ("group_repeats", False), ("tokenizer", None), ("device", None), ("template_kwargs", None),
    ("apply_template", False), ("compute_reward", True), ("collate_fn", None), ("max_steps", 1),
    ("input_mode", "history"),
]  # fmt: skip
TORCHRL_REWARD_PARSER = [
    ("tokenizer", None), ("in_keys", None), ("out_keys", None), ("eos_token", None), ("set_done_if_answer", True),
    ("input_mode", None), ("format_reward", 0.1), ("correct_reward", 1.0),
]  # fmt: skip


def math_parser():
    return MATHRewardParser()


def single_correctness_reward(parser, reference_field, answer, think):
    """TorchRL's ``_single_correctness_reward(reference, answer, think)`` case, through
    ``score``: a response holding ``think`` and ``answer`` in their tags (a tag left out when
    empty, as TorchRL's extraction then gives "")."""
    completion = (f"<think>{think}</think> " if think else "") + (f"<answer>{answer}</answer>" if answer else "")
    return parser.score(completion, reference_field)


def respond(env, td, completion):
    prompt = td["history"].prompt
    k = prompt.batch_size[0]
    reply = History(role=["assistant"] * k, content=[completion] * k, batch_size=[k])
    td.set("history", ChatHistory(prompt=prompt, full=prompt.append(reply, inplace=False), batch_size=[k]))
    return env.step(td)


def parameters_of(cls):
    return [(name, p.default) for name, p in inspect.signature(cls).parameters.items()]


# ---------------------------------------------------------------------------- TestMATHRewardParser


class TestMATHRewardParser:
    def test_extract_boxed_simple(self):
        assert MATHRewardParser.extract_boxed(r"The answer is $\boxed{42}$.") == "42"

    def test_extract_boxed_nested(self):
        assert MATHRewardParser.extract_boxed(r"$\boxed{\frac{1}{2}}$") == r"\frac{1}{2}"

    def test_extract_boxed_no_boxed(self):
        assert MATHRewardParser.extract_boxed("no boxed here") == "no boxed here"

    def test_extract_tags(self):
        think, answer = MATHRewardParser.extract_tags(r"<think>reasoning</think> <answer>\frac{1}{2}</answer>")
        assert think == "reasoning"
        assert answer == r"\frac{1}{2}"

    def test_correct_answer(self):
        parser = math_parser()
        td = single_correctness_reward(parser, r"\boxed{42}", "42", "reasoning")
        assert td["success"]
        assert td["reward"] == 1.0

    def test_wrong_answer_with_format(self):
        parser = math_parser()
        td = single_correctness_reward(parser, r"\boxed{42}", "99", "reasoning")
        assert not td["success"]
        assert td["reward"] == 0.1

    def test_no_answer(self):
        parser = math_parser()
        td = single_correctness_reward(parser, r"\boxed{42}", "", "")
        assert not td["success"]
        assert td["reward"] == 0.0


# ---------------------------------------------------------------------------- TestCountdownRewardParser


class TestCountdownRewardParser:
    def test_validate_expression_correct(self):
        assert CountdownRewardParser.validate_expression("(25 + 3) * 4", 112, [25, 3, 4])

    def test_validate_expression_wrong_result(self):
        assert not CountdownRewardParser.validate_expression("25 + 3", 100, [25, 3, 4])

    def test_validate_expression_reuses_number(self):
        assert not CountdownRewardParser.validate_expression("25 + 25", 50, [25, 3, 4])

    def test_validate_expression_invalid_chars(self):
        assert not CountdownRewardParser.validate_expression("import os", 0, [1, 2])

    def test_parse_ground_truth(self):
        target, numbers = CountdownRewardParser.parse_ground_truth("target=42, numbers=10,20,5,7")
        assert target == 42
        assert numbers == [10, 20, 5, 7]

    def test_correct_answer_reward(self):
        parser = CountdownRewardParser()
        td = single_correctness_reward(parser, countdown_answer(28, [25, 3]), "25 + 3", "thinking")
        assert td["success"]
        assert td["reward"] == 1.0

    def test_wrong_answer_with_format(self):
        parser = CountdownRewardParser()
        td = single_correctness_reward(parser, countdown_answer(100, [25, 3]), "25 + 3", "thinking")
        assert not td["success"]
        assert td["reward"] == 0.1

    def test_no_answer(self):
        parser = CountdownRewardParser()
        td = single_correctness_reward(parser, countdown_answer(100, [25, 3]), "", "")
        assert not td["success"]
        assert td["reward"] == 0.0


# ---------------------------------------------------------------------------- the documented examples


def test_mathenv_docstring_example(tiny_tokenizer):
    """``env = MATHEnv(tokenizer=tokenizer, apply_template=True); r = env.reset(); assert "history" in r``
    (local rows instead of the hub dataset), then a step scored as TorchRL's parser scores it."""
    env = MATHEnv(dataset=MATH_ROWS, tokenizer=tiny_tokenizer, apply_template=True, shuffle=False)
    r = env.reset()
    assert "history" in r
    assert r["query"].tolist() == [MATH_ROWS[0]["problem"]] and r["answer"].tolist() == [MATH_ROWS[0]["solution"]]
    out = respond(env, r, "<think>6 sevens</think> <answer>42</answer>")
    assert out["next", "reward"].tolist() == [[1.0]]  # rlpost: [B, 1] (TorchRL: [B, 1, 1])
    assert out["next", "success"].tolist() == [[True]] and out["next", "done"].tolist() == [[True]]
    env.transform[-1].close()


def test_countdownenv_docstring_example(tiny_tokenizer):
    """``env = CountdownEnv(tokenizer=tokenizer, apply_template=True, seed=42); r = env.reset();
    assert "history" in r``: generated problems, no dataset, as in TorchRL."""
    env = CountdownEnv(tokenizer=tiny_tokenizer, apply_template=True, seed=42)
    r = env.reset()
    assert "history" in r
    target, numbers = CountdownRewardParser.parse_ground_truth(r["answer"][0])
    assert r["query"][0].startswith(
        f"Using the numbers {numbers}, create an arithmetic expression that equals {target}"
    )
    out = respond(env, r, f"<answer>{' + '.join(map(str, numbers))} + 1000</answer>")  # wrong: format reward
    assert out["next", "reward"].tolist() == [[pytest.approx(0.1)]]


def test_ifevalenv_primers_are_ifevaldata_s_spec():
    """TorchRL's IFEvalEnv passes ``primers=IFEvalData.default_spec((num_envs,), device)``; the spec's
    keys are the row's ``key``, ``instruction_id_list``, ``kwargs`` and ``query``. Deviation:
    rlpost's IFEvalEnv does not pass it by default (see :mod:`rlpost.envs.ifeval`), but takes it."""
    from pathlib import Path

    spec = IFEvalData.default_spec((2,), None)
    assert set(spec.keys()) == {"key", "instruction_id_list", "kwargs", "query"}
    assert spec["key"].dtype == torch.int64 and spec.data_cls is IFEvalData
    data = Path(__file__).resolve().parents[1] / "data" / "ifeval_sample.jsonl"
    env = IFEvalEnv(dataset=data, num_envs=2, compute_reward=False, primers=spec)
    td = env.reset()
    assert td["key"].dtype == torch.int64 and td["key"].shape == (2,)
    assert all(isinstance(ids, list) for ids in td["instruction_id_list"].tolist())


# ---------------------------------------------------------------------------- the API reference


@pytest.mark.parametrize("cls", [MATHEnv, CountdownEnv])
def test_env_signatures_are_torchrl_s(cls):
    """TorchRL's keywords and defaults, in its order (rlpost's extra keywords follow them).
    Deviation: ``dataset`` (and, for Countdown, TorchRL's generator settings) keep TorchRL's
    defaults; rlpost's envs also take local data there."""
    parameters = dict(parameters_of(cls))
    for name, default in TORCHRL_DATASET_ENV:
        assert parameters[name] == default, name
    names = [name for name, _ in parameters_of(cls)]
    assert [n for n in names if n in dict(TORCHRL_DATASET_ENV)] == [n for n, _ in TORCHRL_DATASET_ENV]
    if cls is MATHEnv:
        assert names[0] == "dataset" and parameters["dataset"] == "DigitalLearningGmbH/MATH-lighteval"
        assert parameters["ray_backend"] is False and parameters["dataloader_actor_name"] is None
    else:
        assert names[:3] == ["num_count", "max_number", "max_target"]
        assert (parameters["num_count"], parameters["max_number"], parameters["max_target"]) == (4, 100, 1000)


@pytest.mark.parametrize("cls", [MATHRewardParser, CountdownRewardParser])
def test_reward_parser_signatures_are_torchrl_s(cls):
    """TorchRL's positional arguments and defaults, in its order; rlpost's are keyword-only."""
    parameters = list(inspect.signature(cls).parameters.values())
    assert [(p.name, p.default) for p in parameters[: len(TORCHRL_REWARD_PARSER)]] == TORCHRL_REWARD_PARSER
    assert all(p.kind is p.KEYWORD_ONLY for p in parameters[len(TORCHRL_REWARD_PARSER) :])
    parser = cls()
    assert parser.out_keys == ["reward_answer", "reward_think", "reward_right", "reward", "success"]
    assert (parser.format_reward, parser.correct_reward, parser.set_done_if_answer) == (0.1, 1.0, True)


def test_math_answers_match_deviation():
    """TorchRL's ``answers_match`` is a static method that hands math-verify the bare strings, so
    an answer identical to the reference (``x^2+1``) does not match. rlpost's is a method of the
    parser (its worker pool and time limit), and matches identical and equivalent answers."""
    parser = MATHRewardParser()
    try:
        assert parser.answers_match("x^2+1", "x^2+1")
        assert parser.answers_match(r"\frac{1}{2}", "0.5")
        assert not parser.answers_match("12", "1, 2")  # TorchRL's normaliser drops the comma: a match
    finally:
        parser.close()
