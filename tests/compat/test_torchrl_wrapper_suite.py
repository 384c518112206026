"""TorchRL's own wrapper tests (``test/llm/test_wrapper.py``), ported as a TorchRL user would.

The calls are TorchRL's, with rlpost's imports and the offline tiny model (a plain
``vllm.LLM`` and a transformers model) instead of the hub model. Where TorchRL's test only checks
that a field is there, these tests also check its value. Behaviours already covered by
``test_torchrl_llm_wrappers.py`` (the tutorial and the API docs) or by
``tests/integration/policies/test_wrappers.py`` are not repeated; batching, ``prefer_tokens``, the Ray
wrapper and the TRL adapters are ported in ``test_torchrl_wrapper_options.py``, async engines in
the AsyncVLLM tests.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict

from rlpost.data import History
from rlpost.policies import ChatHistory, Masks, Text, Tokens, TransformersWrapper, vLLMWrapper

pytestmark = pytest.mark.compat

TOLERANCE = 1e-3  # fp32 engine vs fp32 transformers
MAX_NEW_TOKENS = 8  # TorchRL's tests use 10 (transformers) and vLLM's 16
NUM_SAMPLES = 3  # TorchRL uses 2, which cannot tell a [num_samples] batch from a [B] one when B == 2

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CHATS = [
    [SYSTEM, {"role": "user", "content": "Are you happy? Say yes or no."}],
    [
        {"role": "system", "content": "You are a very helpful assistant, but more handsome."},
        {"role": "user", "content": "Explain the difference between a cat and a dog. Be very detailed."},
    ],
]
ANSWERS = ["Yes.", "A cat is a small animal that meows, while a dog is a larger animal that barks."]
HISTORY = History.from_chats(CHATS)
HISTORY_ASSISTANT = History.from_chats([c + [{"role": "assistant", "content": a}] for c, a in zip(CHATS, ANSWERS)])
TEXTS = ["Are you happy? Say yes or no.", "Explain the difference between a cat and a dog. Be very detailed."]


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(params=["vllm", "transformers"])
def backend(request):
    return request.param


@pytest.fixture
def make(backend, plain_llm, hf_model, tiny_tokenizer):
    """TorchRL's ``wrapper_class(model, tokenizer=tokenizer, **kwargs)`` for either backend."""

    def make_wrapper(**kwargs):
        kwargs.setdefault("generate_kwargs", {"max_new_tokens": MAX_NEW_TOKENS})
        if backend == "vllm":
            return vLLMWrapper(plain_llm, tokenizer=tiny_tokenizer, **kwargs)
        return TransformersWrapper(hf_model, tokenizer=tiny_tokenizer, **kwargs)

    return make_wrapper


def left_padded(tokenizer):
    """TorchRL's ``sample_tokens``: left-padded ids and their attention mask."""
    enc = tokenizer(TEXTS, return_tensors="pt", padding=True, padding_side="left")
    return enc["input_ids"], enc["attention_mask"]


def make_input(mode: str, generate: bool, tokenizer, null: bool) -> TensorDict:
    """TorchRL's inputs: a ChatHistory, Text or Tokens container (plus ``attention_mask``)."""
    if mode == "history":
        chat = ChatHistory(prompt=HISTORY) if generate else ChatHistory(full=HISTORY_ASSISTANT)
        td = TensorDict(history=chat, batch_size=(2,))
    elif mode == "text":
        td = TensorDict(text=Text(prompt=TEXTS) if generate else Text(full=TEXTS), batch_size=(2,))
    else:
        ids, mask = left_padded(tokenizer)
        tokens = Tokens(prompt=ids) if generate else Tokens(full=ids)
        td = TensorDict(tokens=tokens, attention_mask=mask, batch_size=(2,))
    return td[0] if null else td


def flags(padded) -> list[bool]:
    return [bool(padded)] if isinstance(padded, bool) else [bool(p) for p in padded]


def rows(out: TensorDict, key: tuple, part: str) -> list[torch.Tensor]:
    """Per-row tensors without padding (a 0-d output is one unpadded row)."""
    if out.ndim == 0:
        return [out.get((key, part))]
    container = out[key]
    if not any(flags(container.padded)):
        return list(out.get((key, part), as_list=True))
    mask = out["masks"].all_attention_mask
    width = out["tokens"].prompt.shape[-1] if out["tokens"].prompt is not None else 0
    cut = {"full": mask, "prompt": mask[:, :width], "response": mask[:, width:]}[part]
    return [row[m] for row, m in zip(getattr(container, part), cut)]


def assert_torchrl_layout(out: TensorDict, pad_output: bool, scored_without_prompt: bool = False) -> None:
    """TorchRL's ``check_output_shapes``, with values: every ``padded`` flag is ``pad_output``;
    dense (or 0-d) outputs share one full shape and prompt + response widths make the full
    width; per row, prompt + response == full; a scored input without a prompt has neither
    prompt nor response."""
    for key in ("tokens", "masks", "log_probs"):
        if key in out.keys():
            assert set(flags(out[key].padded)) == {pad_output}, key
    tokens, log_probs, masks = out["tokens"], out.get("log_probs", None), out["masks"]
    if pad_output or out.ndim == 0:
        fulls = {tokens.full.shape, masks.all_attention_mask.shape}
        fulls |= {t.shape for t in (getattr(log_probs, "full", None), masks.all_assistant_mask) if t is not None}
        assert len(fulls) == 1, fulls
        if tokens.response is not None:
            assert tokens.prompt.shape[-1] + tokens.response.shape[-1] == tokens.full.shape[-1]
            if log_probs is not None:
                assert log_probs.response.shape == tokens.response.shape
    if scored_without_prompt:
        for key in {"tokens", "log_probs", "text"} & set(out.keys()):
            assert out[key].prompt is None and out[key].response is None, key
        return
    for prompt, response, full in zip(*(rows(out, "tokens", part) for part in ("prompt", "response", "full"))):
        assert torch.equal(torch.cat([prompt, response]), full)
    if log_probs is not None:
        for lp, full in zip(rows(out, "log_probs", "full"), rows(out, "tokens", "full")):
            assert lp.shape == full.shape


def expected_ids(mode: str, generate: bool, tokenizer) -> list[list[int]]:
    """The ids a wrapper must read from ``make_input``: the prompts, or the full sequences."""
    if mode == "history":
        history = HISTORY if generate else HISTORY_ASSISTANT
        rendered = history.apply_chat_template(tokenizer, tokenize=True, add_generation_prompt=generate)
        return [t.tolist() for t in rendered]
    if mode == "text":
        return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    ids, mask = left_padded(tokenizer)
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


# ---------------------------------------------------------------- input modes


@pytest.mark.parametrize("null", [True, False], ids=["0d", "batch2"])
@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("generate", [True, False], ids=["generate", "score"])
@pytest.mark.parametrize("mode", ["history", "text", "tokens"])
def test_input_modes(make, tiny_tokenizer, mode, generate, pad_output, null):
    """TorchRL wrappers: history / text / tokens input x generate True/False x pad_output, on a
    batch of 2 and on a 0-d TensorDict (test_history_input_mode, test_text_input_mode,
    test_tokens_input_mode, test_log_probs_only_mode): keys, layouts, and the ids each mode reads."""
    extra = {"attention_mask_key": "attention_mask"} if mode == "tokens" else {}
    wrapper = make(input_mode=mode, generate=generate, pad_output=pad_output, **extra)
    assert wrapper.in_keys == [(mode, "prompt" if generate else "full")]
    expected_keys = {
        "history": ["text", "masks", "tokens", "log_probs", "history"],
        "text": ["text", "masks", "tokens", "log_probs"],
        "tokens": ["masks", "tokens", "log_probs"],
    }[mode]
    assert wrapper.out_keys == expected_keys
    out = wrapper(make_input(mode, generate, tiny_tokenizer, null))
    assert out.batch_size == (() if null else (2,))
    assert set(expected_keys) <= set(out.keys())
    assert_torchrl_layout(out, pad_output, scored_without_prompt=not generate)
    wanted = expected_ids(mode, generate, tiny_tokenizer)[:1] if null else expected_ids(mode, generate, tiny_tokenizer)
    read = [t.tolist() for t in rows(out, "tokens", "prompt" if generate else "full")]
    assert read == wanted
    if generate:
        response = out["tokens"].response if pad_output else out["tokens"].get("response", as_list=True)
        assert isinstance(response, torch.Tensor) if null or pad_output else isinstance(response, list)
        assert all(1 <= len(r) <= MAX_NEW_TOKENS for r in rows(out, "tokens", "response"))
    if mode == "text":
        text = out["text"]
        given = TEXTS[0] if null else TEXTS
        assert (text.prompt if generate else text.full) == given
        if generate:
            assert isinstance(text.response, str) if null else all(isinstance(r, str) for r in text.response)
            fulls = [text.full] if null else list(text.full)
            prompts, responses = ([text.prompt], [text.response]) if null else (text.prompt, text.response)
            assert fulls == [p + r for p, r in zip(prompts, responses)]
        else:
            assert text.response is None  # TorchRL: scoring generates nothing
    if mode == "history":
        chat = out["history"]
        # generation adds the parsed response (one assistant message, more when the sample wrote
        # further turn markers); scoring returns the history as given
        grown = chat.response.shape[-1] if generate else 0
        n_messages = (HISTORY if generate else HISTORY_ASSISTANT).shape[-1]
        assert chat.full.shape[-1] == n_messages + grown
        if generate:
            roles = chat.response[..., 0].role
            assert grown >= 1 and set([roles] if isinstance(roles, str) else roles) == {"assistant"}
        if generate:
            assert isinstance(out["text"].response, str) if null else isinstance(out["text"].response, list)


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
def test_batch_sizes(make, tiny_tokenizer, batch_size, pad_output):
    """TorchRL wrappers: a history batch of 1 or 3 rows gives that many responses (test_batch_sizes)."""
    chats = [[SYSTEM, {"role": "user", "content": f"Question {i}?"}] for i in range(batch_size)]
    wrapper = make(input_mode="history", generate=True, return_log_probs=True, pad_output=pad_output)
    out = wrapper(TensorDict(history=ChatHistory(prompt=History.from_chats(chats)), batch_size=(batch_size,)))
    assert_torchrl_layout(out, pad_output)
    assert len(out["text"].get("response", as_list=True)) == batch_size
    assert len(rows(out, "tokens", "response")) == batch_size
    chat = out["history"]
    assert chat.full.shape[0] == batch_size
    assert chat.full.shape[1] == 2 + chat.response.shape[1]  # the prompt, then the parsed response
    assert set(chat.response[:, 0].role) == {"assistant"}


def test_single_message_chat_history(make):
    """TorchRL wrappers: a ChatHistory whose prompt has one message per row is unsqueezed to
    ``[B, 1]`` conversations (test_single_history_item_unsqueeze)."""
    wrapper = make(input_mode="history")
    with pytest.warns(UserWarning, match="unsqueezing"):
        chat = ChatHistory(prompt=HISTORY[:, 0], batch_size=(2,))
    out = wrapper(TensorDict(history=chat, batch_size=(2,)))
    assert_torchrl_layout(out, pad_output=False)
    assert out["history"].prompt.shape == (2, 1) and out["history"].full.shape == (2, 2)
    assert list(out["history"].full[:, 0].role) == ["system", "system"]


def test_two_dim_batch(make, tiny_tokenizer):
    """TorchRL wrappers: an N-d input is flattened, run and given back in its shape."""
    td = TensorDict(history=ChatHistory(prompt=HISTORY), batch_size=(2,))
    out = make(input_mode="history", pad_output=True)(torch.stack([td, td], 0))
    assert out.batch_size == (2, 2) and out["tokens"].batch_size == (2, 2)
    prompts = [t.tolist() for t in HISTORY.apply_chat_template(tiny_tokenizer, tokenize=True)]
    for i in range(2):
        assert [t.tolist() for t in rows(out[i], "tokens", "prompt")] == prompts


@pytest.mark.parametrize("null", [True, False], ids=["0d", "batch2"])
def test_custom_input_key(make, null):
    """TorchRL wrappers: ``input_key=("custom_history_key", "prompt")`` reads the prompt there
    and writes the outputs under the usual keys (test_custom_input_key)."""
    wrapper = make(input_mode="history", input_key=("custom_history_key", "prompt"), generate=True)
    assert wrapper.in_keys == [("custom_history_key", "prompt")]
    td = TensorDict(custom_history_key=ChatHistory(prompt=HISTORY), batch_size=(2,))
    out = wrapper(td[0] if null else td)
    assert_torchrl_layout(out, pad_output=False)
    assert {"text", "masks", "tokens", "log_probs"} <= set(out.keys())
    prompts = [out["history"].prompt] if null else list(out["history"].prompt.unbind(0))
    assert [list(p.content) for p in prompts] == [[m["content"] for m in chat] for chat in CHATS[: len(prompts)]]


@pytest.mark.parametrize("return_log_probs", [True, False])
def test_selective_outputs(make, return_log_probs):
    """TorchRL wrappers: ``return_log_probs=False`` drops ``log_probs`` from out_keys and from the
    output (test_selective_outputs)."""
    wrapper = make(input_mode="history", generate=True, return_log_probs=return_log_probs)
    expected = ["text", "masks", "tokens"] + (["log_probs"] if return_log_probs else []) + ["history"]
    assert wrapper.out_keys == expected
    out = wrapper(TensorDict(history=ChatHistory(prompt=HISTORY), batch_size=(2,)))
    assert sorted(out.keys()) == sorted(expected)


@pytest.mark.parametrize("null", [True, False], ids=["0d", "batch2"])
def test_unpadded_output_as_list(make, null):
    """TorchRL wrappers: unpadded outputs are read with ``as_list=True``: strings and one tensor per
    row, a response log-prob per response token (test_unpadded_output_with_as_list)."""
    td = TensorDict(history=ChatHistory(prompt=HISTORY), batch_size=(2,))
    out = make(input_mode="history", pad_output=False)(td[0] if null else td)
    text = out.get("text", as_list=True)
    tokens = out.get("tokens", as_list=True).get("response", as_list=True)
    log_probs = out.get("log_probs", as_list=True).get("response", as_list=True)
    if null:
        assert isinstance(text.response, str)
        tokens, log_probs = [tokens], [log_probs]
    else:
        assert isinstance(text.response, list) and len(text.response) == 2
        assert isinstance(tokens, list) and isinstance(log_probs, list)
    assert [t.shape for t in tokens] == [lp.shape for lp in log_probs]
    assert all((lp <= 0).all() for lp in log_probs)


# ---------------------------------------------------------------- num_samples and inplace


@pytest.mark.parametrize("null", [True, False], ids=["0d", "batch2"])
@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("mode", ["history", "text", "tokens"])
def test_num_samples(make, tiny_tokenizer, mode, pad_output, null):
    """TorchRL wrappers: ``num_samples`` adds a trailing batch dim, ``(n,)`` for a 0-d input and
    ``(B, n)`` otherwise, every sample continuing its row's prompt (test_num_samples). TorchRL's
    tokens input there is ``Tokens(prompt=left-padded ids)`` without a mask: rlpost reads such ids
    as they are (a documented deviation), so the prompt keeps its pad ids."""
    wrapper = make(input_mode=mode, generate=True, pad_output=pad_output, num_samples=NUM_SAMPLES)
    assert wrapper.inplace is False
    if mode == "tokens":
        ids, _ = left_padded(tiny_tokenizer)
        td = TensorDict(tokens=Tokens(prompt=ids), batch_size=(2,))
        prompts = ids.tolist()
    else:
        td = make_input(mode, True, tiny_tokenizer, null=False)
        prompts = expected_ids(mode, True, tiny_tokenizer)
    out = wrapper(td[0] if null else td)
    assert out.batch_size == ((NUM_SAMPLES,) if null else (2, NUM_SAMPLES))
    assert set(out.keys()) == set(wrapper.out_keys)  # inplace=False: the outputs only
    flat = out if null else out.reshape(-1)
    assert_torchrl_layout(flat, pad_output)
    expected = [p for p in (prompts[:1] if null else prompts) for _ in range(NUM_SAMPLES)]
    assert [t.tolist() for t in rows(flat, "tokens", "prompt")] == expected


def test_num_samples_without_log_probs(make):
    """TorchRL wrappers: ``num_samples`` with ``return_log_probs=False`` returns no log-probs."""
    wrapper = make(input_mode="history", num_samples=NUM_SAMPLES, return_log_probs=False, pad_output=True)
    out = wrapper(TensorDict(history=ChatHistory(prompt=HISTORY), batch_size=(2,)))
    assert out.batch_size == (2, NUM_SAMPLES) and "log_probs" not in out.keys()
    assert out["history"].full.shape[:2] == (2, NUM_SAMPLES)


@pytest.mark.parametrize("inplace", [True, False, "empty"])
def test_inplace_modes(make, inplace):
    """TorchRL wrappers, ``inplace``: True writes into the input (a 0-d input too) and returns it;
    False returns a new TensorDict of the outputs only; "empty" returns ``input.empty()`` (type
    and batch size kept) holding the outputs."""
    wrapper = make(input_mode="history", inplace=inplace)
    for null in (False, True):
        td = TensorDict(history=ChatHistory(prompt=HISTORY), reward=torch.zeros(2), batch_size=(2,))
        td = td[0] if null else td
        out = wrapper(td)
        assert out.batch_size == td.batch_size
        if inplace is True:
            assert out is td and {"reward", *wrapper.out_keys} == set(td.keys())
        else:
            assert out is not td and set(out.keys()) == set(wrapper.out_keys)
            assert set(td.keys()) == {"history", "reward"}  # the input is left alone
    lazy = LazyStackedTensorDict(*TensorDict(history=ChatHistory(prompt=HISTORY), batch_size=(2,)).unbind(0))
    out = wrapper(lazy)
    assert isinstance(out, LazyStackedTensorDict) == (inplace in (True, "empty"))


# ---------------------------------------------------------------- scoring


@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("mode", ["history", "text", "tokens"])
def test_scoring_lazy_input_with_custom_log_probs_key(hf_model, tiny_tokenizer, mode, pad_output):
    """TorchRL KL transforms' scorers: ``TransformersWrapper(generate=False, log_probs_key=...)``
    on a lazy-stacked ChatHistory / Text / Tokens+Masks input writes ``(log_probs_key, "full")``,
    a ``[2, T]`` tensor when padded and two tensors otherwise, equal to the default scorer's."""
    if mode == "tokens":
        ids, mask = left_padded(tiny_tokenizer)
        td = TensorDict(tokens=Tokens(full=ids), masks=Masks(all_attention_mask=mask), batch_size=(2,))
    else:
        td = make_input(mode, False, tiny_tokenizer, null=False)
    ref = TransformersWrapper(hf_model, tokenizer=tiny_tokenizer, input_mode=mode, generate=False,
                              pad_output=pad_output, log_probs_key="ref_log_probs")  # fmt: skip
    assert ref.out_keys[-2 if mode == "history" else -1] == "ref_log_probs"
    out = ref(td.to_lazystack(0))
    if pad_output:
        full = out.get(("ref_log_probs", "full"))
        assert isinstance(full, torch.Tensor) and full.shape[0] == 2
    else:
        full = out.get(("ref_log_probs", "full"), as_list=True)
        assert isinstance(full, list) and len(full) == 2
    plain = TransformersWrapper(hf_model, tokenizer=tiny_tokenizer, input_mode=mode, generate=False)(td.clone())
    out.rename_key_("ref_log_probs", "log_probs")
    for ours, theirs in zip(rows(out, "log_probs", "full"), rows(plain, "log_probs", "full")):
        assert torch.allclose(ours, theirs, atol=1e-5)


@pytest.mark.parametrize("pad_output", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("mode", ["history", "text", "tokens"])
def test_log_probs_consistency(plain_llm, hf_model, tiny_tokenizer, mode, pad_output):
    """TorchRL wrappers (TestLogProbsComparison): greedy generation with vLLM, then the prompt +
    response scored by vLLM and by transformers give the same log-probs (TorchRL allows 0.1;
    here 1e-3), and in tokens mode they equal the log-probs of the generation itself."""
    ids, mask = left_padded(tiny_tokenizer)
    data, input_key = {
        "history": (TensorDict(history=HISTORY, batch_size=(2,)), "history"),
        "text": (TensorDict(text=TEXTS, batch_size=(2,)), "text"),
        "tokens": (TensorDict(input_ids=ids, attention_mask=mask, batch_size=(2,)), "input_ids"),
    }[mode]
    common = dict(tokenizer=tiny_tokenizer, input_mode=mode, input_key=input_key, pad_output=pad_output)
    vllm_gen = vLLMWrapper(plain_llm, generate=True, generate_kwargs={"max_tokens": 5, "temperature": 0.0}, **common)
    tf_gen = TransformersWrapper(
        hf_model, generate=True, generate_kwargs={"max_new_tokens": 5, "do_sample": False, "temperature": 0.0}, **common
    )
    generated = vllm_gen(data.copy())
    tf_generated = tf_gen(data.copy())
    assert rows(generated, "tokens", "full")[0].tolist() == rows(tf_generated, "tokens", "full")[0].tolist()  # greedy
    if mode == "history":
        chats = [chat + [{"role": "assistant", "content": r}] for chat, r in zip(CHATS, generated["text"].response)]
        new_data = TensorDict(history=History.from_chats(chats), batch_size=(2,))
    elif mode == "text":
        new_data = TensorDict(text=[t + r for t, r in zip(TEXTS, generated["text"].response)], batch_size=(2,))
    else:  # TorchRL concatenates the (padded) prompt ids and the response ids
        fulls = [torch.cat([p, r]) for p, r in zip(ids, rows(generated, "tokens", "response"))]
        width = max(len(f) for f in fulls)
        new_data = TensorDict(input_ids=torch.stack([torch.cat([f.new_full((width - len(f),), 0), f]) for f in fulls]),
                              attention_mask=torch.stack([torch.arange(width) >= width - len(f) for f in fulls]).long(),
                              batch_size=(2,))  # fmt: skip
    scored = [
        cls(model, generate=False, attention_mask_key="attention_mask", **common)(new_data.copy())
        for cls, model in ((vLLMWrapper, plain_llm), (TransformersWrapper, hf_model))
    ]
    vllm_rows, tf_rows = (rows(s, "log_probs", "full") for s in scored)
    assert rows(scored[0], "tokens", "full") and len(vllm_rows) == 2
    for a, b, ta, tb in zip(vllm_rows, tf_rows, rows(scored[0], "tokens", "full"), rows(scored[1], "tokens", "full")):
        assert torch.equal(ta, tb)
        assert a[0] == 0 and (a - b).abs().max().item() <= TOLERANCE
    if mode == "tokens":  # the same ids: the scores of the response are the generation's log-probs
        for lp, sampled in zip(vllm_rows, rows(generated, "log_probs", "response")):
            assert (lp[-len(sampled) :] - sampled).abs().max().item() <= TOLERANCE


def test_vllm_get_dist_is_not_implemented(plain_llm, tiny_tokenizer):
    """TorchRL wrappers (TestDistributionMethods): vLLM returns no logits, so a vLLM scorer's
    ``get_dist`` raises NotImplementedError("vLLM does not return logits")."""
    wrapper = vLLMWrapper(plain_llm, tokenizer=tiny_tokenizer, input_mode="history", generate=False)
    with pytest.raises(NotImplementedError, match="vLLM does not return logits"):
        wrapper.get_dist(TensorDict(history=HISTORY_ASSISTANT, batch_size=(2,)))


# ---------------------------------------------------------------- generation parameters and errors


def test_legacy_and_conflicting_parameter_names(plain_llm, hf_model, tiny_tokenizer):
    """TorchRL wrappers: vLLM's names ``max_tokens`` / ``n`` are read as ``max_new_tokens`` /
    ``num_return_sequences`` and win over them (test_legacy_parameter_names,
    test_parameter_conflict_resolution); vLLM shows them in ``sampling_params``, transformers in
    ``generate_kwargs``. (TorchRL's test_parameter_conflict_errors expects a ValueError for the
    same input instead; rlpost follows the resolution test and warns.)"""
    legacy = {"max_tokens": 10, "n": 1, "temperature": 0.7}
    conflict = {"max_tokens": 20, "max_new_tokens": 10, "n": 2, "num_return_sequences": 1, "temperature": 0.7}
    with pytest.warns(UserWarning, match="re-scored"):  # a plain vllm.LLM returns raw log-probs
        wrapper = vLLMWrapper(plain_llm, tokenizer=tiny_tokenizer, input_mode="text", generate_kwargs=legacy)
    params = wrapper.sampling_params
    assert (params.max_tokens, params.n, params.temperature) == (10, 1, 0.7)
    with pytest.warns(UserWarning, match="max_tokens wins"):
        wrapper = vLLMWrapper(plain_llm, tokenizer=tiny_tokenizer, input_mode="text", generate_kwargs=conflict)
    assert (wrapper.sampling_params.max_tokens, wrapper.sampling_params.n, wrapper.num_samples) == (20, 2, 2)
    tf = TransformersWrapper(hf_model, tokenizer=tiny_tokenizer, input_mode="text", generate_kwargs=legacy)
    assert (tf.generate_kwargs["max_new_tokens"], tf.generate_kwargs["num_return_sequences"]) == (10, 1)
    assert tf.generate_kwargs["temperature"] == 0.7
    with pytest.warns(UserWarning, match="n wins"):
        tf = TransformersWrapper(hf_model, tokenizer=tiny_tokenizer, input_mode="text", generate_kwargs=conflict)
    assert (tf.generate_kwargs["max_new_tokens"], tf.generate_kwargs["num_return_sequences"]) == (20, 2)
    assert tf.num_samples == 2
    with warnings.catch_warnings():  # a twin keeps the resolved values and does not warn again
        warnings.simplefilter("error")
        assert tf.get_new_version(generate=False).generate_params["max_new_tokens"] == 20


def test_standardized_generation_parameters(plain_llm, hf_model, tiny_tokenizer):
    """TorchRL wrappers: the standard generation names reach each backend
    (test_standardized_generation_parameters; vLLM's ``best_of`` check is xfail in TorchRL and
    left out). On a plain ``vllm.LLM`` (raw log-probs) rlpost refuses ``repetition_penalty`` while
    log-probs are asked for, because it cannot re-score them (a documented deviation: log-probs
    are never silently wrong); without log-probs the parameters are passed on."""
    kwargs = {
        "max_new_tokens": 10, "num_return_sequences": 1, "temperature": 0.7, "top_p": 0.9, "top_k": 50,
        "repetition_penalty": 1.1, "do_sample": True, "num_beams": 1, "length_penalty": 1.0, "early_stopping": False,
        "skip_special_tokens": True, "logprobs": True,
    }  # fmt: skip
    with pytest.raises(ValueError, match="repetition_penalty"):
        vLLMWrapper(plain_llm, tokenizer=tiny_tokenizer, input_mode="text", generate_kwargs=kwargs)
    wrapper = vLLMWrapper(plain_llm, tokenizer=tiny_tokenizer, input_mode="text", generate_kwargs=kwargs,
                          return_log_probs=False)  # fmt: skip
    params = wrapper.sampling_params
    assert (params.max_tokens, params.n, params.temperature, params.top_p, params.top_k) == (10, 1, 0.7, 0.9, 50)
    assert params.repetition_penalty == 1.1
    out = wrapper(TensorDict(text=Text(prompt=TEXTS), batch_size=(2,)))
    assert all(len(r) <= 10 for r in rows(out, "tokens", "response"))
    tf = TransformersWrapper(hf_model, tokenizer=tiny_tokenizer, input_mode="text", generate_kwargs=kwargs)
    for key in ("max_new_tokens", "num_return_sequences", "temperature", "top_p", "top_k", "repetition_penalty"):
        assert tf.generate_kwargs[key] == kwargs[key], key
    assert tf.generate_kwargs["do_sample"] is True
    out = tf(TensorDict(text=Text(prompt=TEXTS), batch_size=(2,)))
    assert all(1 <= len(r) <= 10 for r in rows(out, "tokens", "response"))


def test_parameter_validation_messages(make):
    """TorchRL wrappers: invalid sampling values are ValueErrors with TorchRL's messages
    (test_parameter_validation)."""
    cases = [
        ({"temperature": -0.1}, "Temperature must be non-negative"),
        ({"top_p": 1.5}, "top_p must be between 0 and 1"),
        ({"top_k": 0}, "top_k must be positive"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be positive"),
        ({"do_sample": False, "temperature": 0.7}, "When do_sample=False.*temperature must be 0"),
    ]
    for generate_kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            make(input_mode="text", generate=True, generate_kwargs=generate_kwargs)


def test_error_messages(make):
    """TorchRL wrappers: an invalid ``input_mode``, a missing input key and ``generate=False``
    without log-probs raise TorchRL's ValueErrors (test_invalid_input_mode,
    test_missing_input_key, test_generate_false_without_log_probs)."""
    with pytest.raises(ValueError, match="input_mode must be one of"):
        make(input_mode="invalid_mode")
    wrapper = make(input_mode="history", input_key="history")
    with pytest.raises(ValueError, match="Expected 'history' key"):
        wrapper(TensorDict(batch_size=(2,)))
    with pytest.raises(ValueError, match="return_log_probs must be True"):
        make(generate=False, return_log_probs=False)


def test_chat_history_of_a_string_is_a_type_error(make):
    """TorchRL wrappers: ``ChatHistory(prompt="not a history object")`` is a TypeError
    ("Expected History object") when the wrapper reads it (test_invalid_history_type)."""
    wrapper = make(input_mode="history")
    with pytest.raises(TypeError, match="Expected History object"):
        wrapper(TensorDict(history=ChatHistory(prompt="not a history object"), batch_size=(2,)))


def test_get_new_version_returns_a_twin(make):
    """TorchRL wrappers: ``get_new_version()`` is a new wrapper of the same class and settings on
    the same model; ``generate=False`` gives the scorer with the full-sequence input key."""
    wrapper = make(input_mode="text", pad_output=True)
    twin = wrapper.get_new_version()
    assert twin is not wrapper and type(twin) is type(wrapper)
    assert (twin.input_mode, twin.pad_output, twin.in_keys, twin.generate_kwargs) == (
        "text", True, [("text", "prompt")], {"max_new_tokens": MAX_NEW_TOKENS},
    )  # fmt: skip
    scorer = wrapper.get_new_version(generate=False)
    assert scorer.generate is False and scorer.in_keys == [("text", "full")] and scorer.pad_output is True
