"""grpo_loss, masked_aggregate and the KL estimators against hand-computed values."""

import math

import pytest
import torch

from rlpost.algo import (
    grpo_loss,
    k3_kl_token_estimate,
    kl_per_token,
    load_loss_function,
    loss_normaliser,
    masked_aggregate,
)

pytestmark = pytest.mark.unit

F64 = torch.float64


def t64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def all_true(*shape) -> torch.Tensor:
    return torch.ones(*shape, dtype=torch.bool)


# The reference batch: old = 0, so ratio = exp(lp); eps = 0.2.
#   row 0, A = +1, ratios [1.0, 1.5, 0.5]: losses [-1, -1.2 (clipped high), -0.5]
#   row 1, A = -2, ratios [0.5, 1.5, pad]: losses [1.6 (clipped low), 3.0, -]
RATIOS = [[1.0, 1.5, 0.5], [0.5, 1.5, 1.0]]
ADVANTAGES = [1.0, -2.0]
MASK = [[True, True, True], [True, True, False]]
TOKEN_LOSSES = [[-1.0, -1.2, -0.5], [1.6, 3.0, 0.0]]
# d loss_t / d lp_t = -ratio * A where the min picks the unclipped term, 0 where it picks the
# clipped one (row 0 token 1, row 1 token 0) and on padding.
TOKEN_GRADS = [[-1.0, 0.0, -0.5], [0.0, 3.0, 0.0]]
# Normaliser seen by each token: token_mean 5 tokens; sequence_mean 2 rows * row length;
# sequence_sum_norm B * max_tokens = 2 * 4.
NORMALISERS = {
    "token_mean": [[5.0] * 3, [5.0] * 3],
    "sequence_mean": [[6.0] * 3, [4.0] * 3],
    "sequence_sum_norm": [[8.0] * 3, [8.0] * 3],
}
EXPECTED_LOSS = {
    "token_mean": 1.9 / 5,
    "sequence_mean": (-2.7 / 3 + 4.6 / 2) / 2,
    "sequence_sum_norm": 1.9 / 8,
}


def reference_batch():
    logprobs = t64(RATIOS).log().requires_grad_()
    return logprobs, torch.zeros(2, 3, dtype=F64), t64(ADVANTAGES), torch.tensor(MASK)


# --- masked_aggregate -------------------------------------------------------------------------

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=F64)
X_MASK = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("token_mean", 7 / 3),  # (1 + 2 + 4) / 3
        ("sequence_mean", (1.5 + 4.0) / 2),  # the empty third row is left out
        ("sequence_sum_norm", 7 / (3 * 5)),  # B = 3 rows, max_tokens = 5
    ],
)
def test_masked_aggregate_hand_computed(aggregation, expected):
    out = masked_aggregate(X, X_MASK, aggregation, max_tokens=5)
    assert out.shape == ()
    assert out.item() == pytest.approx(expected, rel=1e-12)


def test_masked_aggregate_empty_mask_is_zero():
    for aggregation in ("token_mean", "sequence_mean", "sequence_sum_norm"):
        empty = torch.zeros(3, 3, dtype=torch.bool)
        assert masked_aggregate(X, empty, aggregation, max_tokens=4).item() == 0.0


def test_sequence_sum_norm_without_max_tokens_is_an_error():
    with pytest.raises(ValueError, match="max_tokens"):
        masked_aggregate(X, X_MASK, "sequence_sum_norm")
    with pytest.raises(ValueError, match="max_tokens"):
        grpo_loss(*reference_batch(), aggregation="sequence_sum_norm")


def test_masked_aggregate_rejects_bad_inputs():
    with pytest.raises(ValueError, match="'mean'"):
        masked_aggregate(X, X_MASK, "mean")
    with pytest.raises(ValueError, match=r"\(3, 2\)"):
        masked_aggregate(X, X_MASK[:, :2], "token_mean")
    with pytest.raises(ValueError, match="bool"):
        masked_aggregate(X, X_MASK.long(), "token_mean")


# --- clipped objective: values and gradients --------------------------------------------------


@pytest.mark.parametrize("aggregation", list(NORMALISERS))
def test_objective_value_per_aggregation(aggregation):
    terms = grpo_loss(*reference_batch(), aggregation=aggregation, max_tokens=4)
    assert terms.loss_objective.item() == pytest.approx(EXPECTED_LOSS[aggregation], rel=1e-12)
    by_hand = masked_aggregate(t64(TOKEN_LOSSES), torch.tensor(MASK), aggregation, max_tokens=4)
    assert by_hand.item() == pytest.approx(EXPECTED_LOSS[aggregation], rel=1e-12)
    assert terms.loss.item() == terms.loss_objective.item()
    assert terms.loss_kl.item() == 0.0 and terms.loss_entropy.item() == 0.0


@pytest.mark.parametrize("aggregation", list(NORMALISERS))
def test_gradient_is_analytic_and_zero_where_clipped(aggregation):
    logprobs, old, advantages, mask = reference_batch()
    terms = grpo_loss(logprobs, old, advantages, mask, aggregation=aggregation, max_tokens=4)
    terms.loss.backward()
    expected = t64(TOKEN_GRADS) / t64(NORMALISERS[aggregation])
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-12, atol=0)
    # Clipped tokens and padding get exactly zero, not merely small.
    assert logprobs.grad[0, 1] == 0 and logprobs.grad[1, 0] == 0 and logprobs.grad[1, 2] == 0


def test_clip_fractions_and_token_diagnostics():
    terms = grpo_loss(*reference_batch())
    assert terms.clip_fraction.item() == pytest.approx(2 / 5)
    assert terms.clip_fraction_low.item() == pytest.approx(1 / 5)
    assert terms.clip_fraction_high.item() == pytest.approx(1 / 5)
    # kl_approx = mean(old - lp) = mean(-log ratio) over the 5 masked tokens.
    assert terms.kl_approx.item() == pytest.approx(-(2 * math.log(1.5) + 2 * math.log(0.5)) / 5)
    # ESS = (sum w)^2 / sum w^2 / N with w = ratios [1, 1.5, .5, .5, 1.5]: 25 / 6 / 5.
    assert terms.ess.item() == pytest.approx(25 / 6 / 5, rel=1e-12)
    assert terms.kl_to_ref is None and terms.entropy is None
    for diagnostic in (terms.clip_fraction, terms.kl_approx, terms.ess):
        assert not diagnostic.requires_grad


@pytest.mark.parametrize(
    ("clip_eps", "expected_loss", "expected_low", "expected_high"),
    [
        # row 0 (A=+1, ratio 1.25): clipped high at 1.2 under 0.2, free under high=0.3.
        # row 1 (A=-2, ratio 0.85): free under 0.2, clipped low at 0.9 under low=0.1.
        (0.2, (-1.2 + 0.85 * 2) / 2, 0.0, 0.5),
        ((0.2, 0.2), (-1.2 + 0.85 * 2) / 2, 0.0, 0.5),
        ((0.1, 0.3), (-1.25 + 0.9 * 2) / 2, 0.5, 0.0),
    ],
)
def test_symmetric_and_asymmetric_clipping(clip_eps, expected_loss, expected_low, expected_high):
    logprobs = t64([[1.25], [0.85]]).log().requires_grad_()
    old = torch.zeros(2, 1, dtype=F64)
    terms = grpo_loss(logprobs, old, t64([1.0, -2.0]), all_true(2, 1), clip_eps=clip_eps)
    assert terms.loss.item() == pytest.approx(expected_loss, rel=1e-12)
    assert terms.clip_fraction_low.item() == expected_low
    assert terms.clip_fraction_high.item() == expected_high
    terms.loss.backward()
    unclipped_grad = t64([[-1.25 * 1.0], [-0.85 * -2.0]]) / 2
    clipped = torch.tensor([[expected_high > 0], [expected_low > 0]])
    expected_grad = torch.where(clipped, 0.0, unclipped_grad)
    torch.testing.assert_close(logprobs.grad, expected_grad, rtol=1e-12, atol=0)


def test_negative_advantage_above_range_is_not_clipped():
    # A < 0 and ratio > 1 + eps: the min keeps the (worse) unclipped term, gradient flows.
    logprobs = t64([[math.log(2.0)]]).requires_grad_()
    terms = grpo_loss(logprobs, torch.zeros(1, 1, dtype=F64), t64([-1.0]), all_true(1, 1))
    assert terms.loss.item() == pytest.approx(2.0)
    assert terms.clip_fraction.item() == 0.0
    terms.loss.backward()
    assert logprobs.grad.item() == pytest.approx(2.0)


def test_old_logprobs_are_constants_even_when_they_share_the_graph():
    logprobs = t64([[-0.3, -1.2]]).requires_grad_()
    terms = grpo_loss(logprobs, logprobs, t64([0.5]), all_true(1, 2))
    terms.loss.backward()
    # On-policy: ratio 1, so d loss / d lp = -A / N on every token.
    torch.testing.assert_close(logprobs.grad, torch.full((1, 2), -0.25, dtype=F64))
    assert terms.ess.item() == pytest.approx(1.0) and terms.kl_approx.item() == 0.0


def test_bf16_inputs_are_computed_in_float32():
    logprobs = torch.zeros(1, 2, dtype=torch.bfloat16, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.bfloat16)
    terms = grpo_loss(logprobs, old, torch.ones(1, dtype=torch.bfloat16), all_true(1, 2))
    assert terms.loss.dtype == torch.float32 and terms.loss.item() == -1.0
    terms.loss.backward()
    assert logprobs.grad.dtype == torch.bfloat16


# --- KL and entropy terms ---------------------------------------------------------------------

KL_LP = torch.tensor([[0.0, -1.0]], dtype=F64)
KL_REF = torch.tensor([[-0.5, -0.5]], dtype=F64)
K3 = [math.exp(-0.5) + 0.5 - 1, math.exp(0.5) - 0.5 - 1]
KL_EXPECTED = {"k1": [0.5, -0.5], "k2": [0.125, 0.125], "k3": K3}
# d kl_t / d lp_t: k1 -> 1, k2 -> lp - ref, k3 -> 1 - exp(ref - lp).
KL_GRADS = {"k1": [1.0, 1.0], "k2": [0.5, -0.5], "k3": [1 - math.exp(-0.5), 1 - math.exp(0.5)]}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_per_token_hand_computed(estimator):
    out = kl_per_token(KL_LP, KL_REF, estimator)
    torch.testing.assert_close(out, t64([KL_EXPECTED[estimator]]), rtol=1e-12, atol=0)


def test_k3_kl_token_estimate_is_torchrls_argument_order_for_k3():
    """TorchRL's k3_kl_token_estimate(target_log_prob, log_prob): expm1(d) - d, d = target - log_prob."""
    log_prob = torch.tensor([-1.0, -0.5, -2.0])
    target = torch.tensor([-1.0, -1.5, -0.5])
    d = target - log_prob
    assert torch.equal(k3_kl_token_estimate(target, log_prob), torch.expm1(d) - d)
    assert torch.equal(k3_kl_token_estimate(target, log_prob), kl_per_token(log_prob, target, "k3"))
    assert torch.equal(k3_kl_token_estimate(log_prob, log_prob), torch.zeros(3))  # TorchRL's doc example
    with pytest.raises(ValueError, match="same shape"):
        k3_kl_token_estimate(target, log_prob[:2])


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_term_in_the_loss(estimator):
    logprobs = KL_LP.clone().requires_grad_()
    # A = 0 silences the objective, so the loss is the KL term alone.
    terms = grpo_loss(
        logprobs,
        KL_LP.clone(),
        torch.zeros(1, dtype=F64),
        all_true(1, 2),
        ref_logprobs=KL_REF,
        kl_coef=0.1,
        kl_estimator=estimator,
    )
    kl_mean = sum(KL_EXPECTED[estimator]) / 2
    assert terms.kl_to_ref.item() == pytest.approx(kl_mean, abs=1e-15)
    assert terms.loss_kl.item() == pytest.approx(0.1 * kl_mean, abs=1e-15)
    assert torch.equal(terms.loss, terms.loss_objective + terms.loss_kl)
    assert not terms.kl_to_ref.requires_grad
    terms.loss.backward()
    torch.testing.assert_close(logprobs.grad, 0.1 * t64([KL_GRADS[estimator]]) / 2)


def test_kl_uses_the_loss_aggregation_and_k3_is_the_default():
    lp = torch.tensor([[0.0, -1.0], [0.0, 0.0]], dtype=F64)
    ref = torch.tensor([[-0.5, -0.5], [-0.5, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True], [True, False]])
    terms = grpo_loss(
        lp,
        lp,
        torch.zeros(2, dtype=F64),
        mask,
        aggregation="sequence_mean",
        ref_logprobs=ref,
        kl_coef=1.0,
    )
    k3_row1 = math.exp(-0.5) + 0.5 - 1
    assert terms.loss_kl.item() == pytest.approx(((K3[0] + K3[1]) / 2 + k3_row1) / 2, rel=1e-12)
    assert terms.kl_to_ref.item() == pytest.approx((K3[0] + K3[1] + k3_row1) / 3, rel=1e-12)


def test_ref_without_kl_coef_reports_kl_but_adds_nothing():
    lp = torch.zeros(1, 2, dtype=F64)
    ref = torch.tensor([[-0.5, 1000.0]], dtype=F64)  # k3 overflows to inf: must not leak as 0*inf
    terms = grpo_loss(lp, lp, torch.ones(1, dtype=F64), all_true(1, 2), ref_logprobs=ref)
    assert terms.loss.item() == -1.0 and terms.loss_kl.item() == 0.0
    assert terms.kl_to_ref.item() == math.inf


def test_entropy_bonus():
    lp = torch.zeros(2, 2, dtype=F64)
    entropy = torch.tensor([[1.0, 2.0], [4.0, float("nan")]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    terms = grpo_loss(lp, lp, torch.zeros(2, dtype=F64), mask, entropy=entropy, entropy_coef=0.01)
    assert terms.entropy.item() == pytest.approx(7 / 3)
    assert terms.loss_entropy.item() == pytest.approx(-0.01 * 7 / 3)
    assert terms.loss.item() == pytest.approx(-0.01 * 7 / 3)
    terms.loss.backward()
    expected_grad = torch.tensor([[-0.01 / 3, -0.01 / 3], [-0.01 / 3, 0.0]], dtype=F64)
    torch.testing.assert_close(entropy.grad, expected_grad, rtol=1e-12, atol=0)


def test_total_combines_all_three_terms():
    logprobs, old, advantages, mask = reference_batch()
    ref = torch.zeros(2, 3, dtype=F64)
    entropy = torch.ones(2, 3, dtype=F64)
    terms = grpo_loss(
        logprobs,
        old,
        advantages,
        mask,
        ref_logprobs=ref,
        kl_coef=0.5,
        entropy=entropy,
        entropy_coef=0.1,
    )
    # k3 with ref = 0, lp = log r, d = -log r: exp(d) - d - 1 = 1/r + log r - 1 per token.
    ratios = [1.0, 1.5, 0.5, 0.5, 1.5]
    kl = sum(1 / r + math.log(r) - 1 for r in ratios) / 5
    assert terms.kl_to_ref.item() == pytest.approx(kl, rel=1e-12)
    assert terms.loss.item() == pytest.approx(1.9 / 5 + 0.5 * kl - 0.1 * 1.0, rel=1e-12)
    assert set(terms.metrics()) == {
        "loss",
        "loss_objective",
        "loss_kl",
        "loss_entropy",
        "clip_fraction",
        "clip_fraction_low",
        "clip_fraction_high",
        "kl_approx",
        "ess",
        "kl_to_ref",
        "entropy",
        "sampling_logp_diff_mean",
    }


# --- padding never matters --------------------------------------------------------------------


def padded_batch(fill: float):
    """The reference batch plus an all-padding row; every padded slot holds ``fill``."""
    mask = torch.tensor(MASK + [[False, False, False]])
    lp = torch.tensor(RATIOS + [[1.0, 1.0, 1.0]], dtype=F64).log()
    old = torch.zeros(3, 3, dtype=F64)
    ref = torch.full((3, 3), -0.7, dtype=F64)
    entropy = torch.full((3, 3), 1.3, dtype=F64)
    lp, old, ref, entropy = (torch.where(mask, t, fill) for t in (lp, old, ref, entropy))
    advantages = torch.tensor(ADVANTAGES + [fill], dtype=F64)
    return lp.requires_grad_(), old, advantages, mask, ref, entropy.requires_grad_()


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), float("-inf"), 1e30])
@pytest.mark.parametrize("aggregation", list(NORMALISERS))
def test_padding_changes_no_value_and_no_gradient(fill, aggregation):
    results = []
    for value in (0.0, fill):
        lp, old, advantages, mask, ref, entropy = padded_batch(value)
        terms = grpo_loss(
            lp,
            old,
            advantages,
            mask,
            aggregation=aggregation,
            max_tokens=4,
            ref_logprobs=ref,
            kl_coef=0.1,
            entropy=entropy,
            entropy_coef=0.01,
        )
        terms.loss.backward()
        results.append((terms.metrics(), lp.grad, entropy.grad))
    (clean, clean_lp_grad, clean_h_grad), (dirty, dirty_lp_grad, dirty_h_grad) = results
    assert clean == dirty
    assert all(math.isfinite(v) for v in dirty.values())
    assert torch.equal(clean_lp_grad, dirty_lp_grad) and torch.equal(clean_h_grad, dirty_h_grad)
    assert torch.equal(dirty_lp_grad[~padded_batch(0.0)[3]], torch.zeros(4, dtype=F64))


def test_empty_mask_gives_zero_loss_and_finite_diagnostics():
    logprobs, old, advantages, _ = reference_batch()
    terms = grpo_loss(logprobs, old, advantages, torch.zeros(2, 3, dtype=torch.bool))
    assert terms.loss.item() == 0.0 and terms.clip_fraction.item() == 0.0
    assert terms.ess.item() == 1.0 and terms.kl_approx.item() == 0.0
    terms.loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros(2, 3, dtype=F64))


# --- input validation -------------------------------------------------------------------------


def test_shape_errors_name_the_shapes():
    lp, old, advantages, mask = reference_batch()
    with pytest.raises(ValueError, match=r"advantages.*\(2,\).*\(2, 1\)"):
        grpo_loss(lp, old, advantages[:, None], mask)
    with pytest.raises(ValueError, match=r"old_logprobs has shape \(2, 2\), logprobs has \(2, 3\)"):
        grpo_loss(lp, old[:, :2], advantages, mask)
    with pytest.raises(ValueError, match=r"ref_logprobs has shape \(3, 3\)"):
        grpo_loss(lp, old, advantages, mask, ref_logprobs=torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"entropy has shape \(2,\)"):
        grpo_loss(lp, old, advantages, mask, entropy=torch.zeros(2))
    with pytest.raises(ValueError, match=r"\[B, T\].*\(3,\)"):
        grpo_loss(lp[0], old[0], advantages, mask[0])
    with pytest.raises(ValueError, match="bool"):
        grpo_loss(lp, old, advantages, mask.long())


def test_option_errors():
    batch = reference_batch()
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(*batch, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy"):
        grpo_loss(*batch, entropy_coef=0.1)
    with pytest.raises(ValueError, match="'k4'"):
        grpo_loss(*batch, kl_estimator="k4")
    with pytest.raises(ValueError, match="'k4'"):
        kl_per_token(KL_LP, KL_REF, "k4")
    with pytest.raises(ValueError, match="'grpo'"):
        grpo_loss(*batch, aggregation="grpo")
    for bad in ((0.2,), (0.2, 0.3, 0.4), -0.1, (1.5, 0.2), "0.2"):
        with pytest.raises(ValueError, match="clip_eps"):
            grpo_loss(*batch, clip_eps=bad)


# --- the normaliser: a batch split into pieces ----------------------------------------------


@pytest.mark.parametrize(
    ("aggregation", "expected"), [("token_mean", 5.0), ("sequence_mean", 2.0), ("sequence_sum_norm", 8.0)]
)
def test_loss_normaliser_is_the_aggregations_denominator(aggregation, expected):
    assert loss_normaliser(torch.tensor(MASK), aggregation, max_tokens=4) == expected
    empty_row = torch.tensor([[True, False], [False, False]])
    assert loss_normaliser(empty_row, "sequence_mean") == 1.0  # rows with a loss token only
    with pytest.raises(ValueError, match="max_tokens"):
        loss_normaliser(torch.tensor(MASK), "sequence_sum_norm")


@pytest.mark.parametrize("aggregation", list(NORMALISERS))
def test_pieces_over_the_whole_batchs_normaliser_add_up_to_the_whole_batch(aggregation):
    # every term (objective, KL to the reference, entropy, KL to inference) and its gradient
    torch.manual_seed(0)
    logprobs = (torch.randn(5, 4, dtype=F64) - 1).requires_grad_()
    old, ref, entropy = (torch.randn(5, 4, dtype=F64) - 1 for _ in range(3))
    advantages = torch.randn(5, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    kwargs = dict(
        aggregation=aggregation, max_tokens=4, ref_logprobs=ref, kl_coef=0.1, entropy=entropy, entropy_coef=0.01
    )
    kwargs["kl_to_inference_coef"] = 0.05
    whole = grpo_loss(logprobs, old, advantages, mask, **kwargs)
    (whole_grad,) = torch.autograd.grad(whole.loss, logprobs)
    normaliser = loss_normaliser(mask, aggregation, max_tokens=4)
    pieces = [slice(0, 2), slice(2, 5)]
    assert sum(loss_normaliser(mask[p], aggregation, 4) for p in pieces) == normaliser
    total = 0.0
    for p in pieces:
        sliced = dict(kwargs, ref_logprobs=ref[p], entropy=entropy[p], normaliser=normaliser)
        terms = grpo_loss(logprobs[p], old[p], advantages[p], mask[p], **sliced)
        total = total + terms.loss
        for name in ("loss_objective", "loss_kl", "loss_entropy", "loss_kl_to_inference"):
            assert getattr(terms, name).item() != 0.0, name  # every term is in the sum
    (pieces_grad,) = torch.autograd.grad(total, logprobs)
    assert total.item() == pytest.approx(whole.loss.item(), rel=1e-12)
    assert torch.allclose(pieces_grad, whole_grad, rtol=1e-12, atol=1e-15)
    # each piece over its own normaliser is not the same loss (what the normaliser is for)
    own = sum(grpo_loss(logprobs[p], old[p], advantages[p], mask[p], **dict(kwargs, ref_logprobs=ref[p],
              entropy=entropy[p])).loss for p in pieces)  # fmt: skip
    assert own.item() != pytest.approx(whole.loss.item(), rel=1e-6)


def test_a_bad_normaliser_is_refused():
    with pytest.raises(ValueError, match="normaliser must be > 0"):
        masked_aggregate(t64(TOKEN_LOSSES), torch.tensor(MASK), "token_mean", normaliser=0.0)


# --- a custom loss function --------------------------------------------------------------------


def test_load_loss_function_names_what_is_wrong():
    assert load_loss_function("rlpost.algo:grpo_loss") is grpo_loss
    assert load_loss_function("rlpost.algo.grpo_loss") is grpo_loss
    with pytest.raises(ValueError, match="loss function 'grpo_loss' is not of the form"):
        load_loss_function("grpo_loss")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        load_loss_function("no_such_module_xyz:loss")
    with pytest.raises(ValueError, match="'rlpost.algo' has no attribute 'missing'"):
        load_loss_function("rlpost.algo:missing")


# ------------------------------------------------------------------ off-policy correction (TIS / MIS)


def _off_policy_batch():
    """Two rows of 3 tokens (the last of row 1 padding): the learner's current log-probs ``lp``,
    its log-probs at the start of the step ``prox`` and the sampler's ``old``, chosen so that the
    importance weights w = exp(prox - old) are 1, e, 0.5 | 3, 1.2 (threshold 2: e and 3 are over)."""
    prox = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 0.0]])
    old = prox - torch.log(torch.tensor([[1.0, math.e, 0.5], [3.0, 1.2, 1.0]]))
    lp = (prox + torch.tensor([[0.1, -0.1, 0.0], [0.05, 0.3, 0.0]])).requires_grad_()
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return lp, old, prox, torch.tensor([1.0, -1.0]), mask


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_off_policy_corrections_weight_each_token_by_its_capped_importance_weight(correction):
    lp, old, prox, adv, mask = _off_policy_batch()
    terms = grpo_loss(lp, old, adv, mask, clip_eps=0.2, off_policy_correction=correction, off_policy_threshold=2.0,
                      proximal_logprobs=prox)  # fmt: skip
    w = torch.exp(prox - old)
    weight = w.clamp(max=2.0) if correction == "tis" else torch.where(w > 2.0, 0.0, w)
    ratio = torch.exp(lp.detach() - prox)  # the PPO ratio is taken against the learner's own
    adv_bt = adv[:, None].expand_as(lp)
    surrogate = -torch.minimum(ratio * adv_bt, ratio.clamp(0.8, 1.2) * adv_bt)
    expected = (weight * surrogate)[mask].sum() / mask.sum()
    assert terms.loss_objective.item() == pytest.approx(expected.item(), rel=1e-6)
    terms.loss.backward()
    # d/d lp of -weight * ratio * A where unclipped: -weight * ratio * A / N; zero where clipped
    clipped = ((ratio > 1.2) & (adv_bt > 0)) | ((ratio < 0.8) & (adv_bt < 0))
    grad = torch.where(mask & ~clipped, -weight * ratio * adv_bt / mask.sum(), 0.0)
    assert torch.allclose(lp.grad, grad, atol=1e-7)
    assert terms.off_policy_fraction.item() == pytest.approx(2 / 5)  # e and 3 are over the cap
    assert terms.sampling_logp_diff_mean.item() == pytest.approx((prox - old).abs()[mask].mean().item(), rel=1e-6)
    if correction == "mis":  # the masked tokens (w = e, w = 3) leave no gradient
        assert lp.grad[0, 1] == 0 and lp.grad[1, 0] == 0


def test_without_proximal_log_probs_the_correction_is_taken_at_the_current_ones():
    """One optimizer step per batch: the learner's log-probs at the start of the step are the
    current ones, so the ratio is 1 and each token's gradient is -min(w, C) * A / N."""
    lp, old, _, adv, mask = _off_policy_batch()
    terms = grpo_loss(lp, old, adv, mask, off_policy_correction="tis", off_policy_threshold=2.0)
    terms.loss.backward()
    w = torch.exp(lp.detach() - old).clamp(max=2.0)
    assert torch.allclose(lp.grad, torch.where(mask, -w * adv[:, None] / mask.sum(), 0.0), atol=1e-7)
    assert terms.clip_fraction.item() == 0.0  # ratio 1: nothing clipped


def test_no_correction_keeps_the_sampler_ratio_and_still_reports_the_log_prob_gap():
    lp, old, prox, adv, mask = _off_policy_batch()
    plain = grpo_loss(lp, old, adv, mask)
    with_prox = grpo_loss(lp, old, adv, mask, proximal_logprobs=prox)
    assert plain.loss.item() == with_prox.loss.item()  # "none" ignores the proximal log-probs in the loss
    assert plain.off_policy_fraction is None
    assert plain.sampling_logp_diff_mean.item() == pytest.approx((lp.detach() - old).abs()[mask].mean().item())
    # on-policy samples (the sampler's log-probs are the learner's): every correction is "none"
    on_policy = [
        grpo_loss(lp, lp.detach(), adv, mask, off_policy_correction=c).loss.item() for c in ("none", "tis", "mis")
    ]
    assert on_policy[0] == pytest.approx(on_policy[1]) == pytest.approx(on_policy[2])


def test_off_policy_options_are_checked():
    lp, old, prox, adv, mask = _off_policy_batch()
    with pytest.raises(ValueError, match="off_policy_correction must be one of"):
        grpo_loss(lp, old, adv, mask, off_policy_correction="clip")
    with pytest.raises(ValueError, match="off_policy_threshold must be > 1"):
        grpo_loss(lp, old, adv, mask, off_policy_correction="tis", off_policy_threshold=1.0)
    with pytest.raises(ValueError, match="proximal_logprobs has shape"):
        grpo_loss(lp, old, adv, mask, proximal_logprobs=prox[:, :2])
