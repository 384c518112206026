"""TorchRL's ``TensorDictReplayBuffer`` and ``PrioritizedSampler`` (``torchrl.data``), as TorchRL's
docstrings show them and its expert-iteration scripts build them.

The docstring examples run with ``ListStorage`` / ``LazyStackStorage`` for TorchRL's
``LazyTensorStorage`` (rlpost keeps LLM steps in lists). Sampling follows priority ** alpha, the
importance weights are ``"priority_weight"``, and a sample carries ``"index"``.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict

from rlpost.torchrl.data import (
    LazyStackStorage,
    ListStorage,
    PrioritizedSampler,
    RandomSampler,
    ReplayBuffer,
    SamplerWithoutReplacement,
    TensorDictReplayBuffer,
)

pytestmark = pytest.mark.compat


def test_prioritized_sampler_docstring_example():
    """PrioritizedSampler's docstring, with its TensorDictReplayBuffer variant: priorities 0 and
    1000 with alpha = beta = 1: every draw is item 1, its weight (p_1 / p_min) ** -1 = 1e-11."""
    rb = TensorDictReplayBuffer(
        storage=ListStorage(10),
        sampler=PrioritizedSampler(max_capacity=10, alpha=1.0, beta=1.0),
        priority_key="priority",
    )
    priority = torch.tensor([0, 1000])
    data_0 = TensorDict({"reward": 0, "obs": [0], "action": [0], "priority": priority[0]}, [])
    data_1 = TensorDict({"reward": 1, "obs": [1], "action": [2], "priority": priority[1]}, [])
    data = torch.stack([data_0, data_1])
    assert rb.extend(data).tolist() == [0, 1]
    assert data["index"].tolist() == [0, 1]  # the written data knows where it went
    sample, info = rb.sample(10, return_info=True)
    assert sample["index"].tolist() == [1] * 10  # the index is packed with the tensordict
    assert info["index"].tolist() == [1] * 10
    assert torch.allclose(info["priority_weight"], torch.full((10,), 1e-11))
    assert torch.equal(sample["priority_weight"], info["priority_weight"])
    assert sample["obs"].shape == (10, 1) and (sample["reward"] == 1).all()


def test_tensordict_replay_buffer_docstring_example():
    """TensorDictReplayBuffer's docstring: samples keep track of the index; the buffer iterates."""
    torch.manual_seed(0)
    rb = TensorDictReplayBuffer(storage=ListStorage(10), batch_size=5)
    data = TensorDict({"a": torch.ones(10, 3), ("b", "c"): torch.zeros(10, 1, 1)}, [10])
    rb.extend(data)
    with pytest.warns(UserWarning, match="differs from the buffer's batch_size=5"):  # rlpost's warning
        sample = rb.sample(3)
    assert set(sample.keys()) == {"a", "b", "index"}
    assert sample["index"].shape == (3,) and sample["b", "c"].shape == (3, 1, 1)
    for i, batch in enumerate(rb):
        assert batch.batch_size == (5,) and batch["index"].shape == (5,)
        if i == 2:
            break
    assert "priority_weight" not in sample.keys()  # a uniform sampler says only where


def test_sampling_follows_priority_to_the_alpha_with_importance_weights():
    alpha, beta, eps = 0.5, 0.4, 1e-8
    sampler = PrioritizedSampler(max_capacity=8, alpha=alpha, beta=beta, eps=eps)
    rb = TensorDictReplayBuffer(
        storage=ListStorage(8), sampler=sampler, priority_key="td_error", generator=torch.Generator().manual_seed(0)
    )
    priorities = torch.tensor([1.0, 4.0, 9.0, 16.0])
    rb.extend(TensorDict({"x": torch.arange(4), "td_error": priorities}, [4]))
    sample, info = rb.sample(40_000, return_info=True)
    counts = torch.bincount(sample["index"], minlength=4).double() / 40_000
    expected = (priorities + eps) ** alpha / ((priorities + eps) ** alpha).sum()  # 1, 2, 3, 4 out of 10
    assert torch.allclose(counts, expected.double(), atol=0.01), counts
    # w_i = (N P(i)) ** -beta / max_j (N P(j)) ** -beta = (v_i / v_min) ** -beta
    values = (priorities + eps) ** alpha
    assert torch.allclose(info["priority_weight"], (values[sample["index"]] / values.min()) ** -beta)
    assert info["priority_weight"].dtype == torch.float32 and info["priority_weight"].max() <= 1.0
    # alpha = 0: uniform
    sampler.alpha = 0.0
    counts = torch.bincount(rb.sample(20_000)["index"], minlength=4).double() / 20_000
    assert torch.allclose(counts, torch.full((4,), 0.25, dtype=torch.float64), atol=0.02)


def test_new_items_get_the_largest_priority_and_priorities_can_be_updated():
    sampler = PrioritizedSampler(max_capacity=4, alpha=1.0, beta=0.0, eps=0.0)
    rb = TensorDictReplayBuffer(storage=ListStorage(4), sampler=sampler)
    assert sampler.default_priority == 1.0  # before any priority
    rb.extend(TensorDict({"x": torch.arange(2)}, [2]))  # no "td_error": default priority
    rb.update_priority(torch.tensor([0, 1]), torch.tensor([3.0, 0.5]))
    assert sampler.default_priority == 3.0
    index = rb.add(TensorDict({"x": torch.tensor(9)}, []))
    assert index == 2
    # a sample whose priority key was changed updates what it points at
    rb.update_priority(2, 0.0)
    batch = rb.sample(50)
    assert 2 not in batch["index"].tolist()  # priority 0 with eps 0: never drawn
    batch.set("td_error", torch.where(batch["index"] == 0, 0.0, 7.0))
    rb.update_tensordict_priority(batch)
    assert set(rb.sample(100)["index"].tolist()) == {1}
    rb.empty()
    assert sampler.default_priority == 1.0 and len(rb) == 0


def test_max_priority_within_buffer_forgets_an_overwritten_maximum():
    sampler = PrioritizedSampler(max_capacity=2, alpha=1.0, beta=1.0, max_priority_within_buffer=True)
    rb = TensorDictReplayBuffer(storage=ListStorage(2), sampler=sampler, priority_key="p")
    rb.extend(TensorDict({"p": torch.tensor([5.0, 2.0])}, [2]))
    assert sampler.default_priority == 5.0
    rb.update_priority(0, 1.0)  # the maximum went down: the largest stored is item 1's
    assert sampler.default_priority == pytest.approx(2.0)
    rb.add(TensorDict({"p": torch.tensor(1.5)}, []))  # overwrites slot 0
    rb.add(TensorDict({"p": torch.tensor(1.0)}, []))  # overwrites slot 1, where the maximum was
    assert sampler.default_priority == pytest.approx(1.5)  # the largest stored now: slot 0's


def test_expert_iteration_buffer_of_llm_steps():
    """expert-iteration-async.py: TensorDictReplayBuffer, PrioritizedSampler(max_capacity=...,
    alpha, beta, eps) and ``priority_key=("next", "reward")`` on a LazyStackStorage of steps
    whose histories differ in length: the rewarded steps are drawn, each sample says where from."""
    rb = TensorDictReplayBuffer(
        storage=partial(LazyStackStorage, 16, device="cpu"),
        sampler=partial(PrioritizedSampler, max_capacity=16, alpha=1.0, beta=0.5, eps=1e-6),
        priority_key=("next", "reward"),
        batch_size=8,
    )
    steps = [
        TensorDict(
            {"text": "x" * (n + 1), "tokens": torch.arange(n + 3), "next": {"reward": torch.tensor([float(n % 2)])}}, []
        )
        for n in range(6)
    ]
    rb.extend(LazyStackedTensorDict(*steps, stack_dim=0))
    assert rb.write_count == 6 and isinstance(rb.sampler, PrioritizedSampler)
    batch = rb.sample()
    assert isinstance(batch, LazyStackedTensorDict) and batch.batch_size == (8,)
    assert set(batch["index"].tolist()) <= {1, 3, 5}  # reward 1 against 1e-6
    for row, index in zip(batch.unbind(0), batch["index"].tolist()):
        assert row["tokens"].shape == (index + 3,) and row["text"] == "x" * (index + 1)
    assert batch["priority_weight"].shape == (8,)


def test_the_buffer_host_builds_it_as_ray_replay_buffer_would():
    """RayReplayBuffer(replay_buffer_cls=TensorDictReplayBuffer, sampler=partial(PrioritizedSampler,
    ...), priority_key=...): the actor builds the buffer from those arguments (BufferHost, here
    in this process: no Ray cluster)."""
    from rlpost.data.buffer_host import BufferHost

    host = BufferHost(
        TensorDictReplayBuffer,
        {
            "storage": partial(LazyStackStorage, 8),
            "sampler": partial(PrioritizedSampler, max_capacity=8, alpha=0.7, beta=0.5, eps=1e-6),
            "priority_key": ("next", "reward"),
            "batch_size": 4,
        },
    )
    data = TensorDict({"next": {"reward": torch.tensor([[0.0], [1.0]])}}, [2])
    _, writes, index = host.call("extend", data)
    assert writes == 2 and index.tolist() == [0, 1]
    _, _, batch = host.call("sample")
    assert batch.batch_size == (4,) and "priority_weight" in batch.keys()
    host.call("update_priority", torch.tensor([0]), torch.tensor([5.0]))
    assert host.rb.sampler.default_priority == 5.0


def test_errors_and_plain_samplers():
    with pytest.raises(ValueError, match="alpha must be greater or equal than 0"):
        PrioritizedSampler(10, alpha=-1.0, beta=0.5)
    with pytest.raises(ValueError, match="beta must be greater or equal to 0"):
        PrioritizedSampler(10, alpha=1.0, beta=-0.5)
    rb = TensorDictReplayBuffer(storage=ListStorage(4), sampler=PrioritizedSampler(4, 1.0, 1.0))
    with pytest.raises(RuntimeError, match="empty storage"):
        rb.sample(2)
    with pytest.raises(ValueError, match="only accepts TensorDictBase"):
        rb.extend([1, 2])
    with pytest.raises(RuntimeError, match="same length as index"):
        rb.update_priority(torch.tensor([0, 1]), torch.ones(3))
    # the plain buffer with a PrioritizedSampler returns the weights in its info
    plain = ReplayBuffer(storage=ListStorage(4), sampler=PrioritizedSampler(4, 1.0, 1.0))
    plain.extend(torch.arange(3))
    _, info = plain.sample(5, return_info=True)
    assert set(info) == {"priority_weight", "index"} and torch.equal(info["priority_weight"], torch.ones(5))
    # other samplers: "index" only, and update_priority says it does nothing
    for sampler in (RandomSampler(), SamplerWithoutReplacement()):
        uniform = TensorDictReplayBuffer(storage=ListStorage(4), sampler=sampler, priority_key="p")
        with pytest.warns(UserWarning, match="not prioritized"):  # as TorchRL's: the data has a priority
            uniform.extend(TensorDict({"p": torch.ones(2)}, [2]))
        assert set(uniform.sample(2).keys()) == {"p", "index"}
        with pytest.warns(UserWarning, match="not prioritized"):
            uniform.update_priority(0, 1.0)
