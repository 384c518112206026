"""MCAdvantage: complete groups only, one prompt per group, advantages, and the DAPO filter."""

import math
import random

import pytest
import torch

from rlpost.objectives.mc_advantage import MCAdvantage

pytestmark = pytest.mark.unit


def sample(prompt, reward, uid=None):
    return {"prompt_id": prompt, "reward": reward, "uid": uid}


def samples(prompts_and_rewards):
    return [sample(prompt, reward) for prompt, reward in prompts_and_rewards]


def test_emits_a_group_only_when_complete_and_keeps_others_pending():
    mc = MCAdvantage(grpo_size=3)
    arrivals = samples([("a", 1.0), ("b", 0.0), ("a", 0.0), ("c", 1.0), ("b", 1.0)])
    assert mc.add(arrivals) == []
    assert (mc.num_pending, mc.num_pending_groups) == (5, 3)

    groups = mc.add([sample("a", 0.0)])
    assert len(groups) == 1 and [s["prompt_id"] for s in groups[0]] == ["a", "a", "a"]
    # rewards [1, 0, 0]: mean 1/3, Bessel std sqrt(1/3).
    std = math.sqrt(1 / 3) + 1e-4
    expected = [(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std]
    assert [s["advantage"] for s in groups[0]] == pytest.approx(expected, rel=1e-12)
    assert (mc.num_pending, mc.num_pending_groups, mc.num_emitted_groups) == (3, 2, 1)

    groups = mc(iter([sample("b", 0.5)]))  # __call__ == add, any iterable
    assert [s["prompt_id"] for s in groups[0]] == ["b", "b", "b"]
    assert (mc.num_pending, mc.num_pending_groups) == (1, 1)


def test_groups_never_mix_prompts_and_nothing_is_lost():
    rng = random.Random(0)
    grpo_size, num_prompts = 4, 7
    arrivals = [
        sample(p, float(rng.randint(0, 3)), uid=(p, k))
        for p in range(num_prompts)
        for k in range(grpo_size)
    ]
    arrivals += [sample(p, 1.0, uid=(p, "extra")) for p in range(3)]  # partial second groups
    rng.shuffle(arrivals)
    mc = MCAdvantage(grpo_size=grpo_size)
    groups = []
    for start in range(0, len(arrivals), 5):
        groups += mc.add(arrivals[start : start + 5])
    emitted = [s["uid"] for g in groups for s in g]
    assert all(len(g) == grpo_size and len({s["prompt_id"] for s in g}) == 1 for g in groups)
    assert len(emitted) == len(set(emitted))
    # Each prompt completes one group; prompts 0..2 each leave one extra sample pending.
    assert (len(groups), mc.num_pending, mc.num_pending_groups) == (num_prompts, 3, 3)
    assert len(emitted) + mc.num_pending == len(arrivals)
    for g in groups:
        assert sum(s["advantage"] for s in g) == pytest.approx(0.0, abs=1e-9)


def test_a_prompt_with_more_samples_starts_a_new_group():
    mc = MCAdvantage(grpo_size=2, scale="none")
    groups = mc.add(samples([(7, 1.0), (7, 3.0), (7, 5.0), (7, 5.0), (7, 0.0)]))
    assert [[s["advantage"] for s in g] for g in groups] == [[-1.0, 1.0], [0.0, 0.0]]
    assert mc.num_pending == 1


def test_equal_rewards_give_zero_advantage_without_filter():
    mc = MCAdvantage(grpo_size=3)
    (group,) = mc.add([sample("a", 0.1)] * 3)
    assert [s["advantage"] for s in group] == [0.0, 0.0, 0.0]
    assert mc.num_dropped_equal == 0


def test_dapo_filter_drops_and_counts_equal_groups():
    mc = MCAdvantage(grpo_size=2, filter_equal_rewards=True, eps=0.0)
    groups = mc.add(samples([("a", 1.0), ("b", 0.0), ("a", 1.0), ("b", 1.0), ("c", 0.0)]))
    assert [[s["prompt_id"] for s in g] for g in groups] == [["b", "b"]]
    # rewards [0, 1]: mean 0.5, Bessel std sqrt(0.5), eps 0.
    expected = [-0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5)]
    assert [s["advantage"] for s in groups[0]] == pytest.approx(expected, rel=1e-12)
    assert mc.add([sample("c", 0.0)]) == []
    assert (mc.num_dropped_equal, mc.num_emitted_groups, mc.num_pending) == (2, 1, 0)


def test_samples_are_not_mutated_and_keys_are_configurable():
    mc = MCAdvantage(
        grpo_size=2, prompt_key="question", reward_key="score", advantage_key="adv", scale="none"
    )
    originals = [{"question": "q", "score": 2.0}, {"question": "q", "score": 0.0}]
    (group,) = mc.add(originals)
    assert [s["adv"] for s in group] == [1.0, -1.0]
    assert all("adv" not in s for s in originals)


def test_tensor_rewards_and_tensor_prompt_ids():
    mc = MCAdvantage(grpo_size=2, scale="none")
    prompt = torch.tensor(3)
    (group,) = mc.add(samples([(prompt, torch.tensor([1.0])), (prompt, torch.tensor([0.0]))]))
    assert isinstance(group[0]["advantage"], torch.Tensor)
    assert group[0]["advantage"].shape == (1,) and group[0]["advantage"].item() == 0.5
    assert group[1]["advantage"].item() == -0.5


def test_tensordict_samples():
    tensordict = pytest.importorskip("tensordict")
    mc = MCAdvantage(grpo_size=2, scale="none")
    tds = [
        tensordict.TensorDict(
            {"prompt_id": torch.tensor(1), "reward": torch.tensor([r])}, batch_size=[]
        )
        for r in (3.0, 1.0)
    ]
    (group,) = mc.add(tds)
    advantages = torch.stack([td["advantage"] for td in group])
    assert torch.equal(advantages, torch.tensor([[1.0], [-1.0]]))
    assert "advantage" not in tds[0].keys()


def test_bad_samples_and_options_raise():
    mc = MCAdvantage(grpo_size=2)
    with pytest.raises(ValueError, match="not finite"):
        mc.add([sample("a", float("nan"))])
    with pytest.raises(ValueError, match="scalar"):
        mc.add([sample("a", torch.tensor([1.0, 2.0]))])
    with pytest.raises(KeyError, match="reward"):
        mc.add([{"prompt_id": "a"}])
    assert (mc.num_pending, mc.num_pending_groups) == (0, 0)
    # A bad sample later in the call leaves the state untouched (no completed group is lost).
    mc.add([sample("a", 1.0)])
    with pytest.raises(ValueError, match="not finite"):
        mc.add([sample("a", 0.0), sample("b", float("inf"))])
    assert (mc.num_pending, mc.num_emitted_groups) == (1, 0)
    assert len(mc.add([sample("a", 0.0)])) == 1
    with pytest.raises(ValueError, match="'batch'"):
        MCAdvantage(grpo_size=2, scale="batch")
    with pytest.raises(ValueError, match="grpo_size"):
        MCAdvantage(grpo_size=0)
