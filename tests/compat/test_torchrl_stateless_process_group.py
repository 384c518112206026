"""TorchRL's stateless_init_process_group(master_address, master_port, rank, world_size, device): two real
processes over gloo, beside a default group, with a bounded wait for a rank that never comes."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from rlpost.transport import stateless_init_process_group

pytestmark = pytest.mark.compat


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank1(port: int, queue) -> None:
    import torch.distributed as dist

    # a default group of its own, as a vLLM worker has: the stateless group must not care
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    group = stateless_init_process_group("127.0.0.1", port, 1, 2, torch.device("cpu"), timeout_s=30)
    tensor = torch.zeros(4)
    group.broadcast(tensor, src=0)
    group.barrier()
    queue.put(tensor.tolist())
    group.close()


def test_two_ranks_broadcast_from_rank_zero():
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    peer = ctx.Process(target=_rank1, args=(port, queue))
    peer.start()
    try:
        group = stateless_init_process_group("127.0.0.1", port, 0, 2, "cpu", timeout_s=30)
        assert group.backend == "gloo" and group.port == port
        group.broadcast(torch.tensor([1.0, 2.0, 3.0, 4.0]), src=0)
        group.barrier()
        assert queue.get(timeout=30) == [1.0, 2.0, 3.0, 4.0]
        group.close()
    finally:
        peer.join(timeout=30)
        if peer.is_alive():
            peer.kill()
    assert peer.exitcode == 0
    assert not torch.distributed.is_initialized()  # this process's default group was never touched


def test_a_missing_rank_is_named_after_the_timeout():
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not join"):
        stateless_init_process_group("127.0.0.1", free_port(), 0, 2, "cpu", timeout_s=2)
    with pytest.raises(ValueError, match="rank"):
        stateless_init_process_group("127.0.0.1", free_port(), 2, 2)
