"""TorchRL's LLM wrappers tutorial ("LLM Wrappers in TorchRL", examples 1-7) and the wrappers'
documented behaviour, run on rlpost with the tiny model.

Each example makes the tutorial's calls with the tutorial's arguments; where the tutorial prints,
the test asserts the printed value (and, where the tutorial only shows that something is there,
that it is right: log-probs are checked against a transformers forward pass).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rlpost.data import History
from rlpost.policies import CategoricalSequential, TransformersWrapper, processed_logprobs, vLLMWrapper

pytestmark = pytest.mark.compat

TOLERANCE = 1e-3  # fp32 engine vs fp32 transformers

CHATS = [
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of Canada?"},
    ],
]
OUT_KEYS_HISTORY = ["text", "masks", "tokens", "log_probs", "history"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def history():
    return History.from_chats(CHATS)


@pytest.fixture
def vllm_wrapper(plain_llm, tokenizer):
    return vLLMWrapper(
        plain_llm,
        tokenizer=tokenizer,
        input_mode="history",
        generate=True,
        return_log_probs=True,
        return_text=True,
        return_tokens=True,
        return_masks=True,
        pad_output=False,  # Use False to avoid stacking issues
    )


def full_rows(result, key) -> list[torch.Tensor]:
    return list(result.get(key)) if any(_flags(result[key[0]].padded)) else list(result.get(key, as_list=True))


def transformers_scores(hf_model, tokenizer, token_rows, temperature=1.0) -> list[torch.Tensor]:
    scorer = TransformersWrapper(
        hf_model, tokenizer=tokenizer, input_mode="tokens", generate=False,
        generate_kwargs={"temperature": temperature},
    )  # fmt: skip
    with torch.no_grad():
        out = scorer(TensorDict(tokens=torch.nested.as_nested_tensor(token_rows), batch_size=[len(token_rows)]))
    return list(out.get(("log_probs", "full"), as_list=True))


def test_example_1_vllm_wrapper_with_history_input(vllm_wrapper, history, hf_model, tokenizer):
    """TorchRL LLM wrappers tutorial, example 1: vLLM wrapper with history input."""
    assert vllm_wrapper.in_keys == [("history", "prompt")]
    assert vllm_wrapper.out_keys == OUT_KEYS_HISTORY
    data_history = TensorDict(history=history, batch_size=(2,))
    result = vllm_wrapper(data_history)
    responses = result["text"].response
    assert len(responses) == 2 and all(isinstance(r, str) for r in responses)
    assert result["tokens"].response is not None and result["tokens"].response.size(0) == 2
    assert result["log_probs"].response is not None
    # the log-probs are the model's (default sampling: temperature 1, no top-p/top-k)
    fulls = full_rows(result, ("tokens", "full"))
    expected = transformers_scores(hf_model, tokenizer, fulls)
    got = full_rows(result, ("log_probs", "full"))
    for row, (lp, ref, ids) in enumerate(zip(got, expected, full_rows(result, ("tokens", "prompt")))):
        start = len(ids)
        assert (lp[start:] - ref[start:]).abs().max().item() <= TOLERANCE, row
    # the history grew by the assistant's message
    assert result["history"].full.shape[:2] == (2, 3)
    assert list(result["history"].response[:, 0].role) == ["assistant", "assistant"]


def test_example_2_transformers_wrapper_with_history_input(hf_model, tokenizer, history):
    """TorchRL LLM wrappers tutorial, example 2: Transformers wrapper with history input."""
    transformers_wrapper = TransformersWrapper(
        hf_model,
        tokenizer=tokenizer,
        input_mode="history",
        generate=True,
        return_log_probs=True,
        return_text=True,
        return_tokens=True,
        return_masks=True,
        pad_output=True,  # Transformers typically use padded outputs
        generate_kwargs={"max_new_tokens": 50},
    )
    assert transformers_wrapper.in_keys == [("history", "prompt")]
    assert transformers_wrapper.out_keys == OUT_KEYS_HISTORY
    result_tf = transformers_wrapper(TensorDict(history=history, batch_size=(2,)))
    assert len(result_tf["text"].response) == 2
    shape = result_tf["tokens"].response.shape
    assert shape[0] == 2 and 1 <= shape[1] <= 50
    assert result_tf["log_probs"].response.shape == shape


def test_example_3_text_input_mode(vllm_wrapper, plain_llm, tokenizer, hf_model):
    """TorchRL LLM wrappers tutorial, example 3: text input mode."""
    prompts = ["The capital of France is", "The capital of Canada is"]
    data_text = TensorDict(text=prompts, batch_size=(2,))
    vllm_text_wrapper = vLLMWrapper(
        plain_llm, tokenizer=tokenizer, input_mode="text", generate=True, return_text=True, return_tokens=True,
        pad_output=False,
    )  # fmt: skip
    result_vllm_text = vllm_text_wrapper(data_text)
    assert list(result_vllm_text["text"].prompt) == prompts
    assert [p + r for p, r in zip(prompts, result_vllm_text["text"].response)] == list(result_vllm_text["text"].full)
    transformers_text_wrapper = TransformersWrapper(
        hf_model, tokenizer=tokenizer, input_mode="text", generate=True, return_text=True, return_tokens=True,
        pad_output=True, generate_kwargs={"max_new_tokens": 20},
    )  # fmt: skip
    result_tf_text = transformers_text_wrapper(data_text)
    assert len(result_tf_text["text"].response) == 2
    assert result_tf_text["tokens"].response.shape[1] <= 20


def test_example_4_log_probabilities_only(plain_llm, tokenizer, hf_model, history):
    """TorchRL LLM wrappers tutorial, example 4: log-probabilities only (generate=False)."""
    data_history = TensorDict(history=history, batch_size=(2,))
    vllm_logprobs_wrapper = vLLMWrapper(
        plain_llm, tokenizer=tokenizer, input_mode="history", generate=False, return_log_probs=True,
        return_text=True, return_tokens=True, pad_output=False,
    )  # fmt: skip
    assert vllm_logprobs_wrapper.in_keys == [("history", "full")]
    result_vllm_lp = vllm_logprobs_wrapper(data_history)
    transformers_logprobs_wrapper = TransformersWrapper(
        hf_model, tokenizer=tokenizer, input_mode="history", generate=False, return_log_probs=True,
        return_text=True, return_tokens=True, pad_output=True,
    )  # fmt: skip
    with torch.no_grad():
        result_tf_lp = transformers_logprobs_wrapper(data_history)
    dense = result_tf_lp["log_probs"].full
    mask = result_tf_lp["masks"].all_attention_mask
    for row, lp in enumerate(result_vllm_lp.get(("log_probs", "full"), as_list=True)):
        assert (lp - dense[row][mask[row]]).abs().max().item() <= TOLERANCE
    # scoring keeps the history it scored
    assert result_vllm_lp["history"].full.shape == history.shape


def test_example_5_tensorclass_structure(vllm_wrapper, history):
    """TorchRL LLM wrappers tutorial, example 5: the TensorClass structure of the outputs."""
    result = vllm_wrapper(TensorDict(history=history, batch_size=(2,)))
    assert list(result["text"].__class__.__annotations__.keys()) == ["prompt", "response", "full", "padded"]
    assert list(result["tokens"].__class__.__annotations__.keys()) == ["prompt", "response", "full", "padded"]
    assert list(result["log_probs"].__class__.__annotations__.keys()) == ["prompt", "response", "full", "padded"]
    assert list(result["masks"].__class__.__annotations__.keys()) == [
        "all_attention_mask", "all_assistant_mask", "padded",
    ]  # fmt: skip
    text = result["text"]
    assert [p + r for p, r in zip(text.prompt, text.response)] == list(text.full)
    assert not any(_flags(text.padded)) and not any(_flags(result["tokens"].padded))
    assert result["tokens"].full.size(0) == 2
    assert result["masks"].all_attention_mask.size(0) == 2
    assert result["masks"].all_assistant_mask.size(0) == 2


def _flags(padded) -> list[bool]:
    return [bool(padded)] if isinstance(padded, bool) else [bool(p) for p in padded]


def test_example_6_error_handling(plain_llm, tokenizer):
    """TorchRL LLM wrappers tutorial, example 6: a missing key and an invalid mode are ValueErrors."""
    wrapper = vLLMWrapper(plain_llm, tokenizer=tokenizer, input_mode="tokens", input_key="tokens")
    with pytest.raises(ValueError, match="'tokens'"):
        wrapper(TensorDict(batch_size=(2,)))  # Missing tokens key
    with pytest.raises(ValueError, match="input_mode"):
        vLLMWrapper(plain_llm, tokenizer=tokenizer, input_mode="invalid_mode")


def test_example_7_rl_environment_integration(vllm_wrapper, history):
    """TorchRL LLM wrappers tutorial, example 7: the wrapper as a policy on an env state."""
    env_state = TensorDict(
        {
            "history": history,
            "action_mask": torch.ones(2, 1000),
            "reward": torch.zeros(2),
            "done": torch.zeros(2, dtype=torch.bool),
        },
        batch_size=(2,),
    )
    action_output = vllm_wrapper(env_state)
    assert len(action_output["text"].response) == 2
    assert action_output["log_probs"].response is not None
    # inplace (the default with one sample): the env's entries are still there
    assert action_output is env_state
    assert torch.equal(action_output["action_mask"], torch.ones(2, 1000))


# ---------------------------------------------------------------- behaviours from TorchRL's API docs


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (0.7, 0.9), (1.3, 1.0)])
def test_plain_engine_logprobs_are_processed_at_any_temperature(
    plain_llm, tokenizer, hf_model, history, temperature, top_p
):
    """TorchRL vLLMWrapper docs: ``log_probs`` are the sampled tokens' log-probs. On a plain
    ``vllm.LLM`` (raw log-probs mode) rlpost re-scores them under the processed distribution."""
    with pytest.warns(UserWarning, match="re-scored"):
        wrapper = vLLMWrapper(
            plain_llm, tokenizer=tokenizer, input_mode="history", num_samples=2,
            generate_kwargs={"temperature": temperature, "top_p": top_p, "max_new_tokens": 12, "seed": 3},
        )  # fmt: skip
    result = wrapper(TensorDict(history=history, batch_size=(2,))).reshape(-1)
    fulls = list(result.get(("tokens", "full"), as_list=True))
    prompts = list(result.get(("tokens", "prompt"), as_list=True))
    got = list(result.get(("log_probs", "response"), as_list=True))
    with torch.no_grad():
        width = max(len(f) for f in fulls)
        ids = torch.stack([torch.cat([f, f.new_zeros(width - len(f))]) for f in fulls])
        raw = torch.log_softmax(hf_model(input_ids=ids).logits.float(), dim=-1)
    for full, prompt, lp, raw_row in zip(fulls, prompts, got, raw):
        expected = [
            processed_logprobs(raw_row[t - 1], temperature=temperature, top_p=top_p, top_k=0)[full[t]]
            for t in range(len(prompt), len(full))
        ]
        assert (lp - torch.stack(expected)).abs().max().item() <= TOLERANCE
    if top_p == 1.0:  # without top-p the processed log-probs are the tempered model's: score them
        scored = transformers_scores(hf_model, tokenizer, fulls, temperature=temperature)
        for prompt, lp, ref in zip(prompts, got, scored):
            assert (lp - ref[len(prompt) :]).abs().max().item() <= TOLERANCE


def test_wrapper_keys_follow_torchrl(plain_llm, hf_model, tokenizer):
    """TorchRL wrapper docs, "Input Keys" / "Output Keys": in_keys by mode and generate, out_keys
    in TorchRL's order, a tuple ``input_key`` used as given."""
    for mode, out_keys in [("history", OUT_KEYS_HISTORY), ("text", ["text", "masks", "tokens", "log_probs"]),
                           ("tokens", ["masks", "tokens", "log_probs"])]:  # fmt: skip
        for generate, part in [(True, "prompt"), (False, "full")]:
            for wrapper in (
                vLLMWrapper(plain_llm, tokenizer=tokenizer, input_mode=mode, generate=generate),
                TransformersWrapper(hf_model, tokenizer=tokenizer, input_mode=mode, generate=generate),
            ):
                assert wrapper.in_keys == [(mode, part)]
                assert wrapper.out_keys == out_keys
                assert wrapper.return_history == (mode == "history")
    given = vLLMWrapper(plain_llm, tokenizer=tokenizer, input_key=("history", "prompt"))
    assert given.in_keys == [("history", "prompt")] and given.input_key == ("history", "prompt")


def test_tokenizer_taken_from_the_model(plain_llm, hf_model, tokenizer):
    """TorchRL wrapper docs: ``tokenizer=None`` uses the model's tokenizer."""
    from_vllm = vLLMWrapper(plain_llm, input_mode="history")
    from_hf = TransformersWrapper(hf_model, input_mode="history")
    for wrapper in (from_vllm, from_hf):
        assert wrapper.tokenizer.get_vocab() == tokenizer.get_vocab()
        assert wrapper.tokenizer.chat_template == tokenizer.chat_template


def test_one_message_per_row_history_is_a_conversation(vllm_wrapper):
    """TorchRL ChatHistory docs: a ``[B]`` History stands for ``[B, 1]`` conversations."""
    single = History(role=["user", "user"], content=["What is 2 + 2?", "What is 3 + 4?"], batch_size=[2])
    result = vllm_wrapper(TensorDict(history=single, batch_size=(2,)))
    assert result["history"].prompt.shape == (2, 1)
    assert result["history"].full.shape == (2, 2)


def test_generate_kwargs_precedence_and_attributes(plain_llm, hf_model, tokenizer, history):
    """TorchRL LLMWrapperBase docs, "Parameter Conflict Resolution": ``max_tokens`` wins over
    ``max_new_tokens``; the wrappers expose ``sampling_params`` / ``generate_kwargs``."""
    from vllm import SamplingParams

    with pytest.warns(UserWarning, match="max_tokens wins"):
        wrapper = vLLMWrapper(
            plain_llm, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 9, "max_tokens": 2, "temperature": 0}
        )
    out = wrapper(TensorDict(history=history, batch_size=(2,)))
    assert all(len(r) <= 2 for r in out.get(("tokens", "response"), as_list=True))
    params = wrapper.sampling_params
    assert isinstance(params, SamplingParams) and params.max_tokens == 2 and params.temperature == 0
    assert wrapper.generate_kwargs == {"max_new_tokens": 2, "temperature": 0}  # standard names, max_tokens won
    assert vLLMWrapper(plain_llm, tokenizer=tokenizer).sampling_params.max_tokens == 16  # vLLM's default
    tf = TransformersWrapper(hf_model, tokenizer=tokenizer, generate_kwargs={"n": 3, "num_return_sequences": 2})
    assert tf.num_samples == 3 and tf.inplace is False  # n wins, and several samples are never in place


def test_torchrl_exception_types(plain_llm, hf_model, tokenizer):
    """TorchRL's errors for bad input: ValueError for bad arguments, TypeError for a wrong type."""
    cases = [
        dict(pad_output="yes"),
        dict(generate=False, return_log_probs=False),
        dict(generate_kwargs={"top_p": 1.5}),
        dict(generate_kwargs={"top_k": 0}),
        dict(generate_kwargs={"temperature": -1.0}),
        dict(generate_kwargs={"do_sample": False, "temperature": 0.7}),
        dict(num_samples=2, inplace=True),
        dict(num_samples=2, generate_kwargs={"n": 3}),
    ]
    for kwargs in cases:
        for cls, model in ((vLLMWrapper, plain_llm), (TransformersWrapper, hf_model)):
            with pytest.raises(ValueError):
                cls(model, tokenizer=tokenizer, **kwargs)
    wrapper = vLLMWrapper(plain_llm, tokenizer=tokenizer)
    with pytest.raises(TypeError, match="History"):
        wrapper(TensorDict(history=["not a history", "either"], batch_size=(2,)))


def test_wrappers_are_categorical_sequentials(hf_model, tokenizer, history):
    """TorchRL modules docs: the wrappers are ``CategoricalSequential`` modules (``log_prob``,
    ``get_dist``, ``log_prob_key``)."""
    generator = TransformersWrapper(
        hf_model, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 6, "temperature": 0}
    )
    assert isinstance(generator, CategoricalSequential)
    assert generator.log_prob_key == "log_probs"
    out = generator(TensorDict(history=history, batch_size=(2,)))
    with pytest.raises(RuntimeError):
        generator.log_prob(out)
    scorer = generator.get_new_version(generate=False, input_mode="tokens")
    with torch.no_grad():
        log_prob = scorer.log_prob(out.select("tokens"), as_list=True)
        dist = scorer.get_dist(out.select("tokens"))
    fulls = list(out.get(("tokens", "full"), as_list=True))
    for row, (full, lp) in enumerate(zip(fulls, log_prob)):
        response = lp  # (log_probs, "response"): the tokens after the prompt
        from_dist = dist.log_prob(torch.nn.functional.pad(full, (0, dist.logits.shape[1] - len(full))))[row]
        n = len(response)
        assert (from_dist[len(full) - n : len(full)] - response).abs().max().item() <= 1e-5
        assert dist.mask[row].sum().item() == len(full) - 1


def test_llm_on_device_is_a_lazy_vllm_llm(tiny_model_path):
    """TorchRL modules docs, ``LLMOnDevice``: a ``vllm.LLM`` whose engine starts on ``initialize()``."""
    from vllm import LLM

    from rlpost.policies import LLMOnDevice

    assert issubclass(LLMOnDevice, LLM)
    engine = LLMOnDevice(str(tiny_model_path), bundle_indices=[0])
    assert engine.initialized is False and engine.args == (str(tiny_model_path),)


class _RawEngineClient:
    """Engine settings of a plain ``vllm.LLM(model=...)``: raw log-probs, at most 20 per position."""

    logprobs_mode, max_logprobs, vocab_size = "raw_logprobs", 20, 448

    def generate(self, prompt_token_ids, sampling):  # never reached: construction refuses
        raise AssertionError

    def score(self, token_ids, *, temperature):
        raise AssertionError


def test_wrong_logprobs_fail_at_construction(tokenizer):
    """Log-probs are never silently wrong: raw log-probs that cannot be re-scored are refused."""
    client = _RawEngineClient()
    with pytest.raises(ValueError, match="logprobs_mode='processed_logprobs'"):
        vLLMWrapper(client, tokenizer=tokenizer, generate_kwargs={"temperature": 0.7})
    with pytest.raises(ValueError, match="repetition_penalty"):
        vLLMWrapper(client, tokenizer=tokenizer, generate_kwargs={"repetition_penalty": 1.2})
    with pytest.raises(ValueError, match="max_logprobs=-1"):
        vLLMWrapper(client, tokenizer=tokenizer, generate=False, generate_kwargs={"temperature": 0.7})
    # temperature 1 (no top-p/top-k) and greedy: raw log-probs are the processed ones
    vLLMWrapper(client, tokenizer=tokenizer)
    vLLMWrapper(client, tokenizer=tokenizer, generate_kwargs={"temperature": 0})
