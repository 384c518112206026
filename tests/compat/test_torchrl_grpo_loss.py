"""TorchRL's GRPOLoss tests and examples (``torchrl.objectives.llm.GRPOLoss``), run on rlpost.

Ported from TorchRL's ``test/llm/test_llm_objectives.py`` (``TestLosses``), the loss's
``tensor_keys`` docstring example and its GRPO training scripts (the loss and backward part of
their loop), with two substitutions: rlpost's imports, and the offline tiny model instead of
TorchRL's mock transformer. Where a TorchRL test only checks that a field is there, the port also
checks it against a hand-made forward pass of the tiny model.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import MetaData, TensorDict, set_list_to_stack

from rlpost.data import History
from rlpost.envs import RetrieveKL
from rlpost.objectives import DAPO, CISPOLoss, CISPOLossOutput, DAPOLossOutput, GRPOLoss, GRPOLossOutput
from rlpost.policies import ChatHistory, Masks, TransformersWrapper

pytestmark = pytest.mark.compat


@pytest.fixture(autouse=True, scope="module")
def list_to_stack():
    with set_list_to_stack(True):
        yield


def mock_data_grpo(tokenizer, vocab_size: int) -> TensorDict:
    """TorchRL's ``_mock_data_grpo``: one system + user prompt answered by the assistant, random
    per-token advantages and random sampling log-probs."""
    prompt = History(role=["system", "user"], content=["You are a useful assistant.", "What is 2+2?"], batch_size=(2,))
    response = History(role=["assistant"], content=["2 + 2 = 4."], batch_size=(1,))
    full_history = prompt.extend(response, inplace=False)
    history = ChatHistory(prompt=prompt, response=response, full=full_history)
    batch_size = 1
    history = history.expand((batch_size,))
    next_history = ChatHistory(prompt=full_history).expand((batch_size,))
    tokens_full = history.to_tokens(tokenizer)
    next_tokens = next_history.to_tokens(tokenizer)
    seq_len = tokens_full.get("full", as_padded_tensor=True, padding_side="left", padding_value=0).shape[-1]
    generator = torch.Generator().manual_seed(0)
    masks = Masks(
        all_attention_mask=torch.ones(batch_size, seq_len, dtype=torch.bool),
        all_assistant_mask=None,
        padded=MetaData(True),
        batch_size=(batch_size,),
    )
    return TensorDict(
        {
            "advantage": torch.randn(batch_size, seq_len, 1, generator=generator),
            "history": history,
            "tokens": tokens_full % vocab_size,
            "masks": masks,
            "next": {
                "history": next_history,
                "tokens": next_tokens % vocab_size,
                "reward": torch.randn(batch_size, seq_len, 1, generator=generator),
                "done": torch.zeros(batch_size, seq_len, 1, dtype=torch.bool),
            },
            "log_probs": {"full": torch.randn(batch_size, seq_len, generator=generator)},
        },
        batch_size=(batch_size,),
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def actor_network(hf_model, tokenizer):
    return TransformersWrapper(hf_model, tokenizer=tokenizer, generate=False, pad_output=True, input_mode="history")


@pytest.fixture
def data(hf_model, tokenizer):
    return mock_data_grpo(tokenizer, hf_model.config.vocab_size)


def manual_response_logprobs(hf_model, data) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiny model's log-probs of the mock's full ids, and the response mask (after the prompt)."""
    ids = data.get(("tokens", "full"), as_padded_tensor=True)[0]
    prompt_len = data.get(("tokens", "prompt"), as_padded_tensor=True).shape[-1]
    with torch.no_grad():
        logits = hf_model(input_ids=ids[None]).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[1:, None]).squeeze(-1)
    response = torch.zeros(ids.shape, dtype=torch.bool)
    response[prompt_len:] = True
    return torch.cat([torch.zeros(1), lp]), response


@pytest.mark.parametrize("dapo", [True, False], ids=["dapo", "symmetric"])
def test_grpo(actor_network, data, hf_model, dapo):
    """TorchRL's ``TestLosses.test_grpo``."""
    eps = (0.20, 0.28) if dapo else 0.20
    loss_fn = GRPOLoss(actor_network, clip_epsilon=eps)
    loss_vals = loss_fn(data)
    assert isinstance(loss_vals, GRPOLossOutput), f"Expected GRPOLossOutput, got {type(loss_vals)}"
    for name in ("loss_objective", "clip_fraction", "kl_approx", "ESS", "entropy", "loss_entropy"):
        assert hasattr(loss_vals, name), f"Missing {name}"
    for name in ("loss_objective", "clip_fraction", "kl_approx", "ESS"):
        assert getattr(loss_vals, name).shape == (), f"{name} should be scalar"
    assert torch.isfinite(loss_vals.loss_objective) and torch.isfinite(loss_vals.ESS)
    assert 0 <= loss_vals.clip_fraction <= 1
    # beyond TorchRL's checks: "sft" masking counts the response, scored by the tiny model
    lp, response = manual_response_logprobs(hf_model, data)
    old = data["log_probs", "full"][0]
    log_ratio = (lp - old)[response]
    assert loss_vals.kl_approx.item() == pytest.approx(-log_ratio.mean().item(), rel=1e-4)
    ess = (2 * log_ratio.logsumexp(0) - (2 * log_ratio).logsumexp(0)).exp() / response.sum()
    assert loss_vals.ESS.item() == pytest.approx(ess.item(), rel=1e-4)


def test_kl_mask_threshold(actor_network, data):
    """TorchRL's ``TestLosses.test_kl_mask_threshold``: a threshold that masks nothing changes
    nothing. TorchRL's 100 masks nothing under its random mock model; the trained tiny model
    gives the mock's response tokens log-probs down to about -14, so the port's threshold is 1e4.
    One token's sampling log-prob is set to +30 (whatever the model, ``0.5 * drift**2`` is then
    above 100 and below 1e4), so that a threshold of 100 must drop it."""
    data = data.clone()
    data.get(("log_probs", "full"))[:, -1] = 30.0
    loss_baseline = GRPOLoss(actor_network, clip_epsilon=0.2, kl_mask_threshold=None)(data.clone())
    assert torch.isfinite(loss_baseline.loss_objective)
    strict = GRPOLoss(actor_network, clip_epsilon=0.2, kl_mask_threshold=100.0)(data.clone())
    assert not torch.isclose(loss_baseline.loss_objective, strict.loss_objective, rtol=1e-3)
    loss_with_threshold = GRPOLoss(actor_network, clip_epsilon=0.2, kl_mask_threshold=1e4)(data.clone())
    assert isinstance(loss_with_threshold, GRPOLossOutput)
    assert torch.isfinite(loss_with_threshold.loss_objective) and torch.isfinite(loss_with_threshold.ESS)
    assert torch.isclose(loss_baseline.loss_objective, loss_with_threshold.loss_objective, rtol=1e-3)


def test_failure_missing_entries(actor_network, data):
    """TorchRL's ``TestLosses.test_failure_missing_entries``."""
    loss_fn = GRPOLoss(actor_network, clip_epsilon=0.2)
    data_missing_sample_log_prob = data.clone()
    data_missing_sample_log_prob.exclude(("log_probs", "full"), inplace=True)
    with pytest.raises(KeyError, match="Couldn't find the log-prob"):
        loss_fn(data_missing_sample_log_prob)
    # no reference log-probs: fine while kl_to_ref_coeff is None
    data_missing_ref = data.clone()
    assert ("next", "ref_log_probs", "full") not in data_missing_ref.keys(True)
    loss_vals = loss_fn(data_missing_ref)
    assert isinstance(loss_vals, GRPOLossOutput) and torch.isfinite(loss_vals.loss_objective)
    loss_fn_with_kl = GRPOLoss(actor_network, clip_epsilon=0.2, kl_to_ref_coeff=0.1)
    with pytest.raises(KeyError, match="Couldn't find the ref log-prob"):
        loss_fn_with_kl(data.clone())


def test_tensor_keys_docstring_example(actor_network):
    """The example of TorchRL's ``GRPOLoss.tensor_keys`` docstring."""
    loss = GRPOLoss(actor_network)
    assert loss.tensor_keys.advantage == "advantage"
    loss.set_keys(advantage="my_advantage_key")
    assert loss.tensor_keys.advantage == "my_advantage_key"


def test_grpo_script_training_step(hf_model, tokenizer):
    """The loss part of TorchRL's GRPO scripts: sample completions with the policy, attach the
    advantages, compute the loss with the training wrapper, backpropagate ``loss.mean(reduce=True)``
    and log ``ESS``; a second step's data is off-policy by exactly that update."""
    chats = [[{"role": "user", "content": "What is 2 + 2?"}], [{"role": "user", "content": "Name a colour."}]]
    policy = TransformersWrapper(
        hf_model,
        tokenizer=tokenizer,
        input_mode="history",
        generate=True,
        generate_kwargs={"max_new_tokens": 6, "temperature": 1.0, "seed": 0},
    )
    with torch.no_grad():
        batch = policy(TensorDict(history=ChatHistory(prompt=History.from_chats(chats)), batch_size=(2,)))
    batch.set("advantage", torch.tensor([[1.0], [-1.0]]))
    policy_training = policy.get_new_version(generate=False)
    loss_fn = GRPOLoss(
        actor_network=policy_training,
        kl_to_ref_coeff=0.0,
        kl_to_inference_coeff=0.0,
        entropy_coeff=0.01,
        masking_strategy="sft",
    )
    model = hf_model
    saved = {name: p.detach().clone() for name, p in model.named_parameters()}
    try:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        loss = loss_fn(batch)
        # sampled with the same weights: on-policy
        assert loss.ESS.item() == pytest.approx(1.0, abs=1e-4)
        assert abs(loss.kl_to_inference.item()) < 1e-4 and loss.clip_fraction.item() == 0
        assert loss.kl_to_ref is None  # no reference log-probs in the batch
        loss_val = loss.mean(reduce=True)
        loss_val.backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after = loss_fn(batch)
        assert after.kl_approx.item() != 0 and after.ESS.item() < 1.0
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(saved[name])
                p.grad = None


def test_reference_log_probs_from_retrieve_kl(hf_model, tokenizer):
    """A reference scored by rlpost's RetrieveKL (here the policy's own weights, so the KL is 0):
    on data without a ``"next"`` entry it writes ``("ref_log_probs", "full")``, which the loss
    reads when ``("next", "ref_log_probs", "full")`` is absent."""
    chats = [[{"role": "user", "content": "Say hi."}], [{"role": "user", "content": "Count to three."}]]
    policy = TransformersWrapper(
        hf_model,
        tokenizer=tokenizer,
        input_mode="history",
        generate=True,
        generate_kwargs={"max_new_tokens": 5, "temperature": 1.0, "seed": 1},
    )
    with torch.no_grad():
        batch = policy(TensorDict(history=ChatHistory(prompt=History.from_chats(chats)), batch_size=(2,)))
    batch.set("advantage", torch.tensor([0.5, -0.5]))
    reference = TransformersWrapper(hf_model, tokenizer=tokenizer, input_mode="tokens", generate=False)
    RetrieveKL(gen_model=None, ref_model=reference, assistant_only=False, add_to_reward=False)(batch)
    assert ("ref_log_probs", "full") in batch.keys(True)
    loss_fn = GRPOLoss(policy.get_new_version(generate=False), kl_to_ref_coeff=0.1, entropy_bonus=False)
    out = loss_fn(batch)
    assert abs(out.kl_to_ref.item()) < 1e-5 and abs(out.loss_kl_to_ref.item()) < 1e-6


def test_dapo_class(actor_network, data):
    """TorchRL's ``DAPO`` (which cannot be built at ae9719f): clip-higher by default, DAPO's
    output type, the GRPO value under the same clip."""
    loss_fn = DAPO(actor_network)
    assert (float(loss_fn.clip_epsilon_low), float(loss_fn.clip_epsilon_high)) == pytest.approx((0.2, 0.28))
    out = loss_fn(data)
    assert isinstance(out, DAPOLossOutput)
    same = GRPOLoss(actor_network, clip_epsilon=(0.2, 0.28))(data)
    torch.testing.assert_close(out.loss_objective, same.loss_objective)
    with pytest.raises(ValueError, match="eps_high >= eps_low"):
        DAPO(actor_network, clip_epsilon=(0.3, 0.2))


def test_cispo(actor_network, data):
    """TorchRL's ``TestLosses.test_cispo``, plus the value TorchRL reports: the token mean of
    ``-clip(ratio) * A`` over the response."""
    loss_fn = CISPOLoss(actor_network, clip_epsilon=0.20)
    loss_vals = loss_fn(data)
    assert isinstance(loss_vals, CISPOLossOutput), f"Expected CISPOLossOutput, got {type(loss_vals)}"
    for name in ("loss_objective", "clip_fraction", "kl_approx", "ESS", "entropy", "loss_entropy"):
        assert hasattr(loss_vals, name), f"Missing {name}"
    for name in ("loss_objective", "clip_fraction", "kl_approx", "ESS"):
        assert getattr(loss_vals, name).shape == (), f"{name} should be scalar"
    assert torch.isfinite(loss_vals.loss_objective) and torch.isfinite(loss_vals.ESS)
    assert 0 <= loss_vals.clip_fraction <= 1
    lp, response = manual_response_logprobs(actor_network.model, data)
    ratio = (lp - data["log_probs", "full"][0]).exp()[response]
    advantage = data["advantage"][0, :, 0][response]
    expected = -(ratio.clamp(0.8, 1.2) * advantage).mean()
    assert loss_vals.loss_objective.item() == pytest.approx(expected.item(), rel=1e-4)
    clipped = ((ratio < 0.8) | (ratio > 1.2)).float().mean()
    assert loss_vals.clip_fraction.item() == pytest.approx(clipped.item(), abs=1e-6)
