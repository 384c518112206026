"""GRPOLoss (module path) against grpo_loss (functional path) on the real tiny model."""

import pytest
import torch
from tensordict import TensorDict

from rlpost.algo import grpo_loss
from rlpost.objectives import GRPOLoss
from rlpost.policies import TransformersWrapper

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)


def manual_logprobs(model, ids_bt, attention_bt, temperature=1.0, entropy=False):
    """log p(ids[t] | ids[:t]) row by row (no padding in the forward), 0 at t=0 and on padding;
    with ``entropy``, the entropy of each of those next-token distributions instead."""
    out = torch.zeros(ids_bt.shape)
    rows = []
    for ids, att in zip(ids_bt, attention_bt):
        real = ids[att]
        logits = model(input_ids=real[None]).logits[0, :-1].float() / temperature
        if entropy:
            values = torch.distributions.Categorical(logits=logits).entropy()
        else:
            values = torch.log_softmax(logits, -1).gather(-1, real[1:, None]).squeeze(-1)
        rows.append(torch.cat([torch.zeros(1), values]))
    return out.index_put((attention_bt,), torch.cat(rows))


def loss_sum(out):
    """The total loss as TorchRL users add it up."""
    return sum(v for k, v in out.items() if k.startswith("loss_"))


def make_batch(tok):
    # one right-padded row and one left-padded row: the loss must honour any layout
    pad = tok.pad_token_id
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, pad], [pad, pad, 10, 11, 16, 17, 18]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1]]).bool()
    assistant = torch.tensor([[0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1]]).bool()
    return ids, attention, assistant


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "sequence_sum_norm"])
def test_module_path_equals_functional_path(model, tiny_tokenizer, aggregation):
    ids, attention, assistant = make_batch(tiny_tokenizer)
    with torch.no_grad():
        base = manual_logprobs(model, ids, attention)
    old = base + torch.tensor([[0, 0, 0, 0.3, -0.3, 0.05, 0], [0, 0, 0, 0, 0.2, -0.25, 0.01]])
    ref = base - 0.1
    advantage = torch.tensor([[1.0], [-0.5]])
    batch = TensorDict(
        {
            ("tokens", "full"): ids,
            ("masks", "all_attention_mask"): attention,
            ("masks", "all_assistant_mask"): assistant,
            ("log_probs", "full"): old,
            ("ref_log_probs", "full"): ref,
            "advantage": advantage,
        },
        batch_size=[2],
    )
    actor = TransformersWrapper(model, tokenizer=tiny_tokenizer, input_mode="tokens", generate=False)
    loss_fn = GRPOLoss(
        actor,
        clip_epsilon=(0.2, 0.28),
        aggregation=aggregation,
        max_tokens=8,
        kl_to_ref_coeff=0.05,
        entropy_bonus=False,
    )

    model.zero_grad()
    out = loss_fn(batch)
    loss_sum(out).backward()
    module_grads = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    lp = manual_logprobs(model, ids, attention)
    expected = grpo_loss(
        lp,
        old,
        advantage.reshape(-1),
        assistant & attention,
        clip_eps=(0.2, 0.28),
        aggregation=aggregation,
        max_tokens=8,
        ref_logprobs=ref,
        kl_coef=0.05,
    )
    expected.loss.backward()

    assert torch.allclose(loss_sum(out), expected.loss, atol=1e-5)
    assert torch.allclose(loss_fn.loss_terms(batch).loss, expected.loss, atol=1e-5)
    assert torch.allclose(out.loss_objective, expected.loss_objective, atol=1e-5)
    assert torch.allclose(out.kl_to_ref, expected.kl_to_ref, atol=1e-5)
    assert float(out.clip_fraction) == float(expected.clip_fraction) > 0  # the 0.3 / -0.3 shifts clip
    for got, want in zip(module_grads, (p.grad for p in model.parameters())):
        assert torch.allclose(got, want, atol=1e-5)


def test_kl_to_inference_is_zero_on_policy_and_penalises_drift(model, tiny_tokenizer):
    ids, attention, assistant = make_batch(tiny_tokenizer)
    actor = TransformersWrapper(model, tokenizer=tiny_tokenizer, input_mode="tokens", generate=False)
    loss_fn = GRPOLoss(actor, kl_to_inference_coeff=0.5)
    with torch.no_grad():
        lp = loss_fn.score(ids, attention)
    batch = TensorDict(
        {
            ("tokens", "full"): ids,
            ("masks", "all_attention_mask"): attention,
            ("masks", "all_assistant_mask"): assistant,
            ("log_probs", "full"): lp,
            "advantage": torch.tensor([1.0, -1.0]),
        },
        batch_size=[2],
    )
    on_policy = loss_fn(batch)
    assert abs(float(on_policy.kl_to_inference)) < 1e-6 and float(on_policy.ESS) == pytest.approx(1.0)
    batch.set(("log_probs", "full"), lp + 0.2 * assistant)
    drifted = loss_fn(batch)
    assert float(drifted.kl_to_inference) > 0.01
    assert drifted.loss_kl_to_inference.item() == pytest.approx(0.5 * drifted.kl_to_inference.item(), rel=1e-5)


def test_exact_entropy_and_its_log_probs_match_a_manual_forward(model, tiny_tokenizer):
    # one forward pass (get_dist) gives both; the batch has a right- and a left-padded row
    ids, attention, assistant = make_batch(tiny_tokenizer)
    with torch.no_grad():
        lp = manual_logprobs(model, ids, attention)
        entropy = manual_logprobs(model, ids, attention, entropy=True)
    old = lp + 0.1 * assistant
    batch = TensorDict(
        {
            ("tokens", "full"): ids,
            ("masks", "all_attention_mask"): attention,
            ("masks", "all_assistant_mask"): assistant,
            ("log_probs", "full"): old,
            "advantage": torch.tensor([1.0, -1.0]),
        },
        batch_size=[2],
    )
    actor = TransformersWrapper(model, tokenizer=tiny_tokenizer, input_mode="tokens", generate=False)
    out = GRPOLoss(actor, entropy_coeff=0.1)(batch)  # TorchRL's defaults: exact entropy bonus, "sft" masking
    mask = assistant & attention
    assert out.entropy.item() == pytest.approx(entropy[mask].mean().item(), rel=1e-5)
    assert out.loss_entropy.item() == pytest.approx(-0.1 * entropy[mask].mean().item(), rel=1e-5)
    expected = grpo_loss(lp, old, batch["advantage"], mask)
    assert torch.allclose(out.loss_objective, expected.loss_objective, atol=1e-5)


def test_a_generating_actor_is_refused(model, tiny_tokenizer):
    actor = TransformersWrapper(model, tokenizer=tiny_tokenizer, input_mode="tokens", generate=True)
    with pytest.raises(ValueError, match="needs a scoring actor"):
        GRPOLoss(actor)
