"""TorchRL's KL transforms (``torchrl.envs.llm.transforms.kl``), their docstring examples run
against rlpost with rlpost's imports and the offline tiny model instead of OPT.

The printed shapes in TorchRL's docstrings are OPT's token counts; here each example asserts the
same thing for the tiny model's ChatML rendering: one row per conversation, as many positions as
the longest rendered conversation. The shared-actor (Ray) forms are exercised in
tests/integration/envs/test_kl_retrieval.py, which has a Ray cluster.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, list_to_stack, set_list_to_stack

from rlpost.data import History
from rlpost.envs import KLComputation, KLRewardTransform, RetrieveKL, RetrieveLogProb
from rlpost.policies import ChatHistory, TransformersWrapper

pytestmark = pytest.mark.compat

CHATS = [
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello, how are you?"},
        {"role": "assistant", "content": "I'm doing well, thank you!"},
    ],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's the weather like?"},
        {"role": "assistant", "content": "I can't check the weather for you."},
    ],
]


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.pad_token = tokenizer.eos_token  # as the example does for OPT
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    return model, tokenizer


def longest(tokenizer) -> int:
    return max(len(tokenizer.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"]) for c in CHATS)


@pytest.fixture
def restore_list_to_stack():
    """The docstring example sets tensordict's list_to_stack for the process; put it back after."""
    before = list_to_stack()
    yield
    set_list_to_stack(before).set()


def test_retrieve_log_prob_docstring_example(tiny, restore_list_to_stack):
    model, tokenizer = tiny
    set_list_to_stack(True).set()
    chats = CHATS
    history = History.from_chats(chats)
    print(f"Created history with shape: {history.shape}")
    assert history.shape == (2, 3)
    ref_model = TransformersWrapper(
        model, tokenizer=tokenizer, input_mode="history", generate=False, return_log_probs=True, pad_output=True
    )
    transform = RetrieveLogProb(ref_model, assistant_only=True, tokenizer=tokenizer)
    chat_history = ChatHistory(full=history)
    data = TensorDict(history=chat_history, batch_size=(2,))
    result = transform(data)
    log_probs_key = (ref_model.log_probs_key, "full")
    ref_log_probs = result.get(log_probs_key)
    print(f"Log-probs shape: {ref_log_probs.shape}")
    assert ref_log_probs.shape == (2, longest(tokenizer))
    # only the assistant's tokens keep a log-prob (the example's default assistant_only=True)
    assert ((ref_log_probs != 0).sum(-1) < (2 * longest(tokenizer))).all() and (ref_log_probs <= 0).all()


def test_retrieve_kl_docstring_example(tiny):
    model, tokenizer = tiny
    history = History.from_chats(CHATS)
    gen_model = TransformersWrapper(
        model, tokenizer=tokenizer, input_mode="history", generate=False, return_log_probs=True, pad_output=True,
        log_probs_key="gen_log_probs",
    )  # fmt: skip
    ref_model = TransformersWrapper(
        model, tokenizer=tokenizer, input_mode="history", generate=False, return_log_probs=True, pad_output=True,
        log_probs_key="ref_log_probs",
    )  # fmt: skip
    transform = RetrieveKL(gen_model=gen_model, ref_model=ref_model, assistant_only=True, tokenizer=tokenizer)
    chat_history = ChatHistory(full=history)
    next_td = TensorDict(history=chat_history, batch_size=(2,))
    data = TensorDict(history=chat_history, next=next_td, batch_size=(2,))
    result = transform(data)
    kl = result["next"].get("kl_penalty")
    print(f"KL shape: {kl.shape}")
    assert kl.shape == (2, longest(tokenizer))
    assert kl.abs().max() == 0  # the same model on both sides


def test_kl_computation_docstring_example():
    """Verbatim, including the docstring's keyword spellings (``gen_log_probs_key``,
    ``ref_log_probs_key``, ``coef``), which rlpost accepts beside the signature's names."""
    gen_log_probs = torch.randn(2, 10)  # 2 samples, 10 tokens each
    ref_log_probs = torch.randn(2, 10)
    next_td = TensorDict(
        {
            ("gen_log_probs", "full"): gen_log_probs,
            ("ref_log_probs", "full"): ref_log_probs,
            "reward": torch.randn(2, 10, 1),
        },
        batch_size=(2,),
    )
    data = TensorDict(next=next_td, batch_size=(2,))
    reward = next_td["reward"].clone()
    kl_transform = KLComputation(
        gen_log_probs_key=("gen_log_probs", "full"),
        ref_log_probs_key=("ref_log_probs", "full"),
        kl_key="kl_penalty",
        add_to_reward=True,
        coef=1.0,
    )
    result = kl_transform(data)
    kl = result["next"].get("kl_penalty")
    print(f"KL shape: {kl.shape}")
    assert kl.shape == (2, 10)
    assert torch.allclose(kl, gen_log_probs - ref_log_probs)
    assert torch.allclose(result["next", "reward"], reward - kl.unsqueeze(-1))


def test_kl_computation_takes_rlpost_sequence_rewards_and_ragged_rows():
    """Deviation: an env's ``[B, 1]`` reward is broadcast over the tokens; ragged (nested)
    log-probs give a nested KL and reward."""
    gen = torch.nested.as_nested_tensor([torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])], layout=torch.jagged)
    ref = torch.nested.as_nested_tensor([torch.tensor([-1.5, -1.0]), torch.tensor([-0.5])], layout=torch.jagged)
    td = TensorDict({("log_probs", "full"): gen, ("ref_log_probs", "full"): ref, "reward": torch.tensor([[1.0], [2.0]])},
                    batch_size=(2,))  # fmt: skip
    out = KLComputation(coeff=0.5)(td)
    kl = list(out["kl_penalty"].unbind(0))
    assert torch.allclose(kl[0], torch.tensor([0.5, -1.0])) and torch.allclose(kl[1], torch.tensor([0.0]))
    rewards = list(out["reward"].unbind(0))
    assert torch.allclose(rewards[0], torch.tensor([[0.75], [1.5]])) and torch.allclose(
        rewards[1], torch.tensor([[2.0]])
    )


def test_kl_reward_transform_docstring_examples(tiny):
    """The legacy docstring's two lines as written: ``KLRewardTransform(gen_model, ref_model)``
    (a form TorchRL's own signature rejects; rlpost takes it: the generation model says where its
    log-probs are, the history-mode reference is scored through its tokens-mode twin), then the
    recommended ``RetrieveKL(gen_model, ref_model, assistant_only=True)``. The legacy transform
    is then run on the generation model's output: the KL is ``gen - ref`` on the response
    tokens, and the reward is lowered by it."""
    model, tokenizer = tiny
    gen_model = TransformersWrapper(model, tokenizer=tokenizer, input_mode="history", generate=False,
                                    log_probs_key="gen_log_probs")  # fmt: skip
    ref_model = TransformersWrapper(model, tokenizer=tokenizer, input_mode="history", generate=False,
                                    log_probs_key="ref_log_probs")  # fmt: skip
    # Legacy usage (not recommended for new code)
    transform = KLRewardTransform(gen_model, ref_model)
    assert transform.log_prob_full_key == ("gen_log_probs", "full")
    assert transform.ref_model.input_mode == "tokens" and transform.ref_model.model is model
    # Recommended approach using RetrieveKL
    recommended = RetrieveKL(gen_model, ref_model, assistant_only=True)
    assert len(recommended) == 3

    history = History.from_chats(CHATS)
    scored = gen_model(TensorDict(history=ChatHistory(full=history), batch_size=(2,)))
    prompt_ids = [
        torch.tensor(
            tokenizer.apply_chat_template(chat[:-1], add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        for chat in CHATS
    ]
    scored.set(("tokens", "prompt"), torch.nested.as_nested_tensor(prompt_ids, layout=torch.jagged))
    scored.set("next", TensorDict(reward=torch.tensor([[1.0], [0.0]]), batch_size=(2,)))
    out = transform(scored)["next"]
    kl_rows = list(out.get("kl_penalty", as_list=True))
    for row, prompt in zip(kl_rows, prompt_ids):
        # the same model on both sides: no KL anywhere, and the prompt never counts
        assert row.abs().max().item() < 1e-5 and row.shape[0] > prompt.numel()
    with pytest.raises(ValueError, match="tokens as input"):
        KLRewardTransform(ref_model)
    with pytest.raises(ValueError, match="exactly one of 'ref_model' or 'ref_model_factory'"):
        KLRewardTransform()
    with pytest.raises(TypeError, match="legacy form"):
        KLRewardTransform(gen_model, ref_model, ref_model)
