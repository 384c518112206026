"""The metrics of a learner step (rlpost.actors.learner.step_metrics): micro-batches combined into a
pass's, passes averaged into the step's, and what the samples say (staleness, sampling entropy)."""

import dataclasses

import pytest

from rlpost.actors.learner.step_metrics import batch_metrics, combine_micro_metrics, mean_dicts
from rlpost.data.samples import Sample

pytestmark = pytest.mark.unit


def test_micro_batch_losses_add_up_and_token_means_are_weighted_by_loss_tokens():
    parts = [
        ({"loss": 0.25, "loss_objective": 0.2, "clip_fraction": 0.5, "kl_to_ref": 0.1, "custom": 9.0}, 3),
        ({"loss": 0.5, "loss_objective": 0.4, "clip_fraction": 0.0, "kl_to_ref": 0.3}, 1),
    ]
    assert combine_micro_metrics(parts) == pytest.approx(
        {"loss": 0.75, "loss_objective": 0.6, "clip_fraction": 0.375, "kl_to_ref": 0.15}
    )  # each loss over the whole batch's normaliser: their sum; 0.5 * 3/4; 0.1 * 3/4 + 0.3 * 1/4
    # a term no micro-batch reported is left out (the custom one is no known metric), but kl_to_ref
    # is always there; no loss token at all divides by 1
    assert combine_micro_metrics([({"loss": -0.5, "entropy": 2.0}, 0)]) == {
        "loss": -0.5,
        "entropy": 0.0,
        "kl_to_ref": 0.0,
    }


def test_a_steps_metrics_are_the_mean_of_its_passes_but_lr_is_the_last_ones():
    passes = [{"loss": 1.0, "grad_norm": 4.0, "lr": 1e-4}, {"loss": 3.0, "grad_norm": 2.0, "lr": 2e-4}]
    assert mean_dicts(passes) == {"loss": 2.0, "grad_norm": 3.0, "lr": 2e-4}
    assert mean_dicts(passes[:1]) == passes[0]


def test_batch_metrics_measure_staleness_per_token_where_samples_say_which_version_made_each():
    def sample(policy_version, versions):
        n = len(versions)
        return Sample(prompt_id=0, token_ids=[1] * (2 + n), logprobs=[0.0] * (2 + n), loss_mask=[False] * 2 + [True] * n,
                      prompt_len=2, reward=1.0, policy_version=policy_version, finished=True,
                      token_versions=[-1, -1] + versions)  # fmt: skip

    rows = [(sample(3, [3, 3, 4, 4]), 1.0), (sample(4, [4, 4]), -1.0)]
    metrics = batch_metrics(rows, version_at_start=5)
    assert metrics["staleness_mean"] == 1.5  # per sample: 2 and 1
    assert metrics["token_staleness_mean"] == (2 + 2 + 1 + 1 + 1 + 1) / 6
    assert metrics["inflight_token_fraction"] == 2 / 6  # the first sample's version-4 tokens
    assert metrics["entropy_sampled"] == 0.0  # every generated token had log-prob 0
    unlabelled = [(dataclasses.replace(s, token_versions=None), a) for s, a in rows]
    assert "token_staleness_mean" not in batch_metrics(unlabelled, version_at_start=5)


def test_batch_metrics_estimate_the_sampling_entropy_from_the_generated_tokens_log_probs():
    # two prompt tokens (log-prob 0, not generated) and the generated tokens' behaviour log-probs
    rows = [
        (Sample(prompt_id=0, token_ids=[1] * 4, logprobs=[0.0, 0.0, -0.5, -1.5], loss_mask=[False, False, True, True],
                prompt_len=2, reward=1.0, policy_version=0, finished=True), 1.0),
        (Sample(prompt_id=0, token_ids=[1] * 3, logprobs=[0.0, 0.0, -2.5], loss_mask=[False, False, True],
                prompt_len=2, reward=0.0, policy_version=0, finished=True), -1.0),
    ]  # fmt: skip
    assert batch_metrics(rows, version_at_start=0)["entropy_sampled"] == pytest.approx((0.5 + 1.5 + 2.5) / 3)
