"""IFEval: the strict and loose checks of Google's instructions, IfEvalScorer's score, reward and
done flags through the env in each input mode, IFEvalEnv over a local IFEval-format file, and the
errors for bad rows, a missing checker package and missing NLTK data."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from rlpost.data import ChatHistory, History, Text, Tokens
from rlpost.envs import ChatEnv, IFEvalEnv, IFEvalScoreData, IfEvalScorer, Transform
from rlpost.envs.ifeval import IFEVAL_SYSTEM_PROMPT, PUNKT_INSTRUCTIONS

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[2] / "data" / "ifeval_sample.jsonl"
ROWS = [json.loads(line) for line in DATA.read_text().splitlines()]
BY_PROMPT = {row["prompt"]: row for row in ROWS}

NO_COMMA_WORDS = (
    ["punctuation:no_comma", "length_constraints:number_words"],
    [{}, {"relation": "at least", "num_words": 20}],
)
NOTE = (
    "Dear neighbour our grey cat Milo went missing on Tuesday night so please check your garage "
    "and your garden for him"
)  # 21 words, no comma
POEM = "<<falling leaves>>\nred leaves drift down\nthe wind hums low"
LIGHTHOUSE = "THE BEACON SHINES THROUGH THE STORM. SHIPS FIND THEIR WAY HOME SAFELY TONIGHT."


@pytest.fixture(scope="module")
def scorer():
    return IfEvalScorer()


FIELDS = ("prompt_level_strict_acc", "inst_level_strict_acc", "prompt_level_loose_acc", "inst_level_loose_acc")


def flags(score: IFEvalScoreData) -> dict[str, list[bool]]:
    return {name: getattr(score, name).tolist() for name in FIELDS}


def respond(env, td, completions, *, complete=None, reset=True):
    """Act as the policy in history mode: one assistant message per row (``complete`` gives
    each message's ``is_complete``), then step (and reset the rows that are done)."""
    prompt = td["history"].prompt
    chats = prompt.to_chats(include_state=True)
    for i, text in enumerate(completions):
        done = True if complete is None else complete[i]
        chats[i].append({"role": "assistant", "content": text, "is_complete": done})
    td.set("history", ChatHistory(prompt=prompt, full=History.from_chats(chats), batch_size=prompt.batch_size[:1]))
    return env.step_and_maybe_reset(td) if reset else (env.step(td), None)


# ---------------------------------------------------------------------------- strict and loose


def test_no_comma_strict_fails_on_a_chatty_first_line_that_loose_forgives(scorer):
    response = "Sure, here is my note:\n" + NOTE
    score = scorer.score(response, *NO_COMMA_WORDS)
    assert flags(score) == {
        "prompt_level_strict_acc": [False],
        "inst_level_strict_acc": [False, True],  # the comma is in the first line
        "prompt_level_loose_acc": [True],
        "inst_level_loose_acc": [True, True],  # the variant without the first line has none
    }
    assert flags(scorer.score(NOTE, *NO_COMMA_WORDS))["prompt_level_strict_acc"] == [True]


def test_word_count_relations_at_the_boundary(scorer):
    ids, kwargs = ["length_constraints:number_words"], [{"relation": "less than", "num_words": 15}]
    fourteen = " ".join(["rain"] * 14)
    assert flags(scorer.score(fourteen, ids, kwargs))["inst_level_strict_acc"] == [True]
    assert flags(scorer.score(fourteen + " again", ids, kwargs))["inst_level_loose_acc"] == [False]
    short = "rain " * 19 + "rain"
    assert scorer.score(short, *NO_COMMA_WORDS).inst_level_strict_acc.tolist() == [True, True]  # exactly 20
    assert scorer.score("rain " * 18 + "rain", *NO_COMMA_WORDS).inst_level_loose_acc.tolist() == [True, False]


def test_title_and_lowercase(scorer):
    ids, kwargs = ["detectable_format:title", "change_case:english_lowercase"], [{}, {}]
    assert flags(scorer.score(POEM, ids, kwargs))["inst_level_strict_acc"] == [True, True]
    chatty = "Here is my poem:\n" + POEM  # a capital letter in the first line only
    assert flags(scorer.score(chatty, ids, kwargs)) == {
        "prompt_level_strict_acc": [False],
        "inst_level_strict_acc": [True, False],
        "prompt_level_loose_acc": [True],
        "inst_level_loose_acc": [True, True],
    }
    untitled = scorer.score("red leaves drift down", ids, kwargs)
    assert untitled.inst_level_loose_acc.tolist() == [False, True]  # no variant adds a title


def test_keywords_and_capital_letters(scorer):
    ids, kwargs = ["keywords:existence", "change_case:english_capital"], [{"keywords": ["beacon", "storm"]}, {}]
    assert flags(scorer.score(LIGHTHOUSE, ids, kwargs))["prompt_level_strict_acc"] == [True]
    lower = scorer.score(LIGHTHOUSE.lower(), ids, kwargs)  # keywords match in any case
    assert lower.inst_level_strict_acc.tolist() == [True, False]
    assert lower.inst_level_loose_acc.tolist() == [True, False]
    no_storm = scorer.score("THE BEACON SHINES TONIGHT OVER THE CALM DARK SEA.", ids, kwargs)
    assert no_storm.inst_level_strict_acc.tolist() == [False, True]


def test_loose_forgives_markdown_asterisks(scorer):
    ids, kwargs = ["startend:quotation"], [{}]
    assert scorer.score('"soft rain on the roof"', ids, kwargs).prompt_level_strict_acc.tolist() == [True]
    bold = scorer.score('**"soft rain on the roof"**', ids, kwargs)
    assert flags(bold)["inst_level_strict_acc"] == [False] and flags(bold)["inst_level_loose_acc"] == [True]


def test_empty_response_follows_nothing(scorer):
    score = scorer.score("   ", *NO_COMMA_WORDS)  # no_comma would pass on an empty text: IFEval says no
    assert flags(score)["inst_level_strict_acc"] == [False, False]
    assert flags(score)["inst_level_loose_acc"] == [False, False]


def test_none_arguments_are_dropped_and_zero_is_kept(scorer):
    ids = ["detectable_format:number_bullet_lists", "length_constraints:number_words"]
    kwargs = [{"num_bullets": 0, "num_highlights": None}, {"relation": "at least", "num_words": 2, "keywords": None}]
    # Deviation from TorchRL, which drops every falsy argument: num_bullets=0 would become a random
    # count drawn by the checker; here it is kept, so "no bullets" passes every time.
    results = {tuple(scorer.score("no bullets here", ids, kwargs).inst_level_strict_acc.tolist()) for _ in range(5)}
    assert results == {(True, True)}


def test_unknown_instruction_id_is_a_clear_error(scorer):
    with pytest.raises(ValueError, match=r"unknown IFEval instruction id 'punctuation:no_semicolon'.*known ids"):
        scorer.score("text", ["punctuation:no_semicolon"], [{}])


def test_kwargs_must_match_the_instructions(scorer):
    with pytest.raises(ValueError, match="2 instructions but 1 kwargs"):
        scorer.score("text", ["punctuation:no_comma", "length_constraints:number_words"], [{}])
    with pytest.raises(ValueError, match=r"bad kwargs \{'num_wordz': 3\} for IFEval instruction 'length_constraints"):
        scorer.score("text", ["length_constraints:number_words"], [{"num_wordz": 3}])
    with pytest.raises(ValueError, match="lists no instructions"):
        scorer.score("text", [], [])


# ---------------------------------------------------------------------------- the score data and the reward


def test_score_data_fields_are_bool_with_a_trailing_dim():
    score = IFEvalScoreData(prompt_level_strict_acc=True, inst_level_strict_acc=torch.tensor([1, 0]), batch_size=[])
    assert score.prompt_level_strict_acc.dtype == torch.bool and score.prompt_level_strict_acc.tolist() == [True]
    assert score.inst_level_strict_acc.tolist() == [True, False]
    assert score.prompt_level_loose_acc.tolist() == [False]  # missing: False (TorchRL: a float 0)
    batched = IFEvalScoreData(prompt_level_loose_acc=torch.tensor([True, False]), batch_size=[2])
    assert batched.prompt_level_loose_acc.shape == (2, 1)  # given without its trailing dim
    spec = IFEvalScoreData.default_spec((3,))
    zero = spec.zero()
    assert isinstance(zero, IFEvalScoreData) and zero.batch_size == (3,) and spec.is_in(zero)
    assert zero.inst_level_loose_acc.dtype == torch.bool


def _score(strict, loose):
    return IFEvalScoreData(
        prompt_level_strict_acc=torch.tensor([all(strict)]), inst_level_strict_acc=torch.tensor(strict),
        prompt_level_loose_acc=torch.tensor([all(loose)]), inst_level_loose_acc=torch.tensor(loose), batch_size=[],
    )  # fmt: skip


@pytest.mark.parametrize(
    "strict, loose, think, answer, complete, expected",
    [
        ([True, True], [True, True], ["t"], ["a"], True, 1.0 + 0.1 + 0.05),  # the most: 1.15
        ([True, True], [True, True], ["t"], ["a"], False, 1.15),  # completion is not rewarded
        # no answer block: the scorer checked the empty response, which follows nothing
        ([False, False], [False, False], ["t"], [], True, 0.05),
        ([False], [False], [], [], None, 0.0),  # the least
        ([True], [True], [], ["a"], False, 1.0 + 0.1),  # no think block
        ([True], [True], ["t", "t"], ["a", "a"], False, 1.0),  # several of each: no bonus
        ([True, False], [True, True], ["t"], ["a"], True, 0.3 * 0.5 + 0.2 + 0.1 + 0.15),  # metrics 0.45
        ([False, False, False], [False, False, False], ["t"], ["a"], None, 0.15),  # the format alone
    ],
)
def test_default_reward_aggregator(scorer, strict, loose, think, answer, complete, expected):
    reward = scorer.default_reward_aggregator(_score(strict, loose), think_blocks=think, answer_blocks=answer,
                                              complete=complete)  # fmt: skip
    assert reward.shape == (1,) and reward.dtype == torch.get_default_dtype()
    assert reward.item() == pytest.approx(expected)


def test_default_reward_aggregator_on_a_batch_of_scores(scorer):
    """A score of batch ``[B]`` (equal instruction counts) gives ``[B, 1]``, as in TorchRL."""
    score = IFEvalScoreData(
        prompt_level_strict_acc=torch.tensor([True, False]),
        inst_level_strict_acc=torch.tensor([[True, True], [False, True]]),
        prompt_level_loose_acc=torch.tensor([True, True]),
        inst_level_loose_acc=torch.tensor([[True, True], [True, True]]),
        batch_size=[2],
    )
    reward = scorer.default_reward_aggregator(score, think_blocks=["t"], answer_blocks=["a"])
    assert reward.shape == (2, 1)
    assert reward.view(-1).tolist() == pytest.approx([1.15, 0.3 * 0.5 + 0.2 + 0.1 + 0.15])


def test_format_weights_are_used_and_checked():
    only_strict = IfEvalScorer(format_weights=[1.0, 0.0, 0.0, 0.0])
    reward = only_strict.default_reward_aggregator(_score([True], [True]), think_blocks=["t"], answer_blocks=["a"])
    assert reward.item() == pytest.approx(1.0 + 0.15)
    half_strict = only_strict.default_reward_aggregator(_score([True, False], [True, True]))
    assert half_strict.item() == pytest.approx(0.0)  # the prompt-level strict flag is False; no blocks
    with pytest.raises(ValueError, match="format_weights needs 4 weights"):
        IfEvalScorer(format_weights=[1.0, 0.0])


# ---------------------------------------------------------------------------- through IFEvalEnv


def _answers_for(td) -> list[str]:
    """A response that follows every instruction of each row's prompt, by key."""
    good = {
        1000: NOTE, 1001: POEM, 1002: LIGHTHOUSE, 1003: '"soft rain falls on the quiet roof"',
        1004: "What is the capital of France? Paris.",
        1005: "* apple\n* pear\n* plum\nIs there anything else I can help with?",
        1006: "Plants take in *water* and *carbon dioxide* and turn them into sugar.",
    }  # fmt: skip
    return [good[key] for key in td["key"].tolist()]


def test_env_reset_lays_out_the_row_as_torchrl_does():
    env = IFEvalEnv(dataset=DATA, num_envs=3, shuffle=False)
    td = env.reset()
    assert env.max_steps == 1
    assert td["key"].dtype == torch.int64 and td["key"].tolist() == [1000, 1001, 1002]
    assert td["instruction_id_list"].tolist() == [row["instruction_id_list"] for row in ROWS[:3]]
    assert [[{k: v for k, v in d.items() if v is not None} for d in kw] for kw in td["kwargs"].tolist()] == [
        row["kwargs"] for row in ROWS[:3]
    ]
    chats = td["history"].prompt.to_chats()
    assert chats[0] == [
        {"role": "system", "content": IFEVAL_SYSTEM_PROMPT},
        {"role": "user", "content": ROWS[0]["prompt"]},
    ]
    assert "<think>" in IFEVAL_SYSTEM_PROMPT and "<answer>" in IFEVAL_SYSTEM_PROMPT


def test_env_step_scores_rewards_and_terminates():
    env = IFEvalEnv(dataset=DATA, num_envs=4, shuffle=False, max_steps=3)
    td = env.reset()
    good = _answers_for(td)
    completions = [
        f"<think>plan</think><answer>{good[0]}</answer>",  # all followed, both blocks: 1 + 0.15
        f"<think>plan</think>{good[1]}",  # no answer block: the empty response, the think bonus only
        f"<think>plan</think><answer>{good[2].lower()}</answer>",  # capital letters missed
        f"<answer>{good[3]}</answer>",  # no think block: 1 + 0.1
    ]
    out, nxt = respond(env, td, completions, complete=[True, True, False, True])
    n = out["next"]
    score = n["ifeval_score"]
    assert isinstance(score, IFEvalScoreData) and score.batch_size == (4,)
    assert score.prompt_level_strict_acc.view(-1).tolist() == [True, False, False, True]
    assert [t.tolist() for t in score.get("inst_level_strict_acc", as_list=True)] == [
        [True, True], [False, False], [True, False], [True, True]
    ]  # fmt: skip
    # row 2: metrics 0.3 * 0.5 + 0.1 * 0.5 = 0.2, plus both blocks' bonus (incomplete changes nothing)
    expected = [1.15, 0.05, 0.2 + 0.15, 1.1]
    assert n["reward"].dtype == torch.float32 and n["reward"].shape == (4, 1)
    assert n["reward"].view(-1).tolist() == pytest.approx(expected)
    assert n["terminated"].view(-1).tolist() == [True, False, True, True]  # an answer ends the episode
    assert n["done"].view(-1).tolist() == [True, False, True, True]
    # the row that goes on keeps its columns; the others were reset with the next rows' columns
    assert nxt["key"].tolist() == [1004, 1001, 1005, 1006]
    for key, ids, query in zip(nxt["key"].tolist(), nxt["instruction_id_list"].tolist(), nxt["query"].tolist()):
        assert BY_PROMPT[query]["key"] == key and BY_PROMPT[query]["instruction_id_list"] == ids


def test_hub_layout_parquet_with_none_filled_kwargs(tmp_path):
    """The hub's parquet stores kwargs as structs: every dict has every argument name, None
    where unused. Those Nones are dropped before the checkers see them."""
    import datasets

    path = tmp_path / "ifeval.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    env = IFEvalEnv(dataset=path, num_envs=2, shuffle=False)
    td = env.reset()
    assert td["kwargs"].tolist()[0][1]["num_words"] == 20 and td["kwargs"].tolist()[0][1]["keywords"] is None
    good = _answers_for(td)
    out, _ = respond(env, td, [f"<think>a</think><answer>{text}</answer>" for text in good])
    assert out["next", "ifeval_score"].prompt_level_strict_acc.view(-1).tolist() == [True, True]
    assert out["next", "reward"].view(-1).tolist() == pytest.approx([1.15, 1.15])


def _completion(score, think_blocks=None, answer_blocks=None, complete=None):
    """An aggregator whose reward is whether the response was complete (1.0) or cut (0.0)."""
    return torch.tensor([float(complete)])


COMPLETION = {"aggregate_reward": _completion}


def test_completion_reaches_the_aggregator_and_the_default_ignores_it():
    env = IFEvalEnv(dataset=DATA, num_envs=2, shuffle=False, repeats=2)
    td = env.reset()
    answer = f"<think>plan</think><answer>{_answers_for(td)[0]}</answer>"
    out, _ = respond(env, td, [answer, answer], complete=[True, False])
    assert out["next", "reward"].view(-1).tolist() == pytest.approx([1.15, 1.15])  # as TorchRL's: no bonus
    env = IFEvalEnv(dataset=DATA, num_envs=2, shuffle=False, repeats=2, scorer_kwargs=COMPLETION)
    out, _ = respond(env, env.reset(), [answer, answer], complete=[True, False])
    assert out["next", "reward"].view(-1).tolist() == [1.0, 0.0]


def test_set_done_if_answer_false_and_custom_aggregator():
    seen = []

    def aggregate(score, think_blocks=None, answer_blocks=None, complete=None):
        seen.append((score.inst_level_loose_acc.tolist(), think_blocks, answer_blocks, complete))
        return torch.tensor([[5.0]])

    env = IFEvalEnv(dataset=DATA, num_envs=1, shuffle=False, max_steps=2,
                    scorer_kwargs={"aggregate_reward": aggregate, "set_done_if_answer": False})  # fmt: skip
    td = env.reset()
    response = f"<think>a</think><think>b</think><answer>{NOTE}</answer>"
    out, _ = respond(env, td, [response])
    assert seen == [([True, True], ["a", "b"], [NOTE], True)]
    assert out["next", "reward"].tolist() == [[5.0]]
    assert out["next", "done"].tolist() == [[False]] and out["next", "terminated"].tolist() == [[False]]


def test_aggregator_must_return_one_value_and_false_gives_no_reward():
    env = IFEvalEnv(dataset=DATA, num_envs=1, shuffle=False,
                    scorer_kwargs={"aggregate_reward": lambda score, **_: torch.ones(2)})  # fmt: skip
    with pytest.raises(ValueError, match=r"one value per row, got shape \(2,\)"):
        respond(env, env.reset(), ["<answer>x</answer>"])
    env = IFEvalEnv(dataset=DATA, num_envs=1, shuffle=False, scorer_kwargs={"aggregate_reward": False})
    out, _ = respond(env, env.reset(), [f"<think>a</think><answer>{NOTE}</answer>"])
    assert out["next", "reward"].tolist() == [[0.0]]
    assert out["next", "ifeval_score"].prompt_level_strict_acc.tolist() == [[True]]


class _PlusOne(Transform):
    def on_step(self, td, next_td):
        next_td.set("reward", next_td.get("reward") + 1.0)
        return next_td


def test_reward_is_added_to_the_reward_of_earlier_transforms():
    # Deviation from TorchRL, whose scorer overwrites next["reward"]
    env = IFEvalEnv(dataset=DATA, num_envs=1, shuffle=False, compute_reward=False)
    env = env.append_transform(_PlusOne())
    env = env.append_transform(IfEvalScorer())
    out, _ = respond(env, env.reset(), [f"<think>a</think><answer>{NOTE}</answer>"])
    assert out["next", "reward"].tolist() == [[pytest.approx(1.0 + 1.15)]]


def test_text_mode_completion_is_the_end_of_turn_marker(tiny_tokenizer):
    env = IFEvalEnv(dataset=DATA, num_envs=2, shuffle=False, repeats=2, input_mode="text", tokenizer=tiny_tokenizer,
                    scorer_kwargs=COMPLETION)  # fmt: skip
    td = env.reset()
    prompts = td["text"].prompt
    answer = f"<think>plan</think><answer>{NOTE}</answer>"
    responses = [answer + "<|im_end|>", answer]  # the second was cut at the token limit
    td.set("text", Text(prompt=prompts, response=responses, full=[p + r for p, r in zip(prompts, responses)],
                        batch_size=[2]))  # fmt: skip
    out = env.step(td)
    assert out["next", "reward"].view(-1).tolist() == [1.0, 0.0]
    assert out["next", "ifeval_score"].prompt_level_strict_acc.view(-1).tolist() == [True, True]


def test_tokens_mode_completion_is_the_end_of_turn_token(tiny_tokenizer):
    env = IFEvalEnv(dataset=DATA, num_envs=2, shuffle=False, repeats=2, input_mode="tokens", tokenizer=tiny_tokenizer,
                    scorer_kwargs=COMPLETION)  # fmt: skip
    td = env.reset()
    prompts = td.get(("tokens", "prompt"), as_list=True)
    answer = f"<think>plan</think><answer>{NOTE}</answer>"
    texts = (answer + "<|im_end|>", answer)  # the second was cut at the token limit
    responses = [torch.tensor(tiny_tokenizer.encode(text, add_special_tokens=False)) for text in texts]
    rows = [Tokens(prompt=p, response=r, full=torch.cat([p, r]), padded=False) for p, r in zip(prompts, responses)]
    td.set("tokens", lazy_stack(rows))
    out = env.step(td)
    assert out["next", "reward"].view(-1).tolist() == [1.0, 0.0]
    assert out["next", "terminated"].view(-1).tolist() == [True, True]


# ---------------------------------------------------------------------------- the scorer on a plain ChatEnv


def test_scorer_on_a_chat_env_reads_the_reset_input_and_names_a_missing_key():
    env = ChatEnv(batch_size=(1,))
    env = env.append_transform(IfEvalScorer())
    reset_input = TensorDict(
        {"query": [ROWS[0]["prompt"]], "instruction_id_list": [ROWS[0]["instruction_id_list"]],
         "kwargs": [ROWS[0]["kwargs"]], "key": [7]},
        batch_size=(1,),
    )  # fmt: skip
    out, _ = respond(env, env.reset(reset_input), [f"<think>a</think><answer>{NOTE}</answer>"])
    assert out["next", "reward"].tolist() == [[pytest.approx(1.15)]]
    td = env.reset(TensorDict({"query": ["no instructions here"]}, batch_size=(1,)))
    with pytest.raises(ValueError, match=r"needs the instruction ids under 'instruction_id_list'.*has keys"):
        respond(env, td, ["<answer>x</answer>"])


def test_scorer_reads_the_configured_keys():
    # TorchRL's scoring reads "instruction_id_list" / "kwargs" whatever keys were passed
    env = ChatEnv(batch_size=(1,))
    env = env.append_transform(IfEvalScorer(instruction_ids_key="ids", keyword_args_key="args", id_key="uid"))
    td = env.reset(TensorDict({"query": ["q"], "ids": [["punctuation:no_comma"]], "args": [[{}]], "uid": [3]},
                              batch_size=(1,)))  # fmt: skip
    out, _ = respond(env, td, ["<think>a</think><answer>no commas at all</answer>"])
    assert out["next", "ifeval_score"].prompt_level_strict_acc.tolist() == [[True]]
    bad = env.reset(TensorDict({"query": ["q"], "ids": [["nope:nope"]], "args": [[{}]], "uid": [3]}, batch_size=(1,)))
    with pytest.raises(ValueError, match=r"row 0 \(uid=3\): unknown IFEval instruction id 'nope:nope'"):
        respond(env, bad, ["<answer>x</answer>"])


# ---------------------------------------------------------------------------- bad datasets


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_missing_instruction_column_is_named(tmp_path):
    rows = [{"key": 1, "prompt": "p", "kwargs": [{}]}]
    with pytest.raises(ValueError, match=r"column 'instruction_id_list' not found in dataset .*its columns are"):
        IFEvalEnv(dataset=_write_rows(tmp_path / "a.jsonl", rows))
    rows = [{"key": 1, "prompt": "p", "instruction_id_list": ["punctuation:no_comma"]}]
    with pytest.raises(ValueError, match=r"column 'kwargs' not found"):
        IFEvalEnv(dataset=_write_rows(tmp_path / "b.jsonl", rows))
    rows = [{"key": 1, "question": "p", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}]
    with pytest.raises(ValueError, match=r"IFEval rows need a 'prompt' column; this row has the columns \['instr"):
        IFEvalEnv(dataset=_write_rows(tmp_path / "c.jsonl", rows))
    env = IFEvalEnv(dataset=tmp_path / "c.jsonl", prompt_column="question")  # another prompt column, named
    assert env.reset()["query"].tolist() == ["p"]


def test_bad_rows_fail_at_construction(tmp_path):
    rows = ROWS[:2] + [{"key": 77, "prompt": "p", "instruction_id_list": ["keywords:telepathy"], "kwargs": [{}]}]
    path = _write_rows(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=r"row 2 \(key=77\).*unknown IFEval instruction id 'keywords:telepathy'"):
        IFEvalEnv(dataset=path)
    IFEvalEnv(dataset=path, compute_reward=False)  # nothing is scored, nothing is checked


def test_bad_argument_values_fail_at_construction(tmp_path):
    rows = [{"key": 8, "prompt": "p", "instruction_id_list": ["length_constraints:number_words"],
             "kwargs": [{"relation": "more than", "num_words": 3}]}]  # fmt: skip
    with pytest.raises(ValueError, match=r"row 0 \(key=8\).*bad kwargs .*'length_constraints:number_words'"):
        IFEvalEnv(dataset=_write_rows(tmp_path / "bad.jsonl", rows))


def test_every_sample_row_has_a_fully_following_answer(scorer):
    td = TensorDict({"key": torch.tensor([row["key"] for row in ROWS])}, batch_size=[len(ROWS)])
    for row, answer in zip(ROWS, _answers_for(td)):
        score = scorer.score(answer, row["instruction_id_list"], row["kwargs"], row["prompt"])
        assert score.prompt_level_strict_acc.tolist() == [True], row["key"]


def test_missing_checker_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "if_verifiable.common", None)
    with pytest.raises(ImportError, match=r"pip install 'rlpost\[ifeval\]'"):
        IfEvalScorer()


def test_language_detection_is_deterministic(monkeypatch):
    from langdetect import DetectorFactory

    monkeypatch.setattr(DetectorFactory, "seed", None)
    scorer = IfEvalScorer()
    assert DetectorFactory.seed == 0
    ids, kwargs = ["language:response_language"], [{"language": "en"}]
    text = "ok fine tak no"  # short and ambiguous: langdetect's answer depends on its random state
    assert len({tuple(scorer.score(text, ids, kwargs).inst_level_strict_acc.tolist()) for _ in range(8)}) == 1


# ---------------------------------------------------------------------------- NLTK punkt data


def _punkt_tables(root: Path) -> Path:
    """A punkt_tab folder with empty tables: an untrained punkt tokenizer, enough to split
    sentences ending with '.', '?' or '!' before a capital letter."""
    folder = root / "tokenizers" / "punkt_tab" / "english"
    folder.mkdir(parents=True)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        (folder / name).write_text("")
    return root


SENTENCES = (["length_constraints:number_sentences"], [{"relation": "less than", "num_sentences": 4}])
CAPITALS = (["change_case:capital_word_frequency"], [{"capital_relation": "at least", "capital_frequency": 2}])


def test_without_punkt_data_the_error_names_it_and_its_install_command(scorer, tmp_path, monkeypatch):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])  # an empty NLTK data folder
    assert PUNKT_INSTRUCTIONS == {SENTENCES[0][0], CAPITALS[0][0]}
    for ids, kwargs in (SENTENCES, CAPITALS):
        with pytest.raises(LookupError, match=r"'punkt_tab' is not installed.*python -m nltk\.downloader punkt_tab"):
            scorer.score("One. Two. Three.", ids, kwargs)
    assert scorer.score("no commas", ["punctuation:no_comma"], [{}]).prompt_level_strict_acc.tolist() == [True]
    rows = ROWS[:1] + [{"key": 5, "prompt": "p", "instruction_id_list": SENTENCES[0], "kwargs": SENTENCES[1]}]
    path = _write_rows(tmp_path / "sentences.jsonl", rows)
    with pytest.raises(LookupError, match=r"'length_constraints:number_sentences'.*punkt_tab"):
        IFEvalEnv(dataset=path)  # at construction, not in the middle of a run


def test_with_punkt_data_sentences_and_capital_words_are_counted(scorer, tmp_path, monkeypatch):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(_punkt_tables(tmp_path))])
    three = "It rains. The roof sings. We sleep."
    assert scorer.score(three, *SENTENCES).inst_level_strict_acc.tolist() == [True]
    at_least_four = (SENTENCES[0], [{"relation": "at least", "num_sentences": 4}])
    assert scorer.score(three, *at_least_four).inst_level_strict_acc.tolist() == [False]
    assert scorer.score(three + " Then we wake!", *at_least_four).inst_level_strict_acc.tolist() == [True]
    assert scorer.score("HELLO big WORLD", *CAPITALS).inst_level_strict_acc.tolist() == [True]
    assert scorer.score("HELLO big world", *CAPITALS).inst_level_strict_acc.tolist() == [False]
    rows = [{"key": 5, "prompt": "p", "instruction_id_list": SENTENCES[0], "kwargs": SENTENCES[1]}]
    IFEvalEnv(dataset=_write_rows(tmp_path / "sentences.jsonl", rows))  # builds: the data is there


# ---------------------------------------------------------------------------- smaller deviations


class _EchoPrompt:
    """A checker that takes the prompt, as Google's evaluation hands it (no IFEval checker does)."""

    def __init__(self, instruction_id):
        self.prompt = None

    def build_description(self, prompt=None):
        self.prompt = prompt

    def get_instruction_args(self):
        return {"prompt": self.prompt}

    def check_following(self, value):
        return value.startswith(self.prompt)


def test_prompt_handed_to_checkers_is_the_query_unless_prompt_key_holds_strings():
    scorer = IfEvalScorer()
    scorer.registry = {**scorer.registry, "test:echo_prompt": _EchoPrompt}
    env = ChatEnv(batch_size=(1,))
    env = env.append_transform(scorer)
    reset_input = {"query": ["Say hi"], "instruction_id_list": [["test:echo_prompt"]], "kwargs": [[{}]]}
    out, _ = respond(env, env.reset(TensorDict(reset_input, batch_size=(1,))), ["<answer>Say hi back</answer>"])
    assert out["next", "ifeval_score"].prompt_level_strict_acc.tolist() == [[True]]
    # TorchRL 0.9's layout: the query under "text", IfEvalScorer's default prompt_key
    legacy = {"text": ["Hello"], "instruction_id_list": [["test:echo_prompt"]], "kwargs": [[{}]]}
    out, _ = respond(env, env.reset(TensorDict(legacy, batch_size=(1,))), ["<answer>Hello there</answer>"], reset=False)
    assert out["next", "ifeval_score"].prompt_level_strict_acc.tolist() == [[True]]


def test_env_defaults_to_the_hub_dataset():
    import inspect

    assert inspect.signature(IFEvalEnv).parameters["dataset"].default == "google/IFEval"
