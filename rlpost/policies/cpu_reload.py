"""Load new weights straight into vLLM's CPU kernels, without its layerwise reload.

vLLM's generic ``reload_weights`` on the CPU re-creates every parameter per layer (fresh memory,
faulted in page by page), copies the update in through the weight loaders, packs the GEMM kernels
and drops the dense copy: 2-2.5 s for the 0.5B-shaped fp32 model (2.5 GB, 2 cores), half of it
the loaders' copies. :class:`DirectCpuReload` packs each linear weight straight from the update's
tensor through vLLM's own ``dispatch_cpu_unquantized_gemm`` (fused q/k/v and gate/up through one
reused scratch buffer), copies embeddings, norms and biases into the existing tensors and
re-packs the LM head: 1.05 s against 2.5 s (BENCHMARKS.md, section 10), 80% of it kernel packs.

It takes a model whose every parameter module is an unquantized linear layer on one TP rank, an
embedding / LM head or an RMSNorm / LayerNorm (:func:`unsupported_reason` names the first that is
not), and an update whose every name maps onto it; else the caller uses ``reload_weights``. Trap:
the kernel must own its packed copy, since the next publish rewrites the update's memory
(checked once per process per linear shape, :func:`kernel_copies_weight`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

_NORMS = ("RMSNorm", "LayerNorm", "GemmaRMSNorm")


@dataclass
class _Fused:
    """The shards of one fused linear layer's weight (and bias) in one update."""

    weight: dict[int, torch.Tensor] = field(default_factory=dict)
    bias: dict[int, torch.Tensor] = field(default_factory=dict)


def _module_kind(module: torch.nn.Module) -> str | None:
    """ "linear", "embedding", "norm" or None (not a kind this loader handles)."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    if isinstance(module, LinearBase):
        tp = getattr(module, "tp_size", 1)
        ok = isinstance(module.quant_method, UnquantizedLinearMethod) and tp == 1 and hasattr(module, "cpu_linear")
        return "linear" if ok else None
    if isinstance(module, VocabParallelEmbedding):
        ok = isinstance(module.quant_method, UnquantizedEmbeddingMethod) and getattr(module, "tp_size", 1) == 1
        return "embedding" if ok else None
    if type(module).__name__ in _NORMS:
        return "norm"
    return None


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why :class:`DirectCpuReload` cannot load into ``model`` (None: it can). Also builds one
    kernel of each linear shape the model has, to check that it owns its packed weight."""
    shapes = set()
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        kind = _module_kind(module)
        if kind is None:
            return f"{name or 'the model'} is a {type(module).__name__}, not a layer the direct reload knows"
        if kind == "linear":
            shapes.add((module.output_size_per_partition, module.input_size_per_partition, module.params_dtype))
    if getattr(model, "hf_to_vllm_mapper", None) is None and getattr(model, "packed_modules_mapping", None) is None:
        return f"{type(model).__name__} names no mapping from checkpoint names to its layers"
    for rows, cols, dtype in sorted(shapes, key=str):
        if not kernel_copies_weight(rows, cols, dtype):
            return f"vLLM's CPU kernel for a {rows} x {cols} {dtype} weight reads the weight it was built from"
    return None


def kernel_copies_weight(rows: int, cols: int, dtype: torch.dtype) -> bool:
    """Whether vLLM's CPU GEMM kernel built from a ``rows x cols`` weight still gives the same
    results once that weight's memory is overwritten: the direct reload builds kernels from
    memory that the next update (or the next fused layer) writes again."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Module()
    weight = torch.rand(rows, cols, generator=generator).to(dtype)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    x = torch.rand(2, cols, generator=generator).to(dtype)
    before = layer.cpu_linear(x, layer.weight, None).clone()
    weight.fill_(3.0)
    return torch.equal(layer.cpu_linear(x, layer.weight, None), before)


class DirectCpuReload:
    """Loads whole-model updates into a vLLM model on the CPU (module docstring).

    Args:
        model: the engine's model (``model_runner.get_model()`` in the worker process).
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.modules = dict(model.named_modules())
        self.mapper = getattr(model, "hf_to_vllm_mapper", None)
        self.packed = getattr(model, "packed_modules_mapping", None) or {}
        self._scratch = torch.empty(0)

    def plan(self, names: Iterable[str]) -> dict[str, tuple[str, str, int | None]] | str:
        """``{update name: (module name, parameter name, shard index or None)}``, or the reason
        (a string) why some name does not map onto this model."""
        out = {}
        for name in names:
            mapped = self._map(name)
            if mapped is None:
                return f"{name} does not map onto a layer of {type(self.model).__name__}"
            module_name, param_name, shard = mapped
            module = self.modules.get(module_name)
            if module is None or _module_kind(module) is None:
                return f"{name} maps to {module_name}, which the direct reload does not handle"
            if shard is not None and _module_kind(module) != "linear":
                return f"{name} is a shard of {module_name}, which is not a linear layer"
            out[name] = mapped
        return self._check_fused_complete(out)

    def _check_fused_complete(self, plan: dict[str, tuple[str, str, int | None]]) -> dict | str:
        """``plan``, or why not: a fused layer's weight must come whole (every shard once)."""
        shards: dict[tuple[str, str], list[int]] = {}
        for module_name, param_name, shard in plan.values():
            if shard is not None:
                shards.setdefault((module_name, param_name), []).append(shard)
        for (module_name, param_name), got in shards.items():
            expected = list(range(len(getattr(self.modules[module_name], "output_sizes", ()))))
            if sorted(got) != expected:
                return f"the update brings shards {sorted(got)} of {module_name}.{param_name}, which has {expected}"
        return plan

    def _map(self, name: str) -> tuple[str, str, int | None] | None:
        shard = None
        if self.mapper is not None:
            mapped = self.mapper._map_name_with_shard(name)
            if mapped is None:
                return None
            name, shard = mapped
            if isinstance(shard, list):  # one tensor loaded into several shards: not a plain layout
                return None
        else:  # the model's packed modules: "...q_proj.weight" -> ("...qkv_proj", "weight", 0)
            module_name, _, param_name = name.rpartition(".")
            parent, _, leaf = module_name.rpartition(".")
            for fused, parts in self.packed.items():
                if leaf in parts:
                    name, shard = f"{parent}.{fused}.{param_name}", parts.index(leaf)
                    break
        module_name, _, param_name = name.rpartition(".")
        return module_name, param_name, _shard_index(shard)

    @torch.no_grad()
    def load(self, named: list[tuple[str, torch.Tensor]], plan: dict[str, tuple[str, str, int | None]]) -> int:
        """Write ``named`` (a planned update) into the model; returns how many layers' kernels
        were rebuilt. The tensors may be views of memory that changes after this returns."""
        fused: dict[str, _Fused] = {}
        whole: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in named:
            module_name, param_name, shard = plan[name]
            if shard is None:
                whole.setdefault(module_name, {})[param_name] = tensor
            else:
                getattr(fused.setdefault(module_name, _Fused()), param_name)[shard] = tensor
        rebuilt, written = 0, set()
        for module_name in dict.fromkeys([*whole, *fused]):  # each layer once
            module = self.modules[module_name]
            kind = _module_kind(module)
            tensors = dict(whole.get(module_name, {}))
            if module_name in fused:
                tensors.update(self._fuse(fused[module_name]))
            if kind == "linear":
                rebuilt += self._load_linear(module_name, module, tensors)
                continue
            for param_name, tensor in tensors.items():
                target = getattr(module, param_name)
                if id(target) not in written:  # a tensor two layers share (a tied LM head): once
                    _copy_into(module_name, target, param_name, tensor)
                    written.add(id(target))
        return rebuilt + self._rebuild_heads(written)

    def _rebuild_heads(self, written: set[int]) -> int:
        """Pack again the kernel of every LM head whose weight was written (under its own name
        or, tied, under the embedding's). A plain embedding only looks rows up: vLLM builds a
        kernel for it as well, which nothing calls, so it is not rebuilt."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        heads = {id(m): m for m in self.modules.values() if isinstance(m, ParallelLMHead)}
        head = getattr(self.model, "lm_head", None)
        if isinstance(head, torch.nn.Module) and _module_kind(head) == "embedding":
            heads[id(head)] = head
        rebuilt = 0
        for module in heads.values():
            if id(module.weight) in written and hasattr(module, "cpu_linear"):
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                rebuilt += 1
        return rebuilt

    def _fuse(self, shards: _Fused) -> dict[str, torch.Tensor]:
        """A fused layer's weight (in the reused scratch buffer) and bias from their shards."""
        out = {}
        if shards.weight:
            parts = [shards.weight[i] for i in sorted(shards.weight)]
            rows, cols = sum(p.shape[0] for p in parts), parts[0].shape[1]
            if self._scratch.numel() < rows * cols or self._scratch.dtype != parts[0].dtype:
                self._scratch = torch.empty(rows * cols, dtype=parts[0].dtype)
            out["weight"] = torch.cat(parts, out=self._scratch[: rows * cols].view(rows, cols))
        if shards.bias:
            out["bias"] = torch.cat([shards.bias[i] for i in sorted(shards.bias)])
        return out

    def _load_linear(self, module_name: str, module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> int:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        if "bias" in tensors:
            _copy_into(module_name, module.bias, "bias", tensors["bias"])
        weight = tensors.get("weight")
        if weight is None:
            return 0
        shape = (module.output_size_per_partition, module.input_size_per_partition)
        if tuple(weight.shape) != shape:
            raise ValueError(f"{module_name}.weight: the update has shape {tuple(weight.shape)}, the layer {shape}")
        weight = weight.to(module.params_dtype)  # no copy when the dtypes match
        module.weight = torch.nn.Parameter(weight, requires_grad=False)
        dispatch_cpu_unquantized_gemm(module, remove_weight=True)
        if module.weight.numel():  # a kernel that reads the dense weight at each call keeps its own
            module.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        return 1


def _shard_index(shard) -> int | None:
    """vLLM's shard ids ("q", "k", "v" or 0, 1, ...) as positions in the fused weight."""
    if shard is None:
        return None
    return {"q": 0, "k": 1, "v": 2}.get(shard, shard) if isinstance(shard, str) else int(shard)


def _copy_into(module_name: str, target: torch.Tensor, param_name: str, tensor: torch.Tensor) -> None:
    if target.shape != tensor.shape:
        raise ValueError(
            f"{module_name}.{param_name}: the update has shape {tuple(tensor.shape)}, the model {tuple(target.shape)}"
        )
    target.data.copy_(tensor)
