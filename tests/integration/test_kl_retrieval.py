"""RetrieveLogProb / KLComputation / RetrieveKL on the real tiny model and tokenizer."""

import copy

import pytest
import torch
from tensordict import TensorDict

from rlpost.data import ChatHistory, History
from rlpost.envs.kl import KLComputation, RetrieveKL, RetrieveLogProb
from rlpost.policies import TransformersWrapper

pytestmark = pytest.mark.integration

CHATS = [
    [{"role": "system", "content": "Answer with <answer>number</answer>."},
     {"role": "user", "content": "What is 3 + 4?"},
     {"role": "assistant", "content": "<answer>7</answer>"}],
    [{"role": "system", "content": "Answer with <answer>number</answer>."},
     {"role": "user", "content": "What is 10 - 2?"},
     {"role": "assistant", "content": "<answer>9</answer>"}],
]


@pytest.fixture(scope="module")
def models(tiny_model_path):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return policy, reference


def scorer(model, tok, key):
    return TransformersWrapper(model, tokenizer=tok, input_mode="history", generate=False, pad_output=True,
                               log_probs_key=key)


def batch():
    return TensorDict(history=ChatHistory(full=History.from_chats(CHATS), batch_size=[2]), reward=torch.tensor([[1.0], [0.1]]),
                      batch_size=[2])


def test_retrieve_log_prob_keeps_only_assistant_tokens(models, tiny_tokenizer):
    policy, _ = models
    out = RetrieveLogProb(scorer(policy, tiny_tokenizer, "log_probs"))(batch())
    lp, mask = out.get(("log_probs", "full")), out.get(("masks", "all_assistant_mask"))
    for i, chat in enumerate(CHATS):
        rendered = tiny_tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert mask[i].sum() == sum(rendered["assistant_masks"])  # "<answer>7</answer><|im_end|>"
    assert (lp[~mask] == 0).all() and (lp[mask] < 0).all()


def test_same_model_gives_zero_kl_and_unchanged_reward(models, tiny_tokenizer):
    policy, _ = models
    out = RetrieveKL(scorer(policy, tiny_tokenizer, "log_probs"), scorer(policy, tiny_tokenizer, "ref_log_probs"),
                     coeff=0.5)(batch())
    assert out.get("kl_penalty").abs().max() == 0
    assert torch.equal(out.get("reward"), torch.tensor([[1.0], [0.1]]))


def test_reference_kl_is_subtracted_from_reward(models, tiny_tokenizer):
    policy, reference = models
    out = RetrieveKL(scorer(policy, tiny_tokenizer, "log_probs"), scorer(reference, tiny_tokenizer, "ref_log_probs"),
                     coeff=0.5)(batch())
    lp, ref = out.get(("log_probs", "full")), out.get(("ref_log_probs", "full"))
    mask = out.get(("masks", "all_assistant_mask"))
    kl = out.get("kl_penalty")
    assert torch.allclose(kl, torch.where(mask, lp - ref, torch.zeros_like(lp)))
    expected = torch.tensor([[1.0], [0.1]]) - 0.5 * kl.sum(-1, keepdim=True)
    assert torch.allclose(out.get("reward"), expected) and kl.abs().sum() > 0


def test_kl_for_the_loss_leaves_reward_alone_and_k3_is_non_negative():
    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    td = TensorDict({("log_probs", "full"): lp, ("ref_log_probs", "full"): ref, "reward": torch.tensor([[1.0]]),
                     ("masks", "all_assistant_mask"): torch.tensor([[True, True, False]])}, batch_size=[1])
    out = KLComputation(add_to_reward=False, estimator="k3")(td)
    d = ref - lp
    expected = torch.where(td.get(("masks", "all_assistant_mask")), d.exp() - d - 1, torch.zeros_like(d))
    assert torch.allclose(out.get("kl_penalty"), expected) and (out.get("kl_penalty") >= 0).all()
    assert out.get("reward").item() == 1.0


def test_bad_configurations_are_refused(models, tiny_tokenizer):
    policy, _ = models
    generator = TransformersWrapper(policy, tokenizer=tiny_tokenizer, input_mode="history", generate=True)
    with pytest.raises(ValueError, match="needs a scoring model"):
        RetrieveLogProb(generator)
    with pytest.raises(ValueError, match="pad_output=True"):
        RetrieveLogProb(TransformersWrapper(policy, tokenizer=tiny_tokenizer, generate=False, pad_output=False))
    same = scorer(policy, tiny_tokenizer, "log_probs")
    with pytest.raises(ValueError, match="different log_probs_key"):
        RetrieveKL(same, same)
    td = TensorDict({("log_probs", "full"): torch.zeros(1, 3), ("ref_log_probs", "full"): torch.zeros(1, 4)}, batch_size=[1])
    with pytest.raises(ValueError, match="differ"):
        KLComputation(add_to_reward=False)(td)
