"""The answer-format reward (GSM8K and the arithmetic task) and user reward functions."""

from __future__ import annotations

import math
import sys

import pytest

from rlpost.envs.rewards import (
    answer_reward,
    call_user_reward,
    extract_answer,
    has_answer,
    load_reward_fn,
    normalize_answer,
    parse_gsm8k_target,
)

pytestmark = pytest.mark.unit

GSM8K_ROW = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
    "clips in May. How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
}


@pytest.mark.parametrize(
    ("completion", "target", "reward"),
    [
        ("<think>48 + 24</think><answer>72</answer>", "72", 1.0),
        ("<think>48 + 24</think><answer> 72 </answer>", "72", 1.0),
        ("<answer>$1,234.00</answer>", "1234", 1.0),
        ("<answer> 12. </answer>", "12", 1.0),
        ("<answer>12.50</answer>", "12.5", 1.0),
        ("<answer>+7</answer>", "7", 1.0),
        ("<answer>-3</answer>", "-3", 1.0),
        ("<think>so</think><answer>72", "72", 1.0),  # stopped at the '</answer>' stop string
        ("<answer>71</answer>", "72", 0.1),  # wrong
        ("<answer>-72</answer>", "72", 0.1),
        ("<answer></answer>", "72", 0.1),  # tag present, empty
        ("<answer>seventy-two</answer>", "72", 0.1),
        ("<answer>72</answer> wait, no: <answer>70</answer>", "72", 0.1),  # the last tag counts
        ("<answer>70</answer> wait, no: <answer>72</answer>", "72", 1.0),
        ("<answer>72</answer>\n", "72", 1.0),  # whitespace may follow the answer
        ("<answer>72</answer> done", "72", 0.0),  # anything else may not: the answer ends it
        ("<answer>72</answer>0</answer>1</answer>", "72", 0.0),  # the drift the rule stops
        ("The answer is 72.", "72", 0.0),  # no tag
        ("<think>72</think>", "72", 0.0),
        ("<Answer>72</Answer>", "72", 0.0),  # tags are case-sensitive
        ("", "72", 0.0),
    ],
)
def test_gsm8k_reward_table(completion, target, reward):
    assert answer_reward(completion, target) == reward


def test_reward_against_a_real_gsm8k_row():
    target = parse_gsm8k_target(GSM8K_ROW["answer"])
    assert target == "72"
    completion = "<think>48/2 = 24, 48 + 24 = 72</think>\n<answer>72</answer>"
    assert answer_reward(completion, target) == 1.0
    assert answer_reward("<answer>$72.00</answer>", GSM8K_ROW["answer"].split("####")[1]) == 1.0


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("72", "72"),
        ("  72\n", "72"),
        ("$1,234.00", "1234"),
        (" 12. ", "12"),
        ("12.0", "12"),
        ("12.50", "12.5"),
        ("0.50", "0.5"),
        (".5", "0.5"),
        ("-.5", "-0.5"),
        ("+5", "5"),
        ("007", "7"),
        ("-0", "0"),
        ("-0.00", "0"),
        ("1 000 000", "1000000"),
        ("$ 5", "5"),
        ("1" * 5000, "1" * 5000),  # no int() digit limit
        ("abc", "abc"),
        ("1.2.3", "1.2.3"),
        ("", ""),
    ],
)
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal
    assert normalize_answer(normal) == normal  # idempotent


def test_extract_answer_and_has_answer():
    assert extract_answer("<answer>1</answer><answer> 2 </answer>") == "2"
    assert extract_answer("<answer>1</answer> trailing text") == "1"
    assert extract_answer("<answer>  cut short") == "cut short"
    assert extract_answer("<answer></answer>") == ""
    assert extract_answer("no tag </answer>") is None
    assert has_answer("<think>x</think><answer>3</answer>")
    assert not has_answer("<think>still thinking")


def test_parse_gsm8k_target():
    assert parse_gsm8k_target("so 1,234 in all\n#### 1,234") == "1234"
    assert parse_gsm8k_target("#### -5") == "-5"
    with pytest.raises(ValueError, match="no final answer after '####': 'the answer is 5'"):
        parse_gsm8k_target("the answer is 5")
    with pytest.raises(ValueError, match="####"):
        parse_gsm8k_target("#### ")


def test_user_reward_fn_is_called_with_completion_and_row():
    calls = []

    def length_reward(completion, row):
        calls.append((completion, row))
        return len(completion) / 10

    assert call_user_reward(length_reward, "abcde", {"id": 1}) == (0.5, None)
    assert calls == [("abcde", {"id": 1})]
    assert call_user_reward(lambda c, r: True, "", {}) == (1.0, None)


def test_raising_user_reward_fn_gives_zero_and_the_error_type():
    def broken(completion, row):
        return row["missing"]

    assert call_user_reward(broken, "x", {}) == (0.0, "KeyError")
    assert call_user_reward(lambda c, r: 1 / 0, "x", {}) == (0.0, "ZeroDivisionError")
    assert call_user_reward(lambda c, r: sys.exit(1), "x", {}) == (0.0, "SystemExit")
    assert call_user_reward(lambda c, r: "high", "x", {}) == (0.0, "ValueError")
    assert call_user_reward(lambda c, r: None, "x", {}) == (0.0, "TypeError")
    assert call_user_reward(lambda c, r: math.nan, "x", {}) == (0.0, "NonFiniteReward")
    assert call_user_reward(lambda c, r: -math.inf, "x", {}) == (0.0, "NonFiniteReward")


def test_keyboard_interrupt_is_not_swallowed():
    def interrupted(completion, row):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        call_user_reward(interrupted, "x", {})


def test_load_reward_fn_forms(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def exact(completion, row):\n    return float(completion == row['answer'])\n"
        "class Scorer:\n    @staticmethod\n    def score(completion, row):\n        return 0.5\n"
        "THRESHOLD = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for path in ("my_rewards:exact", "my_rewards.exact"):
        fn = load_reward_fn(path)
        assert call_user_reward(fn, "4", {"answer": "4"}) == (1.0, None)
    assert load_reward_fn("my_rewards:Scorer.score")("x", {}) == 0.5
    assert load_reward_fn("os.path:join") is __import__("os").path.join
    with pytest.raises(ValueError, match=r"'my_rewards:THRESHOLD' is not callable \(it is a int\)"):
        load_reward_fn("my_rewards:THRESHOLD")
    for path in ("my_rewards:nope", "my_rewards.nope"):
        with pytest.raises(ValueError, match=f"'{path}': 'my_rewards' has no attribute 'nope'"):
            load_reward_fn(path)


@pytest.mark.parametrize("path", ["no_such_rlpost_mod:f", "no_such_rlpost_mod.f", "math.nope:f"])
def test_load_reward_fn_missing_module(path):
    with pytest.raises(ValueError, match=f"reward function '{path}': cannot import module"):
        load_reward_fn(path)


@pytest.mark.parametrize("path", ["", "exact", "my_rewards:", ":exact", "a:b:c", "pkg."])
def test_load_reward_fn_malformed_path(path):
    with pytest.raises(ValueError, match="is not of the form 'package.module:function'"):
        load_reward_fn(path)
