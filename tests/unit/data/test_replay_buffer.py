"""ReplayBuffer, its storages, samplers and transform hooks (pure logic)."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict

from rlpost.data import (
    LazyStackStorage,
    ListStorage,
    RandomSampler,
    ReplayBuffer,
    SamplerWithoutReplacement,
)

pytestmark = pytest.mark.unit


def steps(n, start=0):
    return TensorDict({"x": torch.arange(start, start + n)}, batch_size=[n])


def test_list_storage_with_numbers_and_any_objects():
    rb = ReplayBuffer(storage=ListStorage(max_size=1000), batch_size=5)
    assert rb.extend(range(10)).tolist() == list(range(10))
    sample = rb.sample()
    assert sample.shape == (5,) and sample.dtype == torch.long and all(0 <= v < 10 for v in sample.tolist())

    anything = ReplayBuffer(storage=ListStorage(100), collate_fn=lambda x: x)
    anything.extend(["a", 1, None])
    drawn = anything.sample(3)
    assert isinstance(drawn, list) and len(drawn) == 3 and set(drawn) <= {"a", 1, None}
    # Without a collate_fn, items that cannot be stacked come back as a list.
    strings = ReplayBuffer(storage=ListStorage(5))
    strings.extend(["a", "b"])
    assert isinstance(strings.sample(2), list)


def test_round_robin_overwrites_the_oldest_items():
    rb = ReplayBuffer(storage=ListStorage(3))
    assert rb.extend([0, 1, 2, 3, 4]).tolist() == [0, 1, 2, 0, 1]
    assert len(rb) == 3 and rb.write_count == 5
    assert rb[:].tolist() == [3, 4, 2] and rb[2] == 2
    assert rb.add(5) == 2 and rb[:].tolist() == [3, 4, 5]
    rb.empty()
    assert len(rb) == 0 and rb.write_count == 0 and rb.add(7) == 0


def test_list_storage_stacks_tensordicts_and_tensors():
    rb = ReplayBuffer(storage=ListStorage(10))
    rb.extend(steps(4))
    batch = rb.sample(6)
    assert batch.batch_size == (6,) and set(batch["x"].tolist()) <= {0, 1, 2, 3}
    tensors = ReplayBuffer(storage=ListStorage(10))
    tensors.extend(torch.ones(4, 2))
    assert tensors.sample(3).shape == (3, 2)


def test_lazy_stack_storage_holds_heterogeneous_tensordicts():
    rb = ReplayBuffer(storage=LazyStackStorage(max_size=1000))
    rb.add(TensorDict(a=torch.randn(10), b=torch.rand(4), c="a string!"))
    rb.add(TensorDict(a=torch.randn(11), b=torch.rand(4), c="another string!"))
    sample = rb.sample(10)
    assert isinstance(sample, LazyStackedTensorDict) and sample.batch_size == (10,)
    assert sample["b"].shape == (10, 4)
    assert set(sample["c"]) <= {"a string!", "another string!"}
    assert {len(sample[i]["a"]) for i in range(10)} <= {10, 11}
    with pytest.raises(TypeError, match="LazyStackStorage holds TensorDicts"):
        rb.add(3)
    last_dim = ReplayBuffer(storage=LazyStackStorage(10, stack_dim=-1))
    last_dim.extend(TensorDict({"y": torch.zeros(3, 2)}, batch_size=[3, 2]))
    assert last_dim.sample(5).batch_size == (2, 5)


def test_sampler_without_replacement_passes_over_every_item_once():
    rb = ReplayBuffer(storage=ListStorage(100), sampler=SamplerWithoutReplacement(), batch_size=4)
    rb.extend(range(10))
    batches = [b.tolist() for b in rb]
    assert [len(b) for b in batches] == [4, 4, 2]  # the last batch of a pass is short
    assert sorted(v for b in batches for v in b) == list(range(10))
    assert sorted(v for b in rb for v in b.tolist()) == list(range(10))  # a second pass

    in_order = ReplayBuffer(storage=ListStorage(100), sampler=SamplerWithoutReplacement(shuffle=False), batch_size=4)
    in_order.extend(range(6))
    assert [b.tolist() for b in in_order] == [[0, 1, 2, 3], [4, 5]]

    dropping = ReplayBuffer(
        storage=ListStorage(100), sampler=RandomSampler(replacement=False, drop_last=True, shuffle=False), batch_size=4
    )
    assert isinstance(dropping.sampler, SamplerWithoutReplacement)
    dropping.extend(range(10))
    assert [b.tolist() for b in dropping] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_sampler_without_replacement_restarts_when_the_storage_grows():
    rb = ReplayBuffer(storage=ListStorage(100), sampler=SamplerWithoutReplacement(shuffle=False), batch_size=2)
    rb.extend(range(4))
    assert rb.sample().tolist() == [0, 1]
    rb.extend(range(4, 6))
    assert rb.sample().tolist() == [0, 1]  # a new pass over the 6 items


def test_generator_makes_sampling_reproducible():
    def draws():
        rb = ReplayBuffer(storage=ListStorage(100), batch_size=8, generator=torch.Generator().manual_seed(3))
        rb.extend(range(50))
        return [rb.sample().tolist() for _ in range(3)]

    assert draws() == draws()


class AddOne:
    """A write hook: adds 1 to "x" on write; nothing on read."""

    def inv(self, td):
        return td.set("x", td["x"] + 1)


class Times10:
    """A read hook (forward): multiplies "x" by 10 on read (into a new TensorDict: a read hook
    that sets entries in place would change the stored steps a lazy stack is made of)."""

    def forward(self, td):
        return TensorDict({"x": td["x"] * 10}, batch_size=td.batch_size)


class HoldOdd:
    """A write hook that keeps back (returns None for) data whose first x is odd."""

    def inv(self, td):
        return None if td["x"][0] % 2 else td


def test_write_hooks_on_extend_and_read_hooks_on_sample():
    rb = ReplayBuffer(storage=LazyStackStorage(10), transform=Times10(), batch_size=3)
    rb.append_transform(AddOne())
    rb.extend(steps(3))
    stored = [td["x"].item() for td in rb.storage._storage]
    assert stored == [1, 2, 3]  # AddOne ran on write, Times10 did not
    assert sorted(rb[:]["x"].tolist()) == [10, 20, 30]  # Times10 runs on read
    assert set(rb.sample()["x"].tolist()) <= {10, 20, 30}

    held = ReplayBuffer(storage=LazyStackStorage(10), transform=[HoldOdd()])
    assert held.extend(steps(2, start=1)).shape == (0, 1) and len(held) == 0
    assert held.extend(steps(2, start=2)).tolist() == [0, 1]


def test_write_hooks_run_last_appended_first_and_invert_swaps_hooks():
    order = []

    class Tag:
        def __init__(self, name):
            self.name = name

        def inv(self, data):
            order.append(("write", self.name))
            return data

        def forward(self, data):
            order.append(("read", self.name))
            return data

    rb = ReplayBuffer(storage=ListStorage(10), transform=Tag("a"), batch_size=1).append_transform(Tag("b"))
    rb.extend([1])
    rb.sample()
    assert order == [("write", "b"), ("write", "a"), ("read", "a"), ("read", "b")]

    def plus_one(data):  # a plain callable: a read hook; inverted, it runs on write
        return [x + 1 for x in data] if isinstance(data, list) else data + 1

    inverted = ReplayBuffer(storage=ListStorage(10), batch_size=2)
    inverted.append_transform(plus_one, invert=True)
    inverted.extend([0, 0])
    assert inverted[:].tolist() == [1, 1]
    assert inverted.sample().tolist() == [1, 1]  # no read hook: plus_one has no inv
    plain = ReplayBuffer(storage=ListStorage(10), transform_factory=lambda: plus_one, batch_size=2)
    plain.extend([0, 0])
    assert plain.storage.get(slice(None)) == [0, 0]  # stored as written
    assert plain[:].tolist() == [1, 1] and plain.sample().tolist() == [1, 1]  # rb[...] reads through it too


def test_add_goes_through_write_hooks_with_a_leading_dim():
    seen = []

    class Record:
        def inv(self, td):
            seen.append(td.batch_size)
            return td

    rb = ReplayBuffer(storage=LazyStackStorage(10), transform=Record())
    assert rb.add(TensorDict(x=torch.tensor(4))) == 0
    assert seen == [torch.Size([1])] and rb[0].batch_size == () and rb[0]["x"].item() == 4


def test_add_writes_every_element_a_write_hook_releases():
    """Deliberate deviation: an add() whose write hook releases several elements (a completed
    group) writes each of them (TorchRL would store the whole group as one element)."""

    class ReleaseThree:
        def __init__(self):
            self.held = []

        def inv(self, td):
            self.held.append(td)
            if len(self.held) < 3:
                return None
            out, self.held = torch.cat(self.held, 0), []
            return out

    rb = ReplayBuffer(storage=LazyStackStorage(10), transform=ReleaseThree())
    assert rb.add(TensorDict(x=torch.tensor(0))).numel() == 0
    assert rb.add(TensorDict(x=torch.tensor(1))).numel() == 0
    assert rb.add(TensorDict(x=torch.tensor(2))).tolist() == [0, 1, 2]
    assert len(rb) == 3 and sorted(rb[:]["x"].tolist()) == [0, 1, 2]


def test_sample_options_and_info():
    rb = ReplayBuffer(storage=ListStorage(10), batch_size=2)
    rb.extend(range(5))
    data, info = rb.sample(return_info=True)
    assert torch.equal(data, info["index"])  # items 0..4 sit at indices 0..4
    with pytest.warns(UserWarning, match="differs from the buffer's batch_size=2"):
        assert rb.sample(batch_size=4).shape == (4,)


def test_bad_input_raises_clear_errors():
    with pytest.raises(RuntimeError, match="empty storage"):
        ReplayBuffer(batch_size=2).sample()
    with pytest.raises(RuntimeError, match="empty storage"):
        ReplayBuffer(sampler=SamplerWithoutReplacement(), batch_size=2).sample()
    rb = ReplayBuffer()
    rb.extend([1, 2])
    with pytest.raises(RuntimeError, match="batch_size not specified"):
        rb.sample()
    with pytest.raises(RuntimeError, match="without batch_size"):
        next(iter(rb))
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        rb.sample(0)
    with pytest.raises(ValueError, match="max_size must be an int >= 1"):
        ListStorage(0)
    with pytest.raises(TypeError, match="transform or transform_factory"):
        ReplayBuffer(transform=Times10(), transform_factory=Times10)
    with pytest.raises(TypeError, match="has none"):
        ReplayBuffer(transform=object())
    with pytest.raises(TypeError, match="storage must be a Storage"):
        ReplayBuffer(storage=[])
    with pytest.raises(ValueError, match="drop_last=True needs the batch size"):
        ReplayBuffer(sampler=SamplerWithoutReplacement(drop_last=True))
    with pytest.raises(ValueError, match="use add"):
        ReplayBuffer(storage=LazyStackStorage(5)).extend(TensorDict(x=torch.tensor(1)))
    with pytest.raises(TypeError, match="extend needs a list"):
        ReplayBuffer().extend({"x": 1})
    with pytest.raises(TypeError, match="unexpected arguments"):
        RandomSampler(drop_last=True)
    small = ReplayBuffer(storage=ListStorage(5), sampler=SamplerWithoutReplacement(drop_last=True), batch_size=4)
    small.extend([1, 2])
    with pytest.raises(ValueError, match="larger than the 2 items stored"):
        small.sample()


def test_several_writer_threads_and_pickling():
    rb = ReplayBuffer(storage=LazyStackStorage(10_000), batch_size=4)

    def writer(k):
        for i in range(50):
            rb.extend(steps(3, start=1000 * k + 10 * i))

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(rb) == 600 and rb.write_count == 600
    assert len(set(rb[:]["x"].tolist())) == 600
    copy = pickle.loads(pickle.dumps(rb))
    assert len(copy) == 600 and copy.sample().batch_size == (4,)
