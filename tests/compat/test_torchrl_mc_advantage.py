"""TorchRL's MCAdvantage (``torchrl.objectives.llm.MCAdvantage``) run against rlpost: its tests
(candidate selection, ``share_memory_`` with two writer processes and validation included) and
docstring example with rlpost's imports, and the GRPO recipe's composition
(``LLMCollector(replay_buffer=rb)`` -> ``ReplayBuffer`` with ``MCAdvantage`` -> ``rb.sample()``)
on a DatasetChatEnv with a scripted policy.

Expected advantages use rlpost's scaling, ``(r - mean) / (std + 1e-4)`` with all-equal groups at
exactly 0, where TorchRL divides by ``std.clamp_min(1e-6)``; where a TorchRL test states its
numbers, they are checked to within that difference.
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import tensordict
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict, lazy_stack

from rlpost.collect import LLMCollector
from rlpost.data import History, LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement
from rlpost.envs import AnswerRewardParser, DatasetChatEnv
from rlpost.objectives import MCAdvantage, MCAdvantageSelector

pytestmark = pytest.mark.compat

PROMPTS = [
    "Lorem ipsum dolor sit amet,",
    "consectetur adipiscing elit,",
    "sed do eiusmod tempor incididunt ut labore et dolore magna aliqua.",
    "Ut enim ad minim veniam, quis nostrud exercitation",
    "ullamco laboris nisi ut aliquip ex ea commodo consequat.",
    "Duis aute irure dolor in reprehenderit in voluptate velit esse cillum dolore",
    "eu fugiat nulla pariatur.",
]


@pytest.fixture(autouse=True)
def list_to_stack():
    with tensordict.set_list_to_stack(True):
        yield


def make_group_traj(group_id, rewards, group_key="group_id"):
    """TorchRL's test helper: one trajectory of ``len(rewards)`` steps with a tensor group id."""
    n_steps = len(rewards)
    return TensorDict(
        {
            group_key: torch.full((n_steps,), group_id),
            ("next", "reward"): torch.tensor(rewards).reshape(n_steps, 1),
            ("next", "done"): torch.tensor([False] * (n_steps - 1) + [True]).reshape(n_steps, 1),
        },
        batch_size=[n_steps],
    )


def rlpost_advantages(values):
    values = torch.as_tensor(values, dtype=torch.float64)
    if bool((values == values[0]).all()):
        return torch.zeros_like(values)
    return (values - values.mean()) / (values.std() + 1e-4)


@pytest.mark.parametrize("ndim", [1, 2])
def test_mc_advantage(ndim):
    """TorchRL's test_mc_advantage: random trajectories of per-token rewards, 7 prompts."""

    def make_silly_trajectory(n_steps=None):
        while True:
            steps = n_steps if n_steps is not None else torch.randint(low=2, high=100, size=(1,)).item()
            tds = []
            for _ in range(steps):
                n_tokens = torch.randint(low=1, high=100, size=(1,)).item()
                rewards = [torch.randn(n_tokens, 1)]
                prompt = np.random.choice(PROMPTS)
                td = TensorDict(query=prompt, next=TensorDict(reward=rewards, done=torch.zeros(1, dtype=torch.bool)))
                tds.append(td)
            tds[-1]["next", "done"] = torch.ones(1, dtype=torch.bool)
            yield lazy_stack(tds)

    rb = ReplayBuffer(storage=LazyStackStorage(100))
    rb.append_transform(MCAdvantage(grpo_size=4))
    if ndim == 1:
        gen = make_silly_trajectory()
        for _ in range(100):
            rb.extend(next(gen))
    else:
        gen = make_silly_trajectory(n_steps=5)
        for _ in range(100):
            rb.extend(lazy_stack([next(gen) for _ in range(3)]).view(-1))
    assert len(rb)
    s = rb.sample(1)
    assert "advantage" in s.keys()
    # Per-token rewards: the advantage has each step's reward shape.
    assert s[0]["advantage"].shape == s[0]["next", "reward"].shape


@pytest.mark.parametrize("agg", ["sum", "max", "mean"])
def test_mc_advantage_trajectory_return(agg):
    adv_t = MCAdvantage(grpo_size=3, prompt_key="group_id", trajectory_return=agg)
    trajs = [make_group_traj(0, [0.0, 0.0]), make_group_traj(0, [0.0, 1.0, 1.0]), make_group_traj(0, [1.0, 0.0])]
    assert adv_t.inv(trajs[0]) is None
    assert adv_t.inv(trajs[1]) is None
    out = adv_t.inv(trajs[2])
    reduce = {"sum": torch.sum, "max": torch.max, "mean": torch.mean}[agg]
    returns = torch.stack([reduce(traj["next", "reward"]) for traj in trajs])
    torchrl_expected = (returns - returns.mean()) / returns.std().clamp_min(1e-6)
    assert out["advantage"].shape == out["next", "reward"].shape
    chunks = out["advantage"].squeeze(-1).split([2, 3, 2])
    for chunk, exp, ours in zip(chunks, torchrl_expected, rlpost_advantages(returns)):
        torch.testing.assert_close(chunk, exp.expand_as(chunk), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(chunk, ours.float().expand_as(chunk))


def test_mc_advantage_string_prompt_survives():
    def traj(prompt, reward, n_steps=2, n_tokens=4):
        steps = [
            TensorDict(
                {
                    "query": NonTensorData(prompt),
                    "tokens": torch.zeros(n_tokens, dtype=torch.long),
                    ("next", "reward"): torch.tensor([reward]),
                    ("next", "done"): torch.tensor([i == n_steps - 1]),
                }
            )
            for i in range(n_steps)
        ]
        return lazy_stack(steps)

    adv_t = MCAdvantage(grpo_size=2, prompt_key="query")
    assert adv_t.inv(traj("prompt-a", 0.0, n_steps=2, n_tokens=4)) is None
    out = adv_t.inv(traj("prompt-a", 1.0, n_steps=3, n_tokens=6))
    assert out is not None and "advantage" in out.keys()
    assert out[0]["query"] == "prompt-a" and out[4]["query"] == "prompt-a"
    assert [len(out[i]["tokens"]) for i in range(5)] == [4, 4, 6, 6, 6]


@pytest.mark.parametrize("group_key", ["group_id", ("meta", "group_id")])
def test_mc_advantage_tensor_group_key(group_key):
    adv_t = MCAdvantage(grpo_size=2, prompt_key=group_key, trajectory_return="sum")
    assert adv_t.inv(make_group_traj(0, [1.0, 0.0], group_key=group_key)) is None
    assert adv_t.inv(make_group_traj(1, [0.0, 0.0], group_key=group_key)) is None
    out0 = adv_t.inv(make_group_traj(0, [0.0, 0.0], group_key=group_key))
    assert out0 is not None and (out0[group_key] == 0).all()
    out1 = adv_t.inv(make_group_traj(1, [0.0, 1.0], group_key=group_key))
    assert out1 is not None and (out1[group_key] == 1).all()


def test_mc_advantage_dynamic_sampling():
    adv_t = MCAdvantage(grpo_size=2, prompt_key="group_id", trajectory_return="sum", keep_return_bounds=(0.1, 0.9))
    assert adv_t.inv(make_group_traj(0, [0.0])) is None  # all-failed group: dropped
    assert adv_t.inv(make_group_traj(0, [0.0])) is None
    assert adv_t.inv(make_group_traj(1, [1.0])) is None  # all-succeeded group: dropped
    assert adv_t.inv(make_group_traj(1, [1.0])) is None
    assert adv_t.inv(make_group_traj(2, [0.0])) is None  # mixed group: kept
    assert adv_t.inv(make_group_traj(2, [1.0])) is not None
    assert not adv_t.queues
    assert adv_t.completed_trajectories == 6
    assert adv_t.completed_decisions == 6
    assert adv_t.successful_trajectories == 3
    assert adv_t.trajectory_return_sum == 3.0
    assert adv_t.trajectory_return_max == 1.0
    assert adv_t.completed_groups == 3
    assert adv_t.written_groups == 1
    assert adv_t.dropped_groups == 2
    assert adv_t.queued_groups == 0
    assert adv_t.queued_trajectories == 0
    assert adv_t.max_queued_trajectories_per_group == 0
    adv_t.reset_stats()
    assert (adv_t.completed_groups, adv_t.written_groups, adv_t.dropped_groups) == (0, 0, 0)
    assert (adv_t.completed_trajectories, adv_t.completed_decisions) == (0, 0)


def test_mc_advantage_clear_queues_preserves_stats():
    adv_t = MCAdvantage(grpo_size=2, prompt_key="group_id", trajectory_return="sum")
    assert adv_t.inv(make_group_traj(0, [1.0])) is None
    assert (adv_t.queued_groups, adv_t.queued_trajectories, adv_t.completed_trajectories) == (1, 1, 1)
    stats = adv_t.get_stats()
    assert (stats["queued_groups"], stats["queued_trajectories"], stats["completed_trajectories"]) == (1, 1, 1)
    adv_t.clear_queues()
    assert (adv_t.queued_groups, adv_t.queued_trajectories, adv_t.completed_trajectories) == (0, 0, 1)


def test_mc_advantage_trajectory_return_rb():
    rb = ReplayBuffer(storage=LazyStackStorage(100))
    rb.append_transform(
        MCAdvantage(grpo_size=2, prompt_key="group_id", trajectory_return="sum", keep_return_bounds=(0.1, 0.9))
    )
    rb.extend(make_group_traj(0, [0.0, 0.0]))
    assert len(rb) == 0
    rb.extend(make_group_traj(0, [0.0, 1.0]))
    assert len(rb) == 4
    rb.extend(make_group_traj(1, [0.0, 0.0]))
    rb.extend(make_group_traj(1, [0.0, 0.0]))
    assert len(rb) == 4
    assert "advantage" in rb.sample(4).keys()


def test_mc_advantage_multi_done_flat_batch():
    adv_t = MCAdvantage(grpo_size=2, prompt_key="group_id", trajectory_return="sum")
    flat = torch.cat(
        [make_group_traj(0, [1.0, 0.0]), make_group_traj(0, [0.0, 0.0, 0.0]), make_group_traj(1, [0.0])], 0
    )
    out = adv_t.inv(flat)
    assert out.shape == (5,)
    returns = torch.tensor([1.0, 0.0])
    torchrl_expected = (returns - returns.mean()) / returns.std().clamp_min(1e-6)
    torch.testing.assert_close(
        out["advantage"].squeeze(-1),
        torch.cat([torchrl_expected[0].expand(2), torchrl_expected[1].expand(3)]),
        rtol=1e-3,
        atol=1e-3,
    )
    assert sum(len(q) for q in adv_t.queues.values()) == 1
    assert adv_t.max_queued_trajectories_per_group == 1


def test_mc_advantage_mixed_lazy_plain_trajectories_return_a_lazy_stack():
    """TorchRL's ``test_mc_advantage_mixed_lazy_plain_trajectories_return_plain_tensordict``: one
    plain and one lazily stacked trajectory queued, then a flat write completing both groups.

    Deviation: the released steps come back as a lazy stack of copies of the caller's steps
    (TorchRL: a plain TensorDict); what TorchRL's test reads of it (shape, ``advantage`` in the
    reward's shape, the queue sizes) reads the same, and ``to_tensordict()`` gives the plain one."""
    adv_t = MCAdvantage(grpo_size=2, prompt_key="group_id", trajectory_return="sum")
    assert adv_t.inv(make_group_traj(0, [1.0])) is None
    lazy_traj = lazy_stack([make_group_traj(1, [0.0])], 0).unbind(0)[0]
    assert adv_t.inv(lazy_traj) is None
    assert all(isinstance(queue[0], TensorDict) for queue in (adv_t.queues[0], adv_t.queues[1]))

    flat = torch.cat([make_group_traj(0, [0.0]), make_group_traj(1, [1.0])], 0)
    out = adv_t.inv(flat)

    assert isinstance(out, LazyStackedTensorDict)  # TorchRL: isinstance(out, TensorDict)
    assert out.shape == (4,)
    assert out["advantage"].shape == out["next", "reward"].shape
    assert adv_t.queued_groups == 0
    assert adv_t.max_queued_trajectories_per_group == 0
    # groups in the order they completed, each in arrival order: returns [1, 0] then [0, 1]
    assert out["group_id"].tolist() == [0, 0, 1, 1]
    assert out["next", "reward"].flatten().tolist() == [1.0, 0.0, 0.0, 1.0]
    expected = torch.cat([rlpost_advantages([1.0, 0.0]), rlpost_advantages([0.0, 1.0])]).float()
    torch.testing.assert_close(out["advantage"].flatten(), expected)
    plain = out.to_tensordict()
    assert type(plain) is TensorDict and plain.shape == (4,)
    torch.testing.assert_close(plain["advantage"], out["advantage"])
    assert "advantage" not in flat.keys()  # copies: the caller's steps are left as they were


def test_mc_advantage_lazily_stacked_trajectory_steps():
    """A trajectory that is a lazy stack of its steps (as a LazyStackStorage holds them) groups
    with a plain one; its advantages are those of the plain case."""
    adv_t = MCAdvantage(grpo_size=2, prompt_key="group_id", trajectory_return="sum")
    steps = lazy_stack(list(make_group_traj(3, [0.0, 1.0]).unbind(0)), 0)
    assert isinstance(steps, LazyStackedTensorDict)
    assert adv_t.inv(steps) is None
    out = adv_t.inv(make_group_traj(3, [0.0, 0.0]))
    assert out.shape == (4,) and out["advantage"].shape == (4, 1)
    expected = rlpost_advantages([1.0, 0.0]).float().repeat_interleave(2)
    torch.testing.assert_close(out["advantage"].flatten(), expected)
    assert "advantage" not in steps.keys()


def test_mc_advantage_docstring_example():
    def traj(group_id, rewards):
        T = len(rewards)
        return TensorDict(
            group_id=torch.full((T,), group_id),
            next=TensorDict(
                reward=torch.tensor(rewards).reshape(T, 1),
                done=torch.tensor([False] * (T - 1) + [True]).reshape(T, 1),
                batch_size=[T],
            ),
            batch_size=[T],
        )

    t = MCAdvantage(grpo_size=2, prompt_key="group_id", trajectory_return="sum")
    assert t.inv(traj(7, [0.0, 0.0, 0.0])) is None  # waits for the full group
    out = t.inv(traj(7, [0.0, 0.0, 1.0]))  # group of 2 complete
    # TorchRL prints tensor([-0.7071, ...]); rlpost's eps=1e-4 gives -0.7070.
    torch.testing.assert_close(
        out["advantage"].squeeze(-1), torch.tensor([-0.7071] * 3 + [0.7071] * 3), rtol=0, atol=2e-4
    )
    t = MCAdvantage(grpo_size=2, prompt_key="group_id", trajectory_return="sum", keep_return_bounds=(0.1, 0.9))
    assert t.inv(traj(0, [0.0, 0.0])) is None
    assert t.inv(traj(0, [0.0, 0.0])) is None  # an all-failed group is dropped wholesale


# ---------------------------------------------------------------------------- the GRPO recipe's composition

ROWS = [{"query": f"What is {i} mod 3?", "answer": str(i % 3)} for i in range(12)]


class ScriptedAnswers:
    """Answers every row with ``<answer>c mod 3</answer>``, ``c`` counting the rows answered, or
    always with ``<answer>{fixed}</answer>``: right for about a third of the prompts' copies."""

    def __init__(self, fixed=None):
        self.answered = 0
        self.fixed = fixed

    def __call__(self, td):
        n = td.batch_size[0]
        answers = []
        for _ in range(n):
            answers.append(self.fixed if self.fixed is not None else str(self.answered % 3))
            self.answered += 1
        reply = History(role=["assistant"] * n, content=[f"<answer>{a}</answer>" for a in answers], batch_size=(n,))
        td["history"].full = td["history"].prompt.extend(reply.unsqueeze(-1), dim=-1, inplace=False)
        return td


def make_env(num_envs, repeats):
    env = DatasetChatEnv(dataset=ROWS, shuffle=False, num_envs=num_envs, repeats=repeats)
    return env.append_transform(AnswerRewardParser())


def groups_in(rb):
    """query -> [(prompt_id, reward, advantage)] in storage order (rewards are float32: rounded)."""
    stored = rb[:]
    groups = {}
    for i in range(len(rb)):
        step = stored[i]
        groups.setdefault(step["query"], []).append(
            (step["prompt_id"].item(), round(step["next", "reward"].item(), 6), step["advantage"].item())
        )
    return groups


def test_grpo_recipe_collector_to_buffer_with_mc_advantage():
    grpo_size = 4
    rb = ReplayBuffer(storage=LazyStackStorage(64), sampler=SamplerWithoutReplacement(), batch_size=4)
    mc = MCAdvantage(grpo_size=grpo_size)
    rb.append_transform(mc)
    # 3 envs, 4 copies of each prompt: a group is split across resets and across extends.
    collector = LLMCollector(
        make_env(num_envs=3, repeats=grpo_size), policy=ScriptedAnswers(), dialog_turns_per_batch=3,
        total_dialog_turns=21, replay_buffer=rb,
    )  # fmt: skip
    assert list(collector) == [None] * 7
    # 21 turns: prompts 0..4 complete (20 written), prompt 5 has 1 of its 4 copies pending.
    assert len(rb) == 20 and mc.queued_groups == 1 and mc.queued_trajectories == 1
    groups = groups_in(rb)
    assert sorted(groups) == sorted(row["query"] for row in ROWS[:5])
    nonzero = 0
    for members in groups.values():
        assert len(members) == grpo_size and len({pid for pid, _, _ in members}) == 1
        rewards = [r for _, r, _ in members]
        assert set(rewards) <= {1.0, 0.1}
        expected = rlpost_advantages(rewards).tolist()
        assert [a for _, _, a in members] == pytest.approx(expected, rel=1e-5, abs=1e-6)
        nonzero += any(a != 0 for a in expected)
    assert nonzero >= 2
    # One pass of the trainer's loop over the buffer sees every written turn once.
    batches = list(rb)
    assert [b.batch_size[0] for b in batches] == [4] * 5
    assert all(b["advantage"].shape == (4, 1) for b in batches)
    assert sum(b["advantage"].sum().item() for b in batches) == pytest.approx(0.0, abs=1e-4)


def test_groups_from_two_writers_complete_in_one_buffer():
    mc = MCAdvantage(grpo_size=4)
    rb = ReplayBuffer(storage=LazyStackStorage(64), transform=mc, batch_size=4)
    # Each writer serves 2 copies of each prompt; a group needs both writers' copies.
    counting = LLMCollector(make_env(num_envs=2, repeats=2), policy=ScriptedAnswers(), dialog_turns_per_batch=2,
                            replay_buffer=rb)  # fmt: skip
    wrong = LLMCollector(make_env(num_envs=2, repeats=2), policy=ScriptedAnswers(fixed="x"), dialog_turns_per_batch=2,
                         replay_buffer=rb)  # fmt: skip
    for _ in range(3):
        counting.next()
        assert mc.queued_groups == 1
        wrong.next()
    assert len(rb) == 12 and mc.queued_groups == 0 and mc.written_groups == 3
    for members in groups_in(rb).values():
        rewards = [r for _, r, _ in members]
        assert rewards.count(0.1) >= 2  # the fixed writer is always wrong
        assert [a for _, _, a in members] == pytest.approx(rlpost_advantages(rewards).tolist(), rel=1e-5, abs=1e-6)
    assert rb.sample()["advantage"].shape == (4, 1)


# ---------------------------------------------------------------------------- oversampling and sharing
# TorchRL's candidate-selection, share_memory and validation tests. Its test_ray_mc_advantage is in
# tests/integration/objectives/test_ray_mc_advantage.py (it needs a Ray cluster).


def test_mc_advantage_candidate_selection_rescues_dynamic_sampling_group():
    selector = MCAdvantageSelector()
    returns = TensorDict({"return": torch.tensor([0.0, 0.0, 0.0, 1.0])}, [4])
    assert selector.select(returns, group_size=2, keep_return_bounds=(0.1, 0.9)) == [0, 3]
    adv_t = MCAdvantage(
        grpo_size=2, prompt_key="group_id", trajectory_return="sum", keep_return_bounds=(0.1, 0.9),
        candidate_group_size=4, candidate_selector=selector,
    )  # fmt: skip
    for _ in range(3):
        assert adv_t.inv(make_group_traj(0, [0.0])) is None
    out = adv_t.inv(make_group_traj(0, [1.0]))
    assert out.shape == (2,) and out["advantage"].shape == out["next", "reward"].shape
    # candidates 0 and 3 (returns 0 and 1): TorchRL's advantages are -/+ 0.7071
    torch.testing.assert_close(out["advantage"].squeeze(-1), torch.tensor([-0.7071, 0.7071]), rtol=0, atol=2e-4)
    assert out["next", "reward"].squeeze(-1).tolist() == [0.0, 1.0]
    assert (adv_t.completed_groups, adv_t.written_groups, adv_t.dropped_groups) == (1, 1, 0)
    assert (adv_t.rescued_groups, adv_t.selected_trajectories, adv_t.unselected_trajectories) == (1, 2, 2)


def test_mc_advantage_candidate_selector_reads_tensordict():
    class ScoreSelector(MCAdvantageSelector):
        def __init__(self):
            super().__init__(in_keys=[("trajectories", "selector_score")])

        def select(self, candidates, *, group_size, keep_return_bounds=None):
            trajectories = candidates.select(*self.in_keys, strict=True).get("trajectories")
            scores = torch.stack([trajectory.get("selector_score")[0] for trajectory in trajectories.unbind(0)])
            return scores.topk(group_size).indices.tolist()

    def make_scored_traj(score, rewards):
        traj = make_group_traj(0, rewards)
        traj.set("selector_score", torch.full((len(rewards),), float(score)))
        return traj

    adv_t = MCAdvantage(
        grpo_size=2, prompt_key="group_id", trajectory_return="sum", candidate_group_size=3,
        candidate_selection_min_size=3, candidate_selector=ScoreSelector(),
    )  # fmt: skip
    assert adv_t.inv(make_scored_traj(0, [0.0])) is None
    assert adv_t.inv(make_scored_traj(2, [1.0])) is None
    out = adv_t.inv(make_scored_traj(1, [0.0]))
    assert out["selector_score"].tolist() == [2.0, 1.0]  # the selector's order
    assert out["next", "reward"].squeeze(-1).tolist() == [1.0, 0.0]
    torch.testing.assert_close(out["advantage"].squeeze(-1), torch.tensor([0.7071, -0.7071]), rtol=0, atol=2e-4)
    assert (adv_t.selected_trajectories, adv_t.unselected_trajectories, adv_t.rescued_groups) == (2, 1, 0)


def test_mc_advantage_candidate_selection_writes_as_soon_as_useful():
    adv_t = MCAdvantage(
        grpo_size=2, prompt_key="group_id", trajectory_return="sum", keep_return_bounds=(0.1, 0.9),
        candidate_group_size=4,
    )  # fmt: skip
    assert adv_t.inv(make_group_traj(0, [0.0])) is None
    out = adv_t.inv(make_group_traj(0, [1.0]))
    assert out.shape == (2,)
    assert (adv_t.completed_groups, adv_t.written_groups, adv_t.dropped_groups, adv_t.queued_groups) == (1, 1, 0, 0)
    assert (adv_t.selected_trajectories, adv_t.unselected_trajectories, adv_t.rescued_groups) == (2, 0, 0)


def test_mc_advantage_candidate_selection_rescues_before_max_candidates():
    adv_t = MCAdvantage(
        grpo_size=2, prompt_key="group_id", trajectory_return="sum", keep_return_bounds=(0.1, 0.9),
        candidate_group_size=4,
    )  # fmt: skip
    assert adv_t.inv(make_group_traj(0, [0.0])) is None
    assert adv_t.inv(make_group_traj(0, [0.0])) is None
    out = adv_t.inv(make_group_traj(0, [1.0]))
    assert out.shape == (2,)
    assert out["next", "reward"].squeeze(-1).tolist() == [0.0, 1.0]  # candidates 0 and 2
    assert (adv_t.completed_groups, adv_t.written_groups, adv_t.rescued_groups) == (1, 1, 1)
    assert (adv_t.selected_trajectories, adv_t.unselected_trajectories) == (2, 1)


def test_mc_advantage_candidate_selection_drops_without_valid_subset():
    adv_t = MCAdvantage(
        grpo_size=2, prompt_key="group_id", trajectory_return="sum", keep_return_bounds=(0.1, 0.9),
        candidate_group_size=4,
    )  # fmt: skip
    assert adv_t.inv(make_group_traj(0, [0.0])) is None
    assert adv_t.inv(make_group_traj(0, [0.0])) is None
    assert (adv_t.completed_groups, adv_t.queued_trajectories) == (0, 2)
    assert adv_t.inv(make_group_traj(0, [0.0])) is None
    assert (adv_t.completed_groups, adv_t.queued_trajectories) == (0, 3)
    assert adv_t.inv(make_group_traj(0, [0.0])) is None
    assert (adv_t.completed_groups, adv_t.written_groups, adv_t.dropped_groups, adv_t.queued_groups) == (1, 0, 1, 0)
    assert (adv_t.selected_trajectories, adv_t.unselected_trajectories) == (0, 0)


def test_mc_advantage_share_memory():
    adv_t = MCAdvantage(grpo_size=2, prompt_key="group_id", trajectory_return="sum")
    assert not adv_t.is_shared
    assert adv_t.inv(make_group_traj(0, [0.0])) is None
    adv_t.share_memory_()
    try:
        assert adv_t.is_shared
        assert (adv_t.queued_groups, adv_t.queued_trajectories) == (1, 1)
        out = adv_t.inv(make_group_traj(0, [1.0]))
        torch.testing.assert_close(out["advantage"].squeeze(-1), torch.tensor([-0.7071, 0.7071]), rtol=0, atol=2e-4)
        assert (adv_t.queued_groups, adv_t.completed_groups, adv_t.written_groups) == (0, 1, 1)
        adv_t.reset_stats()
        assert (adv_t.completed_groups, adv_t.written_groups) == (0, 0)
        assert adv_t.inv(make_group_traj(1, [0.0])) is None
        assert adv_t.queued_groups == 1
        adv_t.queues.clear()
        assert adv_t.queued_groups == 0
    finally:
        adv_t.close()


def test_mc_advantage_local_queues(monkeypatch):
    monkeypatch.setenv("TORCHRL_MC_ADVANTAGE_LOCAL_QUEUES", "1")
    adv_t = MCAdvantage(grpo_size=2, prompt_key="group_id", trajectory_return="sum")
    assert adv_t.share_memory_() is adv_t
    assert not adv_t.is_shared


def _shared_writer(advantage, group_id, rewards, queue):
    """A writer process: one trajectory into the shared transform; what came out goes to ``queue``."""
    out = advantage.inv(make_group_traj(group_id, rewards))
    queue.put(None if out is None else out["advantage"].squeeze(-1).tolist())


def test_mc_advantage_share_memory_multiprocessing():
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    adv_t = MCAdvantage(grpo_size=2, prompt_key="group_id", trajectory_return="sum").share_memory_()
    try:
        queue = ctx.Queue()
        processes = [ctx.Process(target=_shared_writer, args=(adv_t, 0, [r], queue)) for r in (0.0, 1.0)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=60)
        assert [process.exitcode for process in processes] == [0, 0]
        results = [queue.get(timeout=5) for _ in processes]
        assert sum(result is None for result in results) == 1
        advantage = next(result for result in results if result is not None)
        # whichever writer came second released both trajectories: -/+ 1/sqrt(2) (rlpost's eps)
        assert sorted(advantage) == pytest.approx([-(2**-0.5), 2**-0.5], abs=2e-4)
        assert (adv_t.queued_groups, adv_t.completed_groups, adv_t.written_groups) == (0, 1, 1)
        assert adv_t.completed_trajectories == 2
    finally:
        adv_t.close()


def test_mc_advantage_validation():
    with pytest.raises(ValueError, match="trajectory_return must be one of"):
        MCAdvantage(grpo_size=2, trajectory_return="prod")
    with pytest.raises(ValueError, match="dynamic sampling"):
        MCAdvantage(grpo_size=2, keep_return_bounds=(0.1, 0.9))
    with pytest.raises(ValueError, match="increasing"):
        MCAdvantage(grpo_size=2, trajectory_return="sum", keep_return_bounds=(0.9, 0.1))
    with pytest.raises(ValueError, match="grpo_size >= 2"):
        MCAdvantage(grpo_size=1, trajectory_return="sum")
    with pytest.raises(ValueError, match="candidate_group_size"):
        MCAdvantage(grpo_size=2, trajectory_return="sum", candidate_group_size=1)
    with pytest.raises(ValueError, match="candidate_group_size > grpo_size"):
        MCAdvantage(grpo_size=2, candidate_group_size=4)
    for min_size in (1, 5):
        with pytest.raises(ValueError, match="candidate_selection_min_size"):
            MCAdvantage(
                grpo_size=2, trajectory_return="sum", candidate_group_size=4, candidate_selection_min_size=min_size
            )
    with pytest.raises(ValueError, match="strategy must be one of"):
        MCAdvantageSelector("unknown")
