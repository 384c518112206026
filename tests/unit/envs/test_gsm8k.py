"""GSM8K with TorchRL's API: the reward fields and their values, math-verify (off the main thread,
with a time limit), GSM8KPrepareQuestion, GSM8KEnv's keywords, make_gsm8k_env, bad input."""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlpost.config import validate_config
from rlpost.data import ChatHistory, History
from rlpost.envs import ChatEnv, DatasetChatEnv, make_env, tasks
from rlpost.envs.gsm8k import (
    BASE_PROMPT,
    GSM8K_SYSTEM_PROMPT,
    GSM8KEnv,
    GSM8KPrepareQuestion,
    GSM8KRewardParser,
    gsm8k_target,
    make_gsm8k_env,
)
from rlpost.envs.math_verify_check import math_verify_equal

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[2] / "data" / "gsm8k_sample.jsonl"
ROWS = [json.loads(line) for line in DATA.read_text().splitlines()]
PATHOLOGICAL = r"\boxed{9^{9^{9^{9}}}}"  # sympy never finishes comparing this tower with a number


@pytest.fixture(scope="module")
def parser():
    """One parser (one math-verify worker process) for the module's scoring tests."""
    parser = GSM8KRewardParser()
    yield parser
    parser.close()


@pytest.fixture
def one_row(tmp_path):
    """A file with only the snakes row (answer 36), so the drawn prompt is known."""
    path = tmp_path / "snakes.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n")
    return path


def respond(env, td, completions):
    """Act as the policy (history mode): one assistant message per env, then step."""
    prompt = td["history"].prompt
    k = prompt.batch_size[0]
    reply = History(role=["assistant"] * k, content=list(completions), batch_size=[k])
    td.set("history", ChatHistory(prompt=prompt, full=prompt.append(reply, inplace=False), batch_size=[k]))
    return env.step(td)["next"]


def flat(next_td, key):
    return next_td[key].view(-1).tolist()


# ---------------------------------------------------------------------------- TorchRL's helpers


def test_extract_tags_takes_the_first_closed_tags():
    extract = GSM8KRewardParser.extract_tags
    assert extract("<think> work </think> <answer> 72 </answer>") == ("work", "72")
    assert extract("<answer>7</answer><answer>72</answer>") == ("", "7")
    assert extract("<think>a\nb</think><answer>\n3\n</answer>") == ("a\nb", "3")
    assert extract("<think>never closed <answer>72") == ("", "")
    assert extract("no tags at all") == ("", "")


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [("$1,234.50", "1234.5"), ("120.0", "120"), ("120", "120"), (" 72. ", "72"), ("50%", "50"), ("0.250", "0.25")],
)
def test_normalize_answer_is_torchrl_s(raw, normalized):
    assert GSM8KRewardParser.normalize_answer(raw) == normalized


def test_the_target_is_the_text_after_the_last_marker():
    assert gsm8k_target("He sells 3 + 4 = <<3+4=7>>7.\n#### 7") == "7"
    assert gsm8k_target("a #### 5\nthen #### 1,000 ") == "1,000"
    assert gsm8k_target("####72") == "72"
    for bad in ("no final answer", "work\n####   "):
        with pytest.raises(ValueError, match="no final answer after '####'"):
            gsm8k_target(bad)


# ---------------------------------------------------------------------------- the reward table


@pytest.mark.parametrize(
    ("completion", "fields"),
    [
        ("<think>24 + 12 = 36</think> <answer>36</answer>", (1.0, 1.0, 1.0, True)),  # right, well formed
        ("<think>24 + 12 = 37</think> <answer>37</answer>", (1.0, 1.0, 0.1, False)),  # wrong answer: format reward
        ("<answer>36</answer>", (1.0, 0.0, 1.0, True)),  # no think: still right
        ("<think>no answer tag</think> 36", (0.0, 1.0, 0.0, False)),  # badly formatted
        ("The answer is 36.", (0.0, 0.0, 0.0, False)),
        ("<think>cut off</think><answer>36", (0.0, 1.0, 0.0, False)),  # never closed: no answer
        ("<answer>   </answer>", (0.0, 0.0, 0.0, False)),  # empty answer: no answer
        ("<answer>36</answer> I hope this helps.", (1.0, 0.0, 1.0, True)),  # TorchRL ignores trailing text
        ("<answer>3</answer> <answer>36</answer>", (1.0, 0.0, 0.1, False)),  # the first answer counts
        ("<answer>$36.00</answer>", (1.0, 0.0, 1.0, True)),  # normalised
        ("<answer>036</answer>", (1.0, 0.0, 1.0, True)),  # same number
        ("<answer>36</answer><|im_end|>", (1.0, 0.0, 1.0, True)),  # end-of-turn marker removed
    ],
)
def test_reward_fields_of_one_response(parser, completion, fields):
    score = parser.score(completion, ROWS[0]["answer"])  # "#### 36"
    reward_answer, reward_think, reward_right, success = fields
    assert score["reward_answer"] == reward_answer and score["reward_think"] == reward_think
    assert score["reward_right"] == pytest.approx(reward_right) and score["reward"] == score["reward_right"]
    assert score["success"] is success
    assert parser.errors == Counter()


def test_format_and_correct_rewards_are_parameters():
    parser = GSM8KRewardParser(format_reward=0.0, correct_reward=2.0)
    assert parser.score("<answer>36</answer>", "#### 36")["reward"] == 2.0
    assert parser.score("<answer>35</answer>", "#### 36")["reward"] == 0.0


# ---------------------------------------------------------------------------- math-verify


@pytest.mark.parametrize(
    ("answer", "target"),
    [(r"\boxed{1/2}", "0.5"), (r"\frac{1}{2}", "0.5"), (r"\boxed{\frac{1}{2}}", "0.5"), ("1/2", "0.5"),
     ("0.5", "1/2"), ("1,000", "1000")],
)  # fmt: skip
def test_equivalent_latex_answers_are_right_through_math_verify(parser, answer, target):
    score = parser.score(f"<think>t</think><answer>{answer}</answer>", f"work\n#### {target}")
    assert score["success"] is True and score["reward"] == 1.0


def test_different_latex_answers_are_wrong(parser):
    score = parser.score(r"<answer>\boxed{1/3}</answer>", "#### 0.5")
    assert score["success"] is False and score["reward"] == pytest.approx(0.1)


def test_without_math_verify_the_comparison_is_torchrl_s_string_match():
    """Deviation check: TorchRL compares normalised strings, so \\boxed{1/2} for 0.5 and a
    number in words are wrong (0.1); rlpost's default (math-verify) finds both right."""
    torchrl_parser = GSM8KRewardParser(use_math_verify=False)
    for answer, target in ((r"\boxed{1/2}", "0.5"), ("Mary saw a total of 36 snakes.", "36"), ("036", "36")):
        score = torchrl_parser.score(f"<answer>{answer}</answer>", f"#### {target}")
        assert score["success"] is False and score["reward"] == pytest.approx(0.1)
    assert torchrl_parser._pool is None  # no worker process was started


def test_a_number_in_words_is_right_through_math_verify(parser):
    score = parser.score("<think>24 + 12</think> <answer>Mary saw a total of 36 snakes.</answer>", "#### 36")
    assert score["success"] is True and score["reward"] == 1.0


def test_math_verify_works_off_the_main_thread():
    """The bug this prevents: math-verify's own time limit uses signal.alarm, which raises off the
    main thread (in a Ray actor every answer would then score 0)."""
    results, errors = [], []

    def check():
        try:
            results.append((math_verify_equal(r"\boxed{1/2}", "0.5"), math_verify_equal(r"\boxed{1/3}", "0.5")))
        except Exception as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=check)
    thread.start()
    thread.join(timeout=60)
    assert errors == [] and results == [(True, False)]


def test_the_parser_checks_answers_from_worker_threads(parser):
    with ThreadPoolExecutor(max_workers=3) as executor:
        verdicts = list(executor.map(lambda pair: parser.check_answer(*pair),
                                     [(r"\frac{1}{2}", "0.5"), (r"\boxed{3}", "3"), (r"\sqrt{4}", "3")]))  # fmt: skip
    assert verdicts == [True, True, False]
    assert parser.errors == Counter()


def test_a_check_past_the_time_limit_scores_zero_is_counted_and_never_hangs():
    parser = GSM8KRewardParser(verify_timeout_s=1.0)
    try:
        start = time.monotonic()
        score = parser.score(f"<think>t</think><answer>{PATHOLOGICAL}</answer>", "#### 72")
        assert time.monotonic() - start < 60  # 1 s of checking plus the worker's start
        assert score["reward"] == 0.0 and score["reward_right"] == 0.0 and score["success"] is False
        assert score["reward_answer"] == 1.0 and score["reward_think"] == 1.0  # the format is still reported
        assert parser.errors == Counter({"Timeout": 1})
        assert parser.check_answer(r"\frac{1}{2}", "0.5") is True  # a fresh worker replaced the killed one
    finally:
        parser.close()


def test_a_timeout_through_the_env_is_in_reward_errors(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "#### 72"}) + "\n")
    env = GSM8KEnv(dataset=path, num_envs=2, compute_reward=False)
    env.append_transform(GSM8KRewardParser(verify_timeout_s=1.0))
    try:
        nxt = respond(env, env.reset(), [f"<answer>{PATHOLOGICAL}</answer>", "<answer>72</answer>"])
        assert flat(nxt, "reward") == [0.0, 1.0]
        assert env.reward_errors == Counter({"Timeout": 1})
    finally:
        env.close()


# ---------------------------------------------------------------------------- through the env


def test_gsm8k_env_writes_torchrl_s_reward_fields(one_row):
    env = GSM8KEnv(dataset=one_row, num_envs=4, seed=0)
    td = env.reset()
    assert td["history"].prompt.to_chats()[0] == [
        {"role": "system", "content": GSM8K_SYSTEM_PROMPT},
        {"role": "user", "content": ROWS[0]["question"]},
    ]
    nxt = respond(env, td, [
        "<think>3*8 + 6*2</think> <answer>36</answer>",
        "<think>3*8 + 6</think> <answer>30</answer>",
        "I think it is 36",
        "<answer>36</answer>",
    ])  # fmt: skip
    assert flat(nxt, "reward_answer") == [1.0, 1.0, 0.0, 1.0]
    assert flat(nxt, "reward_think") == [1.0, 1.0, 0.0, 0.0]
    assert flat(nxt, "reward_right") == pytest.approx([1.0, 0.1, 0.0, 1.0])
    assert flat(nxt, "reward") == pytest.approx([1.0, 0.1, 0.0, 1.0])
    assert flat(nxt, "success") == [True, False, False, True]
    for key in ("reward_answer", "reward_think", "reward_right", "reward"):
        assert nxt[key].shape == (4, 1) and nxt[key].dtype == torch.float32  # deviation: TorchRL's are [4, 1, 1]
    assert nxt["success"].shape == (4, 1) and nxt["success"].dtype == torch.bool
    assert flat(nxt, "terminated") == [True, True, False, True]  # set_done_if_answer
    assert flat(nxt, "done") == [True] * 4  # max_steps=1


def test_fields_add_to_what_is_there_and_out_keys_rename_them(one_row):
    env = GSM8KEnv(dataset=one_row, num_envs=2, max_steps=None)
    env.append_transform(GSM8KRewardParser(out_keys=["fmt_answer", "fmt_think", "right", "reward", "ok"]))
    nxt = respond(env, env.reset(), ["<answer>36</answer>", "<answer>5</answer>"])
    assert flat(nxt, "reward") == pytest.approx([2.0, 0.2])  # both parsers add to next["reward"]
    assert flat(nxt, "reward_right") == pytest.approx([1.0, 0.1]) and flat(nxt, "right") == pytest.approx([1.0, 0.1])
    assert flat(nxt, "ok") == [True, False] and flat(nxt, "fmt_answer") == [1.0, 1.0]


def test_a_later_turn_is_scored_against_the_same_answer(one_row):
    env = GSM8KEnv(dataset=one_row, num_envs=1, max_steps=3)
    nxt = respond(env, env.reset(), ["<think>still working"])
    assert flat(nxt, "reward") == [0.0] and flat(nxt, "done") == [False]
    nxt = respond(env, env.maybe_reset(nxt), ["<answer>36</answer>"])  # the answer was carried along
    assert flat(nxt, "reward") == [1.0] and flat(nxt, "done") == [True]


def test_strict_format_keeps_rlpost_s_answer_rule(one_row):
    """make_env's rule: the last answer, which may be left unclosed at the very end, and nothing
    after its </answer>; any answer tag ends the episode."""
    env = GSM8KEnv(dataset=one_row, num_envs=5, max_steps=3, strict_format=True)
    nxt = respond(env, env.reset(), [
        "<think>t</think><answer>36</answer>",
        "<think>t</think><answer>36",  # stopped at a "</answer>" stop string
        "<answer>36</answer> and more text",  # text after the answer: 0
        "<answer></answer>",  # an empty answer is a wrong one
        "<think>only thinking",
    ])  # fmt: skip
    assert flat(nxt, "reward") == pytest.approx([1.0, 1.0, 0.0, 0.1, 0.0])
    assert flat(nxt, "reward_answer") == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert flat(nxt, "terminated") == [True, True, True, True, False]


def test_make_env_uses_the_strict_rule_and_torchrl_s_system_prompt(tiny_tokenizer):
    cfg = validate_config({"data": {"task": "gsm8k", "dataset": str(DATA), "group_size": 2}})
    env = make_env(cfg, tiny_tokenizer, batch_size=2)
    parsers = [t for t in env.transforms if isinstance(t, GSM8KRewardParser)]
    assert isinstance(env, GSM8KEnv) and len(parsers) == 1 and parsers[0].strict_format
    assert env.reset()["history"].prompt.to_chats()[0][0]["content"] == GSM8K_SYSTEM_PROMPT


def test_tasks_re_exports_the_gsm8k_names():
    assert tasks.GSM8KEnv is GSM8KEnv and tasks.GSM8KRewardParser is GSM8KRewardParser
    assert tasks.GSM8K_SYSTEM_PROMPT == GSM8K_SYSTEM_PROMPT
    assert GSM8K_SYSTEM_PROMPT.endswith("<answer>answer here</answer>. The answer should be a number.")


# ---------------------------------------------------------------------------- bad input


def test_a_missing_reference_answer_raises_naming_the_key():
    env = ChatEnv(batch_size=(1,), max_steps=1)
    env = env.append_transform(GSM8KRewardParser(answer_key="solution"))
    td = env.reset(TensorDict({"query": ["What is 6 * 6?"]}, batch_size=[1]))
    with pytest.raises(ValueError, match="reference answer under 'solution'"):
        respond(env, td, ["<answer>36</answer>"])


@pytest.mark.parametrize("empty", ["", "   ", None])
def test_an_empty_reference_answer_raises_naming_the_key(empty):
    env = ChatEnv(batch_size=(2,), max_steps=1).append_transform(GSM8KRewardParser())
    td = env.reset(TensorDict({"query": ["q1", "q2"], "answer": ["#### 1", empty]}, batch_size=[2]))
    with pytest.raises(ValueError, match=r"reference answer under 'answer' is empty in row 1"):
        respond(env, td, ["<answer>1</answer>", "<answer>1</answer>"])


def test_an_answer_field_without_the_marker_scores_zero_and_is_counted(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "the answer is 1"}) + "\n")
    env = GSM8KEnv(dataset=path, num_envs=2)
    nxt = respond(env, env.reset(), ["<think>t</think><answer>1</answer>", "no answer"])
    assert flat(nxt, "reward") == [0.0, 0.0] and flat(nxt, "success") == [False, False]
    assert flat(nxt, "reward_answer") == [1.0, 0.0]
    assert env.reward_errors == Counter({"ValueError": 1})  # only the response with an answer is checked


def test_bad_arguments_name_what_is_wrong():
    with pytest.raises(ValueError, match=r"in_keys\[0\]='response'"):
        GSM8KRewardParser(in_keys=["response", "answer"])
    with pytest.raises(ValueError, match="must be \\[response key, answer key\\]"):
        GSM8KRewardParser(in_keys=["answer"])
    with pytest.raises(ValueError, match="contradicts in_keys"):
        GSM8KRewardParser(in_keys=[("history", "full"), "answer"], answer_key="solution")
    with pytest.raises(ValueError, match="out_keys must name the 5 fields"):
        GSM8KRewardParser(out_keys=["reward"])
    with pytest.raises(ValueError, match="verify_timeout_s must be > 0"):
        GSM8KRewardParser(verify_timeout_s=0)
    assert GSM8KRewardParser(in_keys=["text_response", "solution"]).answer_key == "solution"


def test_an_input_mode_that_differs_from_the_env_s_raises(one_row):
    env = GSM8KEnv(dataset=one_row, compute_reward=False)
    env.append_transform(GSM8KRewardParser(input_mode="text"))
    with pytest.raises(ValueError, match="input_mode='text'.*input_mode='history'"):
        respond(env, env.reset(), ["<answer>36</answer>"])


# ---------------------------------------------------------------------------- GSM8KPrepareQuestion


def test_prepare_question_puts_the_query_in_torchrl_s_template():
    env = ChatEnv(batch_size=(2,), max_steps=1).append_transform(GSM8KPrepareQuestion())
    questions = ["What is 6 * 6?", "What is 2 + 2?"]
    td = env.reset(TensorDict({"query": questions}, batch_size=[2]))
    prompts = [BASE_PROMPT % q for q in questions]
    assert [chat[-1]["content"] for chat in td["history"].prompt.to_chats()] == prompts
    assert prompts[0].startswith("A conversation between User and Assistant.")
    assert prompts[0].endswith("User: What is 6 * 6?. Assistant: <think>")
    # an automatic reset restarts the same conversation: the carried query is not wrapped twice
    _, root = env.step_and_maybe_reset(_with_reply(td, ["<answer>36</answer>", "<answer>4</answer>"]))
    assert [chat[-1]["content"] for chat in root["history"].prompt.to_chats()] == prompts


def _with_reply(td, contents):
    prompt = td["history"].prompt
    reply = History(role=["assistant"] * len(contents), content=contents, batch_size=[len(contents)])
    td.set("history", ChatHistory(prompt=prompt, full=prompt.append(reply, inplace=False), batch_size=[len(contents)]))
    return td


def test_prepare_question_in_keys_and_out_keys():
    transform = GSM8KPrepareQuestion(in_keys=["question"], out_keys=["query"])
    env = ChatEnv(batch_size=(1,)).append_transform(transform)
    td = env.reset(TensorDict({"question": ["What is 6 * 6?"]}, batch_size=[1]))
    assert td["history"].prompt.to_chats()[0][-1]["content"] == BASE_PROMPT % "What is 6 * 6?"
    assert td["question"] == ["What is 6 * 6?"]
    with pytest.raises(ValueError, match="as many out_keys as in_keys"):
        GSM8KPrepareQuestion(in_keys=["a", "b"], out_keys=["c"])


def test_prepare_question_errors_name_the_key():
    env = ChatEnv(batch_size=(1,)).append_transform(GSM8KPrepareQuestion(in_keys=["question"]))
    with pytest.raises(ValueError, match="no question under 'question'"):
        env.reset(TensorDict({"query": ["q"]}, batch_size=[1]))
    with pytest.raises(ValueError, match=r"row 0 of 'question' holds a \w+, expected a string"):
        env.reset(TensorDict({"question": [7], "query": ["q"]}, batch_size=[1]))


def test_prepare_question_before_the_primer_raises_saying_where_it_goes():
    """TorchRL's make_gsm8k_env inserts it at index 0; here transforms run in list order, so it
    must come after the primer that loads the questions."""
    env = DatasetChatEnv(dataset=str(DATA), data_key="text", prompt_column="question")
    env.insert_transform(0, GSM8KPrepareQuestion())
    with pytest.raises(ValueError, match="append it after the transform that loads the questions"):
        env.reset()


# ---------------------------------------------------------------------------- GSM8KEnv's keywords


def test_gsm8k_env_passes_torchrl_s_data_loading_keywords():
    def collate(batch):  # TorchRL's DatasetChatEnv style: the rows, with the question renamed to the query key
        return [{"query": row["question"], "answer": row["answer"]} for row in batch]

    env = GSM8KEnv(dataset=str(DATA), num_envs=2, batch_size_dl=2, collate_fn=collate, shuffle=False,
                   apply_template=True, seed=0)  # fmt: skip
    assert env.primer.batch_size_dl == 2 and env.primer.collate_fn is collate
    td = env.reset()
    assert [chat[-1]["content"] for chat in td["history"].prompt.to_chats()] == [r["question"] for r in ROWS[:2]]
    nxt = respond(env, td, ["<answer>36</answer>", "<answer>11</answer>"])
    assert flat(nxt, "success") == [True, True]


def test_gsm8k_env_max_steps_zero_means_no_limit_and_an_actor_name_needs_the_ray_backend():
    assert GSM8KEnv(dataset=str(DATA), max_steps=0).max_steps is None
    assert GSM8KEnv(dataset=str(DATA)).max_steps == 1
    with pytest.raises(ValueError, match="dataloader_actor_name must be None if ray_backend is False"):
        GSM8KEnv(dataset=str(DATA), dataloader_actor_name="mine")


def test_hub_names_load_the_main_subset(monkeypatch):
    import rlpost.envs.datasets as datasets_module

    seen = []

    def fake_load_rows(source, *, name=None, split="train"):
        seen.append((source, name, split))
        return datasets_module.RowList(ROWS), "fake"

    monkeypatch.setattr(datasets_module, "load_rows", fake_load_rows)
    for dataset in ("gsm8k", "openai/gsm8k"):
        GSM8KEnv(dataset=dataset)
    GSM8KEnv(dataset="someone/gsm8k-copy")
    assert seen == [
        ("gsm8k", "main", "train"),
        ("openai/gsm8k", "main", "train"),
        ("someone/gsm8k-copy", None, "train"),
    ]


# ---------------------------------------------------------------------------- make_gsm8k_env


def test_make_gsm8k_env_without_tokenizer_warns_and_assigns_no_reward():
    with pytest.warns(UserWarning) as caught:
        env = make_gsm8k_env(dataset=str(DATA), num_envs=2, seed=0)
    messages = [str(w.message) for w in caught]
    assert "This constructor is to be deprecated. Use GSM8KEnv instead." in messages
    assert "No tokenizer specified - reward will not be assigned." in messages
    td = env.reset()
    questions = {r["question"] for r in ROWS}
    for text, chat in zip(td["text"], td["history"].prompt.to_chats()):
        assert text.startswith("A conversation between User and Assistant.") and chat == [
            {"role": "user", "content": text}
        ]
        assert text[len("A conversation") :].split("User: ", 1)[1][: -len(". Assistant: <think>")] in questions
    nxt = respond(env, td, ["<answer>36</answer>", "<answer>11</answer>"])
    assert flat(nxt, "reward") == [0.0, 0.0] and "reward_answer" not in nxt.keys()
    assert flat(nxt, "done") == [True, True]


def test_make_gsm8k_env_with_a_tokenizer_assigns_the_reward(one_row, tiny_tokenizer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env = make_gsm8k_env(dataset=str(one_row), num_envs=2, repeats=2, tokenizer=tiny_tokenizer)
    assert [str(w.message) for w in caught if w.category is UserWarning] == [
        "This constructor is to be deprecated. Use GSM8KEnv instead."
    ]
    td = env.reset()
    assert td["prompt_id"].tolist() == [0, 0]
    td["text_response"] = ["<think>24 + 12</think> <answer>36</answer><|im_end|>", "<answer>35</answer>"]
    nxt = env.step(td)["next"]
    assert flat(nxt, "reward") == pytest.approx([1.0, 0.1]) and flat(nxt, "success") == [True, False]
