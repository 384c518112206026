"""MCAdvantage: complete groups only, one prompt per group, advantages, and the DAPO filter; for flat
records (``add``) and as a replay-buffer transform over TorchRL-layout steps (``inv``)."""

import logging
import math
import pickle
import random
import threading

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from rlpost.data import LazyStackStorage, ReplayBuffer
from rlpost.objectives import MCAdvantageSelector
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
    arrivals = [sample(p, float(rng.randint(0, 3)), uid=(p, k)) for p in range(num_prompts) for k in range(grpo_size)]
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
    mc = MCAdvantage(grpo_size=2, prompt_key="question", reward_key="score", advantage_key="adv", scale="none")
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
        tensordict.TensorDict({"prompt_id": torch.tensor(1), "reward": torch.tensor([r])}, batch_size=[])
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


# ---------------------------------------------------------------------------- the transform (inv)


def step_td(query, reward, done=True):
    """One step in TorchRL's layout: "query", ("next", "reward") [1], ("next", "done") [1]."""
    return TensorDict(
        {"query": query, "next": {"reward": torch.tensor([float(reward)]), "done": torch.tensor([done])}},
        batch_size=[],
    )


def turns(*queries_and_rewards):
    """Single-step trajectories, laid end to end (what LLMCollector writes for a single-turn env)."""
    return lazy_stack([step_td(q, r) for q, r in queries_and_rewards], 0)


def trajectory(query, rewards):
    """One trajectory of len(rewards) steps, done at the last."""
    return lazy_stack([step_td(query, r, done=i == len(rewards) - 1) for i, r in enumerate(rewards)], 0)


def expected_advantages(rewards, eps=1e-4):
    r = torch.tensor(rewards, dtype=torch.float64)
    if bool((r == r[0]).all()):
        return [0.0] * len(rewards)
    return ((r - r.mean()) / (r.std() + eps)).tolist()


def test_inv_holds_partial_groups_across_writes_and_releases_complete_ones():
    mc = MCAdvantage(grpo_size=3)
    assert (mc.prompt_key, mc.rewards_key, mc.done_key) == ("query", ("next", "reward"), ("next", "done"))
    assert mc.inv(turns(("a", 1.0), ("b", 0.0))) is None
    assert mc.inv(turns(("a", 0.0))) is None
    assert (mc.queued_groups, mc.queued_trajectories, mc.max_queued_trajectories_per_group) == (2, 3, 2)
    out = mc.inv(turns(("b", 1.0), ("a", 0.0), ("c", 1.0)))
    assert out.batch_size == (3,) and [out[i]["query"] for i in range(3)] == ["a", "a", "a"]
    assert out["advantage"].shape == (3, 1)
    assert out["advantage"].flatten().tolist() == pytest.approx(expected_advantages([1.0, 0.0, 0.0]), rel=1e-6)
    assert (mc.queued_groups, mc.queued_trajectories) == (2, 3)  # b twice, c once
    assert (mc.completed_trajectories, mc.completed_groups, mc.written_groups, mc.num_emitted_groups) == (6, 1, 1, 1)


def test_inv_never_modifies_the_callers_data_and_reads_pass_unchanged():
    mc = MCAdvantage(grpo_size=2)
    data = turns(("a", 1.0), ("a", 0.0))
    out = mc.inv(data)
    assert "advantage" in out.keys() and "advantage" not in data.keys()
    assert all("advantage" not in td.keys() for td in data.tensordicts)
    assert mc(out) is out and mc.forward(out) is out  # the read path


def test_multi_step_trajectories_are_normalised_over_every_step():
    mc = MCAdvantage(grpo_size=2, scale="none")
    assert mc.inv(trajectory("q", [1.0, 0.0, 2.0])) is None
    out = mc.inv(trajectory("q", [3.0]))
    # All four step rewards, mean 1.5, centred (scale="none").
    assert out["advantage"].flatten().tolist() == [-0.5, -1.5, 0.5, 1.5]
    assert out["next", "done"].flatten().tolist() == [False, False, True, True]
    assert mc.completed_decisions == 4


@pytest.mark.parametrize("agg,reduce", [("sum", sum), ("max", max), ("mean", lambda r: sum(r) / len(r))])
def test_trajectory_return_broadcasts_a_group_normalised_return(agg, reduce):
    mc = MCAdvantage(grpo_size=2, trajectory_return=agg)
    rewards = [[0.0, 1.0, 1.0], [2.0, 0.0]]
    assert mc.inv(trajectory("q", rewards[0])) is None
    out = mc.inv(trajectory("q", rewards[1]))
    expected = expected_advantages([reduce(r) for r in rewards])
    assert out["advantage"].flatten().tolist() == pytest.approx([expected[0]] * 3 + [expected[1]] * 2, rel=1e-6)
    assert mc.trajectory_return_sum == pytest.approx(sum(reduce(r) for r in rewards))


def test_several_trajectories_in_one_write_and_in_rows():
    mc = MCAdvantage(grpo_size=2, prompt_key="prompt_id", scale="none")
    flat = torch.cat(
        [
            TensorDict(
                {
                    "prompt_id": torch.tensor([7, 7]),
                    "next": {"reward": torch.tensor([[1.0], [0.0]]), "done": torch.tensor([[False], [True]])},
                },
                batch_size=[2],
            ),  # fmt: skip
            TensorDict(
                {
                    "prompt_id": torch.tensor([7]),
                    "next": {"reward": torch.tensor([[3.0]]), "done": torch.tensor([[True]])},
                },
                batch_size=[1],
            ),  # fmt: skip
        ],
        0,
    )
    out = mc.inv(flat)
    assert out["advantage"].flatten().tolist() == pytest.approx([-1 / 3, -4 / 3, 5 / 3])
    rows = TensorDict(  # [B=2, T=2]: each row two single-step trajectories
        {
            "prompt_id": torch.tensor([[1, 2], [1, 2]]),
            "next": {
                "reward": torch.tensor([[[1.0], [0.0]], [[0.0], [0.0]]]),
                "done": torch.ones(2, 2, 1, dtype=torch.bool),
            },
        },  # fmt: skip
        batch_size=[2, 2],
    )
    out = mc.inv(rows)
    assert out["prompt_id"].tolist() == [1, 1, 2, 2] and out["advantage"].flatten().tolist() == [0.5, -0.5, 0.0, 0.0]


def test_dynamic_sampling_filters():
    bounded = MCAdvantage(grpo_size=2, trajectory_return="sum", keep_return_bounds=(0.1, 0.9))
    assert bounded.inv(turns(("fail", 0.0), ("fail", 0.0), ("pass", 1.0), ("pass", 1.0))) is None
    assert bounded.inv(turns(("mixed", 0.0), ("mixed", 1.0))).batch_size == (2,)
    assert (bounded.completed_groups, bounded.written_groups, bounded.dropped_groups) == (3, 1, 2)
    assert (bounded.successful_trajectories, bounded.trajectory_return_max, bounded.queued_groups) == (3, 1.0, 0)

    equal = MCAdvantage(grpo_size=2, filter_equal_rewards=True)
    assert equal.inv(turns(("a", 0.5), ("a", 0.5))) is None
    assert (equal.num_dropped_equal, equal.dropped_groups, equal.written_groups) == (1, 1, 0)


def test_stats_reset_and_clear():
    mc = MCAdvantage(grpo_size=2, trajectory_return="sum")
    mc.inv(turns(("a", 1.0)))
    mc.add([sample("x", 1.0)])
    stats = mc.get_stats()
    assert (stats["queued_groups"], stats["queued_trajectories"], stats["completed_trajectories"]) == (1, 1, 1)
    assert (stats["num_pending"], mc.num_pending_groups) == (2, 2)
    mc.clear_queues()
    assert (mc.queued_groups, mc.num_pending, mc.completed_trajectories) == (0, 0, 1)
    mc.reset_stats()
    assert mc.completed_trajectories == 0 and mc.trajectory_return_max == float("-inf")


def test_each_way_in_has_its_own_default_keys_and_explicit_keys_serve_both():
    mc = MCAdvantage(grpo_size=2, scale="none")
    assert len(mc.add([{"prompt_id": 1, "reward": 1.0}, {"prompt_id": 1, "reward": 0.0}])) == 1
    assert mc.inv(turns(("a", 1.0), ("a", 0.0))) is not None
    keyed = MCAdvantage(grpo_size=2, prompt_key="group", rewards_key="score", done_key="end", scale="none")
    (group,) = keyed.add([{"group": "g", "score": 2.0}, {"group": "g", "score": 0.0}])
    assert [s["advantage"] for s in group] == [1.0, -1.0]
    td = TensorDict(
        {"group": torch.tensor([5, 5]), "score": torch.tensor([2.0, 0.0]), "end": torch.tensor([True, True])},
        batch_size=[2],
    )
    assert keyed.inv(td)["advantage"].tolist() == [1.0, -1.0]
    assert MCAdvantage(grpo_size=2, reward_key="score").rewards_key == "score"


def test_inv_bad_input_raises_and_leaves_the_state_unchanged():
    mc = MCAdvantage(grpo_size=2)
    mc.inv(turns(("a", 1.0)))
    unfinished = lazy_stack([step_td("a", 0.0), step_td("b", 1.0, done=False)], 0)
    with pytest.raises(RuntimeError, match="complete trajectories"):
        mc.inv(unfinished)
    with pytest.raises(KeyError, match="'query'"):
        mc.inv(TensorDict({"next": {"reward": torch.ones(1, 1), "done": torch.ones(1, 1, dtype=torch.bool)}}, [1]))
    with pytest.raises(KeyError, match=r"\('next', 'done'\)"):
        mc.inv(TensorDict({"query": torch.zeros(1)}, [1]))
    with pytest.raises(ValueError, match="not finite"):
        mc.inv(turns(("a", 0.0), ("b", float("nan"))))
    with pytest.raises(ValueError, match="batch dimension"):
        mc.inv(step_td("a", 0.0))
    with pytest.raises(TypeError, match="TensorDict of steps"):
        mc.inv([step_td("a", 0.0)])
    assert (mc.queued_trajectories, mc.completed_trajectories, mc.written_groups) == (1, 1, 0)
    with pytest.raises(ValueError, match="unhashable dict"):
        mc.add([{"prompt_id": {"a": 1}, "reward": 1.0}])


def test_options_are_checked():
    with pytest.raises(ValueError, match="trajectory_return must be one of"):
        MCAdvantage(grpo_size=2, trajectory_return="median")
    with pytest.raises(ValueError, match="grpo_size >= 2"):
        MCAdvantage(grpo_size=1, trajectory_return="sum")
    with pytest.raises(ValueError, match="set trajectory_return"):
        MCAdvantage(grpo_size=2, keep_return_bounds=(0.1, 0.9))
    with pytest.raises(ValueError, match="increasing"):
        MCAdvantage(grpo_size=2, trajectory_return="sum", keep_return_bounds=(0.9, 0.1))
    with pytest.raises(ValueError, match="needs trajectory_return"):
        MCAdvantage(grpo_size=2, candidate_group_size=4)
    with pytest.raises(TypeError, match="candidate_selector needs a select"):
        MCAdvantage(grpo_size=2, candidate_selector=object())
    with pytest.raises(ValueError, match="candidate_group_size must be an int"):
        MCAdvantage(grpo_size=2, trajectory_return="sum", candidate_group_size=2.5)
    with pytest.raises(TypeError, match="not both"):
        MCAdvantage(grpo_size=2, rewards_key="r", reward_key="r")
    assert MCAdvantage(grpo_size=2, candidate_group_size=2).candidate_group_size == 2


@pytest.mark.parametrize("as_constructor_argument", [True, False])
def test_in_a_replay_buffer_groups_complete_across_extends(as_constructor_argument):
    mc = MCAdvantage(grpo_size=4)
    if as_constructor_argument:
        rb = ReplayBuffer(storage=LazyStackStorage(100), transform=mc, batch_size=4)
    else:
        rb = ReplayBuffer(storage=LazyStackStorage(100), batch_size=4)
        rb.append_transform(mc)
    rewards = {"a": [1.0, 0.0, 0.0, 1.0], "b": [0.2, 0.4, 0.6, 0.8]}
    rb.extend(turns(("a", 1.0), ("b", 0.2), ("a", 0.0)))
    assert len(rb) == 0
    assert rb.add(step_td("b", 0.4)).numel() == 0  # add goes through the transform too
    rb.extend(turns(("b", 0.6), ("a", 0.0)))
    assert len(rb) == 0
    rb.extend(turns(("a", 1.0)))
    assert len(rb) == 4
    rb.add(step_td("b", 0.8))
    assert len(rb) == 8 and mc.queued_groups == 0
    stored = rb[:]
    for query in ("a", "b"):
        advantages = [stored[i]["advantage"].item() for i in range(8) if stored[i]["query"] == query]
        assert advantages == pytest.approx(expected_advantages(rewards[query]), rel=1e-6)
    batch = rb.sample()
    assert batch["advantage"].shape == (4, 1) and batch["next", "reward"].shape == (4, 1)


def test_several_writer_threads_complete_shared_groups():
    mc = MCAdvantage(grpo_size=4)
    rb = ReplayBuffer(storage=LazyStackStorage(10_000), transform=mc)

    def writer(k):  # each writer gives each prompt one completion
        for p in range(40):
            rb.extend(turns((f"p{p}", float(k))))

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(rb) == 160 and mc.queued_groups == 0 and mc.written_groups == 40
    stored = rb[:]
    by_prompt = {}
    for i in range(160):
        by_prompt.setdefault(stored[i]["query"], []).append(
            (stored[i]["next", "reward"].item(), stored[i]["advantage"].item())
        )
    for members in by_prompt.values():
        assert sorted(r for r, _ in members) == [0.0, 1.0, 2.0, 3.0]
        assert sum(a for _, a in members) == pytest.approx(0.0, abs=1e-6)


def test_pickles_and_logs_when_verbose(caplog):
    mc = pickle.loads(pickle.dumps(MCAdvantage(grpo_size=2, verbose=True)))
    mc.inv(turns(("a", 1.0)))
    with caplog.at_level(logging.INFO, logger="rlpost.objectives.mc_advantage"):
        mc.inv(turns(("a", 0.0)))
    assert "group 'a' released with 2 steps" in caplog.text


def test_inv_groups_by_any_hashable_identity():
    """Deliberate deviation: TorchRL takes string or tensor identities only; here an int (or a
    list, taken as a tuple) held as a non-tensor entry groups too."""
    mc = MCAdvantage(grpo_size=2, scale="none")
    out = mc.inv(turns((7, 1.0), ([1, 2], 0.0), (7, 0.0), ([1, 2], 2.0)))
    assert out["advantage"].flatten().tolist() == [0.5, -0.5, -1.0, 1.0]
    assert mc.completed_groups == 2 and mc.queued_groups == 0


# ---------------------------------------------------------------------------- oversampling and sharing


def group_traj(group_id, rewards):
    """One trajectory of len(rewards) steps under an int group id (TorchRL's test layout)."""
    n_steps = len(rewards)
    return TensorDict(
        {
            "group_id": torch.full((n_steps,), group_id),
            ("next", "reward"): torch.tensor(rewards).reshape(n_steps, 1),
            ("next", "done"): torch.tensor([False] * (n_steps - 1) + [True]).reshape(n_steps, 1),
        },
        batch_size=[n_steps],
    )


def oversampled(**options):
    defaults = dict(grpo_size=2, prompt_key="group_id", trajectory_return="sum", candidate_group_size=4)
    return MCAdvantage(**{**defaults, **options})


def test_selection_waits_for_candidate_selection_min_size():
    mc = oversampled(keep_return_bounds=(0.1, 0.9), candidate_selection_min_size=3)
    assert mc.inv(group_traj(0, [0.0])) is None
    assert mc.inv(group_traj(0, [1.0])) is None  # useful already, but only 2 of the 3 candidates needed
    out = mc.inv(group_traj(0, [0.0]))
    # (0, 1) and (1, 2) both have mean 0.5 and spread 1: the first is kept
    assert out["next", "reward"].flatten().tolist() == [0.0, 1.0]
    assert out["advantage"].flatten().tolist() == pytest.approx(expected_advantages([0.0, 1.0]), rel=1e-6)
    assert (mc.rescued_groups, mc.selected_trajectories, mc.unselected_trajectories) == (0, 2, 1)
    assert mc.queued_groups == 0


def test_the_selector_receives_every_candidate_and_may_wait_or_drop():
    seen = []

    class Recording:  # no in_keys: it receives every entry of the candidates
        def select(self, candidates, *, group_size, keep_return_bounds=None):
            seen.append(candidates)
            return [2, 0] if candidates.batch_size == (3,) else None

    mc = oversampled(candidate_group_size=3, candidate_selector=Recording())
    assert mc.inv(group_traj(0, [1.0, 2.0])) is None
    assert mc.inv(group_traj(0, [0.0])) is None
    assert seen[0]["return"].dtype == torch.float64 and seen[0]["return"].tolist() == [3.0, 0.0]
    out = mc.inv(group_traj(0, [5.0, 1.0, 1.0]))
    candidates = seen[-1]
    assert candidates["return"].tolist() == [3.0, 0.0, 7.0]
    assert [t["next", "reward"].flatten().tolist() for t in candidates["trajectories"].unbind(0)] == [
        [1.0, 2.0],
        [0.0],
        [5.0, 1.0, 1.0],
    ]
    # the selector's order: candidate 2 (return 7, three steps), then candidate 0 (return 3, two steps)
    assert out["next", "reward"].flatten().tolist() == [5.0, 1.0, 1.0, 1.0, 2.0]
    high, low = expected_advantages([7.0, 3.0])
    assert out["advantage"].flatten().tolist() == pytest.approx([high] * 3 + [low] * 2, rel=1e-6)
    assert (mc.written_groups, mc.selected_trajectories, mc.unselected_trajectories) == (1, 2, 1)

    never = oversampled(
        candidate_group_size=3, candidate_selector=type("Never", (), {"select": lambda *a, **k: None})()
    )
    for rewards in ([1.0], [0.0], [2.0]):
        assert never.inv(group_traj(0, rewards)) is None
    assert (never.completed_groups, never.dropped_groups, never.num_dropped_equal, never.queued_groups) == (1, 1, 0, 0)


def test_a_selectors_answer_is_checked():
    class Twice(MCAdvantageSelector):
        def select(self, candidates, *, group_size, keep_return_bounds=None):
            return [0, 0]

    mc = oversampled(candidate_selector=Twice())
    mc.inv(group_traj(0, [0.0]))
    with pytest.raises(ValueError, match=r"Twice.select must return 2 distinct indices of the 2 candidates.*\[0, 0\]"):
        mc.inv(group_traj(0, [1.0]))


def test_oversampling_with_filter_equal_rewards_waits_for_unequal_returns():
    mc = oversampled(candidate_group_size=3, filter_equal_rewards=True)
    assert mc.inv(group_traj(0, [1.0])) is None
    assert mc.inv(group_traj(0, [1.0])) is None  # two equal returns: not useful yet
    out = mc.inv(group_traj(0, [0.0]))
    # no bounds: spread over the sorted returns [0, 1, 1], lowest and highest
    assert out["next", "reward"].flatten().tolist() == [0.0, 1.0]
    assert (mc.rescued_groups, mc.unselected_trajectories, mc.num_dropped_equal) == (1, 1, 0)
    for _ in range(3):
        assert mc.inv(group_traj(1, [0.5])) is None
    assert (mc.completed_groups, mc.dropped_groups, mc.num_dropped_equal, mc.queued_groups) == (2, 1, 1, 0)


def test_add_does_not_oversample():
    with pytest.raises(NotImplementedError, match="does not oversample"):
        oversampled().add([sample("a", 1.0)])


def test_selection_counters_are_stats_and_reset():
    mc = oversampled(keep_return_bounds=(0.1, 0.9))
    for rewards in ([0.0], [0.0], [1.0]):
        mc.inv(group_traj(0, rewards))
    stats = mc.get_stats()
    assert {k: stats[k] for k in ("rescued_groups", "selected_trajectories", "unselected_trajectories")} == {
        "rescued_groups": 1,
        "selected_trajectories": 2,
        "unselected_trajectories": 1,
    }
    assert "oversampl" not in repr(mc) and "candidate_group_size=4" in repr(mc)
    mc.reset_stats()
    assert (mc.rescued_groups, mc.selected_trajectories, mc.written_groups) == (0, 0, 0)


def test_a_shared_transform_and_its_copies_fill_the_same_groups():
    mc = MCAdvantage(grpo_size=2, scale="none")
    mc.inv(turns(("a", 1.0)))
    assert mc.share_memory_().share_memory_() is mc and mc.is_shared
    try:
        copy = pickle.loads(pickle.dumps(mc))  # what a child process receives
        assert copy.is_shared and copy.queued_groups == 1
        out = copy.inv(turns(("a", 3.0), ("b", 0.0)))
        assert out["advantage"].flatten().tolist() == [-1.0, 1.0]
        assert copy.add([sample("x", 2.0)]) == []
        assert (mc.written_groups, mc.completed_trajectories, mc.queued_groups, mc.num_pending) == (1, 3, 1, 2)
    finally:
        mc.close()
    # close() took the state back: the transform goes on in this process
    assert not mc.is_shared and (mc.written_groups, mc.queued_groups, mc.num_pending) == (1, 1, 2)
    assert mc.inv(turns(("b", 2.0)))["advantage"].flatten().tolist() == [-1.0, 1.0]
    assert len(mc.add([sample("x", 0.0)])) == 1
    mc.close()  # nothing left to stop


def test_verbose_logs_selection(caplog):
    mc = oversampled(keep_return_bounds=(0.1, 0.9), verbose=True)
    with caplog.at_level(logging.INFO, logger="rlpost.objectives.mc_advantage"):
        for rewards in ([0.0], [0.0], [1.0]):
            mc.inv(group_traj(0, rewards))
        for _ in range(4):
            mc.inv(group_traj(1, [0.0]))
    assert "group 0 released (2 of 3 candidates)" in caplog.text
    assert "group 1 dropped (mean return outside (0.1, 0.9))" in caplog.text
