"""TorchRL's documented environment behaviours (ChatEnv, TransformedEnv, DataLoadingPrimer,
DatasetChatEnv), run against rlpost.

Sources: the ChatEnv / DatasetChatEnv source documentation (its docstring example is run
verbatim except imports), TorchRL's environment tests (``test_chat_env`` in three modes, the
DataLoadingPrimer ``repeats`` tests) and its LLM API reference. Imports are rlpost's and the
tokenizer is the offline tiny model's (ChatML, as Qwen's). Where rlpost deliberately deviates,
the test says so.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader

from rlpost.data import ChatHistory, History
from rlpost.data.specs import Composite
from rlpost.envs import ChatEnv, DataLoadingPrimer, DatasetChatEnv, Transform, TransformedEnv

pytestmark = pytest.mark.compat

SYSTEM = "I'm system, do what I want."
USER = "I'm the user. I'm going to tell you a little about something."
ACTION = "This is the action from the assistant!"


# ---------------------------------------------------------------------------- ChatEnv docstring


def test_chat_env_docstring_example_runs_verbatim():
    """The ChatEnv docstring's example, verbatim (TorchRL 0.9's bare History under "history" as
    the step input). TorchRL's step returns the input with "next"; the comment "Full
    conversation history" is about the next prompt, asserted under ("next", "history")."""
    env = ChatEnv(system_prompt="You are a helpful assistant.", input_mode="history")
    reset_data = TensorDict({"query": "Hello, how are you?"}, batch_size=(1,))
    obs = env.reset(reset_data)
    print(obs["history"].prompt)  # History with system prompt + user message
    response_data = TensorDict(
        {
            "history": History.from_chats(
                [
                    [
                        {"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": "Hello, how are you?"},
                        {"role": "assistant", "content": "I'm doing well, thank you!"},
                    ]
                ]
            )
        },
        batch_size=(1,),
    )
    next_obs = env.step(response_data)
    print(next_obs["history"].prompt)  # Full conversation history

    assert obs["history"].prompt.shape == (1, 2)
    assert obs["history"].prompt.role == [["system", "user"]]
    assert next_obs["next", "history"].prompt.shape == (1, 3)
    assert next_obs["next", "history"].prompt[0, -1].content == "I'm doing well, thank you!"
    assert isinstance(next_obs["history"], ChatHistory)
    assert next_obs["history"].full.shape == (1, 3) and next_obs["history"].prompt.shape == (1, 2)


# ---------------------------------------------------------------------------- TorchRL's test_chat_env


@pytest.mark.parametrize("input_mode", ["text", "tokens", "history"])
def test_chat_env_three_modes(tiny_tokenizer, input_mode):
    tokenizer = tiny_tokenizer
    env = ChatEnv(batch_size=(1,), tokenizer=tokenizer, system_prompt=SYSTEM, input_mode=input_mode)
    td_reset = env.reset(TensorDict(query=[USER], batch_size=(1,), device=env.device))
    expected_text = (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{USER}<|im_end|>\n<|im_start|>assistant\n"
    )
    if input_mode == "history":
        assert len(td_reset["history"][0].prompt.content) == 2
        assert td_reset["history"][0].prompt[0].content == SYSTEM
        assert td_reset["history"][0].prompt.role == ["system", "user"]
        td_reset["history"].response = History(content=ACTION, role="assistant").view(1, 1)
        td_reset["history"].full = td_reset["history"].prompt.extend(td_reset["history"].response, dim=-1)
    elif input_mode == "tokens":
        assert tokenizer.decode(td_reset["tokens"][0].prompt.tolist()) == expected_text
        # TorchRL's test sets only the response: the env builds full = prompt + response.
        td_reset["tokens"][0].response = tokenizer.encode(ACTION + "<|im_end|>")
    else:
        assert td_reset["text"][0].prompt == expected_text
        td_reset["text"].response = [ACTION + "<|im_end|>"]
        td_reset["text"].full = [td_reset["text"][0].prompt + ACTION + "<|im_end|>"]
    td_next = env.step(td_reset)
    if input_mode == "history":
        prompt = td_next["next", "history"][0].prompt
        assert len(prompt.content) == 3 and prompt[2].content == ACTION
        assert prompt.role == ["system", "user", "assistant"]
    elif input_mode == "tokens":
        ids = td_next["next", "tokens"][0].prompt.tolist()
        assert tokenizer.decode(ids) == expected_text + ACTION + "<|im_end|>"
    else:
        assert td_next["next", "text"][0].prompt == expected_text + ACTION + "<|im_end|>"


# ---------------------------------------------------------------------------- env contract


def test_append_transform_returns_a_new_env_and_leaves_the_base_untouched():
    base_env = ChatEnv(batch_size=(1,))

    class Tag(Transform):
        def on_step(self, td, next_td):
            next_td.set("tagged", torch.ones(td.batch_size[0], 1))
            return next_td

    env = base_env.append_transform(Tag())
    assert isinstance(env, TransformedEnv) and env is not base_env and env.base_env is base_env
    assert len(env.transform) == 1 and isinstance(env.transform[0], Tag)
    assert list(base_env.transforms) == []
    assert env.append_transform(Tag()) is env and len(env.transform) == 2  # in place on a TransformedEnv
    assert env.input_mode == base_env.input_mode and env.batch_size == base_env.batch_size
    td = env.reset(TensorDict(query=["hi"], batch_size=(1,)))
    td["history"].full = td["history"].prompt.extend(History(role="assistant", content="yo").view(1, 1), dim=-1)
    assert "tagged" in env.step(td.clone())["next"].keys()
    assert "tagged" not in base_env.step(td.clone())["next"].keys()
    # TransformedEnv(env, t) is the same thing spelled out
    assert isinstance(TransformedEnv(base_env, Tag()).transform[0], Tag)


def test_reset_errors_are_runtime_errors_naming_the_key():
    env = ChatEnv(batch_size=(1,))
    with pytest.raises(RuntimeError, match="expects a tensordict as input"):
        env.reset()
    with pytest.raises(RuntimeError, match="'query'.*keys"):
        env.reset(TensorDict(prompt=["hi"], batch_size=(1,)))
    with pytest.raises(RuntimeError, match=r"\('history', 'full'\)"):
        env.step(env.reset(TensorDict(query=["hi"], batch_size=(1,))))


def test_batch_sizes_of_more_than_one_dim_fail_clearly():
    with pytest.raises(ValueError, match="1-D batch size"):
        ChatEnv(batch_size=(2, 3))


@pytest.mark.parametrize("input_mode", ["history", "text", "tokens"])
def test_specs_describe_the_mode_keys(tiny_tokenizer, input_mode):
    env = ChatEnv(batch_size=(2,), tokenizer=tiny_tokenizer, input_mode=input_mode)
    obs, act, state = env.full_observation_spec, env.full_action_spec, env.full_state_spec
    assert isinstance(obs, Composite) and obs.shape == (2,) and list(obs.keys()) == [input_mode]
    assert "prompt" in obs[input_mode].keys() and "full" in act[input_mode].keys()
    assert "full" not in obs[input_mode].keys() and "prompt" not in act[input_mode].keys()
    assert env.action_keys == [(input_mode, "full")]
    assert list(state.keys()) == ["query"] and state["query"].zero() is not None
    assert env.reward_spec.shape == (2, 1) and env.reward_spec.dtype == torch.float32
    assert set(env.full_done_spec.keys()) == {"done", "terminated", "truncated"}
    td = env.reset(TensorDict(query=["a", "b"], batch_size=(2,)))
    assert obs.is_in(td.select(input_mode))
    # A transformed env shows its base env's specs.
    assert env.append_transform(Transform()).full_action_spec == act


def test_rollout_stacks_steps_along_a_new_last_dim():
    env = ChatEnv(batch_size=(2,), max_steps=3)

    def policy(td):
        prompt = td["history"].prompt
        reply = History(role=["assistant"] * 2, content=["ok", "ok"], batch_size=(2,)).unsqueeze(-1)
        td["history"].full = prompt.extend(reply, dim=-1, inplace=False)
        return td

    rollout = env.rollout(5, policy, tensordict=TensorDict(query=["a", "b"], batch_size=(2,)))
    assert rollout.batch_size == (2, 3)  # stopped at max_steps (truncated)
    assert rollout["next", "truncated"][:, -1].all() and not rollout["next", "done"][:, 0].any()
    assert rollout[0, 2]["history"].prompt.shape == (3,)  # user, assistant, assistant
    assert rollout[0, 2]["next", "history"].prompt.shape == (4,)
    with pytest.raises(RuntimeError, match="needs a policy"):
        env.rollout(2)


def test_rollout_without_break_resets_done_envs():
    rows = [{"query": f"q{i}"} for i in range(6)]
    env = DatasetChatEnv(dataset=rows, shuffle=False, num_envs=2, max_steps=1)

    def policy(td):
        reply = History(role=["assistant"] * 2, content=["ok", "ok"], batch_size=(2,)).unsqueeze(-1)
        td["history"].full = td["history"].prompt.extend(reply, dim=-1, inplace=False)
        return td

    rollout = env.rollout(3, policy, break_when_any_done=False)
    assert rollout.batch_size == (2, 3)
    queries = [[rollout[i, t]["query"] for t in range(3)] for i in range(2)]
    assert queries == [["q0", "q2", "q4"], ["q1", "q3", "q5"]]


# ---------------------------------------------------------------------------- DataLoadingPrimer / DatasetChatEnv


class StrLoader:
    """TorchRL's test loader shape: an iterable of batches of strings, with a batch_size."""

    def __init__(self, batch_size: int):
        self.batch_size, self.count = batch_size, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.count += 1
        return {"text": [f"prompt {self.count}-{i}" for i in range(self.batch_size)]}


def test_from_dataloader_with_a_torch_dataloader_and_the_default_text_rename():
    rows = [{"text": f"question {i}", "answer": str(i)} for i in range(8)]
    loader = DataLoader(rows, batch_size=2, shuffle=False, collate_fn=lambda batch: batch)
    env = ChatEnv.from_dataloader(loader, batch_size=(2,), system_prompt="Be brief.")
    assert isinstance(env, DatasetChatEnv) and isinstance(env.transform[0], DataLoadingPrimer)
    td = env.reset()
    assert td["query"] == ["question 0", "question 1"]  # "text" was renamed "query"
    assert td["answer"] == ["0", "1"]
    assert td["history"].prompt.to_chats()[1] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "question 1"},
    ]
    assert env.reset()["query"] == ["question 2", "question 3"]


def test_repeats_queue_each_row_repeats_times_across_resets():
    """TorchRL's meaning: each row of a loaded batch is queued ``repeats`` times in a row and a
    reset of k envs takes the next k items, so copies continue over the next resets."""
    primer = DataLoadingPrimer(StrLoader(batch_size=2), repeats=3)
    env = ChatEnv(batch_size=(2,)).append_transform(primer)
    assert env.transform.state_keys[0] == "query" and primer.repeats == 3
    resets = [env.reset() for _ in range(4)]
    assert [td["query"] for td in resets] == [
        ["prompt 1-0", "prompt 1-0"], ["prompt 1-0", "prompt 1-1"], ["prompt 1-1", "prompt 1-1"],
        ["prompt 2-0", "prompt 2-0"],
    ]  # fmt: skip
    assert [td["prompt_id"].tolist() for td in resets] == [[0, 0], [0, 1], [1, 1], [2, 2]]


def test_repeats_with_one_row_batches_give_consecutive_groups():
    env = DatasetChatEnv(dataset=[{"query": f"q{i}"} for i in range(4)], shuffle=False, num_envs=4, repeats=2)
    td = env.reset()
    assert td["query"] == ["q0", "q0", "q1", "q1"] and td["prompt_id"].tolist() == [0, 0, 1, 1]


def test_group_repeats_puts_every_copy_of_a_batch_in_one_reset():
    rows = [{"query": f"q{i}"} for i in range(4)]
    env = DatasetChatEnv(dataset=rows, shuffle=False, num_envs=4, repeats=2, batch_size_dl=2, group_repeats=True)
    assert env.reset()["query"] == ["q0", "q0", "q1", "q1"]
    assert env.primer.batch_size == (8,)  # TorchRL: group_repeats multiplies the primer's batch by repeats
    with pytest.raises(ValueError, match="whole groups of 4"):
        env.reset(TensorDict(batch_size=(3,)))


def test_dataset_chat_env_takes_torchrl_keywords(tmp_path):
    rows = [{"text": f"t{i}", "label": i} for i in range(6)]

    def collate(batch):  # a user collate: keep TorchRL's rename and add a column
        return [dict(row, query=row.pop("text"), source="mine") for row in batch]

    env = DatasetChatEnv(
        dataset=rows, shuffle=False, num_envs=2, batch_size_dl=2, collate_fn=collate, apply_template=True,
        repeats=None, seed=0, group_repeats=False, input_mode="history", data_key="query",
        system_prompt="Sys", primers=Composite({"label": None}, shape=(2,)),
    )  # fmt: skip
    td = env.reset()
    assert td["query"] == ["t0", "t1"] and td["label"] == [0, 1] and "source" not in td.keys()
    assert td["row"][0] == {"query": "t0", "label": 0, "source": "mine"}
    assert env.apply_template is True


def test_missing_dataset_column_names_the_column_and_columns():
    with pytest.raises(ValueError, match=r"'query' \(prompt_column\).*columns are \['prompt'\]"):
        DatasetChatEnv(dataset=[{"prompt": "p"}], prompt_column="query")
    with pytest.raises(ValueError, match=r"'row'.*clashes"):
        DatasetChatEnv(dataset=[{"query": "p", "row": 1}])


def test_iterable_primer_resumes_by_fast_forwarding():
    def make():
        rows = [{"query": f"q{i}"} for i in range(10)]
        return DataLoadingPrimer(DataLoader(rows, batch_size=2, shuffle=False, collate_fn=lambda b: b), repeats=2)

    primer = make()
    primer.next_items(3)
    state = primer.state_dict()
    expected = [item.row["query"] for item in primer.next_items(5)]
    resumed = make()
    resumed.load_state_dict(state)
    assert [item.row["query"] for item in resumed.next_items(5)] == expected


def test_a_tool_transform_on_an_env_without_a_conversation_names_the_problem():
    from rlpost.envs import PythonInterpreter
    from rlpost.envs.common import EnvBase

    class Plain(EnvBase):  # an env holding no conversation
        batch_size = torch.Size([1])

    tool = PythonInterpreter()
    tool.parent = Plain()
    with pytest.raises(
        RuntimeError, match="PythonInterpreter reads the policy's messages.*Plain holds no conversation"
    ):
        tool.on_step(TensorDict(batch_size=[1]), TensorDict(done=torch.zeros(1, 1, dtype=torch.bool), batch_size=[1]))
