"""GRPOLoss / GRPOLossOutput (rlpost.objectives) against hand-computed values, with a bigram policy.

The policy's next-token logits depend on the previous token only (a [V, V] table), so every
log-prob and entropy can be computed by hand here and fed to :func:`rlpost.algo.grpo_loss`.
Also covered: the additions to rlpost.algo the module uses (per-token advantages, the "none"
aggregation, the KL to the inference policy, the trust-region mask), and each deliberate
deviation from TorchRL listed in rlpost/objectives/grpo.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict, lazy_stack
from torch.nn.utils.rnn import pad_sequence

from rlpost.algo import grpo_loss, kl_per_token, trust_region_mask
from rlpost.objectives import GRPOLoss, GRPOLossOutput, LLMLossOutput
from rlpost.policies import LLMWrapperBase

pytestmark = pytest.mark.unit

VOCAB = 6
TOKENS = ("tokens", "full")
ATTENTION = ("masks", "all_attention_mask")
ASSISTANT = ("masks", "all_assistant_mask")
LOG_PROBS = ("log_probs", "full")
REF = ("ref_log_probs", "full")
NEXT_REF = ("next", "ref_log_probs", "full")


class BigramPolicy(LLMWrapperBase):
    """Scores ``ids[t]`` with ``log_softmax(table[ids[t - 1]] / temperature)``; ``get_dist`` gives
    the same logits, so the exact entropy is computable too."""

    def __init__(self, table: torch.nn.Embedding, **kwargs):
        kwargs.setdefault("input_mode", "tokens")
        kwargs.setdefault("generate", False)
        super().__init__(**kwargs)
        self.table = table

    def _engine(self):
        return self.table

    def _logit_rows(self, full_ids):
        return [
            torch.cat([torch.zeros(1, VOCAB), self.table.weight[torch.tensor(ids[:-1])]]) / self.temperature
            for ids in full_ids
        ]

    def _score_ids(self, full_ids):
        out = []
        for ids, logits in zip(full_ids, self._logit_rows(full_ids)):
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
            out.append(torch.cat([torch.zeros(1), lp[1:]]))
        return out

    def _full_logits(self, tensordict):
        full_ids = self._read_inputs(tensordict).full_ids
        logits = pad_sequence(self._logit_rows(full_ids), batch_first=True)
        mask = torch.zeros(logits.shape[:2], dtype=torch.bool)
        for i, ids in enumerate(full_ids):
            mask[i, 1 : len(ids)] = True
        return logits, mask


@pytest.fixture
def table():
    weights = torch.arange(VOCAB * VOCAB, dtype=torch.float32).reshape(VOCAB, VOCAB).mul(0.7).sin() * 2
    return torch.nn.Embedding.from_pretrained(weights, freeze=False)


@pytest.fixture
def policy(table):
    return BigramPolicy(table)


def manual(table, tokens_bt, attention_bt, temperature=1.0):
    """(log-probs, exact entropies) [B, T] in the batch's layout, 0 off the predicted tokens."""
    lp_bt = torch.zeros(tokens_bt.shape)
    ent_bt = torch.zeros(tokens_bt.shape)
    for i in range(tokens_bt.shape[0]):
        positions = attention_bt[i].nonzero().flatten().tolist()
        for prev, cur in zip(positions, positions[1:]):
            logits = table.weight[tokens_bt[i, prev]] / temperature
            lp_bt = lp_bt.index_put(
                (torch.tensor(i), torch.tensor(cur)), torch.log_softmax(logits, -1)[tokens_bt[i, cur]]
            )
            ent_bt = ent_bt.index_put(
                (torch.tensor(i), torch.tensor(cur)), torch.distributions.Categorical(logits=logits).entropy()
            )
    return lp_bt, ent_bt


# Three right-padded rows; the assistant tokens are the last real ones of each row.
IDS = [[1, 2, 3, 4, 5, 0], [2, 3, 1, 0, 0, 0], [3, 1, 4, 1, 5, 2]]
ATT = [[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
ASSIST = [[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1]]
# behaviour log-probs = current + DRIFT on the assistant tokens: ratios exp(-DRIFT)
DRIFT = [[0, 0, 0.4, -0.3, 0.05, 0], [0, 0.25, -0.1, 0, 0, 0], [0, 0, 0, 0.02, -0.5, 0.3]]
ADV = [1.0, -0.5, 2.0]


def make_batch(table, *, ids=IDS, att=ATT, assist=ASSIST, drift=DRIFT, adv=ADV, ref_shift=-0.2):
    tokens = torch.tensor(ids)
    attention = torch.tensor(att).bool()
    assistant = torch.tensor(assist).bool()
    with torch.no_grad():
        lp, _ = manual(table, tokens, attention)
    old = lp + torch.tensor(drift) * assistant
    return TensorDict(
        {
            TOKENS: tokens,
            ATTENTION: attention,
            ASSISTANT: assistant,
            LOG_PROBS: old,
            REF: torch.where(attention, lp + ref_shift, 0.0),
            "advantage": torch.tensor(adv),
        },
        batch_size=[tokens.shape[0]],
    )


def expected_terms(table, batch, mask=None, **kwargs):
    """grpo_loss on hand-computed log-probs; ``mask`` defaults to the assistant mask."""
    lp, _ = manual(table, batch[TOKENS], batch[ATTENTION])
    mask = batch[ASSISTANT] & batch[ATTENTION] if mask is None else mask
    return grpo_loss(lp, batch[LOG_PROBS], batch["advantage"], mask, **kwargs), lp


def loss_sum(out: GRPOLossOutput) -> torch.Tensor:
    """How TorchRL users add a loss output's terms up."""
    return sum(v for k, v in out.items() if k.startswith("loss_"))


# --- constructor: TorchRL's arguments and defaults ----------------------------------------------


def test_defaults_are_torchrls(policy):
    loss_fn = GRPOLoss(policy)
    assert loss_fn.entropy_bonus is True and loss_fn.entropy_coeff == 0.01
    assert loss_fn.aggregation == "token_mean" and loss_fn.masking_strategy == "sft"
    assert loss_fn.kl_to_ref_coeff is None and loss_fn.kl_to_inference_coeff is None
    assert loss_fn.kl_mask_threshold is None and loss_fn.reduction == "mean"
    assert float(loss_fn.clip_epsilon_low) == float(loss_fn.clip_epsilon_high) == pytest.approx(0.2)
    keys = loss_fn.tensor_keys
    assert (keys.advantage, keys.action, keys.sample_log_prob, keys.ref_log_probs) == (
        "advantage",
        TOKENS,
        LOG_PROBS,
        NEXT_REF,
    )
    assert loss_fn.in_keys == [TOKENS, LOG_PROBS, "advantage", NEXT_REF]
    assert loss_fn.out_keys == [
        "loss_objective",
        "clip_fraction",
        "ESS",
        "kl_approx",
        "entropy",
        "loss_entropy",
        "loss_kl_to_ref",
        "kl_to_ref",
        "loss_kl_to_inference",
        "kl_to_inference",
    ]
    assert "entropy" not in GRPOLoss(policy, entropy_bonus=False).out_keys
    # the policy's parameters are the loss's (TorchRL users build the optimizer from them)
    assert any(p is policy.table.weight for p in loss_fn.parameters())


def test_clip_epsilon_float_pair_and_bad_values(policy):
    loss_fn = GRPOLoss(policy, clip_epsilon=(0.2, 0.28), device="cpu")
    assert (loss_fn.clip_epsilon_low.item(), loss_fn.clip_epsilon_high.item()) == pytest.approx((0.2, 0.28))
    assert loss_fn.clip_epsilon_low.device.type == "cpu"
    for bad, match in [
        ((0.1,), "length 2"),
        (-0.1, "non-negative"),
        ((0.1, -0.2), "non-negative"),
        (1.0, "low must be < 1"),
        ("big", "clip_epsilon must be a real number"),
    ]:
        with pytest.raises(ValueError, match=match):
            GRPOLoss(policy, clip_epsilon=bad)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"aggregation": "mean"}, ValueError, "aggregation.*'mean'"),
        ({"aggregation": "sequence_sum_norm"}, ValueError, "max_tokens"),
        ({"masking_strategy": "chat"}, ValueError, "masking_strategy.*'chat'"),
        ({"reduction": "sum"}, ValueError, "reduction.*'sum'"),
        ({"gamma": 0.99}, ValueError, "gamma must be None"),
        ({"clip_value": True}, ValueError, "clip_value must be None"),
        ({"kl_to_ref_coeff": -0.1}, ValueError, "kl_to_ref_coeff must be >= 0"),
        ({"kl_to_inference_coeff": "x"}, ValueError, "kl_to_inference_coeff must be a real number"),
        ({"entropy_estimator": "mc"}, ValueError, "entropy_estimator.*'mc'"),
        ({"kl_estimator": "k4"}, ValueError, "kl_estimator.*'k4'"),
        ({"value_key": "v"}, TypeError, "value_key"),
    ],
)
def test_bad_arguments_are_named(policy, kwargs, error, match):
    with pytest.raises(error, match=match):
        GRPOLoss(policy, **kwargs)


def test_a_generating_or_foreign_actor_is_refused(table):
    with pytest.raises(ValueError, match="needs a scoring actor"):
        GRPOLoss(BigramPolicy(table, generate=True))
    with pytest.raises(TypeError, match="rlpost LLM wrapper.*Linear"):
        GRPOLoss(torch.nn.Linear(2, 2))
    loss_fn = GRPOLoss(None)  # TorchRL allows a loss without an actor (for its helpers)
    with pytest.raises(RuntimeError, match="actor_network=None"):
        loss_fn(make_batch(table))


# --- set_keys -----------------------------------------------------------------------------------


def test_set_keys_reads_the_new_keys_and_none_restores_the_default(table, policy):
    batch = make_batch(table)
    renamed = batch.clone()
    renamed.set("adv", renamed.pop("advantage"))
    renamed.set(("next", "log_probs", "full"), renamed.pop(LOG_PROBS))
    loss_fn = GRPOLoss(policy, masking_strategy="rlhf", entropy_bonus=False)
    loss_fn.set_keys(advantage="adv", sample_log_prob=("next", "log_probs", "full"))
    assert loss_fn.tensor_keys.advantage == "adv"
    assert loss_fn.in_keys == [TOKENS, ("next", "log_probs", "full"), "adv", NEXT_REF]
    assert torch.equal(
        loss_fn(renamed).loss_objective,
        GRPOLoss(policy, masking_strategy="rlhf", entropy_bonus=False)(batch).loss_objective,
    )
    loss_fn.set_keys(advantage=None)
    assert loss_fn.tensor_keys.advantage == "advantage"
    with pytest.raises(ValueError, match="advantage_key is not an accepted tensordict key"):
        loss_fn.set_keys(advantage_key="adv")


# --- forward: values against grpo_loss on hand-computed log-probs --------------------------------


@pytest.mark.parametrize(
    ("aggregation", "algo_name"),
    [("token_mean", "token_mean"), ("prompt_mean", "sequence_mean"), ("sequence_sum_norm", "sequence_sum_norm")],
)
def test_values_and_gradient_equal_the_functional_path(table, policy, aggregation, algo_name):
    batch = make_batch(table)
    loss_fn = GRPOLoss(
        policy,
        clip_epsilon=(0.2, 0.28),
        aggregation=aggregation,
        max_tokens=8,
        kl_to_ref_coeff=0.05,
        entropy_coeff=0.02,
        kl_to_inference_coeff=0.3,
        masking_strategy="rlhf",
    )
    out = loss_fn(batch)
    assert isinstance(out, GRPOLossOutput) and isinstance(out, LLMLossOutput)  # TorchRL's hierarchy
    table.weight.grad = None
    loss_sum(out).backward()
    module_grad = table.weight.grad.clone()

    table.weight.grad = None
    lp, ent = manual(table, batch[TOKENS], batch[ATTENTION])
    mask = batch[ASSISTANT]
    want = grpo_loss(
        lp,
        batch[LOG_PROBS],
        batch["advantage"],
        mask,
        clip_eps=(0.2, 0.28),
        aggregation=algo_name,
        max_tokens=8,
        ref_logprobs=batch[REF],
        kl_coef=0.05,
        entropy=ent,
        entropy_coef=0.02,
        kl_to_inference_coef=0.3,
    )
    want.loss.backward()
    pairs = [
        ("loss_objective", want.loss_objective),
        ("clip_fraction", want.clip_fraction),
        ("kl_approx", want.kl_approx),
        ("ESS", want.ess),
        ("entropy", want.entropy),
        ("loss_entropy", want.loss_entropy),
        ("loss_kl_to_ref", want.loss_kl),
        ("kl_to_ref", want.kl_to_ref),
        ("loss_kl_to_inference", want.loss_kl_to_inference),
        ("kl_to_inference", want.kl_to_inference),
    ]
    for name, value in pairs:
        assert getattr(out, name).shape == ()
        torch.testing.assert_close(getattr(out, name), value, rtol=1e-5, atol=1e-6, msg=name)
    assert float(out.clip_fraction) > 0  # the drifts clip some tokens
    torch.testing.assert_close(loss_sum(out), want.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(module_grad, table.weight.grad, rtol=1e-4, atol=1e-6)


def test_loss_terms_sum_in_order_and_forward_repackages_them(table, policy):
    batch = make_batch(table)
    loss_fn = GRPOLoss(policy, kl_to_ref_coeff=0.1, kl_to_inference_coeff=0.2, masking_strategy="rlhf")
    terms = loss_fn.loss_terms(batch)
    in_order = terms.loss_objective + terms.loss_kl + terms.loss_entropy + terms.loss_kl_to_inference
    assert torch.equal(terms.loss, in_order)
    assert set(terms.metrics()) >= {"loss", "clip_fraction_low", "clip_fraction_high", "kl_to_inference"}
    out = loss_fn(batch)
    assert torch.equal(out.loss_kl_to_ref, terms.loss_kl) and torch.equal(out.ESS, terms.ess)
    # TorchRL's scripts backpropagate the mean of every field
    mean = out.mean(reduce=True)
    assert mean.shape == () and mean.requires_grad
    torch.testing.assert_close(mean, sum(out.values()) / len(list(out.keys())))


def test_optional_fields_follow_the_configuration(table, policy):
    batch = make_batch(table)
    bare = GRPOLoss(policy, entropy_bonus=False)(batch)
    for name in ("entropy", "loss_entropy", "loss_kl_to_ref", "kl_to_ref", "loss_kl_to_inference", "kl_to_inference"):
        assert getattr(bare, name) is None, name
    assert sorted(bare.keys()) == ["ESS", "clip_fraction", "kl_approx", "loss_objective"]
    full = GRPOLoss(policy, kl_to_ref_coeff=0.1, kl_to_inference_coeff=0.0)(batch)
    assert all(
        getattr(full, name) is not None
        for name in (
            "entropy",
            "loss_entropy",
            "loss_kl_to_ref",
            "kl_to_ref",
            "loss_kl_to_inference",
            "kl_to_inference",
        )
    )
    assert full.loss_kl_to_inference.item() == 0.0 and full.kl_to_inference.item() > 0  # 0.0: report only


# --- masking strategies ---------------------------------------------------------------------------


def counted(loss_fn, batch) -> list[list[int]]:
    """Which tokens count: on-policy, advantage 1, the per-token objective is -1 exactly there."""
    on_policy = batch.clone()
    with torch.no_grad():
        on_policy.set(LOG_PROBS, loss_fn.score(batch[TOKENS], batch[ATTENTION]))
    on_policy.set("advantage", torch.ones(batch.shape[0]))
    out = loss_fn(on_policy)
    return (-out.loss_objective.squeeze(-1)).round().int().tolist()


def test_masking_strategies_select_torchrls_tokens(table, policy):
    # rlpost's padded layout: left-padded prompts (width 3) then right-padded responses
    ids = [[0, 1, 2, 3, 4, 0], [2, 3, 1, 5, 4, 3]]
    att = [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assist = [[0, 0, 0, 1, 1, 0], [0, 1, 0, 1, 1, 1]]  # row 1: an earlier assistant turn inside the prompt
    batch = make_batch(table, ids=ids, att=att, assist=assist, drift=[[0] * 6] * 2, adv=[1.0, 1.0])
    batch.set(("tokens", "prompt"), torch.tensor([[0, 1, 2], [2, 3, 1]]))

    def strategy(name, data=batch):
        return counted(GRPOLoss(policy, masking_strategy=name, aggregation="none", entropy_bonus=False), data)

    assert strategy("sft") == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]  # after the prompt columns
    assert strategy("rlhf") == [[0, 0, 0, 1, 1, 0], [0, 1, 0, 1, 1, 1]]  # the assistant mask
    # every real token but each row's first one, which has no context and no log-prob
    assert strategy("generic") == [[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]]
    # without prompt ids, "sft" falls back to the assistant mask (TorchRL's fallback)
    assert strategy("sft", batch.exclude(("tokens", "prompt"))) == strategy("rlhf")
    with pytest.raises(ValueError, match="assistant mask at \\('masks', 'all_assistant_mask'\\) or the prompt ids"):
        strategy("sft", batch.exclude(("tokens", "prompt"), ASSISTANT))
    with pytest.raises(ValueError, match="masking_strategy='rlhf' needs the assistant mask"):
        strategy("rlhf", batch.exclude(ASSISTANT))


# --- deviations from TorchRL ----------------------------------------------------------------------


def test_diagnostics_are_means_over_counted_tokens_and_clip_fraction_counts_active_clips(table, policy):
    # one counted token per row; padding and prompt must not dilute the means
    ids, att = [[1, 2, 3, 0], [2, 3, 1, 4]], [[1, 1, 1, 0], [1, 1, 1, 1]]
    assist = [[0, 0, 1, 0], [0, 0, 0, 1]]
    # ratios exp(-drift): row 0 ratio 1.5 with A > 0 (clip active); row 1 ratio 1.5 with A < 0
    # (outside the range, but the min picks the unclipped term: TorchRL would count it)
    drift = [[0, 0, -math.log(1.5), 0], [0, 0, 0, -math.log(1.5)]]
    batch = make_batch(table, ids=ids, att=att, assist=assist, drift=drift, adv=[1.0, -1.0])
    out = GRPOLoss(policy, masking_strategy="rlhf", entropy_bonus=False, kl_to_ref_coeff=0.5)(batch)
    assert out.clip_fraction.item() == pytest.approx(0.5)
    assert out.kl_approx.item() == pytest.approx(-math.log(1.5), rel=1e-5)  # mean of old - new over 2 tokens
    lp, _ = manual(table, batch[TOKENS], batch[ATTENTION])
    k3 = kl_per_token(lp, batch[REF], "k3")[batch[ASSISTANT]]
    assert out.kl_to_ref.item() == pytest.approx(k3.mean().item(), rel=1e-5)
    # the KL term is reduced like the objective, over the counted tokens
    assert out.loss_kl_to_ref.item() == pytest.approx(0.5 * k3.mean().item(), rel=1e-5)


def test_prompt_mean_leaves_rows_without_counted_tokens_out(table, policy):
    assist = [[0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1]]
    batch = make_batch(table, assist=assist)
    out = GRPOLoss(policy, aggregation="prompt_mean", masking_strategy="rlhf", entropy_bonus=False)(batch)
    per_token = GRPOLoss(policy, aggregation="none", masking_strategy="rlhf", entropy_bonus=False)(batch)
    rows = per_token.loss_objective.squeeze(-1)
    expected = (rows[0].sum() / 3 + rows[2].sum() / 3) / 2  # TorchRL: the same sum over 3 rows
    assert out.loss_objective.item() == pytest.approx(expected.item(), rel=1e-6)


def test_kl_to_ref_coefficient_none_zero_and_positive(table, policy):
    batch = make_batch(table)
    assert GRPOLoss(policy, entropy_bonus=False)(batch).kl_to_ref is None
    monitored = GRPOLoss(policy, kl_to_ref_coeff=0.0, entropy_bonus=False)(batch)
    assert monitored.loss_kl_to_ref.item() == 0.0 and monitored.kl_to_ref.item() > 0
    # 0.0 without reference log-probs: nothing to report, no error
    assert GRPOLoss(policy, kl_to_ref_coeff=0.0)(batch.exclude(REF)).kl_to_ref is None
    with pytest.raises(KeyError, match="Couldn't find the ref log-prob"):
        GRPOLoss(policy, kl_to_ref_coeff=0.1)(batch.exclude(REF))


def test_reference_log_probs_under_next_win_and_the_root_key_is_the_fallback(table, policy):
    batch = make_batch(table)
    at_root = GRPOLoss(policy, kl_to_ref_coeff=0.1)(batch)
    moved = batch.exclude(REF)
    moved.set(NEXT_REF, batch[REF])
    torch.testing.assert_close(GRPOLoss(policy, kl_to_ref_coeff=0.1)(moved).kl_to_ref, at_root.kl_to_ref)
    both = batch.clone()
    both.set(NEXT_REF, batch[REF] - 1.0)
    assert GRPOLoss(policy, kl_to_ref_coeff=0.1)(both).kl_to_ref.item() != pytest.approx(at_root.kl_to_ref.item())
    # a key set with set_keys is the only one read
    custom = GRPOLoss(policy, kl_to_ref_coeff=0.1)
    custom.set_keys(ref_log_probs=("ref", "lp"))
    with pytest.raises(KeyError, match="ref log-prob \\('ref', 'lp'\\)"):
        custom(batch)


def test_empty_mask_gives_zero_loss_and_unit_ess(table, policy):
    batch = make_batch(table, assist=[[0] * 6] * 3)
    out = GRPOLoss(policy, masking_strategy="rlhf", kl_to_ref_coeff=0.1, kl_to_inference_coeff=0.1)(batch)
    assert loss_sum(out).item() == 0.0 and out.ESS.item() == 1.0
    assert all(math.isfinite(v.item()) for v in out.values())


def test_entropy_exact_and_sampled(table, policy):
    batch = make_batch(table)
    lp, ent = manual(table, batch[TOKENS], batch[ATTENTION])
    mask = batch[ASSISTANT]
    exact = GRPOLoss(policy, masking_strategy="rlhf", entropy_coeff=0.1)(batch)
    assert exact.entropy.item() == pytest.approx(ent[mask].mean().item(), rel=1e-5)
    assert exact.loss_entropy.item() == pytest.approx(-0.1 * ent[mask].mean().item(), rel=1e-5)
    sampled = GRPOLoss(policy, masking_strategy="rlhf", entropy_coeff=0.1, entropy_estimator="sampled")(batch)
    assert sampled.entropy.item() == pytest.approx(-lp[mask].mean().item(), rel=1e-5)
    # the exact path scores the tokens from the same logits: same objective
    torch.testing.assert_close(exact.loss_objective, sampled.loss_objective)


def test_exact_entropy_needs_logits(table):
    class NoLogits(BigramPolicy):
        def _full_logits(self, tensordict):
            raise NotImplementedError("no logits here")

    batch = make_batch(table)
    with pytest.raises(NotImplementedError, match="entropy_estimator='sampled'"):
        GRPOLoss(NoLogits(table), masking_strategy="rlhf")(batch)
    assert GRPOLoss(NoLogits(table), masking_strategy="rlhf", entropy_estimator="sampled")(batch).entropy is not None


def test_aggregation_none_and_reduction_none_are_per_token(table, policy):
    batch = make_batch(table)
    kwargs = dict(masking_strategy="rlhf", kl_to_ref_coeff=0.1, kl_to_inference_coeff=0.1)
    per_token = GRPOLoss(policy, aggregation="none", **kwargs)(batch)
    for name in ("loss_objective", "loss_entropy", "loss_kl_to_ref", "loss_kl_to_inference"):
        value = getattr(per_token, name)
        assert value.shape == (3, 6, 1), name
        assert (value.squeeze(-1)[~batch[ASSISTANT]] == 0).all(), name
    for name in ("clip_fraction", "kl_approx", "ESS", "entropy", "kl_to_ref", "kl_to_inference"):
        assert getattr(per_token, name).shape == (), name
    mean = GRPOLoss(policy, **kwargs)(batch)
    num_tokens = batch[ASSISTANT].sum()
    torch.testing.assert_close(per_token.loss_objective.sum() / num_tokens, mean.loss_objective)
    torch.testing.assert_close(per_token.loss_kl_to_ref.sum() / num_tokens, mean.loss_kl_to_ref)
    reduced_none = GRPOLoss(policy, reduction="none", **kwargs)(batch)
    torch.testing.assert_close(reduced_none.loss_objective, per_token.loss_objective)
    # a zero coefficient gives zeros per token, not a 0-d zero
    zero = GRPOLoss(policy, aggregation="none", masking_strategy="rlhf", entropy_coeff=0.0, kl_to_ref_coeff=0.0)(batch)
    assert zero.loss_entropy.shape == zero.loss_kl_to_ref.shape == (3, 6, 1)
    assert not zero.loss_entropy.any() and not zero.loss_kl_to_ref.any()


# --- input errors (TorchRL's types and messages) ---------------------------------------------------


def test_missing_and_malformed_entries(table, policy):
    batch = make_batch(table)
    loss_fn = GRPOLoss(policy, masking_strategy="rlhf")
    with pytest.raises(ValueError, match="Action key \\('tokens', 'full'\\) not in tensordict"):
        loss_fn(batch.exclude(TOKENS))
    with pytest.raises(ValueError, match="Advantage key advantage not in tensordict"):
        loss_fn(batch.exclude("advantage"))
    with pytest.raises(KeyError, match="Couldn't find the log-prob \\('log_probs', 'full'\\)"):
        loss_fn(batch.exclude(LOG_PROBS))
    grad = batch.clone()
    grad.set(LOG_PROBS, batch[LOG_PROBS].clone().requires_grad_())
    with pytest.raises(RuntimeError, match="requires grad"):
        loss_fn(grad)
    short = batch.clone(False)
    short.set(LOG_PROBS, batch[LOG_PROBS][:, :4], inplace=False)
    with pytest.raises(ValueError, match="'log_probs', 'full'.*\\(3, 4\\).*\\(3, 6\\)"):
        loss_fn(short.exclude(REF))
    bad_adv = batch.clone()
    bad_adv.set("advantage", torch.ones(3, 2))
    with pytest.raises(ValueError, match="'advantage' must be a float tensor.*\\(3, 2\\)"):
        loss_fn(bad_adv)


@pytest.mark.parametrize("shape", [(3,), (3, 1), (3, 1, 1)])
def test_advantage_per_sequence_shapes(table, policy, shape):
    batch = make_batch(table)
    reference = GRPOLoss(policy, masking_strategy="rlhf")(batch).loss_objective
    batch.set("advantage", torch.tensor(ADV).reshape(shape))
    torch.testing.assert_close(GRPOLoss(policy, masking_strategy="rlhf")(batch).loss_objective, reference)


def test_advantage_per_token_equals_broadcast_per_sequence(table, policy):
    batch = make_batch(table)
    reference = GRPOLoss(policy, masking_strategy="rlhf")(batch).loss_objective
    for per_token in (torch.tensor(ADV)[:, None].expand(3, 6), torch.tensor(ADV)[:, None, None].expand(3, 6, 1)):
        batch.set("advantage", per_token.clone())
        torch.testing.assert_close(GRPOLoss(policy, masking_strategy="rlhf")(batch).loss_objective, reference)
    varying = torch.tensor(ADV)[:, None].expand(3, 6).clone()
    varying[0, 4] = 10.0
    batch.set("advantage", varying)
    assert GRPOLoss(policy, masking_strategy="rlhf")(batch).loss_objective.item() != pytest.approx(reference.item())


# --- layouts ----------------------------------------------------------------------------------------


def test_left_padding_right_padding_and_lazy_rows_give_the_same_loss(table, policy):
    right = make_batch(table)
    kwargs = dict(masking_strategy="rlhf", kl_to_ref_coeff=0.1, kl_to_inference_coeff=0.1)
    expected = GRPOLoss(policy, **kwargs)(right)

    def left_pad(x):
        rows = [row[mask] for row, mask in zip(x, right[ATTENTION])]
        return pad_sequence(rows, batch_first=True, padding_side="left", padding_value=0)

    left = TensorDict(
        {key: left_pad(right[key]) for key in (TOKENS, ATTENTION, ASSISTANT, LOG_PROBS, REF)}, batch_size=[3]
    )
    left.set("advantage", right["advantage"])
    lazy = lazy_stack(
        [
            TensorDict(
                {key: right[key][i][right[ATTENTION][i]] for key in (TOKENS, ATTENTION, ASSISTANT, LOG_PROBS, REF)}
                | {"advantage": right["advantage"][i : i + 1]},
                batch_size=[],
            )
            for i in range(3)
        ]
    )
    for other in (left, lazy):
        out = GRPOLoss(policy, **kwargs)(other)
        for name, value in expected.items():
            torch.testing.assert_close(getattr(out, name), value, rtol=1e-6, atol=1e-7, msg=name)


def test_leading_batch_dims_are_flattened(table, policy):
    batch = make_batch(table)
    doubled = torch.stack([batch, batch]).contiguous()  # [2, 3]
    torch.testing.assert_close(
        GRPOLoss(policy, masking_strategy="rlhf")(doubled).loss_objective,
        GRPOLoss(policy, masking_strategy="rlhf")(batch).loss_objective,
    )


def test_kl_mask_threshold_drops_drifted_tokens(table, policy):
    batch = make_batch(table)
    kwargs = dict(masking_strategy="rlhf", aggregation="none", entropy_bonus=False)
    kept = counted(GRPOLoss(policy, kl_mask_threshold=100.0, **kwargs), batch)
    assert kept == counted(GRPOLoss(policy, **kwargs), batch)
    out = GRPOLoss(policy, kl_mask_threshold=0.5 * 0.2**2, **kwargs)(batch)
    dropped = (out.loss_objective.squeeze(-1) == 0) & batch[ASSISTANT]
    # |drift| > 0.2: 0.4, -0.3, 0.25, -0.5, 0.3
    assert dropped.sum().item() == 5


def test_kl_to_inference_is_zero_on_policy(table, policy):
    batch = make_batch(table, drift=[[0] * 6] * 3)
    out = GRPOLoss(policy, masking_strategy="rlhf", kl_to_inference_coeff=0.5)(batch)
    assert abs(out.kl_to_inference.item()) < 1e-6 and out.ESS.item() == pytest.approx(1.0)
    drifted = GRPOLoss(policy, masking_strategy="rlhf", kl_to_inference_coeff=0.5)(make_batch(table))
    assert drifted.loss_kl_to_inference.item() == pytest.approx(0.5 * drifted.kl_to_inference.item(), rel=1e-6)


# --- the additions to rlpost.algo --------------------------------------------------------------------


def test_algo_per_token_advantages_none_aggregation_and_kl_to_inference():
    lp = torch.tensor([[0.0, -1.0, -0.5], [0.0, -2.0, -0.1]], requires_grad=True)
    old = torch.tensor([[0.0, -1.2, -0.4], [0.0, -2.0, -0.3]])
    mask = torch.tensor([[False, True, True], [False, True, False]])
    adv = torch.tensor([1.0, -1.0])
    per_seq = grpo_loss(lp, old, adv, mask)
    per_token = grpo_loss(lp, old, adv[:, None].expand(2, 3), mask)
    assert torch.equal(per_seq.loss, per_token.loss)
    none = grpo_loss(lp, old, adv, mask, aggregation="none")
    assert none.loss_objective.shape == (2, 3) and (none.loss_objective[~mask] == 0).all()
    torch.testing.assert_close(none.loss_objective.sum() / 3, per_seq.loss_objective)
    assert "loss_objective" not in none.metrics() and "clip_fraction" in none.metrics()
    # kl_to_inference: None computes nothing, 0 reports it, a coefficient adds it to the loss
    assert per_seq.kl_to_inference is None and "kl_to_inference" not in per_seq.metrics()
    k3 = kl_per_token(lp.detach(), old, "k3")[mask].mean()
    report = grpo_loss(lp, old, adv, mask, kl_to_inference_coef=0.0)
    assert report.loss_kl_to_inference.item() == 0.0 and report.kl_to_inference.item() == pytest.approx(k3.item())
    weighted = grpo_loss(lp, old, adv, mask, kl_to_inference_coef=2.0)
    assert weighted.loss.item() == pytest.approx(per_seq.loss.item() + 2.0 * k3.item(), rel=1e-6)
    with pytest.raises(ValueError, match="advantages must have shape.*\\(2, 2\\)"):
        grpo_loss(lp, old, torch.ones(2, 2), mask)


def test_algo_trust_region_mask():
    lp = torch.tensor([[0.0, -1.0, -2.0]])
    old = torch.tensor([[0.0, -1.5, -1.0]])
    assert trust_region_mask(lp, old, 0.2).tolist() == [[True, True, False]]  # 0, 0.125, 0.5
    with pytest.raises(ValueError, match="same shape"):
        trust_region_mask(lp, old[:, :2], 0.2)
