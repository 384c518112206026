"""TorchRL's tests of the wrapper options (``batching``, ``min_batch_size``, ``max_batch_size``,
``batching_timeout``, ``pad_model_input``, ``prefer_tokens``), the tokenizer fallback,
``LLMMaskedCategorical``, ``RemoteTransformersWrapper`` and the TRL adapters
(``HFRewardModelWrapper``, ``TorchRLBufferDataset``), run on rlpost with the offline tiny model.

TorchRL's tests mostly check that a call ran; these also check its values: a batched call gives
what the same rows give unbatched, and the model ran once per batch; packed scores equal padded
ones; a prompt's given ids are the ones generated from; rewards equal the reward model's own
output. TorchRL's Ray tests (skipped in its CI) run here on a one-CPU local cluster, each call
bounded.
"""

from __future__ import annotations

import copy
import gc
import time
import warnings
from concurrent.futures import CancelledError, ThreadPoolExecutor, wait
from itertools import islice

import pytest
import torch
from tensordict import TensorDict

from rlpost.data import History, ListStorage, ReplayBuffer
from rlpost.policies import (
    ChatHistory,
    HFRewardModelWrapper,
    LLMMaskedCategorical,
    Masks,
    RemoteTransformersWrapper,
    Text,
    Tokens,
    TorchRLBufferDataset,
    TransformersWrapper,
    vLLMWrapper,
)

pytestmark = pytest.mark.compat

GREEDY = {"max_new_tokens": 6, "temperature": 0.0}
TEXTS = ["Are you happy? Say yes or no.", "Explain the difference between a cat and a dog. Be very detailed."]
CHATS = [
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": text}] for text in TEXTS
]
ANSWERS = ["Yes.", "A cat meows, a dog barks."]


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def text_td(prompts) -> TensorDict:
    return TensorDict(text=Text(prompt=list(prompts)), batch_size=(len(prompts),))


def count_model_calls(wrapper) -> list[int]:
    """The number of prompts of each call the wrapper makes to its backend."""
    sizes: list[int] = []
    generate = wrapper._generate_ids

    def counted(prompt_ids, num_samples):
        sizes.append(len(prompt_ids))
        return generate(prompt_ids, num_samples)

    wrapper._generate_ids = counted
    return sizes


def transformers(hf_model, tiny_tokenizer, **kwargs):
    kwargs.setdefault("generate_kwargs", GREEDY)
    return TransformersWrapper(hf_model, tokenizer=tiny_tokenizer, input_mode="text", generate=True, **kwargs)


def vllm(plain_llm, tiny_tokenizer, **kwargs):
    kwargs.setdefault("generate_kwargs", GREEDY)
    return vLLMWrapper(plain_llm, tokenizer=tiny_tokenizer, input_mode="text", generate=True, **kwargs)


def responses(out) -> list[str]:
    return list(out["text"].response)


# ----------------------------------------------------------------------------- batching


def check_batching(wrapper, unbatched):
    """TestBatching.test_batching: two threads send two rows each, with min_batch_size=4: one
    model call of 4 rows, and each thread gets its rows' completions (those of an unbatched call)."""
    sizes = count_model_calls(wrapper)
    inputs = [text_td([f"Question {i}?", f"Question {i + 2}?"]) for i in range(2)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(wrapper, td) for td in inputs]
        done, not_done = wait(futures, timeout=120)
    assert not not_done
    assert sizes == [4]
    for td, future in zip(inputs, futures):
        out = future.result()
        assert out.batch_size == (2,)
        assert list(out["text"].prompt) == list(td["text"].prompt)
        assert responses(out) == responses(unbatched(text_td(td["text"].prompt)))
        assert all(lp.shape == t.shape for lp, t in zip(
            out.get(("log_probs", "response"), as_list=True), out.get(("tokens", "response"), as_list=True)
        ))  # fmt: skip


def test_batching_transformers(hf_model, tiny_tokenizer):
    check_batching(transformers(hf_model, tiny_tokenizer, min_batch_size=4), transformers(hf_model, tiny_tokenizer))


def test_batching_vllm(plain_llm, tiny_tokenizer):
    check_batching(vllm(plain_llm, tiny_tokenizer, min_batch_size=4), vllm(plain_llm, tiny_tokenizer))


def check_batching_uneven(wrapper):
    """TestBatching.test_batching_uneven: callers of 1, 3 and 2 rows with min_batch_size=5: the
    first two wait for the third, then all 6 rows run together."""
    sizes = count_model_calls(wrapper)
    inputs = [text_td(["Question 1?"]), text_td(["Question 2?", "Question 3?", "Question 4?"]),
              text_td(["Question 5?", "Question 6?"])]  # fmt: skip
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = []
        for td in inputs:
            futures.append(pool.submit(wrapper, td))
            time.sleep(0.05)
        _, not_done = wait(futures, timeout=60)
        assert not not_done
    for td, future in zip(inputs, futures):
        assert list(future.result()["text"].prompt) == list(td["text"].prompt)
    assert sizes == [6]
    wrapper.cleanup_batching()


def test_batching_uneven_transformers(hf_model, tiny_tokenizer):
    check_batching_uneven(transformers(hf_model, tiny_tokenizer, min_batch_size=5, batching_timeout=5))


def test_batching_uneven_vllm(plain_llm, tiny_tokenizer):
    check_batching_uneven(vllm(plain_llm, tiny_tokenizer, min_batch_size=5, batching_timeout=5))


def test_batching_timeout_runs_a_short_batch(hf_model, tiny_tokenizer):
    """A caller whose rows never make ``min_batch_size`` runs them after ``batching_timeout``."""
    wrapper = transformers(hf_model, tiny_tokenizer, min_batch_size=8, batching_timeout=0.5)
    sizes = count_model_calls(wrapper)
    start = time.monotonic()
    out = wrapper(text_td(TEXTS))
    assert time.monotonic() - start >= 0.5
    assert sizes == [2] and list(out["text"].prompt) == TEXTS


def test_batching_max_batch_size_splits_a_call(hf_model, tiny_tokenizer):
    wrapper = transformers(hf_model, tiny_tokenizer, max_batch_size=2)
    assert (wrapper._min_batch_size, wrapper._max_batch_size) == (1, 2)
    sizes = count_model_calls(wrapper)
    prompts = [f"Question {i}?" for i in range(5)]
    out = wrapper(text_td(prompts))
    assert sizes == [2, 2, 1]
    assert list(out["text"].prompt) == prompts


def test_batching_error_reaches_every_caller(hf_model, tiny_tokenizer):
    """An exception in the batched model call is raised in each thread whose rows were in it."""
    wrapper = transformers(hf_model, tiny_tokenizer, min_batch_size=2, batching_timeout=30)

    def fail(prompt_ids, num_samples):
        raise RuntimeError(f"model failed on {len(prompt_ids)} prompts")

    wrapper._generate_ids = fail
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(wrapper, text_td([text])) for text in TEXTS]
        _, not_done = wait(futures, timeout=30)
    assert not not_done
    for future in futures:
        with pytest.raises(RuntimeError, match="model failed on 2 prompts"):
            future.result()


def test_batching_num_samples(hf_model, tiny_tokenizer):
    wrapper = transformers(hf_model, tiny_tokenizer, batching=True, num_samples=2,
                           generate_kwargs={"max_new_tokens": 3})  # fmt: skip
    out = wrapper(text_td(TEXTS))
    assert out.batch_size == (2, 2)
    assert [list(row) for row in out["text"].prompt] == [[t, t] for t in TEXTS]


def test_batching_cleanup(hf_model, tiny_tokenizer):
    """TestBatching.test_batching_cleanup: the state before and after cleanup; a caller left
    waiting gets a CancelledError (TorchRL's test races its pool; this one waits for the row)."""
    wrapper = transformers(hf_model, tiny_tokenizer, min_batch_size=3)
    state = wrapper.get_batching_state()
    assert state["batching_enabled"] is True
    assert (state["min_batch_size"], state["queue_size"], state["pending_futures"]) == (3, 0, 0)
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(wrapper, text_td(["Test 1"]))
        deadline = time.monotonic() + 10
        while wrapper.get_batching_state()["queue_size"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        wrapper.cleanup_batching()
        with pytest.raises(CancelledError):
            future.result(timeout=5)
    state = wrapper.get_batching_state()
    assert (state["queue_size"], state["pending_futures"], state["lock_state"]) == (0, 0, "unlocked")
    assert TransformersWrapper(hf_model, tokenizer=tiny_tokenizer).get_batching_state() == {"batching_enabled": False}


@pytest.mark.parametrize("backend", ["transformers", "vllm"])
def test_batching_configuration_validation(backend, hf_model, tiny_tokenizer, request):
    if backend == "vllm":
        model = request.getfixturevalue("plain_llm")
        wrapper_class = vLLMWrapper
    else:
        model, wrapper_class = hf_model, TransformersWrapper

    def make(**kwargs):
        return wrapper_class(model, tokenizer=tiny_tokenizer, input_mode="text", generate=True, **kwargs)

    for sizes, expected in [((2, 5), (2, 5)), ((3, 3), (3, 3)), ((5, None), (5, None)), ((None, 2), (1, 2))]:
        wrapper = make(batching=True, min_batch_size=sizes[0], max_batch_size=sizes[1])
        assert (wrapper._min_batch_size, wrapper._max_batch_size) == expected
        assert wrapper.batching is True
    with pytest.raises(ValueError, match=r"min_batch_size \(5\) must be <= max_batch_size \(2\)"):
        make(batching=True, min_batch_size=5, max_batch_size=2)
    with pytest.raises(ValueError, match="must be None if batching is False"):
        make(batching=False, min_batch_size=2)
    assert make().batching is False


@pytest.mark.parametrize("backend", ["transformers", "vllm"])
def test_batching_null_dimension(backend, hf_model, tiny_tokenizer, request):
    """TestBatching.test_batching_null_dimension: a 0-d input gives a 0-d output, batched or not,
    and the same completion either way (greedy)."""
    if backend == "vllm":
        plain_llm = request.getfixturevalue("plain_llm")
        make = lambda **kw: vllm(plain_llm, tiny_tokenizer, **kw)  # noqa: E731
    else:
        make = lambda **kw: transformers(hf_model, tiny_tokenizer, **kw)  # noqa: E731
    single = TensorDict(text=Text(prompt="Single question without batch dimension?"), batch_size=())
    plain = make()(single.clone())
    batched = make(min_batch_size=1)(single.clone())
    for out in (plain, batched):
        assert out.batch_size == ()
        assert {"text", "tokens", "masks", "log_probs"} <= set(out.keys())
        assert isinstance(out["text"].prompt, str)
    assert batched["text"].response == plain["text"].response
    torch.testing.assert_close(batched["log_probs"].response, plain["log_probs"].response, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="batch_dims > 1"):
        make(batching=True)(text_td(TEXTS).unsqueeze(-1))


# ----------------------------------------------------------------------------- pad_model_input


def packing_pair(hf_model, tiny_tokenizer, mode, pad_output):
    make = lambda pad: TransformersWrapper(  # noqa: E731
        hf_model, tokenizer=tiny_tokenizer, input_mode=mode, generate=False, return_log_probs=True,
        pad_output=pad_output, pad_model_input=pad,
    )  # fmt: skip
    packed, padded = make(False), make(True)
    assert packed.packs_sequences and packed.pad_model_input is False
    assert not padded.packs_sequences and padded.pad_model_input is True
    return packed, padded


def full_log_probs(out) -> list[torch.Tensor]:
    """The rows of ``log_probs.full`` (padded rows when the output is padded)."""
    log_probs = out["log_probs"]
    if isinstance(log_probs.full, torch.Tensor) and not getattr(log_probs.full, "is_nested", False):
        return list(log_probs.full.unbind(0))
    return out.get(("log_probs", "full"), as_list=True)


def assert_same_log_probs(a, b):
    rows_a, rows_b = full_log_probs(a), full_log_probs(b)
    assert len(rows_a) == len(rows_b) == 2
    for x, y in zip(rows_a, rows_b):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pad_output", [False, True])
def test_packing_history(hf_model, tiny_tokenizer, pad_output):
    packed, padded = packing_pair(hf_model, tiny_tokenizer, "history", pad_output)
    full = History.from_chats([c + [{"role": "assistant", "content": a}] for c, a in zip(CHATS, ANSWERS)])
    td = TensorDict({"history": ChatHistory(full=full)}, batch_size=(2,)).to_lazystack(0)
    assert_same_log_probs(packed(td.clone()), padded(td.clone()))


@pytest.mark.parametrize("pad_output", [False, True])
def test_packing_text(hf_model, tiny_tokenizer, pad_output):
    packed, padded = packing_pair(hf_model, tiny_tokenizer, "text", pad_output)
    td = TensorDict({"text": Text(full=TEXTS)}, batch_size=(2,))
    assert_same_log_probs(packed(td.clone()), padded(td.clone()))


@pytest.mark.parametrize("pad_output", [False, True])
def test_packing_tokens(hf_model, tiny_tokenizer, pad_output):
    packed, padded = packing_pair(hf_model, tiny_tokenizer, "tokens", pad_output)
    ids = [torch.tensor(tiny_tokenizer(t)["input_ids"]) for t in TEXTS]
    td = TensorDict(
        {
            "tokens": Tokens(full=torch.nested.as_nested_tensor(ids, layout=torch.jagged)),
            "masks": Masks(all_attention_mask=torch.nested.as_nested_tensor([torch.ones_like(i) for i in ids],
                                                                            layout=torch.jagged)),
        },
        batch_size=(2,),
    ).to_lazystack(0)  # fmt: skip
    out_packed, out_padded = packed(td.clone()), padded(td.clone())
    assert_same_log_probs(out_packed, out_padded)
    if not pad_output:
        assert [len(x) for x in full_log_probs(out_packed)] == [len(i) for i in ids]


def test_pad_model_input_is_for_scoring_only(hf_model, tiny_tokenizer, plain_llm):
    with pytest.raises(ValueError, match="pad_model_input is not supported when generate=True"):
        TransformersWrapper(hf_model, tokenizer=tiny_tokenizer, generate=True, pad_model_input=True)
    with pytest.raises(ValueError, match="pad_model_input is not supported by vLLMWrapper"):
        vLLMWrapper(plain_llm, tokenizer=tiny_tokenizer, generate=False, pad_model_input=True)
    scorer = TransformersWrapper(hf_model, tokenizer=tiny_tokenizer, generate=False, pad_model_input=True)
    assert scorer.get_new_version(generate=True).pad_model_input is True  # generation pads
    assert scorer.get_new_version(generate=True).generate is True


# ----------------------------------------------------------------------------- prefer_tokens


def history_prompt_td(tiny_tokenizer, given_ids=None) -> TensorDict:
    td = TensorDict({"history": ChatHistory(prompt=History.from_chats(CHATS[:1]))}, batch_size=(1,))
    if given_ids is not None:
        td = td.to_lazystack(0)
        td.set(("tokens", "prompt"), [torch.tensor(given_ids)])
    return td


def test_prefer_tokens(hf_model, tiny_tokenizer):
    """TestPreferTokens: with prefer_tokens=True the ids at tokens.prompt are what the model
    generates from (here ids of a different prompt, so it shows); with False the history is
    rendered again, as without tokens."""
    make = lambda prefer: TransformersWrapper(  # noqa: E731
        hf_model, tokenizer=tiny_tokenizer, input_mode="history", generate=True, generate_kwargs=GREEDY,
        prefer_tokens=prefer,
    )  # fmt: skip
    assert make(True).prefer_tokens is True and make(False).prefer_tokens is False
    rendered = History.from_chats(CHATS[:1]).apply_chat_template(tiny_tokenizer, add_generation_prompt=True)[0]
    rendered_ids = tiny_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    other = History.from_chats(CHATS[1:]).apply_chat_template(tiny_tokenizer, add_generation_prompt=True)[0]
    other_ids = tiny_tokenizer(other, add_special_tokens=False)["input_ids"]

    out = make(True)(history_prompt_td(tiny_tokenizer, other_ids))
    assert out.get(("tokens", "prompt"), as_list=True)[0].tolist() == other_ids
    assert out["text"].prompt[0] == tiny_tokenizer.decode(other_ids)
    from_other = make(False)(TensorDict({"history": ChatHistory(prompt=History.from_chats(CHATS[1:]))},
                                        batch_size=(1,)))  # fmt: skip
    assert out["text"].response[0] == from_other["text"].response[0]

    ignored = make(False)(history_prompt_td(tiny_tokenizer, other_ids))
    assert ignored.get(("tokens", "prompt"), as_list=True)[0].tolist() == rendered_ids
    no_tokens = make(True)(history_prompt_td(tiny_tokenizer))  # nothing given: rendered
    assert no_tokens.get(("tokens", "prompt"), as_list=True)[0].tolist() == rendered_ids


def test_prefer_tokens_with_incremental_tokenizer(hf_model, tiny_tokenizer):
    """TestPreferTokens.test_transformers_wrapper_prefer_tokens_with_chatenv, with rlpost's
    ChatEnv + IncrementalTokenizer (TorchRL's ChatEnv(with_tokenizer=True)): the policy reads the
    env's ids, and its completion extends exactly those."""
    from rlpost.envs import ChatEnv, IncrementalTokenizer

    wrapper = TransformersWrapper(hf_model, tokenizer=tiny_tokenizer, input_mode="history", generate=True,
                                  generate_kwargs=GREEDY, prefer_tokens=True)  # fmt: skip
    env = ChatEnv(tokenizer=tiny_tokenizer, batch_size=(1,)).append_transform(IncrementalTokenizer(tiny_tokenizer))
    reset = env.reset(TensorDict({"query": "Hello, world!"}, batch_size=(1,)))
    given = reset.get(("tokens", "prompt"), as_list=True)[0].tolist()
    out = wrapper(reset)
    assert ("text", "response") in out.keys(True, True)
    full = out.get(("tokens", "full"), as_list=True)[0].tolist()
    assert full[: len(given)] == given and len(full) > len(given)


def test_get_new_version_preserves_prefer_tokens(hf_model, tiny_tokenizer):
    wrapper = TransformersWrapper(hf_model, tokenizer=tiny_tokenizer, input_mode="history", prefer_tokens=False)
    assert wrapper.get_new_version(generate=False).prefer_tokens is False
    assert wrapper.get_new_version(prefer_tokens=True).prefer_tokens is True


# ----------------------------------------------------------------------------- tokenizer fallback


def test_tokenizer_from_the_models_name_or_path(hf_model, tiny_tokenizer, tiny_model_path, tmp_path):
    """As TorchRL: a model given without a tokenizer gets the one saved where it was loaded from."""
    for model in (hf_model, str(tiny_model_path)):
        wrapper = TransformersWrapper(model, input_mode="text", generate=True, generate_kwargs=GREEDY)
        assert wrapper.tokenizer.get_vocab() == tiny_tokenizer.get_vocab()
        assert (
            wrapper(text_td(TEXTS[:1]))["text"].response[0]
            == transformers(hf_model, tiny_tokenizer)(text_td(TEXTS[:1]))["text"].response[0]
        )
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(hf_model.config)  # the session's model keeps its own
    config._name_or_path = ""
    unsaved = AutoModelForCausalLM.from_config(config)
    unsaved.name_or_path = ""
    with pytest.raises(ValueError, match="neither a name_or_path"):
        TransformersWrapper(unsaved)
    unsaved.name_or_path = str(tmp_path)  # a folder with no tokenizer in it
    with pytest.raises(ValueError, match="none could be loaded from the model's name_or_path"):
        TransformersWrapper(unsaved)


# ----------------------------------------------------------------------------- LLMMaskedCategorical


def test_masked_categorical_position_level():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    mask = torch.tensor([[False, True, True], [True, True, False]])
    dist = LLMMaskedCategorical(logits=logits, mask=mask, ignore_index=-100)
    assert dist.position_level_masking and dist.ignore_index == -100
    assert torch.equal(dist.logits, logits) and torch.equal(dist.mask, mask)
    assert dist.batch_shape == (2, 3) and dist.event_shape == (5,)
    assert dist._masked_logits is None  # made on first use
    lowest = torch.finfo(logits.dtype).min
    assert (dist.masked_logits[~mask] == lowest).all() and torch.equal(dist.masked_logits[mask], logits[mask])
    tokens = torch.tensor([[1, 2, 3], [4, -100, 0]])
    expected = torch.log_softmax(logits, -1).gather(-1, tokens.clamp(min=0)[..., None]).squeeze(-1)
    expected = torch.where(mask & (tokens != -100), expected, 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecated reduce= alias (TorchRL's non-regression test)
        torch.testing.assert_close(dist.log_prob(tokens), expected)
    assert dist.sample().shape == (2, 3) and dist.sample((4,)).shape == (4, 2, 3)
    torch.testing.assert_close(dist.mode[mask], logits.argmax(-1)[mask])
    entropy = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(dist.entropy()[mask], entropy[mask])
    torch.testing.assert_close(dist.probs, torch.softmax(logits, -1))
    dist.clear_cache()
    assert dist._masked_logits is None and dist._masked_dist is None


def test_masked_categorical_token_level():
    torch.manual_seed(0)
    logits = torch.randn(3, 4)  # [T, V], no batch dims
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[0, :2] = False
    dist = LLMMaskedCategorical(logits=logits, mask=mask)
    assert not dist.position_level_masking
    samples = torch.stack([dist.sample() for _ in range(200)])
    assert not (samples[:, 0] < 2).any()  # masked tokens are never sampled
    scores = dist.log_prob(torch.tensor([0, 1, 2]))
    assert scores[0] < -1e30  # a masked token: about finfo.min, as TorchRL's
    renormalised = torch.log_softmax(logits[0].masked_fill(~mask[0], float("-inf")), -1)
    torch.testing.assert_close(dist.log_prob(torch.tensor([3, 1, 2]))[0], renormalised[3])
    torch.testing.assert_close(scores[1:], torch.log_softmax(logits[1:], -1)[[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="Mask shape"):
        LLMMaskedCategorical(logits=torch.randn(3, 4, 5), mask=torch.ones(3, 4, dtype=torch.bool)[:, :3])


def test_masked_categorical_gradients_reach_the_logits():
    logits = torch.randn(1, 4, 6, requires_grad=True)
    mask = torch.tensor([[True, True, False, True]])
    with torch.enable_grad():
        LLMMaskedCategorical(logits=logits, mask=mask).log_prob(torch.tensor([[1, 2, 3, 4]])).sum().backward()
    assert logits.grad[0, 2].abs().sum() == 0 and logits.grad[0, 0].abs().sum() > 0


# ----------------------------------------------------------------------------- RemoteTransformersWrapper


@pytest.fixture(scope="module")
def local_ray():
    """A one-CPU local Ray cluster (stopped after this module when this fixture started it)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, namespace="rlpost-compat")
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.long
def test_remote_transformers_wrapper(local_ray, tiny_model_path, hf_model, tiny_tokenizer):
    """TestRayWrapper.test_ray_wrapper and TestActorSharing.test_actor_sharing: concurrent 0-d
    calls of a batching wrapper in an actor give 0-d results equal to a local wrapper's; a twin
    scores in the same actor; a second wrapper of the same actor name shares the actor."""
    with pytest.raises(ValueError, match="must be a string"):
        RemoteTransformersWrapper(hf_model)
    remote = RemoteTransformersWrapper(
        model=str(tiny_model_path), generate=True, input_mode="text", batching=True, generate_kwargs=GREEDY,
        num_cpus=1, actor_name="rlpost_compat_remote_transformers", timeout_s=240,
    )  # fmt: skip
    try:
        assert remote.generate is True and remote.batching is True and remote.num_samples is None
        assert remote.in_keys == [("text", "prompt")]
        local = transformers(hf_model, tiny_tokenizer)
        data = TensorDict(text=Text(prompt=TEXTS[0]), batch_size=())
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = [f.result(timeout=240) for f in [pool.submit(remote, data) for _ in range(4)]]
        expected = local(data.clone())["text"].response
        assert all(r.batch_size == () and r["text"].response == expected for r in results)
        assert remote.get_batching_state()["queue_size"] == 0

        scorer = remote.get_new_version(generate=False)
        assert scorer.generate is False and remote.generate is True
        full = TensorDict(text=Text(full=TEXTS), batch_size=(2,))
        local_scores = local.get_new_version(generate=False)(full.clone()).get(("log_probs", "full"), as_list=True)
        remote_scores = scorer(full.clone()).get(("log_probs", "full"), as_list=True)
        for a, b in zip(remote_scores, local_scores):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

        shared = RemoteTransformersWrapper(model=str(tiny_model_path), actor_name="rlpost_compat_remote_transformers")
        assert shared._remote_wrapper == remote._remote_wrapper
        assert shared(data)["text"].response == expected
        with pytest.raises(AttributeError):
            remote.not_an_attribute  # noqa: B018
    finally:
        remote.shutdown()
        gc.collect()


# ----------------------------------------------------------------------------- TRL adapters


def make_rb(n: int = 10, seq_len: int = 8) -> ReplayBuffer:
    rb = ReplayBuffer(storage=ListStorage(max_size=100))
    for i in range(n):
        rb.add(TensorDict({
            "prompt": f"Question {i}", "input_ids": torch.randint(0, 100, (seq_len,)),
            "attention_mask": torch.ones(seq_len, dtype=torch.long), "reward": torch.tensor(float(i)),
        }, batch_size=[]))  # fmt: skip
    return rb


def make_nested_rb(n: int = 10, seq_len: int = 8) -> ReplayBuffer:
    rb = ReplayBuffer(storage=ListStorage(max_size=100))
    for _ in range(n):
        rb.add(TensorDict({
            "tokens": TensorDict({"full": torch.randint(0, 100, (seq_len,))}, batch_size=[]),
            "masks": TensorDict({"all_attention_mask": torch.ones(seq_len, dtype=torch.long)}, batch_size=[]),
        }, batch_size=[]))  # fmt: skip
    return rb


def test_buffer_dataset_yields_flat_dicts():
    samples = list(TorchRLBufferDataset(make_rb(), batch_size=4))
    assert len(samples) == 4
    for sample in samples:
        assert set(sample) == {"prompt", "input_ids", "attention_mask", "reward"}
        assert isinstance(sample["prompt"], str) and sample["prompt"].startswith("Question ")
        assert sample["input_ids"].shape == (8,)
        assert sample["reward"].item() == float(sample["prompt"].split()[-1])  # one item's values together
    assert all(set(s) == {"input_ids"} for s in TorchRLBufferDataset(make_rb(), batch_size=4, keys=["input_ids"]))
    for sample in TorchRLBufferDataset(make_rb(), batch_size=4, device="cpu"):
        assert all(v.device == torch.device("cpu") for v in sample.values() if isinstance(v, torch.Tensor))


def test_buffer_dataset_nested_keys():
    keys = [("tokens", "full"), ("masks", "all_attention_mask")]
    for sample in TorchRLBufferDataset(make_nested_rb(), batch_size=4, keys=keys):
        assert set(sample) == {"tokens.full", "masks.all_attention_mask"}
        assert isinstance(sample["tokens.full"], torch.Tensor)
    sample = next(iter(TorchRLBufferDataset(make_nested_rb(), batch_size=4)))
    assert set(sample) == {"tokens.full", "masks.all_attention_mask"}
    assert not any(isinstance(v, TensorDict) for v in sample.values())


def test_buffer_dataset_num_batches_and_errors():
    assert len(list(TorchRLBufferDataset(make_rb(), batch_size=3, num_batches=2))) == 6
    assert len(list(islice(TorchRLBufferDataset(make_rb(), batch_size=3, num_batches=None), 7))) == 7
    assert "TorchRLBufferDataset" in repr(TorchRLBufferDataset(make_rb(), batch_size=4))
    with pytest.raises(TypeError, match="ReplayBuffer"):
        TorchRLBufferDataset("not_a_buffer", batch_size=4)
    with pytest.raises(ValueError, match="positive integer"):
        TorchRLBufferDataset(make_rb(), batch_size=0)
    with pytest.raises(ValueError, match="num_batches"):
        TorchRLBufferDataset(make_rb(), batch_size=4, num_batches=0)


def test_buffer_dataset_hf_bridge():
    datasets = pytest.importorskip("datasets")
    dataset = TorchRLBufferDataset(make_rb(), batch_size=2, keys=["prompt"], num_batches=1).as_hf_dataset()
    assert isinstance(dataset, datasets.IterableDataset)
    assert isinstance(next(iter(dataset))["prompt"], str)


class FixedRewardModel(torch.nn.Module):
    """A stand-in reward model: logits ``[B, *shape]`` of the row sums; records its calls."""

    def __init__(self, shape=(1,), with_mask=True):
        super().__init__()
        self.shape, self.calls, self.with_mask = shape, [], with_mask

    def forward(self, input_ids, attention_mask=None):
        self.calls.append((torch.is_grad_enabled(), attention_mask is not None))
        sums = input_ids.float().sum(-1)

        class Out:
            logits = sums.reshape(-1, *([1] * len(self.shape))).expand(-1, *self.shape).clone()

        return Out()


def test_hf_reward_model_wrapper_with_stand_in_models():
    model = FixedRewardModel()
    wrapper = HFRewardModelWrapper(model)
    assert wrapper.in_keys == [("tokens", "full"), ("masks", "all_attention_mask")] and wrapper.out_keys == ["reward"]
    ids = torch.randint(0, 1000, (2, 16))
    td = TensorDict({"tokens": {"full": ids}, "masks": {"all_attention_mask": torch.ones(2, 16, dtype=torch.long)}},
                    batch_size=[2])  # fmt: skip
    out = wrapper(td)
    assert out is td and out["reward"].dtype == torch.float32
    torch.testing.assert_close(out["reward"], ids.float().sum(-1))
    scalar = HFRewardModelWrapper(FixedRewardModel(shape=()), attention_mask_key=None, reward_key=("reward", "value"))
    assert scalar.out_keys == [("reward", "value")]
    out = scalar(TensorDict({"tokens": {"full": ids[:, :4]}}, batch_size=[2]))
    torch.testing.assert_close(out.get(("reward", "value")), ids[:, :4].float().sum(-1))
    vector = HFRewardModelWrapper(FixedRewardModel(shape=(2,)), token_key="input_ids", attention_mask_key=None)
    with pytest.raises(RuntimeError, match="one scalar reward per input"):
        vector(TensorDict({"input_ids": ids}, batch_size=[2]))


def test_hf_reward_model_wrapper_keys_grad_and_errors():
    model = FixedRewardModel()
    masked = HFRewardModelWrapper(model, token_key="input_ids", attention_mask_key="attention_mask")
    with pytest.raises(KeyError, match="attention_mask"):
        masked(TensorDict({"input_ids": torch.ones(2, 8, dtype=torch.long)}, batch_size=[2]))
    with pytest.raises(KeyError, match="input_ids"):
        masked(TensorDict({"something_else": torch.zeros(2, 8)}, batch_size=[2]))
    td = TensorDict({"input_ids": torch.ones(2, 8, dtype=torch.long)}, batch_size=[2])
    with torch.enable_grad():
        HFRewardModelWrapper(model, token_key="input_ids", attention_mask_key=None)(td.clone())
        reward = HFRewardModelWrapper(model, token_key="input_ids", attention_mask_key=None,
                                      inference_mode=True)(td.clone())["reward"]  # fmt: skip
        param = torch.nn.Parameter(torch.ones(2))
        (param * reward).sum().backward()  # a no-grad reward is an ordinary tensor downstream
    assert model.calls[-2:] == [(True, False), (False, False)]
    assert torch.equal(param.grad, torch.full((2,), 8.0))

    class BadModel(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return "this is not a valid reward output"

    with pytest.raises(RuntimeError, match="could not extract reward"):
        HFRewardModelWrapper(BadModel(), token_key="input_ids", attention_mask_key=None)(td)


def test_hf_reward_model_wrapper_on_a_sequence_classifier(hf_model, tiny_tokenizer):
    """A real (tiny, offline) sequence-classification model scores what a TransformersWrapper
    generated: the wrapper's rewards are the model's own logits for those ids and mask."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    config = copy.deepcopy(hf_model.config)
    config.num_labels = 1
    reward_model = AutoModelForSequenceClassification.from_config(config).eval()
    policy = TransformersWrapper(hf_model, tokenizer=tiny_tokenizer, input_mode="text", generate=True,
                                 generate_kwargs=GREEDY, pad_output=True)  # fmt: skip
    rollout = policy(text_td(TEXTS))
    wrapper = HFRewardModelWrapper(reward_model, inference_mode=True)
    rewards = wrapper(rollout)["reward"]
    ids, mask = rollout["tokens", "full"], rollout["masks", "all_attention_mask"]
    expected = reward_model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    assert rewards.shape == (2,)
    torch.testing.assert_close(rewards, expected)
