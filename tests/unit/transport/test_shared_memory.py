"""Shared-memory segments of the weight bus: layout arithmetic, and mapping checks (one process
maps its own segment through /proc, as a receiver on the node does)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlpost.transport import shared_memory
from rlpost.transport.bucketing import plan_buckets
from rlpost.transport.shared_memory import ALIGN, HEADER_BYTES, SharedSegment

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not shared_memory.available(), reason="needs Linux's memfd_create")]


def _named():
    return [
        ("a", torch.randn(3, 5)),
        ("b", torch.randn(7).to(torch.bfloat16)),
        ("c", torch.arange(11)),
        ("d", torch.randn(2, 2)),
    ]


def test_buckets_start_aligned_after_the_header_and_fit_the_segment():
    layout = plan_buckets(_named(), bucket_bytes=40)
    offsets = shared_memory.bucket_offsets(layout)
    assert offsets[0] == HEADER_BYTES and all(o % ALIGN == 0 for o in offsets)
    assert offsets == sorted(offsets) and len(offsets) == layout.num_buckets
    last = layout.num_buckets - 1
    size = layout.bucket_numels[last] * torch.tensor([], dtype=getattr(torch, layout.bucket_dtypes[last])).itemsize
    assert shared_memory.segment_bytes(layout) == offsets[last] + size


def test_a_mapping_sees_what_the_creator_writes_and_views_keep_each_dtype():
    named = _named()
    layout = plan_buckets(named, bucket_bytes=40)
    segment = SharedSegment.create(shared_memory.segment_bytes(layout))
    other = SharedSegment.open(segment.ref)  # as a receiver would, through /proc/<pid>/fd/<fd>
    for view, (dtype, numel) in zip(segment.bucket_views(layout), zip(layout.bucket_dtypes, layout.bucket_numels)):
        assert str(view.dtype).endswith(dtype) and view.numel() == numel
        view.copy_(torch.arange(numel).to(view.dtype))
    for mine, theirs in zip(segment.bucket_views(layout), other.bucket_views(layout)):
        assert torch.equal(mine, theirs)
    with pytest.raises(ValueError, match="bytes"):
        SharedSegment.create(HEADER_BYTES).bucket_views(layout)
    other.close()
    segment.close()


def test_opening_a_segment_that_is_not_the_offered_one_fails():
    segment = SharedSegment.create(HEADER_BYTES)
    forged = dataclasses.replace(segment.ref, token="00" * 16)
    with pytest.raises(OSError, match="token"):
        SharedSegment.open(forged)
    gone = dataclasses.replace(segment.ref, pid=2**22 + 1)  # no such process
    with pytest.raises(OSError, match="cannot map"):
        SharedSegment.open(gone)
    segment.close()
