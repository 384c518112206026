"""The reference role on the real tiny model: ref log-probs for the loss, or a KL-shaped reward."""

import pytest
import torch

from rlpost.actors.reference import Reference, ReferenceSettings
from rlpost.algo import group_advantages
from rlpost.config import load_config
from rlpost.data.samples import Group, Sample
from rlpost.envs.arithmetic import ARITHMETIC_SYSTEM_PROMPT

pytestmark = pytest.mark.integration


def make_groups(tok, model, shift):
    chat = [{"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT}, {"role": "user", "content": "What is 3 + 4?"}]
    prompt = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    samples = []
    for text, reward in (("<answer>7</answer><|im_end|>", 1.0), ("<answer>5</answer><|im_end|>", 0.1)):
        ids = prompt + tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        lp = [0.0] + torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()
        mask = [i >= len(prompt) for i in range(len(ids))]
        behaviour = [(v + shift) if m else 0.0 for v, m in zip(lp, mask)]
        samples.append(Sample(0, ids, behaviour, mask, len(prompt), reward, 0, True))
    return [Group(0, samples, group_advantages(torch.tensor([[1.0, 0.1]])).reshape(-1).tolist(), 0)], lp


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)


def test_kl_in_loss_stores_reference_logprobs(tiny_model_path, tiny_tokenizer, model):
    cfg = load_config(
        "configs/tiny-cpu.yaml",
        [
            f"model.name_or_path={tiny_model_path}",
            "reference.enabled=true",
            "reference.kl_coef=0.1",
            "reference.kl_in=loss",
        ],
    )
    groups, lp = make_groups(tiny_tokenizer, model, 0.0)
    out = Reference(ReferenceSettings.from_job(cfg)).annotate(groups)
    sample = out[0].samples[1]
    expected = [v if m else 0.0 for v, m in zip(lp, sample.loss_mask)]
    assert max(abs(a - b) for a, b in zip(sample.ref_logprobs, expected)) < 1e-4
    assert [s.reward for s in out[0].samples] == [1.0, 0.1]


def test_kl_in_reward_penalises_each_sample_and_annotate_leaves_rewards_alone(tiny_model_path, tiny_tokenizer, model):
    cfg = load_config(
        "configs/tiny-cpu.yaml",
        [
            f"model.name_or_path={tiny_model_path}",
            "reference.enabled=true",
            "reference.kl_coef=0.5",
            "reference.kl_in=reward",
        ],
    )
    groups, lp = make_groups(tiny_tokenizer, model, 0.1)  # behaviour log-probs 0.1 above the reference's
    groups[0].samples[1].logprobs = [
        v - 0.1 if m else 0.0 for v, m in zip(groups[0].samples[1].logprobs, groups[0].samples[1].loss_mask)
    ]
    reference = Reference(ReferenceSettings.from_job(cfg))
    first, second = reference.penalize(groups[0].samples)
    assert first.reward == pytest.approx(1.0 - 0.5 * 0.1 * first.num_generated, abs=1e-4)
    assert second.reward == pytest.approx(0.1, abs=1e-4)
    expected = [v if m else 0.0 for v, m in zip(lp, second.loss_mask)]
    assert max(abs(a - b) for a, b in zip(second.ref_logprobs, expected)) < 1e-4

    # annotate (the loss's path) fills the log-probs only: the advantages it was given stand
    fresh, _ = make_groups(tiny_tokenizer, model, 0.1)
    advantages = list(fresh[0].advantages)
    out = reference.annotate(fresh)
    assert [s.reward for s in out[0].samples] == [1.0, 0.1] and out[0].advantages == advantages
    assert all(s.ref_logprobs is not None for s in out[0].samples)
    assert reference.penalize([]) == []
