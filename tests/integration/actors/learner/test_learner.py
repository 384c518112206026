"""The learner's step on the real tiny model: collate layout, learning, grad accumulation,
publishing and scoring. Its checkpoints, memory and Ray actor are tested beside it, in this folder
(those files import this file's helpers)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from safetensors import safe_open

from rlpost.actors.learner import Learner, LearnerSettings
from rlpost.config import JobConfig
from rlpost.data.samples import Group, Sample
from rlpost.objectives.grpo import ASSISTANT_MASK, ATTENTION_MASK, LOG_PROBS_FULL, REF_LOG_PROBS_FULL, TOKENS_FULL
from rlpost.transport.weight_bus import LocalWeightBus

pytestmark = pytest.mark.integration

GOOD, BAD = "<answer>7</answer><|im_end|>", "<answer>5</answer><|im_end|>"


def make_cfg(model_path, **sections) -> LearnerSettings:
    """The learner's sections of a job config with these ``sections`` (a YAML's)."""
    raw = {"model": {"name_or_path": str(model_path)}, "rollout": {"temperature": 0.9}}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return LearnerSettings.from_job(JobConfig.model_validate(raw))


def completion(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def make_sample(prompt: list[int], reply: list[int], *, reward=0.0, version=0, logprobs=None, ref=None) -> Sample:
    ids = prompt + reply
    return Sample(
        prompt_id=0,
        token_ids=ids,
        logprobs=logprobs or [0.0] * len(ids),
        loss_mask=[False] * len(prompt) + [True] * len(reply),
        prompt_len=len(prompt),
        reward=reward,
        policy_version=version,
        finished=True,
        ref_logprobs=ref,
    )


def on_policy_groups(learner: Learner, prompt: list[int], replies: list[list[list[int]]], rewards) -> list[Group]:
    """Groups whose behaviour log-probs are the learner's own scores (on-policy), group advantages."""
    groups = []
    for g, (group_replies, group_rewards) in enumerate(zip(replies, rewards)):
        scores = learner.score([prompt + r for r in group_replies])
        samples = [
            make_sample(prompt, r, reward=rw, version=learner.version, logprobs=[0.0] * len(prompt) + s[len(prompt) :])
            for r, rw, s in zip(group_replies, group_rewards, scores)
        ]
        rw = torch.tensor(group_rewards)
        adv = ((rw - rw.mean()) / (rw.std() + 1e-4)).tolist()
        groups.append(Group(prompt_id=g, samples=samples, advantages=adv, policy_version=learner.version))
    return groups


def completion_logprob(learner: Learner, prompt: list[int], reply: list[int]) -> float:
    return sum(learner.score([prompt + reply])[0][len(prompt) :])


def test_collate_layout(tiny_model_path):
    learner = Learner(make_cfg(tiny_model_path))
    pad = learner.pad_token_id
    a = make_sample([5, 6, 7], [8, 9], reward=1.0, version=3, logprobs=[0, 0, 0, -0.5, -0.25], ref=[0, 0, 0, -1, -2])
    b = make_sample([5, 6], [8], reward=0.0, version=2, logprobs=[0, 0, -0.75], ref=[0, 0, -3])
    c = make_sample([5], [8, 9, 10, 11], version=1)
    batch = learner.collate([Group(0, [a, b], [0.7, -0.7], 2), Group(1, [c], [0.0], 1)])
    assert batch.batch_size == torch.Size([3])
    assert batch.get(TOKENS_FULL).tolist() == [[5, 6, 7, 8, 9], [5, 6, 8, pad, pad], [5, 8, 9, 10, 11]]
    assert batch.get(ATTENTION_MASK).tolist() == [[True] * 5, [True] * 3 + [False] * 2, [True] * 5]
    assert batch.get(ASSISTANT_MASK).int().tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert batch.get(LOG_PROBS_FULL)[:2].tolist() == [[0, 0, 0, -0.5, -0.25], [0, 0, -0.75, 0, 0]]
    assert torch.allclose(batch.get("advantage"), torch.tensor([0.7, -0.7, 0.0]))
    assert batch.get("policy_version").tolist() == [3, 2, 1]
    assert batch.get(REF_LOG_PROBS_FULL, None) is None  # c has no reference log-probs
    with_ref = learner.collate([Group(0, [a, b], [0.7, -0.7], 2)])
    assert with_ref.get(REF_LOG_PROBS_FULL).tolist() == [[0, 0, 0, -1, -2], [0, 0, -3, 0, 0]]
    with pytest.raises(ValueError, match="advantages"):
        learner.collate([Group(0, [a, b], [0.7], 2)])


def train_on_policy(learner: Learner, prompt: list[int], good: list[int], bad: list[int], num_steps: int):
    """``num_steps`` on-policy steps on 2 groups of 4 (7 rewarded 1, 5 rewarded 0); returns the
    (log p(good), log p(bad)) pairs before the first and after every step."""
    trace = [tuple(completion_logprob(learner, prompt, r) for r in (good, bad))]
    for step in range(1, num_steps + 1):
        groups = on_policy_groups(
            learner,
            prompt,
            [[good, bad, good, bad], [bad, bad, good, bad]],
            [[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 0.0]],
        )
        metrics = learner.train_step(groups)
        assert learner.version == step and metrics["policy_version"] == step
        assert metrics["staleness_mean"] == metrics["staleness_max"] == 0
        assert metrics["num_samples"] == 8 and metrics["reward_mean"] == pytest.approx(3 / 8)
        assert metrics["num_tokens"] == 8 * len(good) == 8 * metrics["completion_len_mean"]
        assert metrics["kl_approx"] == pytest.approx(0, abs=1e-5) and metrics["clip_fraction"] == 0
        assert metrics["lr"] == learner.cfg.optimizer.lr and metrics["grad_norm"] > 0 and metrics["kl_to_ref"] == 0
        trace.append(tuple(completion_logprob(learner, prompt, r) for r in (good, bad)))
    return trace


def test_learning_prefers_the_rewarded_completion(tiny_model_path, tiny_tokenizer, prompt_ids):
    # The advantages of a group sum to 0, so with only "7" and "5" in the batch GRPO's objective
    # is c * (log p(7) - log p(5)): the gap must widen. log p(7) itself rises only while the
    # steps are small: AdamW's first step moves every weight by ~lr (sign-like), which at 1e-3 is
    # a jolt that knocks both log-probs down on the tiny model (measured), and later steps also
    # lift the digits "6" and "8" that sit next to "7" and are never penalised.
    good, bad = completion(tiny_tokenizer, GOOD), completion(tiny_tokenizer, BAD)
    small = train_on_policy(Learner(make_cfg(tiny_model_path, optimizer={"lr": 1e-5})), prompt_ids, good, bad, 3)
    for (good_before, bad_before), (good_after, bad_after) in zip(small, small[1:]):
        assert good_after - bad_after > good_before - bad_before + 0.05 and bad_after < bad_before - 0.05, small
    # log p(7) rose at the first step, while the step is small; later it can stall or fall back as
    # the shared weights move (measured: +0.015, +0.007, -0.00002 on a tiny model built on an Intel
    # machine; +0.0034, -0.0044, -0.012 on one built on an AMD machine, while "5" fell by 0.2 a step)
    assert small[1][0] > small[0][0], small
    large = train_on_policy(Learner(make_cfg(tiny_model_path, optimizer={"lr": 1e-4})), prompt_ids, good, bad, 3)
    gaps = [g - b for g, b in large]
    # the gap widens by far; at this lr AdamW can overshoot by a step (measured 2.74, 4.47, 5.19, 5.08
    # on a tiny model built on an AVX-512 machine), so only the first step and the total are exact
    assert gaps[1] > gaps[0] + 0.5 and min(gaps[1:]) > gaps[0] + 1.0, large


def test_epochs_take_one_optimizer_step_each(tiny_model_path, tiny_tokenizer, prompt_ids):
    cfg = make_cfg(tiny_model_path, optimizer={"lr": 1e-3, "warmup_steps": 4}, trainer={"epochs_per_batch": 2})
    learner = Learner(cfg)
    replies = [[completion(tiny_tokenizer, GOOD), completion(tiny_tokenizer, BAD)]]
    groups = on_policy_groups(learner, prompt_ids, replies, [[1.0, 0.0]])
    metrics = learner.train_step(groups)
    assert learner.version == metrics["policy_version"] == 2  # one version per optimizer step
    assert metrics["lr"] == pytest.approx(1e-3 * 2 / 4)  # warm-up: 1/4, then 2/4 of the peak (the last step's)
    assert metrics["kl_approx"] > 1e-4  # the second pass is off-policy: the first step moved the weights
    later = learner.train_step(groups)
    assert later["staleness_mean"] == later["staleness_max"] == 2


def shifted(groups: list[Group], by: float) -> list[Group]:
    """The groups with every completion token's sampler log-prob moved by ``by``."""
    import dataclasses

    def move(sample: Sample) -> Sample:
        logprobs = [lp + by if m else lp for lp, m in zip(sample.logprobs, sample.loss_mask)]
        return dataclasses.replace(sample, logprobs=logprobs)

    return [dataclasses.replace(g, samples=[move(s) for s in g.samples]) for g in groups]


def test_off_policy_corrections_weight_the_step_by_the_sampler_gap(tiny_model_path, tiny_tokenizer, prompt_ids):
    """Samples whose sampler log-probs sit 1 below the learner's (importance weight e on every
    token): "tis" truncates every weight to 2, so its gradient is twice the on-policy one; "mis"
    masks every token, so the step leaves the weights as they were."""
    replies = [[completion(tiny_tokenizer, GOOD), completion(tiny_tokenizer, BAD)]]

    def step(correction: str, by: float, epochs: int = 1):
        learner = Learner(make_cfg(tiny_model_path, optimizer={"lr": 1e-3}, trainer={"epochs_per_batch": epochs},
                                   loss={"off_policy_correction": correction, "off_policy_threshold": 2.0}))  # fmt: skip
        before = {k: v.clone() for k, v in learner.model.state_dict().items()}
        metrics = learner.train_step(shifted(on_policy_groups(learner, prompt_ids, replies, [[1.0, 0.0]]), by))
        moved = any(not torch.equal(v, before[k]) for k, v in learner.model.state_dict().items())
        return metrics, moved

    on_policy, _ = step("none", 0.0)
    assert on_policy["sampling_logp_diff_mean"] < 1e-5 and "off_policy_fraction" not in on_policy
    tis, moved = step("tis", -1.0)
    assert tis["off_policy_fraction"] == 1.0 and tis["sampling_logp_diff_mean"] == pytest.approx(1.0, abs=1e-4)
    assert tis["grad_norm"] == pytest.approx(2 * on_policy["grad_norm"], rel=1e-4) and moved
    mis, moved = step("mis", -1.0)
    assert mis["off_policy_fraction"] == 1.0 and mis["grad_norm"] == 0.0 and not moved
    # below the cap nothing is truncated: the weight exp(-0.5) scales the gradient
    light, _ = step("tis", 0.5)
    assert light["off_policy_fraction"] == 0.0
    assert light["grad_norm"] == pytest.approx(math.exp(-0.5) * on_policy["grad_norm"], rel=1e-4)
    # two epochs: the second pass weighs against the log-probs the step started from (still e: all truncated)
    two, _ = step("tis", -1.0, epochs=2)
    assert two["off_policy_fraction"] == 1.0 and two["policy_version"] == 2
    assert two["sampling_logp_diff_mean"] == pytest.approx(1.0, abs=1e-4)  # the start's, not the moved weights'
    assert abs(two["kl_approx"]) > 1e-5  # the second pass's ratio is against the start: the weights moved


# Ways of splitting or recomputing a step that must not change it: (name, config sections).
SAME_STEP = {
    "grad_accumulation=2": {"optimizer": {"grad_accumulation": 2}},
    "token budget": {"trainer": {"max_tokens_per_microbatch": 64}},
    "gradient checkpointing": {"trainer": {"gradient_checkpointing": True}},
    "rows padded, not packed": {"model": {"pack_sequences": False}},
}


def test_the_exact_entropy_bonus_is_chunked_and_equals_the_dense_one(tiny_model_path, tiny_tokenizer, prompt_ids):
    """loss.entropy_estimator=exact: the whole next-token distribution's entropy, from the
    chunked path's log_probs_and_entropy; the same step as the dense logits give."""
    replies = [completion(tiny_tokenizer, GOOD), completion(tiny_tokenizer, "<answer>")]
    steps = {}
    for estimator, chunked in (("exact", True), ("exact", False), ("sampled", True)):
        learner = Learner(make_cfg(tiny_model_path, loss={"entropy_coef": 0.05, "entropy_estimator": estimator},
                                   model={"chunked_scoring": chunked}))  # fmt: skip
        assert learner.loss_fn.entropy_estimator == estimator
        assert learner.loss_fn.actor_network.scores_in_chunks is chunked
        groups = on_policy_groups(learner, prompt_ids, [replies * 2], [[1.0, 0.0, 0.0, 1.0]])
        steps[estimator, chunked] = learner.train_step(groups)
    exact, dense, sampled = steps["exact", True], steps["exact", False], steps["sampled", True]
    assert exact["entropy"] > 0 and exact["entropy"] != pytest.approx(sampled["entropy"], rel=1e-3)
    for key in ("entropy", "loss", "loss_entropy", "grad_norm"):
        assert exact[key] == pytest.approx(dense[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "sequence_sum_norm"])
def test_micro_batches_and_checkpointing_leave_the_step_unchanged(tiny_model_path, tiny_tokenizer, prompt_ids,
                                                                  aggregation):  # fmt: skip
    # Micro-batches with unequal loss-token counts (a long and a short group): dividing each by
    # the whole batch's normaliser makes any split the same step for every aggregation; so does
    # recomputing the activations in the backward pass.
    long_reply, short_reply = completion(tiny_tokenizer, GOOD), completion(tiny_tokenizer, "<answer>")
    assert len(prompt_ids + long_reply) > 32 and 4 * len(prompt_ids + short_reply) > 64  # the budget splits
    runs = {}
    for name, sections in {"one micro-batch": {}, **SAME_STEP}.items():
        sections = {**sections, "loss": {"aggregation": aggregation}}
        sections["optimizer"] = {"lr": 1e-3, **sections.get("optimizer", {})}
        learner = Learner(make_cfg(tiny_model_path, **sections))
        groups = on_policy_groups(
            learner, prompt_ids, [[long_reply] * 4, [short_reply] * 4], [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]]
        )
        for group in groups:  # off-policy behaviour log-probs, so clipping and ratios matter too
            for i, sample in enumerate(group.samples):
                sample.logprobs = [lp + 0.3 * (i % 2) * m for lp, m in zip(sample.logprobs, sample.loss_mask)]
        grads, layer_calls = {}, []
        learner.optimizer.register_step_pre_hook(
            lambda *_, grads=grads, learner=learner: grads.update(
                {n: p.grad.clone() for n, p in learner.model.named_parameters()}
            )
        )
        # a pre-hook: a recompute stops as soon as it has what the backward pass needs, before
        # the layer's forward returns (where a forward hook would fire)
        learner.model.model.layers[0].register_forward_pre_hook(lambda *_, calls=layer_calls: calls.append(1))
        runs[name] = (learner, learner.train_step(groups), grads, len(layer_calls))
    one, m1, g1, calls1 = runs["one micro-batch"]
    assert m1["micro_batches"] == 1 and m1["clip_fraction"] > 0 and m1["grad_norm"] < 1  # no clipping
    assert runs["grad_accumulation=2"][1]["micro_batches"] == 2
    assert runs["token budget"][1]["micro_batches"] >= 3  # 2 long rows fit 64 tokens, not 3
    assert runs["gradient checkpointing"][3] == 2 * calls1  # each layer ran again in the backward pass
    for name in SAME_STEP:
        other, m2, g2, _ = runs[name]
        assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6), name
        assert m1["clip_fraction"] == pytest.approx(m2["clip_fraction"], abs=1e-6), name
        assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5), name
        for param, grad in g1.items():  # the accumulated gradient is the full-batch one (float32 noise)
            assert torch.allclose(grad, g2[param], atol=1e-7, rtol=1e-5), (name, param)
        # AdamW's first step is lr * g / (|g| + eps): float noise on near-zero gradients moves a
        # weight by up to ~lr / 100, so the weights agree to that, not to float precision.
        for (param, p1), p2 in zip(one.model.named_parameters(), other.model.parameters()):
            assert torch.allclose(p1, p2, atol=1e-5, rtol=0), (name, param)


def test_the_token_budget_is_auto_by_default_and_a_row_over_it_fails_before_the_step(
    tiny_model_path, tiny_tokenizer, prompt_ids, caplog
):
    """By default the learner sets its budget from the model and the free memory (logged); a row
    longer than the budget fails the step with the key to raise, before any pass: the weights
    and the version stay as they were."""
    auto = Learner(make_cfg(tiny_model_path))
    with caplog.at_level(logging.INFO, logger="rlpost"):
        assert auto.token_budget.bytes_per_token > 0 and auto.token_budget.tokens >= 64  # set on first use
    assert "learner token budget per micro-batch" in caplog.text
    reply = completion(tiny_tokenizer, GOOD)
    learner = Learner(make_cfg(tiny_model_path, trainer={"max_tokens_per_microbatch": len(prompt_ids) + 2}))
    groups = on_policy_groups(learner, prompt_ids, [[reply] * 2], [[1.0, 0.0]])
    before = [p.detach().clone() for p in learner.model.parameters()]
    with pytest.raises(ValueError, match=f"a row of {len(prompt_ids) + len(reply)} tokens .* raise "
                                         "trainer.max_tokens_per_microbatch"):  # fmt: skip
        learner.train_step(groups)
    assert learner.version == 0 and all(torch.equal(a, b) for a, b in zip(before, learner.model.parameters()))
    metrics = auto.train_step(on_policy_groups(auto, prompt_ids, [[reply] * 2], [[1.0, 0.0]]))
    assert metrics["token_budget"] == auto.token_budget.tokens and metrics["micro_batches"] == 1


CUSTOM_LOSS = """
from rlpost.algo import GRPOLossTerms, masked_aggregate


def reinforce(logprobs, old_logprobs, advantages, mask, *, aggregation, max_tokens, normaliser, **unused):
    # plain REINFORCE, -A * log p per token: on-policy its gradient is the clipped objective's
    per_token = -advantages[:, None] * logprobs
    return GRPOLossTerms(loss=masked_aggregate(per_token, mask, aggregation, max_tokens, normaliser))
"""


def test_a_custom_loss_function_replaces_grpo_loss(tiny_model_path, tiny_tokenizer, prompt_ids, tmp_path, monkeypatch):
    (tmp_path / "my_losses.py").write_text(CUSTOM_LOSS)
    monkeypatch.syspath_prepend(str(tmp_path))
    replies = [[completion(tiny_tokenizer, GOOD), completion(tiny_tokenizer, BAD), completion(tiny_tokenizer, GOOD)]]
    runs = {}
    for custom_fn in (None, "my_losses:reinforce"):
        cfg = make_cfg(tiny_model_path, optimizer={"lr": 1e-3, "grad_accumulation": 2}, loss={"custom_fn": custom_fn})
        learner = Learner(cfg)
        groups = on_policy_groups(learner, prompt_ids, replies, [[1.0, 0.0, 0.5]])
        rows = [(s, a) for g in groups for s, a in zip(g.samples, g.advantages)]
        runs[custom_fn] = (learner, learner.train_step(groups), rows)
    (grpo, grpo_metrics, _), (custom, custom_metrics, rows) = runs[None], runs["my_losses:reinforce"]
    # the custom loss's value: -sum(A * log p) over the loss tokens / their count, with the
    # log-probs the learner scored before its step (the samples are on-policy)
    num_tokens = sum(sum(s.loss_mask) for s, _ in rows)
    expected = -sum(a * sum(lp for lp, m in zip(s.logprobs, s.loss_mask) if m) for s, a in rows) / num_tokens
    assert custom_metrics["loss"] == pytest.approx(expected, rel=1e-4)
    assert "clip_fraction" not in custom_metrics and "clip_fraction" in grpo_metrics  # only what it reports
    assert grpo_metrics["loss"] == pytest.approx(0.0, abs=1e-6)  # on-policy GRPO: -mean(A) with mean(A) = 0
    # on-policy the two gradients are the same, so the same step (AdamW's first step: lr-sized noise)
    for (name, p1), p2 in zip(grpo.model.named_parameters(), custom.model.parameters()):
        assert torch.allclose(p1, p2, atol=1e-5, rtol=0), name


def test_publish_through_local_bus(tiny_model_path, tiny_tokenizer, prompt_ids):
    bus = LocalWeightBus(timeout_s=5)
    receiver = bus.receiver()
    learner = Learner(make_cfg(tiny_model_path, optimizer={"lr": 1e-3}), publisher=bus)
    learner.train_step(on_policy_groups(learner, prompt_ids, [[completion(tiny_tokenizer, GOOD)] * 2], [[1.0, 0.0]]))
    stats = learner.publish()
    version, tensors = receiver.receive(timeout_s=1)
    assert version == learner.version == 1
    with safe_open(tiny_model_path / "model.safetensors", "pt") as f:
        checkpoint_keys = set(f.keys())
    # the checkpoint's keys plus the tied LM head: vLLM's CPU backend keeps its own copy of it
    assert set(tensors) == checkpoint_keys | {"lm_head.weight"}
    state = learner.model.state_dict()
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        assert torch.equal(tensor, state[name]), name
    assert stats["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    bf16 = Learner(make_cfg(tiny_model_path, model={"dtype": "bfloat16"}))
    assert {t.dtype for _, t in bf16.named_parameters_for_sync()} == {torch.bfloat16}
    assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}  # fp32 masters


def test_score_matches_the_loss_and_a_manual_forward(tiny_model_path, prompt_ids):
    learner = Learner(make_cfg(tiny_model_path))
    rows = [prompt_ids + [40, 41, 42], prompt_ids[:7]]
    scores = learner.score(rows)
    assert [len(s) for s in scores] == [len(r) for r in rows] and scores[0][0] == scores[1][0] == 0.0
    batch = learner.collate([Group(0, [make_sample(r[:3], r[3:]) for r in rows], [0.0, 0.0], 0)])
    with torch.no_grad():
        loss_scores = learner.loss_fn.score(batch.get(TOKENS_FULL), batch.get(ATTENTION_MASK))
        for i, ids in enumerate(rows):
            assert scores[i] == loss_scores[i, : len(ids)].tolist()
            logits = learner.model(input_ids=torch.tensor([ids])).logits[0, :-1] / 0.9  # rollout temperature
            manual = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
            assert torch.allclose(torch.tensor(scores[i][1:]), manual, atol=1e-5)
