"""History against the tiny model's tokenizer: rendering equals the tokenizer's own chat template,
ChatML parsing round trips, and tensorclass batching (append, extend, stack, index)."""

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from rlpost.data import PAD_ROLE, ChatHistory, History
from rlpost.envs.arithmetic import ARITHMETIC_SYSTEM_PROMPT

pytestmark = pytest.mark.unit

SYSTEM = {"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT}
USER = {"role": "user", "content": "What is 3 + 4?"}
ANSWER = {"role": "assistant", "content": "<answer>7</answer>"}
TOOL = {"role": "tool", "content": "Code block 1 executed successfully:\n7\n"}
USER2 = {"role": "user", "content": "What is 10 - 2?"}

CHATS = [[SYSTEM, USER, ANSWER, USER2], [SYSTEM, USER], [SYSTEM, USER, ANSWER, TOOL, ANSWER]]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_text_equals_tokenizer(tiny_tokenizer, add_generation_prompt):
    history = History.from_chats(CHATS)
    assert history.batch_size == torch.Size([3, 5])
    expected = tiny_tokenizer.apply_chat_template(CHATS, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert history.apply_chat_template(tiny_tokenizer, add_generation_prompt=add_generation_prompt) == expected
    # one conversation renders to one string
    single = history[0].apply_chat_template(tiny_tokenizer, add_generation_prompt=add_generation_prompt)
    assert single == expected[0]


def _rows(encoded, key):
    """Per-conversation lists of a batched (lazily stacked) apply_chat_template result."""
    return [t.tolist() for t in encoded.get(key, as_list=True)]


def test_render_tokens_and_assistant_masks_equal_tokenizer(tiny_tokenizer):
    history = History.from_chats(CHATS)
    kwargs = dict(add_generation_prompt=False, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ours = history.apply_chat_template(tiny_tokenizer, **kwargs)
    theirs = tiny_tokenizer.apply_chat_template(CHATS, **kwargs)
    # TorchRL's layout: one TensorDict of tensors per conversation, lazily stacked
    assert ours.batch_size == torch.Size([3])
    assert _rows(ours, "input_ids") == theirs["input_ids"]
    assert _rows(ours, "assistant_masks") == theirs["assistant_masks"]
    assert _rows(ours, "attention_mask") == theirs["attention_mask"]
    # the mask covers exactly each assistant content and its <|im_end|>
    ids, mask = ours[2]["input_ids"], ours[2]["assistant_masks"]
    assert tiny_tokenizer.decode(ids[mask.bool()]) == "<answer>7</answer><|im_end|>" * 2
    ids_only = history.apply_chat_template(tiny_tokenizer, add_generation_prompt=True, tokenize=True)
    assert [t.tolist() for t in ids_only] == tiny_tokenizer.apply_chat_template(
        CHATS, add_generation_prompt=True, return_dict=False
    )


def test_render_padded_tensors_equal_tokenizer(tiny_tokenizer):
    kwargs = dict(tokenize=True, return_dict=True, padding=True, return_tensors="pt", return_assistant_tokens_mask=True)
    ours = History.from_chats(CHATS).apply_chat_template(tiny_tokenizer, add_generation_prompt=False, **kwargs)
    theirs = tiny_tokenizer.apply_chat_template(CHATS, add_generation_prompt=False, **kwargs)
    for key in ("input_ids", "attention_mask", "assistant_masks"):
        assert torch.equal(ours[key], theirs[key]), key


def test_none_padding_is_dropped(tiny_tokenizer):
    history = History.from_chats(CHATS)
    assert list(history[1].role) == ["system", "user", PAD_ROLE, PAD_ROLE, PAD_ROLE]
    assert history[1].to_chats() == [SYSTEM, USER]
    short = tiny_tokenizer.apply_chat_template([SYSTEM, USER], add_generation_prompt=True, tokenize=False)
    assert history[1].apply_chat_template(tiny_tokenizer) == short
    # a lazy stack of ragged conversations renders the same as the padded batch
    ragged = lazy_stack([History.from_chats(chat) for chat in CHATS])
    assert ragged.apply_chat_template(tiny_tokenizer) == history.apply_chat_template(tiny_tokenizer)


def test_tool_messages_render_qwen_style_and_parse_back(tiny_tokenizer):
    history = History.from_chats([SYSTEM, USER, ANSWER, TOOL])
    text = history.apply_chat_template(tiny_tokenizer, add_generation_prompt=False)
    tool_turn = f"<|im_start|>user\n<tool_response>\n{TOOL['content']}\n</tool_response><|im_end|>"
    assert tool_turn in text
    parsed = History.from_text(text)
    assert parsed.to_chats() == [SYSTEM, USER, ANSWER, TOOL]


def test_from_text_round_trip(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=False, tokenize=False)
    parsed = History.from_text(text)
    assert parsed.to_chats() == CHATS[0]
    assert parsed.is_complete.all()
    assert parsed.apply_chat_template(tiny_tokenizer, add_generation_prompt=False) == text


def test_from_text_marks_an_unfinished_last_message_incomplete(tiny_tokenizer):
    prompt = tiny_tokenizer.apply_chat_template([SYSTEM, USER], add_generation_prompt=True, tokenize=False)
    cut = prompt + "<answer>4"
    parsed = History.from_text(cut)
    assert list(parsed.role) == ["system", "user", "assistant"]
    assert parsed[-1].content == "<answer>4"
    assert parsed.is_complete.tolist() == [True, True, False]
    # rendering continues the unfinished message instead of closing it
    assert parsed.apply_chat_template(tiny_tokenizer) == cut
    encoded = parsed.apply_chat_template(tiny_tokenizer, return_assistant_tokens_mask=True)
    assert encoded["input_ids"].tolist() == tiny_tokenizer(cut, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(encoded["input_ids"][encoded["assistant_masks"].bool()]) == "<answer>4"
    # an open generation prompt is an empty unfinished assistant message; it renders back too
    open_turn = History.from_text(prompt)
    assert open_turn[-1].role == "assistant" and open_turn[-1].content == ""
    assert not open_turn[-1].is_complete
    assert open_turn.apply_chat_template(tiny_tokenizer) == prompt


def test_batch_with_complete_and_unfinished_rows(tiny_tokenizer):
    prompt = tiny_tokenizer.apply_chat_template([SYSTEM, USER], add_generation_prompt=True, tokenize=False)
    done = prompt + "<answer>7</answer><|im_end|>\n"
    batch = History.from_text([done, prompt + "<answer>"])
    assert batch.batch_size == torch.Size([2, 3])
    assert batch.is_complete[:, -1].tolist() == [True, False]
    out = batch.apply_chat_template(tiny_tokenizer, add_generation_prompt=False, return_assistant_tokens_mask=True)
    ids = _rows(out, "input_ids")
    assert tiny_tokenizer.decode(ids[0]) == done
    assert tiny_tokenizer.decode(ids[1]) == prompt + "<answer>"
    assert sum(_rows(out, "assistant_masks")[1]) == len(
        tiny_tokenizer("<answer>", add_special_tokens=False)["input_ids"]
    )
    padded = batch.apply_chat_template(
        tiny_tokenizer, add_generation_prompt=False, tokenize=True, return_dict=True, padding=True, return_tensors="pt"
    )
    lengths = [len(row) for row in ids]
    assert padded["input_ids"].shape == (2, max(lengths))
    assert padded["attention_mask"].sum(-1).tolist() == lengths


def test_append_and_extend():
    history = History.from_chats([SYSTEM, USER])
    same = history.append(History(role="assistant", content="<answer>7</answer>"))
    assert same is history and history.batch_size == torch.Size([3])
    assert history.to_chats() == [SYSTEM, USER, ANSWER]
    longer = history.extend(History.from_chats([USER2, ANSWER]), inplace=False)
    assert longer.batch_size == torch.Size([5]) and history.batch_size == torch.Size([3])
    assert [m["role"] for m in longer.to_chats()] == ["system", "user", "assistant", "user", "assistant"]

    batch = History.from_chats([[SYSTEM, USER], [SYSTEM, USER2]])
    replies = History(
        role=["assistant", "assistant"], content=["<answer>7</answer>", "<answer>8</answer>"], batch_size=[2]
    )
    batch.append(replies)
    assert batch.batch_size == torch.Size([2, 3])
    assert [row[-1]["content"] for row in batch.to_chats()] == ["<answer>7</answer>", "<answer>8</answer>"]
    with pytest.raises(ValueError):
        batch.append(History.from_chats([[SYSTEM]]).unsqueeze(0))


def test_stack_index_and_tensordict():
    a, b = History.from_chats([SYSTEM, USER]), History.from_chats([SYSTEM, USER2])
    stacked = torch.stack([a, b])
    assert stacked.batch_size == torch.Size([2, 2])
    assert stacked[1].to_chats() == [SYSTEM, USER2]
    assert list(stacked[:, -1].content) == [USER["content"], USER2["content"]]
    assert stacked[0, 0].role == "system"
    td = TensorDict(history=ChatHistory(prompt=stacked, batch_size=[2]), batch_size=[2])
    assert td[1]["history"].prompt.to_chats() == [SYSTEM, USER2]
    assert torch.stack([td, td]).batch_size == torch.Size([2, 2])
    assert td.reshape(2, 1)["history"].prompt.batch_size == torch.Size([2, 1, 2])


def test_from_chats_and_from_text_errors():
    with pytest.raises(ValueError):
        History.from_chats([])
    with pytest.raises(ValueError):
        History.from_chats([{"role": "user"}])
    with pytest.raises(ValueError):
        History.from_text("no chat markers here")


def test_from_text_keeps_the_models_text_exact(tiny_tokenizer):
    """Deliberate deviations from TorchRL's parser, so that re-rendering gives back the sampled
    text: whitespace is kept, tool calls stay in the content (tool_calls stays None), and a last
    message ending with <|endoftext|> stays unfinished with the marker in its content."""
    prompt = tiny_tokenizer.apply_chat_template([SYSTEM, USER], add_generation_prompt=True, tokenize=False)
    call = '  <tool_call>\n{"name": "python", "arguments": {"code": "3+4"}}\n</tool_call>\n'
    text = prompt + call + "<|im_end|>\n"
    parsed = History.from_text(text)
    assert parsed[-1].content == call and parsed.tool_calls is None
    assert parsed.apply_chat_template(tiny_tokenizer, add_generation_prompt=False) == text
    eos = prompt + "<answer>7</answer><|endoftext|>"
    ended = History.from_text(eos)
    assert ended[-1].content == "<answer>7</answer><|endoftext|>" and not ended[-1].is_complete
    assert ended.apply_chat_template(tiny_tokenizer) == eos


def test_history_errors_are_value_and_runtime_errors():
    """rlpost raises ValueError for a caller's mistake, TorchRL RuntimeError: HistoryError is both."""
    with pytest.raises(ValueError, match="unsqueeze"):
        History(role="user", content="x").append(History(role="user", content="y"))
    with pytest.raises(RuntimeError, match="one less dimension"):
        History.from_chats([SYSTEM, USER]).append(History.from_chats([USER2]))
    assert History.from_chats([SYSTEM]).is_complete.dtype == torch.bool
