"""MATH and Countdown with TorchRL's API, and IFEval's row record: the reward fields and their
values for right, wrong and malformed answers, the prompts the envs build, the keys they write,
and each deliberate deviation from TorchRL (named in the test)."""

from __future__ import annotations

import itertools
import json
import time
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from rlpost.data import ChatHistory, History
from rlpost.envs.countdown import (
    COUNTDOWN_SYSTEM_PROMPT,
    CountdownColumns,
    CountdownEnv,
    CountdownProblems,
    CountdownRewardParser,
    countdown_answer,
    countdown_query,
)
from rlpost.envs.ifeval import IFEvalData, IFEvalEnv
from rlpost.envs.math import MATH_SYSTEM_PROMPT, MATHColumns, MATHEnv, MATHRewardParser, last_boxed

pytestmark = pytest.mark.unit

IFEVAL_DATA = Path(__file__).resolve().parents[2] / "data" / "ifeval_sample.jsonl"
MATH_ROWS = [
    {"problem": "What is $1+1$?", "level": "Level 1", "type": "Prealgebra", "solution": "So $1+1=\\boxed{2}$."},
    {
        "problem": "Expand $(x+1)^2 - 2x$.",
        "level": "Level 2",
        "type": "Algebra",
        "solution": "We get $x^2+2x+1-2x = \\boxed{x^2+1}$.",
    },
    {
        "problem": "Find the point where $y=x+1$ meets $y=3-x$.",
        "level": "Level 3",
        "type": "Algebra",
        "solution": "Adding, $2y=4$, so the point is $\\boxed{(1, 2)}$.",
    },
]
FIELDS = ("reward_answer", "reward_think", "reward_right", "reward", "success")


@pytest.fixture(scope="module")
def math_parser():
    """One parser (one math-verify worker process) for the module's MATH scoring tests."""
    parser = MATHRewardParser()
    yield parser
    parser.close()


def respond(env, td, completions):
    """Act as the policy (history mode): one assistant message per env, then step."""
    prompt = td["history"].prompt
    k = prompt.batch_size[0]
    reply = History(role=["assistant"] * k, content=list(completions), batch_size=[k])
    td.set("history", ChatHistory(prompt=prompt, full=prompt.append(reply, inplace=False), batch_size=[k]))
    return env.step(td)["next"]


def fields_of(next_td):
    """The reward fields of ``next``, one list per field (float32 values rounded: 0.1 reads 0.1)."""
    return {
        name: [v if isinstance(v, bool) else round(v, 6) for v in next_td[name].view(-1).tolist()] for name in FIELDS
    }


def solve_countdown(target, numbers):
    """An expression over some of ``numbers`` equal to ``target`` (brute force, exact), or None."""
    forms = {}  # frozen multiset of indices -> {value: expression}
    for i, n in enumerate(numbers):
        forms[frozenset([i])] = {Fraction(n): str(n)}
    for size in range(2, len(numbers) + 1):
        for subset in itertools.combinations(range(len(numbers)), size):
            key, values = frozenset(subset), {}
            for left_size in range(1, size):
                for left in itertools.combinations(subset, left_size):
                    right = key - frozenset(left)
                    for a, ea in forms[frozenset(left)].items():
                        for b, eb in forms[right].items():
                            values.setdefault(a + b, f"({ea} + {eb})")
                            values.setdefault(a - b, f"({ea} - {eb})")
                            values.setdefault(a * b, f"({ea} * {eb})")
                            if b:
                                values.setdefault(a / b, f"({ea} / {eb})")
            forms[key] = values
    for values in forms.values():
        if Fraction(target) in values:
            return values[Fraction(target)]
    return None


# ---------------------------------------------------------------------------- MATH: the reference


@pytest.mark.parametrize(
    ("solution", "reference"),
    [
        (r"so $\boxed{42}$.", "42"),
        (r"$\boxed{\frac{1}{2}}$", r"\frac{1}{2}"),  # braces nest
        (r"first \boxed{1}, then \boxed{ 2 }", "2"),  # the last box, stripped
        (r"the answer is $\fbox{7}$", "7"),  # the MATH grader's other box
        (r"so the answer is $\boxed 5$.", "5"),  # the brace-less form, up to the next $
        (r"so $\boxed {x+1}$", "x+1"),
        (r"cut off \boxed{\frac{1}{2}", r"\frac{1}{2}"),  # unclosed: the rest (TorchRL drops a character)
    ],
)
def test_the_reference_is_the_last_box(solution, reference):
    assert MATHRewardParser.extract_boxed(solution) == reference


def test_a_solution_without_a_box_is_its_own_reference():
    assert MATHRewardParser.extract_boxed("  12  ") == "12"
    assert last_boxed("no box") is None


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        (r" $x^2 + 1$ ", "x^2+1"),
        (r"\left( 1, 2 \right)", "(1,2)"),  # commas of a pair are kept (TorchRL drops them)
        ("1,000", "1000"),  # a thousands separator goes
        ("-12,345.5", "-12345.5"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"3\,\text{cm}", r"3\text{cm}"),
        (r"\leftarrow", r"\leftarrow"),  # not \left
    ],
)
def test_normalize_answer(raw, normalized):
    assert MATHRewardParser.normalize_answer(raw) == normalized


# ---------------------------------------------------------------------------- MATH: the reward table


@pytest.mark.parametrize(
    ("completion", "solution", "fields"),
    [
        ("<think>1+1</think> <answer>2</answer>", MATH_ROWS[0]["solution"], (1.0, 1.0, 1.0, True)),
        ("<think>1+1</think> <answer>3</answer>", MATH_ROWS[0]["solution"], (1.0, 1.0, 0.1, False)),
        # TorchRL scores this 0.1: math-verify finds nothing in bare LaTeX, and identical is not checked first
        ("<answer>x^2+1</answer>", MATH_ROWS[1]["solution"], (1.0, 0.0, 1.0, True)),
        ("<answer>1 + x^2</answer>", MATH_ROWS[1]["solution"], (1.0, 0.0, 1.0, True)),  # equivalent (math-verify)
        (r"<answer>\frac{1}{2}</answer>", r"$\boxed{0.5}$", (1.0, 0.0, 1.0, True)),
        (r"<answer>\dfrac{\sqrt{3}}{2}</answer>", r"$\boxed{\frac{\sqrt3}{2}}$", (1.0, 0.0, 1.0, True)),
        ("<answer>(1,2)</answer>", MATH_ROWS[2]["solution"], (1.0, 0.0, 1.0, True)),
        ("<answer>(2, 1)</answer>", MATH_ROWS[2]["solution"], (1.0, 0.0, 0.1, False)),  # order matters
        ("<answer>12</answer>", MATH_ROWS[2]["solution"], (1.0, 0.0, 0.1, False)),
        ("<answer>12</answer>", r"$\boxed{1, 2}$", (1.0, 0.0, 0.1, False)),  # TorchRL's normaliser: right
        ("<answer>2, 1</answer>", r"$\boxed{1, 2}$", (1.0, 0.0, 1.0, True)),  # a list of solutions: any order
        ("<think>no answer tag</think> 2", MATH_ROWS[0]["solution"], (0.0, 1.0, 0.0, False)),
        ("<think>cut</think><answer>2", MATH_ROWS[0]["solution"], (0.0, 1.0, 0.0, False)),  # never closed
        ("<answer>  </answer>", MATH_ROWS[0]["solution"], (0.0, 0.0, 0.0, False)),  # empty
        ("<answer>2</answer><|im_end|>", MATH_ROWS[0]["solution"], (1.0, 0.0, 1.0, True)),
        ("<answer>5</answer>", "5", (1.0, 0.0, 1.0, True)),  # a bare answer column
    ],
)
def test_math_reward_fields(math_parser, completion, solution, fields):
    score = math_parser.score(completion, solution)
    assert (score["reward_answer"], score["reward_think"], score["reward_right"], score["success"]) == fields
    assert score["reward"] == score["reward_right"]


def test_math_empty_box_scores_zero_and_is_counted():
    parser = MATHRewardParser(use_math_verify=False)
    score = parser.score("<answer>2</answer>", r"so $\boxed{}$")
    assert (score["reward_answer"], score["reward"], score["success"]) == (1.0, 0.0, False)
    assert parser.errors == {"ValueError": 1}


def test_math_without_math_verify_compares_normalised_strings():
    parser = MATHRewardParser(use_math_verify=False)
    assert parser.score("<answer>x^2 + 1</answer>", MATH_ROWS[1]["solution"])["reward"] == 1.0
    assert parser.score("<answer>1+x^2</answer>", MATH_ROWS[1]["solution"])["reward"] == 0.1


def test_math_answers_match_and_custom_rewards(math_parser):
    assert math_parser.answers_match(r"\frac{1}{2}", "0.5")
    assert not math_parser.answers_match("1/3", "0.5")
    parser = MATHRewardParser(format_reward=0.25, correct_reward=2.0, use_math_verify=False)
    assert parser.score("<answer>2</answer>", MATH_ROWS[0]["solution"])["reward"] == 2.0
    assert parser.score("<answer>4</answer>", MATH_ROWS[0]["solution"])["reward"] == 0.25


def test_math_check_past_the_time_limit_scores_zero():
    """Deviation: TorchRL's check has no time limit; here it is killed and counted."""
    parser = MATHRewardParser(verify_timeout_s=1.0)
    try:
        start = time.monotonic()
        score = parser.score(r"<answer>9^{9^{9^{9}}}</answer>", r"\boxed{5}")
        assert time.monotonic() - start < 30
        assert (score["reward"], score["success"]) == (0.0, False)
        assert parser.errors == {"Timeout": 1}
    finally:
        parser.close()


def test_math_strict_format_needs_the_answer_last():
    parser = MATHRewardParser(strict_format=True, use_math_verify=False)
    assert parser.score("<answer>2</answer>", MATH_ROWS[0]["solution"])["reward"] == 1.0
    assert parser.score("<answer>2</answer> more text", MATH_ROWS[0]["solution"])["reward"] == 0.0


# ---------------------------------------------------------------------------- MATH: the env


def test_math_columns_rename_only_what_is_missing():
    assert MATHColumns()([{"problem": "p", "solution": "s", "level": "1"}]) == [
        {"query": "p", "answer": "s", "level": "1"}
    ]
    # a short answer column is the reference; the solution stays as it is
    assert MATHColumns()({"problem": "p", "solution": "s", "answer": "5"}) == {
        "query": "p",
        "solution": "s",
        "answer": "5",
    }


def test_math_env_prompt_keys_and_rewards(tiny_tokenizer):
    env = MATHEnv(dataset=MATH_ROWS, tokenizer=tiny_tokenizer, num_envs=3, shuffle=False)
    td = env.reset()
    assert env.max_steps == 1
    chats = td["history"].prompt.to_chats()
    assert chats[0] == [
        {"role": "system", "content": MATH_SYSTEM_PROMPT},
        {"role": "user", "content": MATH_ROWS[0]["problem"]},
    ]
    assert td["query"].tolist() == [row["problem"] for row in MATH_ROWS]
    assert td["answer"].tolist() == [row["solution"] for row in MATH_ROWS]
    assert td["level"].tolist() == ["Level 1", "Level 2", "Level 3"]
    assert td["type"].tolist() == ["Prealgebra", "Algebra", "Algebra"]
    assert "problem" not in td.keys() and "solution" not in td.keys()
    nxt = respond(env, td, ["<think>sum</think><answer>2</answer>", "<answer>x^2+2</answer>", "I do not know"])
    assert fields_of(nxt) == {
        "reward_answer": [1.0, 1.0, 0.0],
        "reward_think": [1.0, 0.0, 0.0],
        "reward_right": [1.0, 0.1, 0.0],
        "reward": [1.0, 0.1, 0.0],
        "success": [True, False, False],
    }
    assert nxt["reward"].shape == (3, 1) and nxt["reward"].dtype == torch.float32
    assert nxt["done"].view(-1).tolist() == [True, True, True]  # answered, or the one step is spent
    assert nxt["terminated"].view(-1).tolist() == [True, True, False]
    env.transform[-1].close()


def test_math_env_takes_a_datasets_object_and_a_local_file(tmp_path):
    import datasets

    env = MATHEnv(dataset=datasets.Dataset.from_list(MATH_ROWS[:1]), compute_reward=False)
    assert env.reset()["query"].tolist() == [MATH_ROWS[0]["problem"]]
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in MATH_ROWS[1:2]))
    env = MATHEnv(dataset=str(path), compute_reward=False)
    assert env.reset()["answer"].tolist() == [MATH_ROWS[1]["solution"]]


def test_math_env_defaults_are_torchrl_s():
    import inspect

    parameters = inspect.signature(MATHEnv).parameters
    assert parameters["dataset"].default == "DigitalLearningGmbH/MATH-lighteval"
    assert parameters["max_steps"].default == 1 and parameters["input_mode"].default == "history"
    assert MATHEnv(dataset=MATH_ROWS, compute_reward=False, max_steps=0).max_steps is None


# ---------------------------------------------------------------------------- Countdown: the check


@pytest.mark.parametrize(
    ("expression", "target", "numbers", "valid"),
    [
        ("(25 + 3) * 4", 112, [25, 3, 4], True),
        ("25+3", 28, [25, 3, 4], True),  # a subset of the numbers
        ("25 + 3", 100, [25, 3, 4], False),
        ("25 + 25", 50, [25, 3, 4], False),  # used twice
        ("5 + 5", 10, [5, 5, 3], True),  # given twice
        ("8 / 3 * 3", 8, [8, 3, 3], True),  # exact fractions
        ("(6 - 3) / 3", 1, [6, 3, 3], True),
        ("4 / (2 - 2)", 0, [4, 2, 2], False),  # division by zero
        ("-3 + 25", 22, [25, 3], True),  # unary signs, as TorchRL's eval accepts
        ("2.5 * 4", 10, [2, 5, 4], False),  # TorchRL: True (2 and 5 counted as used)
        ("2 ** 3", 8, [2, 3], False),  # TorchRL: True
        ("7 // 2", 3, [7, 2], False),  # TorchRL: True
        ("(2)(3)", 6, [2, 3], False),
        ("03 + 1", 4, [3, 1], False),
        ("import os", 0, [1, 2], False),
        ("25 + 3 = 28", 28, [25, 3], False),
        ("", 0, [1], False),
        ("()", 0, [1], False),
    ],
)
def test_validate_expression(expression, target, numbers, valid):
    assert CountdownRewardParser.validate_expression(expression, target, numbers) is valid


def test_validate_expression_is_fast_on_hostile_input():
    start = time.monotonic()
    assert not CountdownRewardParser.validate_expression("9**9**9**9", 1, [9, 9, 9, 9])  # TorchRL's eval hangs
    assert not CountdownRewardParser.validate_expression("(" * 5000 + "1" + ")" * 5000, 1, [1])
    assert not CountdownRewardParser.validate_expression("-" * 100000 + "1", -1, [1])
    assert not CountdownRewardParser.validate_expression(" + ".join(["1"] * 10000), 10000, [1])
    assert time.monotonic() - start < 5


def test_parse_ground_truth():
    assert CountdownRewardParser.parse_ground_truth("target=42, numbers=10,20,5,7") == (42, [10, 20, 5, 7])
    assert CountdownRewardParser.parse_ground_truth("target = 42, numbers = [10, 20]") == (42, [10, 20])
    for bad in ("42", "target=42", "numbers=1,2"):
        with pytest.raises(ValueError, match="target=<int>"):
            CountdownRewardParser.parse_ground_truth(bad)


@pytest.mark.parametrize(
    ("completion", "fields"),
    [
        ("<think>25+3=28, 28*4</think> <answer>(25 + 3) * 4</answer>", (1.0, 1.0, 1.0, True)),
        ("<answer>25 * 4 + 3</answer>", (1.0, 0.0, 0.1, False)),  # wrong value
        ("<answer>(25 + 3) * 4 = 112</answer>", (1.0, 0.0, 0.1, False)),  # not only the expression
        ("<answer>25 * 25</answer>", (1.0, 0.0, 0.1, False)),  # a number used twice
        ("<think>(25 + 3) * 4</think>", (0.0, 1.0, 0.0, False)),  # no answer
        ("<answer>(25 + 3) * 4", (0.0, 0.0, 0.0, False)),  # never closed
        ("<answer>(25 + 3) * 4</answer><|im_end|>", (1.0, 0.0, 1.0, True)),
    ],
)
def test_countdown_reward_fields(completion, fields):
    score = CountdownRewardParser().score(completion, "target=112, numbers=25,3,4")
    assert (score["reward_answer"], score["reward_think"], score["reward_right"], score["success"]) == fields


def test_countdown_malformed_reference_scores_zero_and_is_counted():
    parser = CountdownRewardParser()
    assert parser.score("<answer>1 + 2</answer>", "3 from 1 and 2")["reward"] == 0.0
    assert parser.errors == {"ValueError": 1}
    assert not parser.use_math_verify and parser._pool is None  # no worker process for Countdown


# ---------------------------------------------------------------------------- Countdown: the problems


def test_problems_are_a_function_of_seed_and_index():
    problems = CountdownProblems(1000, seed=3)
    again = CountdownProblems(1000, seed=3)
    assert [problems[i] for i in (0, 1, 999)] == [again[i] for i in (0, 1, 999)]
    assert problems[0] != CountdownProblems(1000, seed=4)[0]
    assert problems[0] != problems[1]
    with pytest.raises(IndexError):
        problems[1000]


def test_problems_are_well_formed_and_reachable():
    problems = CountdownProblems(200, num_count=3, max_number=20, max_target=60, seed=0)
    for i in range(200):
        row = problems[i]
        target, numbers = row["target"], row["numbers"]
        assert len(numbers) == 3 and all(1 <= n <= 20 for n in numbers)
        assert 1 <= target <= 60
        assert row["query"] == countdown_query(target, numbers)
        assert CountdownRewardParser.parse_ground_truth(row["answer"]) == (target, numbers)
        expression = solve_countdown(target, numbers)
        assert expression is not None and CountdownRewardParser.validate_expression(expression, target, numbers)


def test_problem_settings_are_checked():
    with pytest.raises(ValueError, match="num_count must be >= 1"):
        CountdownProblems(10, num_count=0)
    with pytest.raises(ValueError, match="max_target"):
        CountdownProblems(10, max_number=100, max_target=50)


def test_query_and_answer_are_torchrl_s():
    assert countdown_query(112, [25, 3, 4]) == (
        "Using the numbers [25, 3, 4], create an arithmetic expression that equals 112. "
        "You may use each number at most once. Only use +, -, *, / and parentheses."
    )
    assert countdown_answer(112, [25, 3, 4]) == "target=112, numbers=25,3,4"


# ---------------------------------------------------------------------------- Countdown: the env


def test_countdown_env_prompt_keys_and_rewards(tiny_tokenizer):
    env = CountdownEnv(tokenizer=tiny_tokenizer, num_envs=2, seed=5, num_count=3, max_number=20, max_target=60)
    td = env.reset()
    targets, numbers = td["target"].tolist(), td["numbers"].tolist()
    chats = td["history"].prompt.to_chats()
    assert chats[0] == [
        {"role": "system", "content": COUNTDOWN_SYSTEM_PROMPT},
        {"role": "user", "content": countdown_query(targets[0], numbers[0])},
    ]
    assert td["answer"].tolist() == [countdown_answer(t, n) for t, n in zip(targets, numbers)]
    assert td["query"].tolist() == [countdown_query(t, n) for t, n in zip(targets, numbers)]
    solution = solve_countdown(targets[0], numbers[0])
    nxt = respond(env, td, [f"<think>search</think><answer>{solution}</answer>", "<answer>1 + 1 + 1</answer>"])
    assert fields_of(nxt) == {
        "reward_answer": [1.0, 1.0],
        "reward_think": [1.0, 0.0],
        "reward_right": [1.0, 0.1],
        "reward": [1.0, 0.1],
        "success": [True, False],
    }
    assert nxt["terminated"].view(-1).tolist() == [True, True]


def test_countdown_env_resumes_exactly():
    env = CountdownEnv(num_envs=2, seed=1)
    env.reset()
    state = env.primer.state_dict()
    expected = env.reset()["query"].tolist()
    resumed = CountdownEnv(num_envs=2, seed=1)
    resumed.primer.load_state_dict(state)
    assert resumed.reset()["query"].tolist() == expected


def test_countdown_row_seed_defaults():
    assert CountdownEnv(seed=7).primer.rows.seed == 7
    assert CountdownEnv(seed=None).primer.rows.seed == 0  # a fixed problem set, in a random order
    assert CountdownEnv(seed=7, row_seed=2).primer.rows.seed == 2
    assert len(CountdownEnv(num_rows=50).primer.rows) == 50


def test_countdown_env_takes_task_set_rows():
    rows = [{"target": 112, "nums": [25, 3, 4]}]
    env = CountdownEnv(dataset=rows)
    td = env.reset()
    assert td["query"].tolist() == [countdown_query(112, [25, 3, 4])]
    assert td["answer"].tolist() == ["target=112, numbers=25,3,4"]
    assert respond(env, td, ["<answer>(25 + 3) * 4</answer>"])["reward"].item() == 1.0
    with pytest.raises(ValueError, match="'target' and 'nums'"):
        CountdownColumns()([{"question": "q"}])


# ---------------------------------------------------------------------------- IFEvalData


def test_ifeval_data_fields_and_spec():
    data = IFEvalData(
        key=torch.tensor([7]),
        instruction_id_list=[["punctuation:no_comma"]],
        kwargs=[[{}]],
        query=["q"],
        batch_size=[1],
    )
    assert data.key.tolist() == [7] and data.response is None and data.reward is None
    spec = IFEvalData.default_spec((2,))
    assert set(spec.keys()) == {"key", "instruction_id_list", "kwargs", "query"}
    assert spec["key"].dtype == torch.int64 and tuple(spec["key"].shape) == (2,)
    assert spec.data_cls is IFEvalData


def test_ifeval_env_with_ifeval_data_primers_writes_only_its_columns():
    """TorchRL's IFEvalEnv passes IFEvalData.default_spec as primers; rlpost's accepts it."""
    env = IFEvalEnv(dataset=IFEVAL_DATA, shuffle=False, compute_reward=False, primers=IFEvalData.default_spec((1,)))
    td = env.reset()
    first = json.loads(IFEVAL_DATA.read_text().splitlines()[0])
    assert env.primer.columns == ["key", "instruction_id_list", "kwargs", "query"]
    assert td["key"].tolist() == [first["key"]]
    assert td["instruction_id_list"].tolist() == [first["instruction_id_list"]]
    assert td["query"].tolist() == [first["prompt"]]
    row = IFEvalData.from_tensordict(td.select("key", "instruction_id_list", "kwargs", "query"))
    assert isinstance(row, IFEvalData) and row.key.tolist() == [first["key"]]
    assert list(row.query) == [first["prompt"]] and row.response is None
