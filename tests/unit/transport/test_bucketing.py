"""Bucket planning, flatten / unflatten round trips, and the in-process weight bus."""

from __future__ import annotations

import threading

import pytest
import torch

from rlpost.transport import LocalWeightBus, WeightSyncError
from rlpost.transport.bucketing import (
    BucketLayout,
    as_named_list,
    empty_buckets,
    flatten_bucket,
    plan_buckets,
    unflatten,
)

pytestmark = pytest.mark.unit

KB = 1024


def named_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(100, generator=g)),  # 400 B fp32
        ("b", torch.randn(7, 9, generator=g).to(torch.bfloat16)),  # 126 B bf16
        ("c", torch.randn(160, generator=g)),  # 640 B fp32: does not fit beside a in 1 KB
        ("big", torch.randn(300, generator=g)),  # 1200 B fp32: larger than a bucket
        ("d", torch.randn(10, generator=g)),
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.zeros(0, 4)),
        ("t", torch.randn(5, 3, generator=g).t()),  # non-contiguous source
        ("ids", torch.arange(13)),
    ]


def test_plan_packs_by_dtype_in_order_and_respects_the_bucket_size():
    layout = plan_buckets(named_tensors(), bucket_bytes=1 * KB)
    where = {s.name: (s.bucket, s.offset) for s in layout.slots}
    assert [s.name for s in layout.slots] == [n for n, _ in named_tensors()]
    assert layout.bucket_dtypes == ("float32", "float32", "float32", "float32", "bfloat16", "int64")
    assert where == {
        "a": (0, 0),
        "c": (1, 0),
        "big": (2, 0),
        "d": (3, 0),
        "scalar": (3, 10),
        "empty": (3, 11),
        "t": (3, 11),
        "b": (4, 0),
        "ids": (5, 0),
    }
    assert layout.bucket_numels == (100, 160, 300, 26, 63, 13)
    assert layout.num_bytes == 4 * (100 + 160 + 300 + 26) + 2 * 63 + 8 * 13


def test_every_bucket_fits_unless_it_holds_one_oversized_tensor():
    layout = plan_buckets(named_tensors(), bucket_bytes=1 * KB)
    for index, numel in enumerate(layout.bucket_numels):
        members = [s for s in layout.slots if s.bucket == index and s.numel > 0]
        itemsize = getattr(torch, layout.bucket_dtypes[index]).itemsize
        assert numel * itemsize <= 1 * KB or len(members) == 1
        assert sum(s.numel for s in members) == numel


def test_flatten_then_unflatten_is_bit_exact_and_hands_out_views():
    named = named_tensors()
    layout = plan_buckets(named, bucket_bytes=1 * KB)
    buckets = [flatten_bucket(layout, i, dict(named), torch.device("cpu")) for i in range(layout.num_buckets)]
    received = unflatten(layout, buckets)
    assert list(received) == [n for n, _ in named]
    for name, original in named:
        got = received[name]
        assert got.dtype == original.dtype and got.shape == original.shape
        assert torch.equal(got, original)
        bucket = buckets[next(s.bucket for s in layout.slots if s.name == name)]
        assert got.untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr()  # a view, no copy


def test_layout_travels_as_json_and_receivers_allocate_matching_buckets():
    layout = plan_buckets(named_tensors(), bucket_bytes=1 * KB)
    again = BucketLayout.from_json(layout.to_json())
    assert again == layout and again.signature() == layout.signature()
    assert plan_buckets(named_tensors(), bucket_bytes=2 * KB).signature() != layout.signature()
    buckets = empty_buckets(again, torch.device("cpu"))
    assert [(b.dtype, b.numel()) for b in buckets] == [
        (getattr(torch, d), n) for d, n in zip(layout.bucket_dtypes, layout.bucket_numels)
    ]


def test_each_bucket_lists_its_slots_end_to_end_in_the_senders_order():
    layout = plan_buckets(named_tensors(), bucket_bytes=1 * KB)
    assert [s for slots in layout.bucket_slots for s in slots] == sorted(layout.slots, key=lambda s: s.bucket)
    for index, slots in enumerate(layout.bucket_slots):
        assert all(s.bucket == index for s in slots)
        assert [s.offset for s in slots] == [sum(p.numel for p in slots[:i]) for i in range(len(slots))]
        assert sum(s.numel for s in slots) == layout.bucket_numels[index]


def test_the_publisher_plans_once_for_the_same_tensors_and_again_when_they_change():
    from rlpost.transport import TorchWeightPublisher

    publisher = TorchWeightPublisher(1, backend="gloo", bucket_mb=0.001, timeout_s=5)  # no receivers
    try:
        first = publisher._plan(named_tensors(), in_order=False)
        assert publisher._plan(named_tensors(), in_order=False) is first  # new values, same layout
        grown = [(n, torch.zeros(101) if n == "a" else t) for n, t in named_tensors()]
        assert publisher._plan(grown, in_order=False) != first
        assert publisher._plan(named_tensors(), in_order=True) != first
        assert publisher.publish(grown, 1).num_bytes == plan_buckets(grown, 1048).num_bytes
    finally:
        publisher.close()


def test_bad_inputs_are_user_errors():
    with pytest.raises(ValueError, match="duplicate"):
        as_named_list([("w", torch.zeros(1)), ("w", torch.ones(1))])
    with pytest.raises(ValueError, match="not a torch.Tensor"):
        as_named_list({"w": [1.0, 2.0]})
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(named_tensors(), bucket_bytes=0)


def test_local_bus_hands_each_receiver_its_own_copy_of_the_latest_version():
    bus = LocalWeightBus(timeout_s=5)
    first, second = bus.receiver(), bus.receiver()
    weight = torch.arange(6.0).view(2, 3)
    stats = bus.publish({"w": weight}, version=1)
    weight.add_(100)  # the learner keeps training: the published snapshot must not change
    version, tensors = first.receive()
    assert (version, stats.num_bytes) == (1, 24) and torch.equal(tensors["w"], torch.arange(6.0).view(2, 3))
    tensors["w"].zero_()  # one receiver's copy is its own
    assert torch.equal(second.receive().tensors["w"], torch.arange(6.0).view(2, 3))
    with pytest.raises(ValueError, match="version"):
        bus.publish({"w": weight}, version=0)
    with pytest.raises(WeightSyncError, match="no update"):
        first.receive(timeout_s=0.05)


def test_local_bus_wakes_a_waiting_receiver():
    bus = LocalWeightBus(timeout_s=5)
    receiver = bus.receiver()
    got = []
    waiter = threading.Thread(target=lambda: got.append(receiver.receive()))
    waiter.start()
    bus.publish([("w", torch.ones(3))], version=7)
    waiter.join(5)
    assert got and got[0].version == 7 and receiver.version == 7
