"""A torch.distributed group that leaves the global default group alone.

:func:`stateless_init_process_group` (TorchRL's and vLLM's name): rank 0 hosts a ``TCPStore``
and a bare gloo / NCCL backend is built on it without ``init_process_group``, so a trainer can
talk to inference workers whose engine owns the default group (vLLM's does). The weight bus is
built the same way, with versions, buckets and recovery on top.

Every wait is bounded by ``timeout_s``: a rank that never joins is named in a ``TimeoutError``,
and a collective that does not complete raises instead of hanging.

Deviation from TorchRL (whose helper returns vLLM's ``PyNcclCommunicator``): the group is
rlpost's :class:`StatelessProcessGroup`, with the same ``broadcast(tensor, src=...)`` call and a
CPU (gloo) path, so it also runs without a GPU or vLLM.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torch._C._distributed_c10d import BarrierOptions, BroadcastOptions, TCPStore

from rlpost.transport.bus_group import BusGroup, full_device, resolve_backend
from rlpost.transport.bus_types import BusSpec


class StatelessProcessGroup:
    """``world_size`` ranks joined by a store at ``master_address:master_port`` (see the module).

    Attributes:
        rank, world_size: this process's rank and the group's size.
        port: the store's port (rank 0 may pass port 0 and read the chosen one here).
        backend: "gloo" or "nccl".
    """

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        device: torch.device | str | int | None = None,
        *,
        backend: str = "auto",
        timeout_s: float = 60.0,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size; got rank={rank}, world_size={world_size}")
        if isinstance(device, int):
            device = torch.device("cuda", device)
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.backend = resolve_backend(backend, device)
        self.device = full_device(device) if self.backend == "nccl" else device
        self._timeout = timedelta(seconds=timeout_s)
        self._store = TCPStore(master_address, master_port, None, rank == 0, self._timeout, wait_for_workers=False)
        self.port = self._store.port
        spec = BusSpec(host=master_address, port=self.port, world_size=world_size, backend=self.backend,
                       timeout_s=timeout_s)  # fmt: skip
        self._group = BusGroup(self._store, spec, rank, self.device)
        try:
            self._group.await_peers(timeout_s)
        except RuntimeError as err:  # the store's wait timed out
            missing = [r for r in range(world_size) if not self._group.keys.check([f"joined/{r}"])]
            raise TimeoutError(
                f"stateless_init_process_group: ranks {missing} did not join {master_address}:{self.port} "
                f"within {timeout_s} s"
            ) from err
        self._group.build_backend()

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream=None) -> torch.Tensor:
        """Broadcast ``tensor`` (in place) from rank ``src`` to every rank; returns it.
        ``stream`` is accepted for TorchRL compatibility (NCCL runs on its own stream)."""
        self._check_open()
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = src, 0, self._timeout
        self._group.backend.broadcast([tensor], opts).wait(self._timeout)
        return tensor

    def barrier(self) -> None:
        """Wait until every rank reaches this point (bounded by ``timeout_s``)."""
        self._check_open()
        opts = BarrierOptions()
        opts.timeout = self._timeout
        self._group.backend.barrier(opts).wait(self._timeout)

    def _check_open(self) -> None:
        if self._group.backend is None:
            raise RuntimeError("this process group is closed")

    def close(self) -> None:
        """Drop the backend (the peers' pending calls fail fast) and the store connection."""
        self._group.abort()

    def __repr__(self) -> str:
        return f"StatelessProcessGroup(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r})"


def stateless_init_process_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    device: torch.device | str | int | None = None,
    *,
    backend: str = "auto",
    timeout_s: float = 60.0,
) -> StatelessProcessGroup:
    """Join a group of ``world_size`` ranks without the global default group (TorchRL's
    signature; ``backend`` and ``timeout_s`` are rlpost's). See :class:`StatelessProcessGroup`."""
    return StatelessProcessGroup(master_address, master_port, rank, world_size, device, backend=backend,
                                 timeout_s=timeout_s)  # fmt: skip
