"""TorchRL's documented data behaviours (History, ContentBase, ChatHistory, Text, Tokens, LogProbs,
Masks, LLMData, the specs, as_nested_tensor / as_padded_tensor), run against rlpost.

Each test is named after the TorchRL document that states the behaviour (the API reference of
``torchrl.data.llm`` and ``torchrl.modules.llm``, its LLM-wrappers tutorial, its test-suite
examples). Imports are rlpost's and the tokenizer is the offline tiny model's (ChatML); other
templates are set on copies of it. Where rlpost deliberately deviates, the test says so.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from rlpost.data import (
    ChatHistory,
    ContentBase,
    History,
    LLMData,
    LogProbs,
    Masks,
    Text,
    Tokens,
    add_chat_template,
    as_nested_tensor,
    as_padded_tensor,
    templates,
)
from rlpost.data.specs import Composite, NonTensor, Unbounded

pytestmark = pytest.mark.compat

TEMPLATE_NAMES = ["chatml_format", "qwen", "dialogpt", "falcon", "deepseek", "llama"]

CODING_CHAT = [
    {"role": "system", "content": "You are a coding assistant."},
    {"role": "user", "content": "Write a Python function to add two numbers."},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
    {"role": "user", "content": "What about subtraction?"},
    {"role": "assistant", "content": "def subtract(a, b):\n    return a - b"},
]
HELLO_CHAT = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there!"}]


def named(tokenizer, name_or_path: str):
    """A copy of the tokenizer that reports another model name (for family detection)."""
    clone = copy.copy(tokenizer)
    clone.name_or_path = name_or_path
    return clone


# ------------------------------------------------------------------------ History.from_text


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_history_from_text_round_trips_each_chat_template_name(tiny_tokenizer, name):
    """TorchRL History API, ``from_text(text, chat_template_name=...)`` inverts
    ``apply_chat_template(chat_template_name=...)`` for every built-in template name."""
    history = History.from_chats(CODING_CHAT)
    text = history.apply_chat_template(tiny_tokenizer, chat_template_name=name, add_generation_prompt=False)
    parsed = History.from_text(text, chat_template_name=name, tokenizer=tiny_tokenizer)
    # DialoGPT renders neither roles nor system messages: those cannot come back
    expected = CODING_CHAT[1:] if name == "dialogpt" else CODING_CHAT
    assert parsed.to_chats() == expected
    assert parsed.is_complete.all()
    again = parsed.apply_chat_template(tiny_tokenizer, chat_template_name=name, add_generation_prompt=False)
    assert again == text


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_history_from_text_marks_a_truncated_last_message_incomplete(tiny_tokenizer, name):
    """TorchRL test-suite "round trip incomplete": a rendering cut 10 characters short parses to
    as many messages, all complete but the last. rlpost also renders it back exactly."""
    history = History.from_chats(CODING_CHAT)
    text = history.apply_chat_template(tiny_tokenizer, chat_template_name=name, add_generation_prompt=False)
    cut = text[:-10]
    parsed = History.from_text(cut, chat_template_name=name, tokenizer=tiny_tokenizer)
    expected = CODING_CHAT[1:] if name == "dialogpt" else CODING_CHAT
    assert [m["role"] for m in parsed.to_chats()] == [m["role"] for m in expected]
    assert parsed.is_complete.tolist() == [True] * (len(expected) - 1) + [False]
    again = parsed.apply_chat_template(tiny_tokenizer, chat_template_name=name, add_generation_prompt=False)
    assert again == cut


QWEN_CASES = {
    "all_complete": (
        "<|im_start|>system\nI am a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
        "<|im_end|>\n<|im_start|>assistant\nThe capital of France is Paris.<|im_end|>",
        ["system", "user", "assistant"],
        [True, True, True],
    ),
    "last_incomplete": (
        "<|im_start|>system\nI am a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
        "<|im_end|>\n<|im_start|>assistant\nThe capital of France is",
        ["system", "user", "assistant"],
        [True, True, False],
    ),
    "mixed_endings": (
        "<|im_start|>system\nI am a helpful assistant.<|im_end|>\n<|im_start|>user\nTell me about Python.<|im_end|>\n"
        "<|im_start|>assistant\nPython is a programming language.<|endoftext|>\n<|im_start|>user\nCan you elaborate?"
        "<|im_end|>\n<|im_start|>assistant\nPython is known for its simplicity",
        ["system", "user", "assistant", "user", "assistant"],
        [True, True, True, True, False],
    ),
    "single_incomplete": ("<|im_start|>assistant\nLet me help you with that", ["assistant"], [False]),
    "empty_complete": (
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\n<|im_end|>",
        ["system", "user"],
        [True, True],
    ),
    "tool_calls": (
        "<|im_start|>system\nI am an assistant that can use tools.<|im_end|>\n<|im_start|>assistant\nLet me help you "
        'with that.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>\n'
        "<|im_end|>\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\nThe result is",
        ["system", "assistant", "tool", "assistant"],
        [True, True, True, False],
    ),
}


@pytest.mark.parametrize("case", sorted(QWEN_CASES))
def test_history_from_text_qwen_completion_cases(case):
    """TorchRL test-suite "history completion": Qwen texts with complete, cut, ``<|endoftext|>``-ended,
    empty and tool messages parse to the expected roles and ``is_complete`` flags."""
    text, roles, complete = QWEN_CASES[case]
    history = History.from_text(text, chat_template_name="qwen")
    assert list(history.role) == roles
    assert history.is_complete.tolist() == complete
    if case == "mixed_endings":
        assert history[2].content == "Python is a programming language."
    if case == "empty_complete":
        assert list(history.content) == ["", ""]
    if case == "tool_calls":
        assert history[2].content == "4"


@pytest.mark.parametrize(
    "model_name, expected",
    [
        ("Qwen/Qwen2.5-0.5B", "qwen"),
        ("microsoft/phi-2", "chatml_format"),
        ("facebook/opt-125m", "chatml_format"),
        ("gpt2", "chatml_format"),
        ("deepseek-ai/deepseek-coder-6.7b-base", "deepseek"),
        ("microsoft/DialoGPT-medium", "dialogpt"),
        ("tiiuae/falcon-7b-instruct", "falcon"),
        ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "llama"),
    ],
)
def test_history_from_text_detects_the_template_from_the_tokenizer(tiny_tokenizer, model_name, expected):
    """TorchRL History API: with ``chat_template_name=None`` the format is detected from the
    tokenizer's model family (its ``name_or_path``); ``chatml_format`` otherwise."""
    tokenizer = named(tiny_tokenizer, model_name)
    assert templates.detect_chat_template_name(tokenizer) == expected
    text = History.from_chats(HELLO_CHAT).apply_chat_template(
        tokenizer, chat_template_name=expected, add_generation_prompt=False
    )
    parsed = History.from_text(text, tokenizer=tokenizer)
    assert [m["content"] for m in parsed.to_chats()][-2:] == ["Hello", "Hi there!"]


def test_history_from_text_batch_and_without_tokenizer(tiny_tokenizer):
    """TorchRL History API: ``from_text`` takes a list of texts; without a tokenizer the format is
    ``chatml_format``. (rlpost pads the batch with ``"<none>"`` messages instead of a ragged stack.)"""
    texts = [
        tiny_tokenizer.apply_chat_template(HELLO_CHAT, tokenize=False),
        tiny_tokenizer.apply_chat_template(CODING_CHAT, tokenize=False),
    ]
    batch = History.from_text(texts)
    assert batch.batch_size == torch.Size([2, 5])
    assert batch.to_chats() == [HELLO_CHAT, CODING_CHAT]


@pytest.fixture
def restore_template_registry():
    saved = (dict(templates.CHAT_TEMPLATES), dict(templates._CUSTOM_PARSERS), dict(templates._CUSTOM_KEYWORDS))
    yield
    for registry, before in zip(
        (templates.CHAT_TEMPLATES, templates._CUSTOM_PARSERS, templates._CUSTOM_KEYWORDS), saved
    ):
        registry.clear()
        registry.update(before)


def test_add_chat_template_uses_its_parser_and_model_family_keywords(tiny_tokenizer, restore_template_registry):
    """TorchRL ``add_chat_template`` docs: a registered template is chosen for tokenizers matching
    its ``model_family_keywords`` and ``from_text`` uses its ``inverse_parser``; a template
    without ``{% generation %}`` is refused."""
    template = (
        "{% for message in messages %}{% if message['role'] == 'user' %}{{ '[USER] ' + message['content'] }}"
        "{% elif message['role'] == 'assistant' %}{% generation %}{{ '[ASSISTANT] ' + message['content'] }}"
        "{% endgeneration %}{% endif %}{% endfor %}"
    )
    calls = []

    def parse(text: str) -> History:
        calls.append(text)
        user, assistant = text[len("[USER] ") :].split("[ASSISTANT] ")
        return History.from_chats([{"role": "user", "content": user}, {"role": "assistant", "content": assistant}])

    add_chat_template("bracket_format", template, inverse_parser=parse, model_family_keywords=["BracketLM"])
    tokenizer = named(tiny_tokenizer, "acme/bracketlm-1b")
    text = History.from_chats(HELLO_CHAT).apply_chat_template(tokenizer, add_generation_prompt=False)
    assert text == "[USER] Hello[ASSISTANT] Hi there!"
    parsed = History.from_text(text, tokenizer=tokenizer)
    assert calls == [text] and parsed.to_chats() == HELLO_CHAT
    with pytest.raises(ValueError, match="generation"):
        add_chat_template("no_mask", "{{ messages[0]['content'] }}")


# ------------------------------------------------------------------------ apply_chat_template


def test_history_apply_chat_template_returns_text_by_default(tiny_tokenizer):
    """TorchRL test-suite "history template": ``tokenize`` defaults to text, and
    ``add_generation_prompt`` (default True) ends the text with the assistant header."""
    history = History.from_chats(CODING_CHAT)
    text = history.apply_chat_template(tokenizer=tiny_tokenizer, add_generation_prompt=False)
    assert text == tiny_tokenizer.apply_chat_template(CODING_CHAT, tokenize=False)
    prompted = history.apply_chat_template(tokenizer=tiny_tokenizer)
    assert prompted.endswith("<|im_start|>assistant\n") and prompted == text + "<|im_start|>assistant\n"
    batch = History.from_chats([HELLO_CHAT, CODING_CHAT]).apply_chat_template(tokenizer=tiny_tokenizer)
    assert batch == tiny_tokenizer.apply_chat_template(
        [HELLO_CHAT, CODING_CHAT], tokenize=False, add_generation_prompt=True
    )


def test_history_apply_chat_template_tokenize_true_returns_a_tensor(tiny_tokenizer):
    """TorchRL test-suite "history template": ``tokenize=True`` returns a tensor of ids; so does
    ``return_tensors="pt"`` alone (tokenize=None becomes True). rlpost gives a conversation's ids
    as ``[L]`` (TorchRL ``[1, L]``, unlike its own dict output)."""
    history = History.from_chats(CODING_CHAT)
    expected = tiny_tokenizer.apply_chat_template(CODING_CHAT, return_dict=False)
    ids = history.apply_chat_template(tokenizer=tiny_tokenizer, tokenize=True, add_generation_prompt=False)
    assert isinstance(ids, torch.Tensor) and ids.tolist() == expected
    same = history.apply_chat_template(tokenizer=tiny_tokenizer, return_tensors="pt", add_generation_prompt=False)
    assert torch.equal(same, ids)
    assert tiny_tokenizer.decode(ids) == history.apply_chat_template(
        tokenizer=tiny_tokenizer, add_generation_prompt=False
    )


def test_history_apply_chat_template_return_dict_gives_a_tensordict(tiny_tokenizer):
    """TorchRL History API: ``return_dict=True`` gives a TensorDict of ``input_ids`` and
    ``attention_mask`` for one conversation, a lazy stack of them for a batch."""
    encoded = History.from_chats(CODING_CHAT).apply_chat_template(
        tokenizer=tiny_tokenizer, tokenize=True, return_dict=True
    )
    expected = tiny_tokenizer.apply_chat_template(CODING_CHAT, add_generation_prompt=True)
    assert isinstance(encoded, TensorDict) and encoded.batch_size == torch.Size([])
    assert encoded["input_ids"].tolist() == expected["input_ids"]
    assert encoded["attention_mask"].tolist() == [1] * len(expected["input_ids"])
    batch = History.from_chats([HELLO_CHAT, CODING_CHAT]).apply_chat_template(
        tokenizer=tiny_tokenizer, tokenize=True, return_dict=True
    )
    assert batch.batch_size == torch.Size([2])
    rows = [t.tolist() for t in batch.get("input_ids", as_list=True)]
    assert (
        rows == tiny_tokenizer.apply_chat_template([HELLO_CHAT, CODING_CHAT], add_generation_prompt=True)["input_ids"]
    )


def test_history_apply_chat_template_assistant_mask_tokenizes_by_itself(tiny_tokenizer):
    """TorchRL History docs, "Example with Assistant Token Masking": asking only for
    ``return_assistant_tokens_mask=True`` returns a dict whose ``assistant_masks`` select the
    assistant's tokens; for a ``[1, n]`` batch the mask is ``[1, L]``."""
    history = History.from_chats([HELLO_CHAT + [{"role": "user", "content": "How are you?"}]])
    result = history.apply_chat_template(
        tokenizer=tiny_tokenizer, add_generation_prompt=False, return_dict=True, return_assistant_tokens_mask=True
    )
    masks = result["assistant_masks"]
    assert masks.shape[0] == 1 and masks.shape[1] == result["input_ids"].shape[1]
    assert tiny_tokenizer.decode(result["input_ids"][masks.bool()]) == "Hi there!<|im_end|>"
    single = history[0].apply_chat_template(tokenizer=tiny_tokenizer, return_assistant_tokens_mask=True)
    assert single["assistant_masks"].sum().item() == masks.sum().item()


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_history_apply_chat_template_masks_with_every_template_name(tiny_tokenizer, name):
    """TorchRL test-suite "assistant mask with custom templates": every named template supports
    assistant masks. rlpost's masks cover what the model generates (content and end marker),
    not the role header (TorchRL's include it)."""
    result = History.from_chats(HELLO_CHAT).apply_chat_template(
        tokenizer=tiny_tokenizer,
        chat_template_name=name,
        add_generation_prompt=False,
        return_assistant_tokens_mask=True,
    )
    masked = tiny_tokenizer.decode(result["input_ids"][result["assistant_masks"].bool()])
    end = {"chatml_format": "<|im_end|>", "qwen": "<|im_end|>", "llama": "<|eot|>", "falcon": ""}.get(
        name, "<|im_end|>"
    )
    assert masked.lstrip() == "Hi there!" + end  # byte-level BPE glues the separator's space to "Hi"


def test_history_apply_chat_template_uses_the_tokenizers_own_template(tiny_tokenizer):
    """Deliberate deviation from TorchRL's model-family detection in ``apply_chat_template``:
    a Qwen-named tokenizer still renders with its own template (the one the inference engine
    uses); TorchRL's ``qwen`` template is used only when named."""
    tokenizer = named(tiny_tokenizer, "Qwen/Qwen2.5-0.5B")
    history = History.from_chats(HELLO_CHAT)
    own = tiny_tokenizer.apply_chat_template(HELLO_CHAT, tokenize=False)
    assert history.apply_chat_template(tokenizer, add_generation_prompt=False) == own
    qwen = history.apply_chat_template(tokenizer, chat_template_name="qwen", add_generation_prompt=False)
    assert qwen == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" + own


# ------------------------------------------------------------------------ TorchRL test-suite sweep (History)


@pytest.fixture
def templateless_tokenizer(tiny_tokenizer):
    """The tiny tokenizer without a chat template, as GPT-2's, OPT's or Pythia's tokenizer is."""
    clone = copy.copy(tiny_tokenizer)
    clone.chat_template = None
    return clone


def test_history_stacked_messages_render_as_chatml_without_a_tokenizer_template(templateless_tokenizer):
    """TorchRL test-suite "history template" and "history template recover" (a GPT-2 tokenizer,
    which has no chat template): ``torch.stack`` of 0-d Histories renders in ``chatml_format``,
    to text or to ids, and ``from_text`` gives back the roles and the multi-line contents, also
    from the decoded ids. TorchRL's "model families" test: assistant masks work there too."""
    setup = History(role="system", content="CONTENT\n        This is the setup")
    prompt = History(role="user", content="CONTENT\n        This is the first user prompt")
    answer = History(
        role="assistant", content="CONTENT\n        This is the second prompt, the first for the assistant."
    )
    history = torch.stack([setup, prompt, answer])
    assert isinstance(history, History) and history.batch_size == torch.Size([3])
    text = history.apply_chat_template(tokenizer=templateless_tokenizer, add_generation_prompt=False)
    assert text == "".join(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in (setup, prompt, answer))
    prompted = history.apply_chat_template(tokenizer=templateless_tokenizer, add_generation_prompt=True)
    assert prompted == text + "<|im_start|>assistant\n"
    ids = history.apply_chat_template(tokenizer=templateless_tokenizer, tokenize=True, add_generation_prompt=False)
    assert isinstance(ids, torch.Tensor) and templateless_tokenizer.decode(ids) == text
    for rendered in (text, templateless_tokenizer.batch_decode(ids[None])[0]):
        recovered = History.from_text(rendered)
        assert recovered.role == history.role and recovered.content == history.content
    masked = History.from_chats([HELLO_CHAT]).apply_chat_template(
        tokenizer=templateless_tokenizer,
        add_generation_prompt=False,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    assert masked["assistant_masks"].shape == masked["input_ids"].shape and masked["assistant_masks"].shape[0] == 1
    assert templateless_tokenizer.decode(masked["input_ids"][masked["assistant_masks"].bool()]) == "Hi there!<|im_end|>"


def _assistant_spans(history: History, end: str) -> str:
    """What the assistant generated in a ``[n]`` History: each content, plus ``end`` when complete."""
    return "".join(m.content + (end if m.is_complete else "") for m in history.unbind(0) if m.role == "assistant")


@pytest.mark.parametrize("case", sorted(QWEN_CASES))
def test_history_assistant_masks_of_parsed_qwen_texts(tiny_tokenizer, case):
    """TorchRL test-suite "assistant mask qwen": a Qwen text parsed with ``from_text`` renders with
    the ``qwen`` template and ``return_assistant_tokens_mask=True``; the mask is set iff there is an
    assistant message. Deliberate deviation (masks cover what the model generates): the masked
    tokens decode to the assistant contents, each followed by ``<|im_end|>`` when finished, with
    no role headers (TorchRL's masks include them, so its test checks a suffix instead)."""
    history = History.from_text(QWEN_CASES[case][0], chat_template_name="qwen")
    result = history.apply_chat_template(
        tokenizer=tiny_tokenizer,
        chat_template_name="qwen",
        add_generation_prompt=False,
        return_assistant_tokens_mask=True,
    )
    masks = result["assistant_masks"].bool()
    assert bool(masks.any()) == ("assistant" in history.role)
    assert tiny_tokenizer.decode(result["input_ids"][masks]) == _assistant_spans(history, "<|im_end|>")


LLAMA_CASES = {
    "all_complete": (
        "<|begin_of_text|><|header_start|>system<|header_end|>\n\nI am a helpful assistant.<|eot|><|header_start|>user"
        "<|header_end|>\n\nWhat is the capital of France?<|eot|><|header_start|>assistant<|header_end|>\n\nThe capital of"
        " France is Paris.<|eot|>",
        ["system", "user", "assistant"],
        [True, True, True],
    ),
    "last_incomplete": (
        "<|begin_of_text|><|header_start|>system<|header_end|>\n\nI am a helpful assistant.<|eot|><|header_start|>user"
        "<|header_end|>\n\nWhat is the capital of France?<|eot|><|header_start|>assistant<|header_end|>\n\nThe capital of"
        " France is",
        ["system", "user", "assistant"],
        [True, True, False],
    ),
    "single_incomplete": (
        "<|header_start|>assistant<|header_end|>\n\nLet me help you with that",
        ["assistant"],
        [False],
    ),
    "tool_calls": (
        "<|begin_of_text|><|header_start|>system<|header_end|>\n\nI am an assistant that can use tools.<|eot|>"
        "<|header_start|>user<|header_end|>\n\n<|eot|><|header_start|>assistant<|header_end|>\n\nLet me help you with "
        'that.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call><|eot|>'
        "<|header_start|>user<|header_end|>\n\n4<|eot|><|header_start|>assistant<|header_end|>\n\nThe result is",
        ["system", "user", "assistant", "user", "assistant"],
        [True, True, True, True, False],
    ),
}


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_history_assistant_masks_of_parsed_llama_texts(tiny_tokenizer, case):
    """TorchRL test-suite "assistant mask llama": Llama 4 texts parse with
    ``chat_template_name="llama"`` (roles, ``is_complete``, an empty user turn kept) and render
    back with assistant masks over the assistant contents and their ``<|eot|>`` (same deviation
    as for Qwen: no role headers in the mask)."""
    text, roles, complete = LLAMA_CASES[case]
    history = History.from_text(text, chat_template_name="llama")
    assert list(history.role) == roles and history.is_complete.tolist() == complete
    result = history.apply_chat_template(
        tokenizer=tiny_tokenizer,
        chat_template_name="llama",
        add_generation_prompt=False,
        return_assistant_tokens_mask=True,
    )
    masked = tiny_tokenizer.decode(result["input_ids"][result["assistant_masks"].bool()])
    assert masked == _assistant_spans(history, "<|eot|>")
    # The tiny tokenizer has no BOS token: the rendering is the text without <|begin_of_text|>.
    rendered = history.apply_chat_template(
        tokenizer=tiny_tokenizer, chat_template_name="llama", add_generation_prompt=False
    )
    assert rendered == text.removeprefix("<|begin_of_text|>")


def test_history_named_template_renders_as_the_tokenizers_own(tiny_tokenizer):
    """TorchRL test-suite "custom template equivalence": a named template renders a multi-turn chat
    as the model's own template does, here ``chatml_format`` against the tiny model's ChatML
    template passed as ``chat_template=tokenizer.chat_template``."""
    chat = HELLO_CHAT + [
        {"role": "user", "content": "How are you?"},
        {"role": "assistant", "content": "I'm good, thanks!"},
    ]
    history = History.from_chats([chat])
    own = history.apply_chat_template(
        tokenizer=tiny_tokenizer,
        add_generation_prompt=False,
        chat_template=tiny_tokenizer.chat_template,
        chat_template_name=None,
    )
    named_out = history.apply_chat_template(
        tokenizer=tiny_tokenizer, add_generation_prompt=False, chat_template_name="chatml_format"
    )
    assert own == named_out == [tiny_tokenizer.apply_chat_template(chat, tokenize=False)]


ROUND_TRIP_CHATS = [
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road? To get to the other side!"},
    ],
    CODING_CHAT,
]


@pytest.mark.parametrize("chat", ROUND_TRIP_CHATS, ids=["system", "joke", "coding"])
@pytest.mark.parametrize(
    "model_name, use_tokenizer_chat_template",
    [
        (None, False),
        (None, True),
        ("Qwen/Qwen2.5-0.5B", False),
        ("Qwen/Qwen2.5-0.5B", True),
        ("microsoft/phi-2", False),
    ],
)
def test_history_round_trip_with_the_detected_template(tiny_tokenizer, model_name, use_tokenizer_chat_template, chat):
    """TorchRL test-suite "history round trip" and "round trip incomplete": with
    ``chat_template_name=None`` (and optionally ``chat_template=tokenizer.chat_template``),
    History -> text -> History gives the chat back, all complete; the text cut 10 characters short
    gives as many messages, the last one unfinished. phi-2's tokenizer has no chat template
    (``chatml_format`` on both sides); a Qwen tokenizer is parsed as ``qwen``."""
    tokenizer = named(tiny_tokenizer, model_name) if model_name else tiny_tokenizer
    if model_name == "microsoft/phi-2":
        tokenizer.chat_template = None
    chat_template = tokenizer.chat_template if use_tokenizer_chat_template else None
    kwargs = dict(tokenizer=tokenizer, chat_template=chat_template, chat_template_name=None)
    text = History.from_chats(chat).apply_chat_template(add_generation_prompt=False, return_dict=False, **kwargs)
    parsed = History.from_text(text=text, **kwargs)
    assert parsed.to_chats() == chat and bool(parsed.is_complete.all())
    cut = History.from_text(text=text[:-10], **kwargs)
    assert [m["role"] for m in cut.to_chats()] == [m["role"] for m in chat]
    assert cut.is_complete.tolist() == [True] * (len(chat) - 1) + [False]


# ------------------------------------------------------------------------ append / extend


def test_history_append_and_extend_in_place_and_out_of_place():
    """TorchRL test-suite "history construct": a 0-d History refuses ``append`` (RuntimeError
    mentioning ``unsqueeze``); once unsqueezed it appends and extends, in place (the same object
    grows) or not (a new History, the original unchanged)."""
    hst0 = History(role="user", content="a message")
    hst1 = History(role="user", content="another message")
    with pytest.raises(RuntimeError, match="unsqueeze"):
        hst0.append(hst1)
    hst0 = hst0.unsqueeze(0)
    hst0_copy = hst0.copy()
    hst0b = hst0.append(hst1, inplace=False)
    assert hst0b is not hst0 and (hst0 == hst0_copy).all() and (hst0b[:-1] == hst0).all()
    assert hst0.append(hst1) is hst0 and hst0.shape == (2,)
    assert hst0.content == ["a message", "another message"]
    hst2 = History(role=["assistant", "user"], content=["i'm the assistant", "i'm the user"], batch_size=2)
    with pytest.raises(RuntimeError, match="The new history to extend"):
        hst0.extend(hst1)
    hst0b = hst0.extend(hst2, inplace=False)
    assert hst0b is not hst0 and hst0.shape == (2,) and (hst0b[:-2] == hst0).all()
    assert hst0.extend(hst2) is hst0
    assert hst0.__dict__["_tensordict"].shape == (4,)
    assert hst0.role == ["user", "user", "assistant", "user"]


def test_history_append_and_extend_along_the_last_dim_of_an_unsqueezed_history():
    """TorchRL test-suite "history construct ndim": a History built with two ``unsqueeze`` calls
    appends and extends along ``dim=1``, in place or not."""
    hst0 = History(role="user", content="a message").unsqueeze(0).unsqueeze(0)
    hst1 = History(role="user", content="another message").unsqueeze(0)
    hst0_copy = hst0.copy()
    hst0b = hst0.append(hst1, inplace=False, dim=1)
    assert hst0.shape == (1, 1) and (hst0 == hst0_copy).all() and (hst0b[:, :-1] == hst0).all()
    assert hst0b.shape == (1, 2)
    assert hst0.append(hst1, dim=1) is hst0 and hst0._tensordict.shape == (1, 2)
    assert hst0.content == [["a message", "another message"]]
    hst2 = History(role=["assistant", "user"], content=["i'm the assistant", "i'm the user"], batch_size=2).unsqueeze(0)
    hst0b = hst0.extend(hst2, inplace=False, dim=1)
    assert hst0.shape == (1, 2) and (hst0b[:, :-2] == hst0).all()
    assert hst0.extend(hst2, dim=-1) is hst0 and hst0.shape == (1, 4)
    assert hst0.role == [["user", "user", "assistant", "user"]]


def test_history_append_to_lazily_stacked_conversations():
    """TorchRL History API: ``append`` adds one message per conversation (``dim=-1``) to a lazy
    stack of conversations of different lengths, and ``extend(dim=0)`` adds conversations."""
    short = History.from_chats([{"role": "user", "content": "x"}])
    long = History.from_chats([{"role": "user", "content": "y"}, {"role": "assistant", "content": "z"}])
    batch = lazy_stack([short, long])
    replies = History(role=["assistant", "assistant"], content=["1", "2"], batch_size=[2])
    assert batch.append(replies) is batch
    assert [[m["content"] for m in chat] for chat in batch.to_chats()] == [["x", "1"], ["y", "z", "2"]]
    more = batch.extend(History.from_chats([[{"role": "user", "content": "new"}]]), inplace=False, dim=0)
    assert more.batch_size[0] == 3 and more.to_chats()[-1] == [{"role": "user", "content": "new"}]
    dense = History.from_chats([[{"role": "user", "content": "x"}]] * 2)
    dense.append(replies)
    assert dense.batch_size == torch.Size([2, 2]) and dense.to_chats()[1][-1]["content"] == "2"


# ------------------------------------------------------------------------ fields and specs


def test_history_tool_calls_and_tool_responses_fields(tiny_tokenizer):
    """TorchRL History attributes: ``tool_calls`` (list of dicts) and ``tool_responses`` (list of
    str) default to None and reach the chat template; the ``qwen`` template renders them."""
    plain = History(role="user", content="hi")
    assert plain.tool_calls is None and plain.tool_responses is None
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+2"}}}
    chat = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "unused", "tool_responses": ["4", "four"]},
        {"role": "assistant", "content": "It is 4."},
    ]
    history = History.from_chats(chat)
    assert history.to_chats() == chat
    assert list(history.tool_calls) == [None, [call], None, None]
    text = history.apply_chat_template(tiny_tokenizer, chat_template_name="qwen", add_generation_prompt=False)
    call_text = '{"name": "calculator", "arguments": {"expression": "2+2"}}'
    assert f"<|im_start|>assistant\n<tool_call>\n{call_text}\n</tool_call><|im_end|>" in text
    assert (
        "<|im_start|>user\n<tool_response>\n4\n</tool_response>\n<tool_response>\nfour\n</tool_response><|im_end|>"
        in text
    )
    parsed = History.from_text(text, chat_template_name="qwen")
    assert [m["role"] for m in parsed.to_chats()] == ["system", "user", "assistant", "tool", "tool", "assistant"]


def test_history_default_spec():
    """TorchRL History API, ``default_spec``: a Composite of ``shape[:-1]`` whose fields have
    ``shape``; ``zero()`` is a History and ``is_in`` accepts it and real Histories."""
    spec = History.default_spec()
    assert spec.shape == torch.Size([]) and spec.data_cls is History
    assert spec.keys() == ["role", "content", "is_complete", "tool_calls", "tool_responses"]
    assert spec["role"].shape == torch.Size([-1]) and spec["content"].example_data == "foo"
    zero = spec.zero()
    assert isinstance(zero, History) and zero.batch_size == torch.Size([1])
    assert zero.role == "foo" and zero.content == "foo" and zero.tool_calls is None
    assert spec.is_in(zero)
    history = History(role=["system", "user"], content=["i'm the system", "i'm the user"], batch_size=2)
    assert spec.is_in(history)
    batch_spec = History.default_spec(shape=(-1, -1))
    assert batch_spec.shape == torch.Size([-1]) and batch_spec.is_in(lazy_stack([history[:1], history]))
    assert not spec.is_in(Text(prompt="x"))


def test_content_base_messages_render_through_the_template():
    """TorchRL ContentBase docs and test-suite "content base": a History whose content is a
    stack of text and image blocks renders through a template that reads list content."""
    content1 = ContentBase(type="text", text="Hello, world!")
    content2 = ContentBase(type="image", url="https://example.com/image.jpg")
    content = lazy_stack([content1, content2])
    assert content.batch_size == torch.Size([2]) and content.type == ["text", "image"]
    assert content.to_blocks() == [
        {"type": "text", "text": "Hello, world!"},
        {"type": "image", "url": "https://example.com/image.jpg"},
    ]
    first = History(role="assistant", content=ContentBase(type="text", text="Ignore both.", batch_size=1))
    history = lazy_stack([first, History(role="user", content=content)])
    processor = _ListContentTokenizer()
    text = history.apply_chat_template(
        tokenizer=processor, add_generation_prompt=False, return_dict=True, tokenize=False
    )
    assert text == "<|im_start|>assistant Ignore both.<|im_end|><|im_start|>user Hello, world!<image><|im_end|>"
    blocks = History.from_chats(
        [{"role": "user", "content": [{"type": "image", "url": "u"}, {"type": "text", "text": "?"}]}]
    )
    assert blocks.apply_chat_template(tokenizer=processor) == "<|im_start|>user <image>?<|im_end|>"


class _ListContentTokenizer:
    """A processor-like renderer whose template reads list content (images become ``<image>``)."""

    chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
        "{% for block in message['content'] %}{% if block['type'] == 'image' %}{{ '<image>' }}"
        "{% else %}{{ block['text'] }}{% endif %}{% endfor %}{{ '<|im_end|>' }}{% endfor %}"
    )
    name_or_path = "llava-hf/llava-onevision-qwen2-0.5b-ov-hf"

    def apply_chat_template(self, conversation, chat_template=None, tokenize=False, **kwargs):
        from transformers.utils.chat_template_utils import render_jinja_template

        assert not tokenize
        batched = isinstance(conversation[0], list)
        rendered, _ = render_jinja_template(
            conversations=conversation if batched else [conversation], chat_template=chat_template or self.chat_template
        )
        return rendered if batched else rendered[0]


def test_llm_wrapper_tutorial_tensorclass_fields():
    """TorchRL LLM-wrappers tutorial, Example 5: the containers' field lists, and
    ``result['text'].padded`` is readable."""
    assert list(Text.__annotations__) == ["prompt", "response", "full", "padded"]
    assert list(Tokens.__annotations__) == ["prompt", "response", "full", "padded"]
    assert list(LogProbs.__annotations__) == ["prompt", "response", "full", "padded"]
    assert list(Masks.__annotations__) == ["all_attention_mask", "all_assistant_mask", "padded"]
    assert list(ChatHistory.__annotations__) == ["prompt", "response", "full"]
    assert list(History.__annotations__) == ["role", "content", "is_complete", "tool_calls", "tool_responses"]
    result = TensorDict(text=Text(prompt=["p"], response=["r"], full=["pr"], batch_size=[1]), batch_size=[1])
    assert result["text"].padded is None and result["text"].full == ["pr"]


@pytest.mark.parametrize(
    "cls, keys, dtype",
    [
        (Tokens, ["prompt", "response", "full"], torch.int64),
        (LogProbs, ["prompt", "response", "full"], torch.float32),
        (Masks, ["all_attention_mask", "all_assistant_mask"], torch.bool),
    ],
)
def test_sequence_container_default_spec(cls, keys, dtype):
    """TorchRL ``Tokens`` / ``LogProbs`` / ``Masks.default_spec``: ``[*shape, -1]`` Unbounded per
    key plus a ``padded`` NonTensor, Composite of ``shape[:-1]``, ``step_mdp_static``. rlpost's
    dtypes are the data's (int64 ids, float32 log-probs, bool masks)."""
    spec = cls.default_spec()
    assert spec.keys() == keys + ["padded"] and spec.shape == torch.Size([]) and spec.step_mdp_static
    for key in keys:
        assert isinstance(spec[key], Unbounded) and spec[key].shape == torch.Size([-1, -1]) and spec[key].dtype == dtype
    assert spec["padded"].shape == torch.Size([-1]) and spec["padded"].example_data is False
    zero = spec.zero()
    assert isinstance(zero, cls) and zero.batch_size == torch.Size([1]) and zero.padded is False
    assert zero._tensordict.get(keys[0]).tolist() == [[0]]
    assert spec.is_in(zero) and spec.is_in(spec.rand())
    assert cls.default_spec(shape=(4,), keys=keys[:1]).keys() == keys[:1] + ["padded"]


def test_text_and_chat_history_default_spec():
    """TorchRL ``Text.default_spec`` (NonTensor "a string" per key) and
    ``ChatHistory.default_spec`` (a History spec of ``shape + (-1,)`` per key)."""
    text = Text.default_spec()
    assert text.keys() == ["prompt", "response", "full"] and text["prompt"].example_data == "a string"
    assert text.zero().prompt == "a string" and text.zero().batch_size == torch.Size([1])
    chat = ChatHistory.default_spec(keys=["prompt"])
    assert chat.keys() == ["prompt"] and chat.step_mdp_static
    assert chat["prompt"].shape == torch.Size([-1]) and chat["prompt", "role"].shape == torch.Size([-1, -1])
    zero = chat.zero()
    assert isinstance(zero, ChatHistory) and zero.prompt.batch_size == torch.Size([1, 1])
    assert zero.prompt.to_chats() == [[{"role": "foo", "content": "foo"}]] and chat.is_in(zero)


def test_chat_env_specs_take_the_env_batch_shape():
    """TorchRL ChatEnv specs: ``Composite(history=ChatHistory.default_spec(shape=batch,
    keys=["prompt"]), shape=batch)`` describes a ``[B]`` ChatHistory of ``[B, n]`` Histories."""
    spec = Composite(
        history=ChatHistory.default_spec(shape=(3,), keys=["prompt"]).to("cpu"),
        data=NonTensor(example_data="a string", shape=(3,)),
        reward=Unbounded(shape=(3, 1), dtype=torch.float32),
        shape=(3,),
    )
    assert spec["history"].shape == torch.Size([3]) and spec["history", "prompt", "content"].shape == torch.Size(
        [3, -1]
    )
    assert ("history", "prompt", "role") in spec.keys(include_nested=True, leaves_only=True)
    value = spec.zero()
    assert value.batch_size == torch.Size([3]) and value["history"].prompt.batch_size == torch.Size([3, 1])
    assert value["reward"].shape == (3, 1) and value["data"] == "a string"
    assert spec.is_in(value)
    batched = NonTensor(example_data="x", shape=(2,), batched=True).rand()
    assert batched.tolist() == ["x", "x"]


# ------------------------------------------------------------------------ conversions


PROMPTS = [
    [{"role": "user", "content": "What is 3 + 4?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
]
RESPONSES = [[{"role": "assistant", "content": "<answer>7</answer>"}], [{"role": "assistant", "content": "4"}]]


def _chat_history() -> ChatHistory:
    return ChatHistory(
        prompt=History.from_chats(PROMPTS),
        response=History.from_chats(RESPONSES),
        full=History.from_chats([p + r for p, r in zip(PROMPTS, RESPONSES)]),
        batch_size=[2],
    )


def test_chat_history_to_text(tiny_tokenizer):
    """TorchRL ``ChatHistory.to_text``: prompt with the generation prompt, full without, response
    is full minus the prompt."""
    text = _chat_history().to_text(tiny_tokenizer)
    assert isinstance(text, Text) and text.batch_size == torch.Size([2])
    assert text.prompt == tiny_tokenizer.apply_chat_template(PROMPTS, tokenize=False, add_generation_prompt=True)
    assert text.response == ["<answer>7</answer><|im_end|>\n", "4<|im_end|>\n"]
    assert [p + r for p, r in zip(text.prompt, text.response)] == list(text.full)
    alone = ChatHistory(response=History.from_chats(RESPONSES), batch_size=[2]).to_text(tiny_tokenizer)
    assert alone.response == [
        "<|im_start|>assistant\n<answer>7</answer><|im_end|>\n",
        "<|im_start|>assistant\n4<|im_end|>\n",
    ]


def test_chat_history_to_tokens(tiny_tokenizer):
    """TorchRL ``ChatHistory.to_tokens``: unpadded ``Tokens`` (``padded=False``) whose response is
    the full ids after the prompt's."""
    tokens = _chat_history().to_tokens(tiny_tokenizer)
    assert isinstance(tokens, Tokens) and tokens.batch_size == torch.Size([2])
    prompt = [t.tolist() for t in tokens.get("prompt", as_list=True)]
    full = [t.tolist() for t in tokens.get("full", as_list=True)]
    response = [t.tolist() for t in tokens.get("response", as_list=True)]
    assert prompt == tiny_tokenizer.apply_chat_template(PROMPTS, add_generation_prompt=True)["input_ids"]
    assert [p + r for p, r in zip(prompt, response)] == full
    assert tiny_tokenizer.batch_decode(response) == ["<answer>7</answer><|im_end|>\n", "4<|im_end|>\n"]
    assert list(tokens.padded) == [False, False]
    one = _chat_history()[1].to_tokens(tiny_tokenizer)
    assert one.batch_size == torch.Size([]) and one.response.tolist() == response[1]


def test_tokens_to_text_and_text_to_tokens_and_history(tiny_tokenizer):
    """TorchRL ``Tokens.to_text``, ``Text.to_tokens`` and ``Text.to_history`` invert each other on
    unpadded data; padded tokens are refused."""
    text = _chat_history().to_text(tiny_tokenizer)
    tokens = text.to_tokens(tiny_tokenizer)
    assert tokens.to_text(tiny_tokenizer).full == list(text.full)
    history = text.to_history(tiny_tokenizer)
    assert history.full.to_chats() == [p + r for p, r in zip(PROMPTS, RESPONSES)]
    assert history.response.to_chats() == RESPONSES
    with pytest.raises(ValueError, match="unpadded"):
        Tokens(full=torch.zeros(2, 3, dtype=torch.long), padded=True, batch_size=[2]).to_text(tiny_tokenizer)


def test_chat_history_unsqueezes_histories_without_a_message_dim():
    """TorchRL ``ChatHistory``: a History with as many batch dims as the ChatHistory is read as one
    message per row and unsqueezed along its last dim, with a warning."""
    one_message_each = History(role=["user", "user"], content=["a", "b"], batch_size=[2])
    with pytest.warns(UserWarning, match="one more batch dim"):
        chat = ChatHistory(prompt=one_message_each, batch_size=[2])
    assert chat.prompt.batch_size == torch.Size([2, 1]) and chat.prompt.to_chats()[1] == [
        {"role": "user", "content": "b"}
    ]


MULTI_TURN_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 equals 4."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome!"},
]


def test_chat_history_of_a_one_chat_batch_converts_to_one_row_lists(tiny_tokenizer, templateless_tokenizer):
    """TorchRL test-suite conversions, single: ``ChatHistory(full=History.from_chats([chat]))`` (a
    0-d ChatHistory over a ``[1, n]`` History) converts to a list of one text, ``[1, L]`` unpadded
    ids, and back to the same ``[1, n]`` History, through text or through tokens. The tokenizer
    has no template (TorchRL uses GPT-2's), so ``chatml_format`` renders."""
    tokenizer = templateless_tokenizer
    history = History.from_chats([HELLO_CHAT])
    chat_history = ChatHistory(full=history)
    rendered = tiny_tokenizer.apply_chat_template(HELLO_CHAT, tokenize=False)
    ids = tiny_tokenizer.apply_chat_template(HELLO_CHAT, return_dict=False)
    text = chat_history.to_text(tokenizer)
    assert isinstance(text, Text) and text.batch_size == torch.Size([]) and text.full == [rendered]
    tokens = chat_history.to_tokens(tokenizer)
    assert isinstance(tokens, Tokens) and tokens.padded is False and tokens.full.tolist() == [ids]
    decoded = tokens.to_text(tokenizer)
    assert decoded.full == [rendered]
    assert decoded.to_tokens(tokenizer).full.tolist() == [ids]
    for back in (text.to_history(tokenizer), tokens.to_history(tokenizer)):
        assert isinstance(back, ChatHistory) and back.full.batch_size == torch.Size([1, 2])
        assert back.full.content == history.content and back.full.to_chats() == [HELLO_CHAT]
    plain = Text(full=["Hello, how are you?"])
    plain_ids = plain.to_tokens(tokenizer)
    assert plain_ids.padded is False and plain_ids.full.shape[0] == 1
    assert plain_ids.to_text(tokenizer).full == ["Hello, how are you?"]


def test_chat_history_prompt_and_full_give_the_response_as_the_rest(templateless_tokenizer):
    """TorchRL test-suite conversions, prompt/response: with ``prompt`` and ``full`` set, the
    response text is the full text after the prompt's (``full == prompt + response``), the
    response ids are the full ids after the prompt's, and ``Tokens.to_text`` decodes all three.
    ``Text.to_tokens`` tokenizes prompt, response and full alike."""
    tokenizer = templateless_tokenizer
    chat_history = ChatHistory(prompt=History.from_chats([HELLO_CHAT[:1]]), full=History.from_chats([HELLO_CHAT]))
    text = chat_history.to_text(tokenizer)
    assert text.prompt == ["<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"]
    assert text.response == ["Hi there!<|im_end|>\n"]
    assert text.full == [text.prompt[0] + text.response[0]]
    tokens = chat_history.to_tokens(tokenizer)
    prompt, response, full = (tokens._tensordict.get(key, as_list=True)[0] for key in ("prompt", "response", "full"))
    assert full.shape[0] == prompt.shape[0] + response.shape[0] and torch.equal(full[: prompt.shape[0]], prompt)
    decoded = tokens.to_text(tokenizer)
    assert (decoded.prompt, decoded.response, decoded.full) == (text.prompt, text.response, text.full)
    assert decoded.to_history(tokenizer).response.to_chats() == [[HELLO_CHAT[1]]]
    split = Text(prompt=["Hello"], response=[", how are you?"], full=["Hello, how are you?"]).to_tokens(tokenizer)
    assert tokenizer.batch_decode(split.prompt) == ["Hello"] and tokenizer.batch_decode(split.response) == [
        ", how are you?"
    ]
    assert tokenizer.batch_decode(split.full) == ["Hello, how are you?"]


def test_lazy_stack_of_chat_histories_converts_row_by_row(tiny_tokenizer, templateless_tokenizer):
    """TorchRL test-suite conversions, batch and "single batch dimension": a ``lazy_stack`` of
    ChatHistory rows, each over a ``[1, n]`` History, keeps its ``[2]`` batch through
    ``to_text``, ``to_tokens`` (unpadded, readable as a nested tensor), ``Tokens.to_text``,
    ``Text.to_history`` and ``Tokens.to_history``. (TorchRL's nested ``[2, 2]`` case is
    test_torchrl_more_ports.py::test_nested_batch_dimensions.)"""
    tokenizer = templateless_tokenizer
    histories = History.from_chats([HELLO_CHAT, MULTI_TURN_CHAT])
    batch = lazy_stack([ChatHistory(full=histories[i : i + 1]) for i in range(histories.shape[0])])
    assert batch.batch_size == torch.Size([2])
    rendered = tiny_tokenizer.apply_chat_template([HELLO_CHAT, MULTI_TURN_CHAT], tokenize=False)
    ids = tiny_tokenizer.apply_chat_template([HELLO_CHAT, MULTI_TURN_CHAT], return_dict=False)
    text = batch.to_text(tokenizer)
    assert text.batch_size == torch.Size([2]) and text.full == [[rendered[0]], [rendered[1]]]
    tokens = batch.to_tokens(tokenizer)
    assert tokens.batch_size == torch.Size([2]) and not any(tokens.padded)
    assert tokens.get("full", as_nested_tensor=True).is_nested
    assert [row.tolist() for row in tokens.get("full", as_list=True)] == [[ids[0]], [ids[1]]]
    assert tokens.to_text(tokenizer).full == text.full
    for back in (text.to_history(tokenizer), tokens.to_history(tokenizer)):
        assert back.batch_size == torch.Size([2])
        assert back.full.to_chats() == [[HELLO_CHAT], [MULTI_TURN_CHAT]]


def test_text_to_tokens_of_a_lazy_text_and_the_conversion_errors(templateless_tokenizer):
    """TorchRL test-suite conversions: a lazily stacked Text filled through ``view(-1)`` tokenizes
    row by row; ``Text.to_tokens(padding=True)`` is refused ("Padding is not yet supported"), and
    so is ``Tokens.to_text`` on tokens marked padded ("padded tokens")."""
    tokenizer = templateless_tokenizer
    text = Text._from_tensordict(TensorDict(batch_size=(2,)).to_lazystack(0))
    with text.view(-1) as flat:
        flat.full = ["Hello, how are you?", "I'm doing great!"]
    tokens = text.to_tokens(tokenizer)
    assert tokens.batch_size == torch.Size([2]) and tokens.get("full", as_nested_tensor=True).is_nested
    assert tokens.to_text(tokenizer).full == ["Hello, how are you?", "I'm doing great!"]
    with pytest.raises(ValueError, match="Padding is not yet supported"):
        Text(full=["Hello, how are you?"]).to_tokens(tokenizer, padding=True)
    marked = ChatHistory(full=History.from_chats([HELLO_CHAT])).to_tokens(tokenizer)
    marked.padded = True
    with pytest.raises(ValueError, match="padded tokens"):
        marked.to_text(tokenizer)


def test_as_nested_tensor_and_as_padded_tensor():
    """TorchRL data-loading primer's stack methods: ``as_nested_tensor`` keeps rows of different
    lengths as a jagged nested tensor; ``as_padded_tensor`` left-pads them with zeros."""
    tds = [TensorDict(ids=torch.tensor([1, 2, 3])), TensorDict(ids=torch.tensor([4, 5]))]
    nested = as_nested_tensor(tds)
    assert nested.batch_size == torch.Size([2]) and nested["ids"].is_nested
    assert [row.tolist() for row in nested["ids"].unbind(0)] == [[1, 2, 3], [4, 5]]
    padded = as_padded_tensor(tds)
    assert padded.batch_size == torch.Size([2])
    assert padded["ids"].tolist() == [[1, 2, 3], [0, 4, 5]]


def test_llm_data_fields():
    """TorchRL ``LLMData``: its attributes, all defaulting to None."""
    assert list(LLMData.__annotations__) == [
        "tokens",
        "tokens_response",
        "attention_mask",
        "token_list",
        "tokens_response_list",
        "logits",
        "log_probs",
        "text",
        "text_response",
    ]
    data = LLMData(tokens=torch.tensor([[1, 2]]), text=["hi"], batch_size=[1])
    assert data.tokens.tolist() == [[1, 2]] and data.text == ["hi"]
    assert data.log_probs is None and data.attention_mask is None and data.tokens_response is None
