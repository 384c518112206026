"""The service's per-token losses against their formulas written out, values and gradients."""

import math

import pytest
import torch

from rlpost.algo.token_losses import check_loss, token_loss

pytestmark = pytest.mark.unit


def _leaf(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def test_cross_entropy_is_the_weighted_sum_of_negative_log_probs():
    lp = _leaf([-0.5, -1.0, -2.0])
    weights = torch.tensor([0.0, 1.0, 0.5])
    loss = token_loss("cross_entropy", lp, {"weights": weights})
    assert loss.item() == pytest.approx(1.0 + 1.0)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-0.0, -1.0, -0.5])


def test_cross_entropy_takes_k_weighted_targets_per_position():
    lp = _leaf([[-0.1, -3.0], [-1.0, -0.7]])
    weights = torch.tensor([[0.9, 0.1], [0.3, 0.7]])
    assert token_loss("cross_entropy", lp, {"weights": weights}).item() == pytest.approx(0.09 + 0.3 + 0.3 + 0.49)


def test_importance_sampling_is_the_unclipped_ratio_times_the_advantage():
    lp = _leaf([-1.0, -0.2, -3.0])
    q = torch.tensor([-1.5, -0.2, -1.0])
    adv = torch.tensor([1.0, -2.0, 4.0])
    loss = token_loss("importance_sampling", lp, {"logprobs": q, "advantages": adv})
    ratio = torch.exp(lp.detach() - q.double())
    assert loss.item() == pytest.approx(-(ratio * adv).sum().item())
    loss.backward()
    assert lp.grad.tolist() == pytest.approx((-(ratio * adv)).tolist())  # d/dlp of -r*A is -r*A


def test_ppo_clips_the_ratio_to_its_thresholds_pessimistically():
    lp = _leaf([0.0, 0.0, 0.0, 0.0])
    # ratios e^0.5 (> 1.2) and e^-0.5 (< 0.8), each with both signs of the advantage
    q = torch.tensor([-0.5, -0.5, 0.5, 0.5])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss = token_loss("ppo", lp, {"logprobs": q, "advantages": adv})
    r_hi, r_lo = math.exp(0.5), math.exp(-0.5)
    # min(r*A, clip(r)*A): A>0 with r>1.2 -> 1.2; A<0 with r>1.2 -> -r; A>0, r<0.8 -> r; A<0, r<0.8 -> -0.8
    assert loss.item() == pytest.approx(-(1.2 - r_hi + r_lo - 0.8))
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([0.0, r_hi, -r_lo, 0.0])


def test_ppo_thresholds_come_from_the_config():
    lp, q, adv = _leaf([0.0]), torch.tensor([-0.5]), torch.tensor([1.0])
    loss = token_loss("ppo", lp, {"logprobs": q, "advantages": adv}, {"clip_high_threshold": 2.0})
    assert loss.item() == pytest.approx(-math.exp(0.5))


def test_cispo_keeps_every_tokens_gradient_with_a_clipped_constant_weight():
    lp = _leaf([0.0, 0.0])
    q = torch.tensor([-0.5, 0.5])
    adv = torch.tensor([1.0, 2.0])
    loss = token_loss("cispo", lp, {"logprobs": q, "advantages": adv})
    assert loss.item() == pytest.approx(-(1.2 * 1.0 + 0.8 * 2.0))
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-1.2, -1.6])


def test_bad_names_keys_and_shapes_are_named():
    with pytest.raises(ValueError, match="unknown loss 'dpo'.*cross_entropy"):
        check_loss("dpo", None)
    with pytest.raises(ValueError, match="ppo takes no key \\['beta'\\]"):
        check_loss("ppo", {"beta": 0.1})
    with pytest.raises(ValueError, match="clip_low_threshold <= 1"):
        check_loss("ppo", {"clip_low_threshold": 1.5})
    with pytest.raises(ValueError, match="missing \\['advantages'\\]"):
        token_loss("ppo", _leaf([0.0]), {"logprobs": torch.tensor([0.0])})
    with pytest.raises(ValueError, match="loss_fn_inputs.weights: shape \\(2,\\)"):
        token_loss("cross_entropy", _leaf([0.0]), {"weights": torch.tensor([1.0, 1.0])})
