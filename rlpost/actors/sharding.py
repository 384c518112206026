"""A sharded learner group: N learner processes that hold one model between them (FSDP2).

Each rank joins the group's own process group and shards the model with ``fully_shard`` (each
decoder layer one unit, gathered for its forward and backward then freed; the rest the root
unit), keeping 1/N of the parameters, gradients and AdamW state::

    rank 0:  open_rendezvous()  -> GroupSpec (host, port of a TCPStore it hosts)
    every rank: join_group(spec, rank)       the default process group, gloo on CPU, NCCL on GPU
    every rank: shard_model(model)           after loading the same weights from disk

Gradients are summed over the ranks, not averaged: each rank's loss is already divided by the
whole step's normaliser, so the sum is the one-process gradient of the whole batch. Every
collective is bounded by ``GroupSpec.timeout_s``: a dead rank makes the others raise, not hang.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class GroupSpec:
    """How to join a learner group (plain, picklable data: it crosses to every rank's process)."""

    host: str  # where rank 0's TCPStore listens
    port: int
    world_size: int
    backend: str = "gloo"  # "gloo" (CPU) or "nccl" (GPU)
    timeout_s: float = 300.0  # bound of joining and of every collective


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def node_address() -> str:
    """This node's address as other nodes reach it (Ray's view when Ray runs here)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # not in a Ray process: the host's own address
        pass
    return socket.gethostbyname(socket.gethostname())


def open_rendezvous(world_size: int, *, backend: str | None = None, timeout_s: float = 300.0,
                    host: str | None = None) -> tuple[Any, GroupSpec]:  # fmt: skip
    """Rank 0: start the group's TCPStore on a free port; returns it (for rank 0's
    :func:`join_group`) and the spec for every rank."""
    if world_size < 1:
        raise ValueError(f"a learner group needs world_size >= 1, got {world_size}")
    host = host or node_address()
    store = torch.distributed.TCPStore(
        host, 0, world_size, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip
    return store, GroupSpec(host, store.port, world_size, backend or default_backend(), timeout_s)


def join_group(spec: GroupSpec, rank: int, store: Any = None) -> None:
    """Join the learner group as ``rank`` (this process's default process group), waiting at most
    ``spec.timeout_s`` for every rank."""
    if torch.distributed.is_initialized():
        raise RuntimeError("this process already belongs to a process group: a learner rank needs its own process")
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if store is None:
        store = torch.distributed.TCPStore(spec.host, spec.port, spec.world_size, is_master=False, timeout=timeout)
    torch.distributed.init_process_group(
        spec.backend, store=store, rank=rank, world_size=spec.world_size, timeout=timeout
    )


def leave_group() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: the modules whose class the model names in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def shard_model(model: torch.nn.Module, *, param_dtype: torch.dtype | None = None) -> None:
    """Shard ``model`` in place (module docstring). ``param_dtype`` (e.g. bfloat16 on GPU): the
    gathered parameters' dtype; gradient reductions and the sharded masters stay float32."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"resources.learner.num_workers > 1: {type(model).__name__} names no decoder layer class "
            "(_no_split_modules), so it cannot be sharded layer by layer"
        )
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (a collective: every rank must call it, in the same order),
    or the tensor itself when it is not sharded."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes this process holds of the model's parameters and gradients and of the optimizer's
    state (its local shards when sharded): the memory sharding divides."""
    from torch.distributed.tensor import DTensor

    def nbytes(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.numel() * local.element_size()

    total = sum(nbytes(p) + (nbytes(p.grad) if p.grad is not None else 0) for p in model.parameters())
    if optimizer is not None:
        for state in optimizer.state.values():
            total += sum(nbytes(v) for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return total


def all_reduce_scalar(value: float, op: str = "sum") -> float:
    """``value`` summed (or its max) over the group's ranks."""
    on_gpu = torch.distributed.get_backend() == "nccl"  # NCCL reduces GPU tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device)
    reduce_op = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX}[op]
    torch.distributed.all_reduce(tensor, op=reduce_op)
    return float(tensor.item())


def broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` (picklable) on every rank."""
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order."""
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def empty_model(name_or_path: str, *, trust_remote_code: bool = False) -> torch.nn.Module:
    """The causal LM with its parameters on the meta device and its buffers (e.g. rotary
    frequencies) computed as usual, tied weights tied; :func:`load_shards` fills it once sharded."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    model.tie_weights()
    return model


def load_shards(model: torch.nn.Module, name_or_path: str, device: torch.device, *,
                trust_remote_code: bool = False) -> str:  # fmt: skip
    """Fill the sharded ``model`` (a collective): rank 0 reads the safetensors one tensor at a time
    and broadcasts it, each rank keeping its shard, so no rank holds the whole model ("streamed");
    safetensors that do not name the parameters are loaded whole on every rank ("whole")."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    names = [name for name, _ in model.named_parameters()]  # tied parameters once
    files = _safetensors_of(name_or_path, names) if torch.distributed.get_rank() == 0 else None
    files = broadcast_from_rank0(files)
    model.to_empty(device=device)
    for name, buffer in model.named_buffers():
        buffer.copy_(buffers[name])
    whole = None
    if files is None:
        from transformers import AutoModelForCausalLM

        whole = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32,
                                                     trust_remote_code=trust_remote_code).state_dict()  # fmt: skip
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in names:
            param = params[name]
            if whole is not None:
                full = whole.pop(name).to(device)
            else:
                full = torch.empty(param.shape, dtype=torch.float32, device=device)
                if torch.distributed.get_rank() == 0:
                    full.copy_(_read_tensor(files, name))
                torch.distributed.broadcast(full, src=0)
            if isinstance(param, DTensor):
                shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(shard.to_local())
            else:
                param.copy_(full)
            del full
    return "whole" if whole is not None else "streamed"


def _safetensors_of(name_or_path: str, names: list[str]) -> dict[str, str] | None:
    """{parameter name: its safetensors file} when the files hold every one of ``names``; else None."""
    import json
    import os

    from safetensors import safe_open

    folder = name_or_path
    if not os.path.isdir(folder):
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(name_or_path, allow_patterns=["*.safetensors", "*.json"])
        except Exception:  # offline, gated, no such repo: from_pretrained reports it as usual
            return None
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            where = {key: os.path.join(folder, file) for key, file in json.load(f)["weight_map"].items()}
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        path = os.path.join(folder, "model.safetensors")
        with safe_open(path, "pt") as f:
            where = dict.fromkeys(f.keys(), path)
    else:
        return None
    if not all(name in where for name in names):
        return None
    return {name: where[name] for name in names}


def _read_tensor(files: dict[str, str], name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(files[name], "pt") as f:
        return f.get_tensor(name)
