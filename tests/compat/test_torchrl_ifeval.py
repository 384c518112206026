"""TorchRL's IFEval API (``IFEvalEnv``, ``IfEvalScorer``, ``IFEvalScoreData``), run against rlpost.

Each test is named after the TorchRL document that shows the behaviour: the API reference of
``torchrl.envs.llm.IfEvalScorer`` / ``IFEvalEnv``, the ``IFEvalEnv`` docstring example and
TorchRL's ``test/llm`` IFEval test. Substitutions: rlpost's imports, the offline tiny model's
tokenizer (ChatML, like the Qwen tokenizer TorchRL uses) and a local IFEval-format file instead
of the ``google/IFEval`` hub dataset. Where rlpost deliberately deviates, the test says so.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict, set_list_to_stack

from rlpost.data import History
from rlpost.envs import ChatEnv, IFEvalEnv, IFEvalScoreData, IfEvalScorer

pytestmark = pytest.mark.compat

DATA = Path(__file__).resolve().parents[1] / "data" / "ifeval_sample.jsonl"
FIRST_ROW = json.loads(DATA.read_text().splitlines()[0])  # no commas, at least 20 words
# A response in the format IFEvalEnv's system prompt asks for, following the first row's instructions
RESPONSE = """<think>
The note must have no commas, and it must be at least 20 words long. I will keep the sentences plain.
</think>
<answer>
Dear neighbour

Our grey cat Milo went missing on Tuesday night. Please check your garage and your garden and call me if you see him.
</answer>"""


def test_ifevalscorer_api_reference_signature():
    """API reference of ``IfEvalScorer``: keyword-only arguments, names and defaults."""
    parameters = inspect.signature(IfEvalScorer).parameters
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters.values())
    defaults = {name: p.default for name, p in parameters.items()}
    assert defaults == {
        "instruction_ids_key": "instruction_id_list",
        "prompt_key": "text",
        "keyword_args_key": "kwargs",
        "id_key": "key",
        "response_column": "text_response",
        "score_key": "ifeval_score",
        "aggregate_reward": True,
        "format_weights": None,
        "verbose": False,
        "set_done_if_answer": True,
    }
    scorer = IfEvalScorer()
    assert scorer.format_weights == [0.4, 0.3, 0.2, 0.1]
    assert scorer.expected_keys == ["instruction_id_list", "text", "kwargs", "key", "text_response"]


def test_ifevalscoredata_fields_and_post_init():
    """``IFEvalScoreData``: the four score fields; a field given without its trailing dim gets
    one, a missing one is zeros of shape ``batch + (1,)``. Deviation: always bool (TorchRL's
    missing field is a float 0)."""
    assert list(IFEvalScoreData.__annotations__) == [
        "prompt_level_strict_acc", "inst_level_strict_acc", "prompt_level_loose_acc", "inst_level_loose_acc",
    ]  # fmt: skip
    score = IFEvalScoreData(
        prompt_level_strict_acc=torch.tensor([True, False]), inst_level_strict_acc=None,
        prompt_level_loose_acc=None, inst_level_loose_acc=torch.ones(2, 3, dtype=torch.bool), batch_size=[2],
    )  # fmt: skip
    assert score.prompt_level_strict_acc.shape == (2, 1)
    assert score.inst_level_strict_acc.shape == (2, 1) and not score.inst_level_strict_acc.any()
    assert score.inst_level_loose_acc.shape == (2, 3)
    spec = IFEvalScoreData.default_spec((2,))
    assert spec.data_cls is IFEvalScoreData and spec.step_mdp_static
    assert spec.is_in(spec.zero())


def test_ifevalenv_docstring_example(tiny_tokenizer):
    """``IFEvalEnv`` docstring: ``IFEvalEnv(tokenizer=..., apply_template=True)``; ``reset()`` gives
    the system prompt and the dataset prompt as a history, plus the row's ``instruction_id_list``,
    ``key`` (int64) and ``kwargs``. rlpost keeps the history under ``ChatHistory.prompt`` (TorchRL
    >= 0.10's layout; the docstring prints the 0.9 one)."""
    with set_list_to_stack(True):
        env = IFEvalEnv(tokenizer=tiny_tokenizer, apply_template=True, dataset=DATA, shuffle=False)
        r = env.reset()
    for key in ("done", "terminated", "truncated", "step_count", "history", "instruction_id_list", "key", "kwargs"):
        assert key in r.keys()
    assert r["query"].tolist() == [FIRST_ROW["prompt"]] and "prompt" not in r.keys()  # the collate's rename
    assert r["key"].dtype == torch.int64 and r["key"].shape == (1,)
    assert r["instruction_id_list"].tolist() == [FIRST_ROW["instruction_id_list"]]
    content = r["history"].prompt.content
    system, user = content[0]
    assert r["history"].prompt.role == [["system", "user"]]
    assert "<think>" in system and "</answer>" in system and "answer" in system
    assert user == FIRST_ROW["prompt"]


def test_ifeval_test_suite(tiny_tokenizer):
    """TorchRL ``test/llm`` ``TestIFEvalEnv.test_ifeval``: a response parsed with
    ``History.from_text`` into ``history.full``; after ``step``, ``("next", "ifeval_score")`` is
    all True and a reward is there."""
    tokenizer = tiny_tokenizer
    torch.manual_seed(0)
    with set_list_to_stack(True):
        env = IFEvalEnv(apply_template=True, tokenizer=tokenizer, input_mode="history", dataset=DATA, shuffle=False)
        r = env.reset()
        r["history"].full = History.from_text(
            r["history"].prompt[0].apply_chat_template(tokenizer=tokenizer, add_generation_prompt=True)
            + RESPONSE
            + "<|im_end|>\n"
        ).unsqueeze(0)
        td = env.step(r)
    assert td["next", "ifeval_score"].all()
    assert td.get(("next", "reward")) is not None
    # every instruction followed (1), one answer block (0.1) and one think block (0.05)
    assert td["next", "reward"].item() == pytest.approx(1.15)
    assert td["next", "done"].all() and td["next", "terminated"].all()  # set_done_if_answer
    # Deviation: the reward is [B, 1] (TorchRL's scorer writes [B, 1, 1])
    assert td["next", "reward"].shape == (1, 1)


def test_ifeval_test_suite_torchrl_0_9_keys(tiny_tokenizer):
    """TorchRL 0.9's version of the same test: the response text under ``"text_response"``."""
    with set_list_to_stack(True):
        env = IFEvalEnv(apply_template=True, tokenizer=tiny_tokenizer, dataset=DATA, shuffle=False)
        r = env.reset()
        r.set("text_response", [RESPONSE + "<|im_end|>\n"])
        td = env.step(r)
    assert td["next", "ifeval_score"].all()
    assert td["next", "reward"].item() == pytest.approx(1.15)


def test_ifevalscorer_as_a_chatenv_transform(tiny_tokenizer):
    """API reference: ``IfEvalScorer`` reads ``instruction_id_list``, ``kwargs`` and ``key`` from
    the tensordict and writes ``IFEvalScoreData`` under ``score_key`` and the reward."""
    with set_list_to_stack(True):
        env = ChatEnv(batch_size=(1,), tokenizer=tiny_tokenizer, input_mode="history")
        env = env.append_transform(IfEvalScorer(score_key="my_score", set_done_if_answer=False))
        r = env.reset(
            TensorDict(
                {
                    "query": [FIRST_ROW["prompt"]],
                    "instruction_id_list": [FIRST_ROW["instruction_id_list"]],
                    "kwargs": [FIRST_ROW["kwargs"]],
                    "key": [FIRST_ROW["key"]],
                },
                batch_size=(1,),
            )
        )
        r["history"].full = History.from_text(
            r["history"].prompt[0].apply_chat_template(tokenizer=tiny_tokenizer, add_generation_prompt=True)
            + RESPONSE.replace("<answer>\n", "<answer>Sure, here it is:\n")  # one comma: no_comma fails
            + "<|im_end|>\n"
        ).unsqueeze(0)
        td = env.step(r)
    score = td["next", "my_score"]
    assert isinstance(score, IFEvalScoreData)
    assert score.prompt_level_strict_acc.tolist() == [[False]]
    assert score.get("inst_level_strict_acc", as_list=True)[0].tolist() == [False, True]
    # the comma is on the answer's first line: the loose check drops it
    assert score.get("inst_level_loose_acc", as_list=True)[0].tolist() == [True, True]
    # metrics 0.3 * 0.5 + 0.2 + 0.1 = 0.45, plus 0.15 for one answer and one think block
    assert td["next", "reward"].item() == pytest.approx(0.45 + 0.15)
    assert not td["next", "done"].any()


def test_ifevalscorer_deviation_works_in_text_mode(tiny_tokenizer):
    """Deviation: TorchRL's scorer raises in text and tokens modes ("only supports history input
    mode"); rlpost's scores the env's latest response in every mode, with the same reward."""
    env = IFEvalEnv(tokenizer=tiny_tokenizer, input_mode="text", dataset=DATA, shuffle=False)
    r = env.reset()
    prompt = r["text"].prompt[0]
    r["text"].full = [prompt + RESPONSE + "<|im_end|>"]
    td = env.step(r)
    assert td["next", "ifeval_score"].all()
    assert td["next", "reward"].item() == pytest.approx(1.15)


def _all_followed() -> IFEvalScoreData:
    return IFEvalScoreData(
        prompt_level_strict_acc=torch.tensor([True]),
        inst_level_strict_acc=torch.tensor([True]),
        prompt_level_loose_acc=torch.tensor([True]),
        inst_level_loose_acc=torch.tensor([True]),
        batch_size=(),
    )


class TestIFEvalRewardAggregator:
    """TorchRL ``test/llm`` ``TestIFEvalRewardAggregator``: ``default_reward_aggregator`` called on
    a score directly. The reward is the weighted metrics (weights summing to 1) plus 0.1 for one
    answer block and 0.05 for one think block."""

    def test_perfect_score_with_format(self):
        reward = IfEvalScorer().default_reward_aggregator(
            _all_followed(), think_blocks=["reasoning"], answer_blocks=["answer"]
        )
        assert reward.item() == pytest.approx(1.0 + 0.1 + 0.05, abs=0.01)
        assert reward.item() == pytest.approx(1.15)  # exactly, here
        assert reward.shape == (1,) and reward.dtype == torch.get_default_dtype()

    def test_zero_score_no_answer(self):
        score = IFEvalScoreData(
            prompt_level_strict_acc=torch.tensor([False]),
            inst_level_strict_acc=torch.tensor([False]),
            prompt_level_loose_acc=torch.tensor([False]),
            inst_level_loose_acc=torch.tensor([False]),
            batch_size=(),
        )
        reward = IfEvalScorer().default_reward_aggregator(score, think_blocks=[], answer_blocks=[])
        assert reward.item() == pytest.approx(0.0, abs=0.01)
        assert reward.item() == 0.0

    def test_reward_range_bounded(self):
        scorer = IfEvalScorer()
        reward = scorer.default_reward_aggregator(_all_followed(), think_blocks=["t"], answer_blocks=["a"])
        assert 0.0 <= reward.item() <= 1.2
        # the bound holds for any flags and blocks: the most is 1.15, the least 0
        for think, answer in ([], []), (["t"], ["a"]), (["t", "t"], ["a", "a"]), (["t"], []), ([], ["a"]):
            for flag in (False, True):
                score = IFEvalScoreData(
                    prompt_level_strict_acc=torch.tensor([flag]),
                    inst_level_strict_acc=torch.tensor([flag, True]),
                    prompt_level_loose_acc=torch.tensor([flag]),
                    inst_level_loose_acc=torch.tensor([True, flag]),
                    batch_size=(),
                )
                value = scorer.default_reward_aggregator(score, think_blocks=think, answer_blocks=answer).item()
                assert 0.0 <= value <= 1.15 + 1e-6
