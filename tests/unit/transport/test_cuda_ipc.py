"""CUDA IPC segments of the weight bus. On the CPU: how the handle travels as JSON and when a
receiver declines a segment (it then stays on the network bus). With a GPU: a second process
maps the publisher's memory for real (scripts/check_nccl_bus.py runs the whole bus that way)."""

from __future__ import annotations

import inspect
import io
import json
import multiprocessing as mp
import os

import pytest
import torch
from torch.multiprocessing import reductions

from rlpost.transport import cuda_ipc, shared_memory
from rlpost.transport.bucketing import BucketLayout, flatten_bucket, plan_buckets, unflatten
from rlpost.transport.bus_group import open_segment
from rlpost.transport.cuda_ipc import CudaSegment, CudaSegmentRef

pytestmark = pytest.mark.unit

# what torch's reduce_tensor returns for a CUDA tensor, in rebuild_cuda_tensor's argument order
_REDUCED = (
    torch.Tensor,  # tensor_cls
    torch.Size([8192]),  # tensor_size
    (1,),  # tensor_stride
    0,  # tensor_offset
    torch.storage.TypedStorage,  # storage_cls
    torch.uint8,  # dtype
    3,  # storage_device: the publisher's index, replaced by the receiver's own
    b"\x01\x02handle",  # storage_handle
    8192,  # storage_size_bytes
    512,  # storage_offset_bytes
    False,  # requires_grad
    b"/torch_123_456",  # ref_counter_handle
    7,  # ref_counter_offset
    b"\x00event",  # event_handle
    True,  # event_sync_required
)


def test_a_handle_travels_as_json_and_rebuilds_with_the_receivers_device(monkeypatch):
    rebuilt = {}
    monkeypatch.setattr(reductions, "reduce_tensor", lambda tensor: (reductions.rebuild_cuda_tensor, _REDUCED))
    handle = cuda_ipc._export(torch.empty(0))
    plain = json.loads(handle)  # no pickle: classes by name, bytes as hex
    assert plain["storage_cls"] == "TypedStorage" and plain["storage_handle"] == {"hex": b"\x01\x02handle".hex()}
    assert "tensor_cls" not in plain and "dtype" not in plain

    real = reductions.rebuild_cuda_tensor
    parameters = list(inspect.signature(real).parameters)

    def rebuild(**kwargs):
        rebuilt.update(kwargs)
        return torch.empty(0)

    rebuild.__signature__ = inspect.signature(real)
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    cuda_ipc._import(handle, device_index=0)
    expected = dict(zip(parameters, _REDUCED))
    expected["storage_device"] = 0  # the receiver's index of the same GPU
    assert rebuilt == expected


def test_a_handle_from_another_torch_is_refused_not_guessed(monkeypatch):
    monkeypatch.setattr(reductions, "reduce_tensor", lambda tensor: (reductions.rebuild_cuda_tensor, _REDUCED[:-1]))
    short = cuda_ipc._export(torch.empty(0))  # one argument missing
    with pytest.raises(OSError, match="this torch expects"):
        cuda_ipc._import(short, device_index=0)
    with pytest.raises(OSError, match="unknown storage class"):
        cuda_ipc._import('{"storage_cls": "os.system"}', device_index=0)


def _ref(**changes) -> dict:
    ref = CudaSegmentRef(pid=1, device_uuid="GPU-0", nbytes=4096, token="00" * 16, handle="{}")
    return {**ref.to_dict(), **changes}


def test_receivers_decline_segments_they_cannot_map():
    assert CudaSegmentRef.from_dict(_ref()) == CudaSegmentRef(1, "GPU-0", 4096, "00" * 16, "{}")
    with pytest.raises(OSError, match="receivers on a GPU"):
        open_segment(_ref(), torch.device("cpu"))  # CPU weights never map GPU memory
    with pytest.raises(OSError, match="host shared memory is for receivers on the CPU"):
        open_segment({"pid": 1, "fd": 3, "nbytes": 4096, "token": "00"}, torch.device("cuda", 0))
    with pytest.raises(OSError, match="its own CUDA IPC export"):
        CudaSegment.open(CudaSegmentRef.from_dict(_ref(pid=os.getpid())), torch.device("cuda", 0))


def test_gpu_readers_are_told_once_per_update_host_readers_per_bucket():
    named = [("a", torch.zeros(300)), ("e", torch.zeros(0)), ("b", torch.zeros(300)), ("c", torch.zeros(300))]
    layout = plan_buckets(named, bucket_bytes=1200)  # one bucket each; "e" adds none
    assert layout.bucket_numels == (300, 300, 300)
    memory = torch.zeros(shared_memory.segment_bytes(layout), dtype=torch.uint8)  # stands in for GPU memory
    gpu_segment = CudaSegment(CudaSegmentRef.from_dict(_ref()), memory)
    assert gpu_segment.ready_points(layout) == [2]
    host = shared_memory.SharedSegment.create(shared_memory.segment_bytes(layout))
    try:
        assert host.ready_points(layout) == [0, 1, 2]
    finally:
        host.close()


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run scripts/check_nccl_bus.py there)")


def _map_and_read(raw: dict, layout_json: str, queue) -> None:
    segment = open_segment(raw, torch.device("cuda", 0))
    layout = BucketLayout.from_json(layout_json)
    tensors = {name: t.cpu() for name, t in unflatten(layout, segment.bucket_views(layout)).items()}
    buffer = io.BytesIO()
    torch.save(tensors, buffer)  # plain bytes: a tensor in the queue would need this process alive
    queue.put(buffer.getvalue())


@gpu
def test_another_process_maps_the_segment_and_reads_the_buckets():
    named = {"a": torch.randn(300, 7), "b": torch.arange(11), "c": torch.randn(5).to(torch.bfloat16)}
    layout = plan_buckets(list(named.items()), bucket_bytes=4096)
    segment = CudaSegment.create(shared_memory.segment_bytes(layout), torch.device("cuda", 0))
    views = segment.bucket_views(layout)
    for index, numel in enumerate(layout.bucket_numels):
        if numel:
            flatten_bucket(layout, index, named, segment.memory.device, out=views[index])
    segment.settle()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=_map_and_read, args=(segment.ref.to_dict(), layout.to_json(), queue))
    process.start()
    got = torch.load(io.BytesIO(queue.get(timeout=120)))
    process.join(30)
    assert list(got) == list(named) and all(torch.equal(got[n], named[n]) for n in named)
