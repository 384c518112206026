"""The math of CISPO, SFT, expert iteration's selection and on-policy distillation
(:mod:`rlpost.algo`), and SFTLoss's deliberate deviations from TorchRL, checked by hand."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, lazy_stack
from tensordict.nn import TensorDictModule

from rlpost.algo import (
    distillation_advantages,
    grpo_loss,
    loss_normaliser,
    minor_sft_loss,
    select_subset,
    sequence_log_likelihood,
    sft_loss,
    top_k_above_median,
)
from rlpost.objectives import MCAdvantageSelector, SFTLoss, TopKRewardSelector

pytestmark = pytest.mark.unit


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    """A token whose ratio is past the clip: PPO's objective gives it no gradient, CISPO's gives
    it the clipped weight times the advantage (TorchRL's CISPOLoss would give none)."""
    lp = torch.tensor([[0.0, 0.5, -0.01]], requires_grad=True)  # token 1: ratio e^0.5 > 1.2
    old = torch.zeros(1, 3)
    adv = torch.tensor([1.0])
    mask = torch.tensor([[False, True, True]])
    ppo = grpo_loss(lp, old, adv, mask, clip_eps=0.2)
    (ppo_grad,) = torch.autograd.grad(ppo.loss, lp)
    cispo = grpo_loss(lp, old, adv, mask, clip_eps=0.2, objective="cispo")
    (cispo_grad,) = torch.autograd.grad(cispo.loss, lp)
    assert ppo_grad[0, 1].item() == 0.0
    # d/dlp of -clip(r) * A * exp(lp - sg(lp)), token mean over 2 tokens
    assert cispo_grad[0, 1].item() == pytest.approx(-1.2 / 2)
    assert cispo_grad[0, 2].item() == pytest.approx(-torch.exp(torch.tensor(-0.01)).item() / 2, rel=1e-6)
    # the value is TorchRL's: -mean(clip(ratio) * A)
    expected = -(1.2 + torch.exp(torch.tensor(-0.01)).item()) / 2
    assert cispo.loss_objective.item() == pytest.approx(expected, rel=1e-6)
    assert cispo.clip_fraction.item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="objective"):
        grpo_loss(lp, old, adv, mask, objective="ppo2")


def test_sft_loss_is_the_masked_nll_with_the_batch_normaliser():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[False, True, True], [True, True, False]])
    terms = sft_loss(lp, torch.zeros(2, 3), torch.zeros(2), mask)
    assert terms.loss.item() == pytest.approx((2 + 3 + 4 + 5) / 4)
    # one row of a two-row batch divided by the whole batch's normaliser adds up
    normaliser = loss_normaliser(mask, "token_mean")
    halves = [
        sft_loss(lp[i : i + 1], torch.zeros(1, 3), torch.zeros(1), mask[i : i + 1], normaliser=normaliser)
        for i in (0, 1)
    ]
    assert sum(h.loss for h in halves).item() == pytest.approx(terms.loss.item())
    seq = sft_loss(lp, torch.zeros(2, 3), torch.zeros(2), mask, aggregation="sequence_mean")
    assert seq.loss.item() == pytest.approx((2.5 + 4.5) / 2)
    ref = torch.tensor([[0.0, -2.0, -3.0], [-4.0, -5.0, 0.0]])
    with_kl = sft_loss(lp, torch.zeros(2, 3), torch.zeros(2), mask, ref_logprobs=ref, kl_coef=0.5)
    assert with_kl.kl_to_ref.item() == pytest.approx(0.0) and with_kl.loss.item() == pytest.approx(terms.loss.item())
    with pytest.raises(ValueError, match="off_policy_correction"):
        sft_loss(lp, torch.zeros(2, 3), torch.zeros(2), mask, off_policy_correction="tis")


def test_sequence_log_likelihood_and_minor_sft():
    lp = torch.tensor([[-1.0, -3.0, 9.0], [-2.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    torch.testing.assert_close(sequence_log_likelihood(lp, mask, normalize=False), torch.tensor([-4.0, -2.0]))
    torch.testing.assert_close(sequence_log_likelihood(lp, mask, normalize=True), torch.tensor([-2.0, -2.0]))
    value = minor_sft_loss(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -4.0]), beta=0.5, reduction="none")
    expected = -torch.nn.functional.logsigmoid(torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(value, expected)


@pytest.mark.parametrize(
    ("values", "k", "expected"),
    [
        ([0.0, 1.0, 0.5, 1.0], 2, [1, 3]),  # median 0.5 (lower middle): two above, ties keep order
        ([0.0, 1.0, 0.5, 0.9], None, [1, 3]),
        ([3.0, 1.0, 2.0, 4.0, 0.0], 1, [3]),
        ([1.0, 1.0, 1.0], 2, []),  # all equal: nothing is better
        ([0.0, 1.0], 5, [1]),
    ],
)
def test_top_k_above_median(values, k, expected):
    assert top_k_above_median(values, k) == expected


def test_select_subset_strategies():
    values = [0.0, 0.0, 0.0, 1.0]
    assert select_subset(values, 2, "balanced", (0.1, 0.9)) == [0, 3]
    assert select_subset(values, 2, "first", (0.1, 0.9)) is None  # mean 0: outside the bounds
    assert select_subset(values, 2, "uniform") == [0, 3]
    assert select_subset([0.0] * 4, 2, "balanced", (0.1, 0.9)) is None
    # past max_combinations: the greedy swaps still find a subset inside the bounds
    many = [0.0] * 9 + [1.0]
    chosen = select_subset(many, 3, "balanced", (0.1, 0.9), max_combinations=1)
    assert chosen is not None and 0.1 < sum(many[i] for i in chosen) / 3 < 0.9
    with pytest.raises(ValueError, match="Need at least"):
        select_subset([1.0], 2)


def test_mc_advantage_selector_reads_one_value_per_candidate():
    selector = MCAdvantageSelector()
    out = selector.select(TensorDict({"return": torch.tensor([0.0, 0.0, 0.0, 1.0])}, [4]), group_size=2,
                          keep_return_bounds=(0.1, 0.9))  # fmt: skip
    assert out == [0, 3]
    with pytest.raises(ValueError, match="one value per candidate"):
        selector.select(TensorDict({"return": torch.zeros(4, 2)}, [4]), group_size=2)
    with pytest.raises(ValueError, match="strategy"):
        MCAdvantageSelector("best")


def test_topk_reward_selector_docstring_example():
    """TorchRL's TopKRewardSelector example: 50 trajectories of 10 prompts, 5 each; the top 3 of
    each group are kept (those above the group's median, best first)."""
    from rlpost.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement

    rb = ReplayBuffer(storage=LazyStackStorage(50), sampler=SamplerWithoutReplacement, batch_size=5)
    td = lazy_stack(
        [
            TensorDict(
                {
                    ("next", "done"): torch.full((1, 1), True),
                    ("next", "reward"): torch.full((i + 5, 1), i),
                    "text": f"Prompt {i // 5}",
                }  # fmt: skip
            )
            for i in range(50)
        ]
    )
    topk = TopKRewardSelector(total_dialog_turns=5, topk_size=3, prompt_key="text")
    rb.append_transform(topk)
    for chunk in td.chunk(25):
        rb.extend(chunk)
    # above the median of 5 there are 2 per group: 20 written (TorchRL's docstring says 30, which its
    # own median rule cannot give)
    assert rb.write_count == 20 and len(rb) == 20
    first = [float(rb[i].get(("next", "reward")).float().mean()) for i in range(4)]
    assert first == [4.0, 3.0, 9.0, 8.0]


def test_topk_reward_selector_drops_equal_groups_and_checks_sizes():
    topk = TopKRewardSelector(total_dialog_turns=2, topk_size=1, prompt_key="q", verbose=False)
    same = [
        TensorDict(
            {"q": "a", ("next", "reward"): torch.ones(1, 1), ("next", "done"): torch.ones(1, 1, dtype=torch.bool)}, [1]
        )
    ]
    assert topk.inv(same[0]) is None and topk.inv(same[0]) is None and topk.queues == {}
    with pytest.raises(ValueError, match="topk_size"):
        TopKRewardSelector(total_dialog_turns=2, topk_size=3)


def test_distillation_advantages():
    adv = torch.tensor([1.0, -1.0])
    teacher = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -0.5]])
    sampler = torch.tensor([[0.0, -2.0, -2.0], [0.0, -0.5, -1.5]])
    mask = torch.tensor([[False, True, True], [False, True, True]])
    out = distillation_advantages(adv, teacher, sampler, mask, coef=0.5)
    torch.testing.assert_close(out, torch.tensor([[0.0, 1.5, 1.0], [0.0, -1.0, -0.5]]))
    pure = distillation_advantages(adv, teacher, sampler, mask, coef=1.0, use_reward=False)
    torch.testing.assert_close(pure, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]))


def test_sft_loss_kl_is_a_mean_over_assistant_tokens():
    """Deviation: kl_to_ref averages over the assistant tokens (TorchRL averages every position,
    so the prompt dilutes it); MinorSFT's reference sums the same tokens."""
    lp = torch.tensor([[-9.0, -1.0, -2.0]])
    ref = torch.tensor([[-4.0, -1.5, -2.0]])  # a reference written on every token
    mask = torch.tensor([[False, True, True]])
    data = lazy_stack([TensorDict({("history", "full"): lp[0], ("masks", "all_attention_mask"): torch.ones(3, dtype=torch.bool),
                                   ("masks", "all_assistant_mask"): mask[0], ("next", "ref_log_probs", "full"): ref[0]}, [])])  # fmt: skip
    actor = TensorDictModule(torch.nn.Identity(), in_keys=[("history", "full")], out_keys=[("log_probs", "full")])
    loss = SFTLoss(actor, tokenizer=object(), kl_to_ref_coeff=1.0)
    out = loss(data)
    d = torch.tensor([-0.5, 0.0])
    assert out.kl_to_ref.item() == pytest.approx((torch.expm1(d) - d).mean().item())
    assert out.loss_sft.item() == pytest.approx(1.5)
    minor = SFTLoss(actor, tokenizer=object(), loss_function="minor_sft", beta=1.0, normalize_by_seq_length=False)(data)
    # LL = -3 and LL_ref = -3.5 over the assistant tokens (TorchRL sums the prompt's -4 in too: -7.5)
    expected = -torch.nn.functional.logsigmoid(torch.tensor(0.5))
    assert minor.loss_sft.item() == pytest.approx(expected.item())
