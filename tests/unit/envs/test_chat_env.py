"""ChatEnv reset/step in history, text and tokens modes, batched, with the tiny model's tokenizer."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from rlpost.data import ChatHistory, History, Masks, Text, Tokens
from rlpost.envs import ChatEnv, Transform
from rlpost.envs.transforms import TransformedEnv
from rlpost.envs.turns import close_with

pytestmark = pytest.mark.unit

SYSTEM = "You are a calculator."
QUERIES = ["What is 2 + 2?", "What is 7 - 3?"]
RESPONSES = ["<answer>4</answer>", "<think>7 minus 3</think><answer>4</answer>"]


def rendered_prompt(query: str, system: str | None = SYSTEM) -> str:
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""
    return head + f"<|im_start|>user\n{query}<|im_end|>\n<|im_start|>assistant\n"


def chats(with_response: bool) -> list[list[dict]]:
    out = []
    for query, response in zip(QUERIES, RESPONSES):
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": query}]
        out.append(chat + ([{"role": "assistant", "content": response}] if with_response else []))
    return out


def reset_input(queries=QUERIES) -> TensorDict:
    return TensorDict({"query": list(queries)}, batch_size=[len(queries)])


def make_env(tokenizer, mode: str, **kwargs) -> ChatEnv:
    return ChatEnv(input_mode=mode, batch_size=2, system_prompt=SYSTEM, tokenizer=tokenizer, **kwargs)


# ---------------------------------------------------------------------------- history mode


def test_history_reset_gives_system_and_user_messages(tiny_tokenizer):
    out = make_env(tiny_tokenizer, "history").reset(reset_input())
    prompt = out["history"].prompt
    assert prompt.batch_size == torch.Size([2, 2])
    assert prompt.to_chats() == chats(with_response=False)
    assert prompt.apply_chat_template(tokenizer=tiny_tokenizer) == [rendered_prompt(q) for q in QUERIES]
    assert out["query"] == QUERIES
    assert out["step_count"].tolist() == [[0], [0]]
    assert out["done"].shape == (2, 1) and not out["done"].any() and not out["terminated"].any()


def test_history_step_makes_full_the_next_prompt(tiny_tokenizer):
    env = make_env(tiny_tokenizer, "history")
    td = env.reset(reset_input())
    full = History.from_chats(chats(with_response=True))
    td.set("history", ChatHistory(prompt=td["history"].prompt, full=full, batch_size=[2]))
    out = env.step(td)
    assert out is td
    nxt = out["next"]
    assert nxt["history"].prompt.to_chats() == chats(with_response=True)
    assert nxt["reward"].dtype == torch.float32 and nxt["reward"].tolist() == [[0.0], [0.0]]
    assert nxt["done"].tolist() == [[False], [False]]
    assert nxt["step_count"].tolist() == [[1], [1]]
    assert nxt["query"] == QUERIES  # state carried to the next step
    rendered = nxt["history"].prompt.apply_chat_template(tokenizer=tiny_tokenizer)
    assert rendered[0] == rendered_prompt(QUERIES[0]) + RESPONSES[0] + "<|im_end|>\n<|im_start|>assistant\n"


def test_history_step_without_full_names_the_key(tiny_tokenizer):
    env = make_env(tiny_tokenizer, "history")
    td = env.reset(reset_input())
    with pytest.raises(ValueError, match=r"\('history', 'full'\)"):
        env.step(td)


# ---------------------------------------------------------------------------- text mode


def test_text_reset_and_step(tiny_tokenizer):
    env = make_env(tiny_tokenizer, "text")
    td = env.reset(reset_input())
    prompts = td["text"].prompt
    assert prompts == [rendered_prompt(q) for q in QUERIES]
    fulls = [p + r + "<|im_end|>" for p, r in zip(prompts, RESPONSES)]
    td.set("text", Text(prompt=prompts, response=RESPONSES, full=fulls, batch_size=[2]))
    nxt = env.step(td)["next"]
    assert nxt["text"].prompt == fulls
    assert env.last_responses(td) == RESPONSES


def test_text_mode_needs_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        ChatEnv(input_mode="text")


# ---------------------------------------------------------------------------- tokens mode


def test_tokens_reset_matches_the_chat_template(tiny_tokenizer):
    td = make_env(tiny_tokenizer, "tokens").reset(reset_input())
    rows = td.get(("tokens", "prompt"), as_list=True)
    for ids, chat in zip(rows, chats(with_response=False)):
        expected = tiny_tokenizer.apply_chat_template(
            chat, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        assert ids.dtype == torch.int64 and ids.tolist() == list(expected)


@pytest.mark.parametrize("mode", ["text", "tokens"])
def test_repeated_prompts_render_once_and_keep_rows_of_their_own(tiny_tokenizer, monkeypatch, mode):
    """A group's rows repeat one prompt: each distinct chat goes through the chat template
    once, every row gets the rendering of its own chat, and no two rows share a tensor."""
    queries = [QUERIES[0], QUERIES[1], QUERIES[0], QUERIES[0], QUERIES[1]]
    env = ChatEnv(input_mode=mode, batch_size=len(queries), system_prompt=SYSTEM, tokenizer=tiny_tokenizer)
    rendered = []
    render = ChatEnv._render

    def counting_render(self, history, **kwargs):
        rendered.append(history.batch_size[0])
        return render(self, history, **kwargs)

    monkeypatch.setattr(ChatEnv, "_render", counting_render)
    td = env.reset(reset_input(queries))
    assert rendered == [2]
    if mode == "text":
        assert td["text"].prompt == [rendered_prompt(q) for q in queries]
        return
    rows = td.get(("tokens", "prompt"), as_list=True)
    for ids, query in zip(rows, queries):
        expected = tiny_tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": query}],
            tokenize=True, add_generation_prompt=True, return_dict=False,
        )  # fmt: skip
        assert ids.tolist() == list(expected)
    assert len({ids.data_ptr() for ids in rows}) == len(rows)
    rows[0][0] = -1  # a row's tensor is its own: the row repeating its prompt keeps its ids
    assert td.get(("tokens", "prompt"), as_list=True)[2][0] != -1


def test_distinct_chats_compares_role_and_content_only():
    from rlpost.envs.chat_rows import distinct_chats as _distinct_chats

    a = [{"role": "user", "content": "x"}]
    b = [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}]
    extra = [{"role": "user", "content": "x", "is_complete": False}]
    distinct, row_of = _distinct_chats([a, b, list(a), extra, list(extra), b])
    assert distinct == [a, b, extra, extra]  # chats with other keys are never merged
    assert row_of == [0, 1, 0, 2, 3, 1]


def _tokens_step_input(tokenizer, td: TensorDict) -> tuple[TensorDict, list[torch.Tensor]]:
    prompts = td.get(("tokens", "prompt"), as_list=True)
    responses = [torch.tensor(tokenizer.encode(r + "<|im_end|>", add_special_tokens=False)) for r in RESPONSES]
    fulls = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    rows = [Tokens(prompt=p, response=r, full=f, padded=False) for p, r, f in zip(prompts, responses, fulls)]
    td.set("tokens", lazy_stack(rows))
    return td, fulls


def test_tokens_step_unpadded(tiny_tokenizer):
    env = make_env(tiny_tokenizer, "tokens")
    td, fulls = _tokens_step_input(tiny_tokenizer, env.reset(reset_input()))
    nxt = env.step(td)["next"]
    assert [t.tolist() for t in nxt.get(("tokens", "prompt"), as_list=True)] == [f.tolist() for f in fulls]
    assert env.last_responses(td) == RESPONSES


def test_tokens_step_padded_uses_the_attention_mask(tiny_tokenizer):
    env = make_env(tiny_tokenizer, "tokens")
    _, fulls = _tokens_step_input(tiny_tokenizer, env.reset(reset_input()))
    pad = tiny_tokenizer.pad_token_id  # == eos id: padding must be told apart by the mask only
    length = max(len(f) for f in fulls) + 2
    padded = torch.full((2, length), pad)
    mask = torch.zeros((2, length), dtype=torch.bool)
    for i, ids in enumerate(fulls):  # one pad on the left, the rest on the right
        padded[i, 1 : 1 + len(ids)] = ids
        mask[i, 1 : 1 + len(ids)] = True
    td = TensorDict(
        {
            "tokens": Tokens(full=padded, padded=True, batch_size=[2]),
            "masks": Masks(all_attention_mask=mask, batch_size=[2]),
        },
        batch_size=[2],
    )
    nxt = env.step(td)["next"]
    assert [t.tolist() for t in nxt.get(("tokens", "prompt"), as_list=True)] == [f.tolist() for f in fulls]


# ---------------------------------------------------------------------------- reset details


def test_missing_query_is_a_clear_error(tiny_tokenizer):
    env = make_env(tiny_tokenizer, "history")
    with pytest.raises(ValueError, match="'query'.*keys"):
        env.reset(TensorDict({"prompt": QUERIES}, batch_size=[2]))


def test_torchrl_09_query_key_text(tiny_tokenizer):
    """TorchRL 0.9's reset key: the query under "text" (when there is no "query")."""
    env = make_env(tiny_tokenizer, "history")
    by_text = env.reset(TensorDict({"text": QUERIES}, batch_size=[2]))["history"].prompt.to_chats()
    by_query = env.reset(TensorDict({"query": QUERIES}, batch_size=[2]))["history"].prompt.to_chats()
    assert by_text == by_query


def test_custom_data_key_per_row_system_prompt_and_no_system(tiny_tokenizer):
    env = ChatEnv(batch_size=2, tokenizer=tiny_tokenizer, data_key="question")
    td = TensorDict({"question": QUERIES, "system_prompt": ["A", "B"]}, batch_size=[2])
    prompt = env.reset(td)["history"].prompt
    assert [c[0] for c in prompt.to_chats()] == [{"role": "system", "content": "A"}, {"role": "system", "content": "B"}]
    plain = ChatEnv(batch_size=1).reset(TensorDict({"query": ["hi"]}, batch_size=[1]))
    assert plain["history"].prompt.to_chats() == [[{"role": "user", "content": "hi"}]]


def test_unbatched_query_is_broadcast(tiny_tokenizer):
    env = make_env(tiny_tokenizer, "text")
    out = env.reset(TensorDict({"query": "Same for all"}, batch_size=[]))
    assert out.batch_size == torch.Size([2])
    assert out["text"].prompt == [rendered_prompt("Same for all")] * 2


def test_batch_size_must_be_1d():
    with pytest.raises(ValueError, match="1-D"):
        ChatEnv(batch_size=(2, 3))


# ---------------------------------------------------------------------------- episodes


def _step_with_responses(env: ChatEnv, td: TensorDict, responses: list[str]) -> tuple[TensorDict, TensorDict]:
    prompt = td["history"].prompt
    k = prompt.batch_size[0]
    reply = History(role=["assistant"] * k, content=responses, batch_size=[k])
    td.set("history", ChatHistory(prompt=prompt, full=prompt.append(reply, inplace=False), batch_size=[k]))
    return env.step_and_maybe_reset(td)


def test_max_steps_truncates_and_plain_env_restarts_same_query(tiny_tokenizer):
    env = make_env(tiny_tokenizer, "history", max_steps=2)
    td = env.reset(reset_input())
    stepped, td = _step_with_responses(env, td, ["a", "b"])
    assert not stepped["next", "done"].any()
    assert td["history"].prompt.batch_size == torch.Size([2, 3])
    stepped, td = _step_with_responses(env, td, ["c", "d"])
    assert stepped["next", "truncated"].all() and stepped["next", "done"].all()
    assert not stepped["next", "terminated"].any()
    assert stepped["next", "history"].prompt.to_chats()[1][-1] == {"role": "assistant", "content": "d"}
    # the next root is a fresh reset: same queries (no data transform), step count 0
    assert td["history"].prompt.to_chats() == chats(with_response=False)
    assert td["step_count"].tolist() == [[0], [0]] and not td["done"].any()


class _Scripted(Transform):
    """Rewards 0.5 per step; terminates env 0 at its first step; records the hooks it saw."""

    state_keys = ("tag",)

    def __init__(self):
        super().__init__()
        self.calls = []

    def reset_preprocess(self, td):
        self.calls.append(("preprocess", td.batch_size[0]))
        td.set("tag", torch.arange(td.batch_size[0]) + 10)
        return td

    def on_reset(self, td, reset_td):
        self.calls.append(("reset", reset_td.batch_size[0]))
        return reset_td

    def on_step(self, td, next_td):
        self.calls.append(("step", td.batch_size[0]))
        next_td.set("reward", next_td["reward"] + 0.5)
        terminated = next_td["terminated"].clone()
        terminated[0] = True
        next_td.set("terminated", terminated)
        return next_td


class _Noop(Transform):
    pass


def test_transforms_hooks_partial_reset_and_carried_state(tiny_tokenizer):
    scripted = _Scripted()
    base = make_env(tiny_tokenizer, "history")
    env = base.append_transform(scripted)
    assert isinstance(env, TransformedEnv) and env.base_env is base and base.transforms == ()
    assert env.append_transform(_Noop()) is env  # a TransformedEnv appends in place
    td = env.reset(reset_input())
    assert td["tag"].tolist() == [10, 11]
    stepped, nxt = _step_with_responses(env, td, ["x", "y"])
    assert stepped["next", "reward"].tolist() == [[0.5], [0.5]]
    assert stepped["next", "done"].tolist() == [[True], [False]]  # done follows terminated
    assert stepped["next", "tag"].tolist() == [10, 11]  # a transform's state key is carried
    # env 0 was reset alone (a batch of 1); env 1 continues with its conversation
    assert scripted.calls == [("preprocess", 2), ("reset", 2), ("step", 2), ("preprocess", 1), ("reset", 1)]
    assert nxt["tag"].tolist() == [10, 11]
    assert nxt["step_count"].tolist() == [[0], [1]]
    assert [len(c) for c in nxt["history"].prompt.to_chats()] == [2, 3]


def test_close_with_completes_a_partial_end_marker():
    assert close_with("abc<|im_end|>", "<|im_end|>\n") == "abc<|im_end|>\n"
    assert close_with("abc", "<|im_end|>\n") == "abc<|im_end|>\n"
    assert close_with("abc<|im_end|>\n", "<|im_end|>\n") == "abc<|im_end|>\n"
    assert close_with([1, 2, 9], [9, 5]) == [1, 2, 9, 5]


def test_state_dict_round_trip_and_set_seed(tiny_tokenizer):
    env = make_env(tiny_tokenizer, "history").append_transform(_Scripted())
    state = env.state_dict()
    assert state == {"transforms": [{}]}
    env.load_state_dict(state)
    with pytest.raises(ValueError, match="transform states"):
        env.load_state_dict({"transforms": []})
    assert env.set_seed(3) == 3
