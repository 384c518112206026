"""LoRA adapters (``model.lora``): the learner trains one with ``peft``, the engines serve it.

The pieces, from the learner to the engines::

    apply_lora(model, lora)          the learner's model: the base frozen, an adapter on each target layer
    adapter_tensors(peft_model)      what a sync sends with lora.sync=adapter: the adapter only, named as
                                     in peft's adapter_model.safetensors
    merged_tensors(peft_model)       what it sends with lora.sync=merged: the base weights with the
                                     adapter merged in, named as in the base model (a sync leaves
                                     out the frozen embeddings, output head and norms)
    write_adapter(folder, ...)       an inference worker writes what it received as a peft adapter folder;
                                     its vLLM engine loads that folder as a LoRA adapter

An engine serves LoRA when it was built with :func:`engine_lora_kwargs`. Both sides build the
adapter's config with :func:`peft_config` from the same section, so the folder a worker writes
describes what the learner trains.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from rlpost.config import VLLM_LORA_RANKS

if TYPE_CHECKING:
    from rlpost.config import JobConfig, LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGED_FOLDER = "merged"  # a checkpoint's merged model (model.lora.save_merged)


def peft_config(lora: LoraConfig):
    """The ``peft.LoraConfig`` of the section (a causal LM's adapter, no bias terms)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def adapter_config_dict(lora: LoraConfig, base_model: str | None = None) -> dict[str, Any]:
    """What ``adapter_config.json`` holds for this section (plain JSON values)."""
    return peft_config_json(peft_config(lora), base_model)


def peft_config_json(config, base_model: str | None) -> dict[str, Any]:
    """A ``peft.LoraConfig`` as ``adapter_config.json`` holds it (plain JSON values)."""
    values = config.to_dict()
    values["base_model_name_or_path"] = base_model
    return json.loads(json.dumps(values, default=_json_value))


def _json_value(value: Any) -> Any:
    if isinstance(value, set):
        return sorted(value)
    return str(value)


def sync_route(cfg: JobConfig) -> Literal["adapter", "merged"] | None:
    """What a LoRA run's weight syncs send, decided before the engines start (None: no LoRA).

    ``model.lora.sync: auto`` sends the merged weights where the inference engines run on CPUs
    (``resources.inference.num_gpus: 0``): vLLM's CPU LoRA kernels generate at about half the
    full-weight speed, which costs more than reloading the merged projections at each sync (the
    0.5B-shaped race on 2 cores: a steady step's generation 9.6 s with the adapter against 4.7 s
    merged, for a sync of ~1.9 s against 0.4 s). On GPUs it sends the adapter; the learner still
    falls back to merged weights where an engine cannot serve LoRA."""
    section = cfg.model.lora
    if section is None:
        return None
    if section.sync != "auto":
        return section.sync
    return "merged" if cfg.resources.inference.num_gpus == 0 else "adapter"


def engine_lora_kwargs(lora: LoraConfig) -> dict[str, Any]:
    """``vllm.LLM`` arguments that let an engine serve this adapter: one adapter at a time, of the
    smallest rank vLLM builds for that holds ``lora.rank``."""
    return {
        "enable_lora": True,
        "max_lora_rank": next(r for r in VLLM_LORA_RANKS if r >= lora.rank),
        "max_loras": 1,
    }


@dataclass(frozen=True)
class AdapterServing:
    """An engine that serves many clients' adapters, one chosen per request (the service's
    engines): adapters up to ``max_rank``, ``max_loras`` of them in one batch, ``in_memory`` more
    loaded in host memory, ``files`` kept as files (the least recently used dropped past that)."""

    max_rank: int
    max_loras: int = 4
    in_memory: int = 8
    files: int = 64


def engine_adapter_kwargs(serving: AdapterServing) -> dict[str, Any]:
    """``vllm.LLM`` arguments for :class:`AdapterServing`."""
    return {
        "enable_lora": True,
        "max_lora_rank": next(r for r in VLLM_LORA_RANKS if r >= serving.max_rank),
        "max_loras": serving.max_loras,
        "max_cpu_loras": serving.max_loras + serving.in_memory,
    }


def apply_lora(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    """``model`` wrapped by peft with a fresh adapter (B = 0: it still computes the base) on
    every target layer, the base frozen. A target matching no layer is an error naming it (peft
    complains only when none matches)."""
    from peft import get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [target for target in lora.target_modules if target not in names]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(
            f"model.lora.target_modules: {type(model).__name__} has no layer named {missing}; its linear "
            f"layers are {linear}"
        )
    return get_peft_model(model, peft_config(lora))


def is_lora_model(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def adapter_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter's tensors of a peft model, as peft saves them (``...q_proj.lora_A.weight``):
    the names vLLM reads from an adapter folder."""
    from peft import get_peft_model_state_dict

    yield from get_peft_model_state_dict(model).items()


def merged_tensors(
    model: torch.nn.Module, *, merge: bool = True, changing_only: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's tensors of a peft model under their base names, each adapted layer's
    weight with its adapter merged in (``W + scale * B @ A``), one at a time; the model is not
    changed. ``merge=False`` yields the unmerged tensors under the same names (their shapes).

    ``changing_only``: leave out the tensors that training never changes and that weigh the
    most, the frozen embeddings, the output head and the norms of layers without an adapter
    (what a weight sync sends: the engines loaded the same base checkpoint, so they hold these
    already). Every other layer is kept, adapted or not, because an engine fuses sibling
    projections (q/k/v, gate/up) into one layer whose update must come whole. On the
    Qwen2.5-0.5B shape with the default targets this is 1.4 of 2.5 GB, and the engine's CPU
    reload skips repacking the 136M-parameter output head."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    adapted = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    kept = _frozen_unchanging_modules(base, adapted) if changing_only else set()
    for key, tensor in base.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        if ".lora_" in f".{key}":  # lora_A / lora_B / lora_embedding_*: the adapter itself
            continue
        if owner in kept:
            continue
        layer_name = owner.removesuffix(".base_layer")
        if owner.endswith(".base_layer") and layer_name in adapted:
            key = f"{layer_name}.{leaf}"
            if merge and leaf == "weight":
                tensor = _merged_weight(adapted[layer_name], tensor)
        yield key, tensor


def _merged_weight(layer, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` with each active adapter of the peft ``layer`` added, ``W + scale * B @ A``.

    A plain LoRA adapter on a linear layer takes one fused multiply-add (``torch.addmm``): peft's
    ``get_delta_weight`` makes the product, the scaled product and the sum as three full-size
    tensors, which on the Qwen2.5-0.5B shape's 168 adapted layers takes 1.2 s against 0.43 s
    (2 CPU cores). Any other kind (DoRA, another dtype than the adapter's) goes through peft,
    the sum made in the wider dtype and stored in the weight's, as peft's ``merge_and_unload``
    adds in place (TorchRL's GRPO scripts keep fp32 adapters on a bf16 base: the merged weight
    is bf16, rounded once)."""
    merged = weight
    for name in layer.active_adapters:
        a = layer.lora_A[name].weight if name in layer.lora_A else None
        b = layer.lora_B[name].weight if name in layer.lora_B else None
        plain = (
            a is not None
            and b is not None
            and weight.dim() == 2
            and a.dtype == b.dtype == weight.dtype
            and not layer.use_dora.get(name, False)
            and getattr(layer, "lora_variant", {}).get(name) is None
        )
        if not plain:
            merged = (merged + layer.get_delta_weight(name)).to(weight.dtype)
        elif layer.fan_in_fan_out:  # the weight is stored transposed (GPT-2's Conv1D): add (B @ A)^T
            merged = torch.addmm(merged, a.t(), b.t(), alpha=layer.scaling[name])
        else:
            merged = torch.addmm(merged, b, a, alpha=layer.scaling[name])
    return merged


def _frozen_unchanging_modules(base: torch.nn.Module, adapted: dict[str, torch.nn.Module]) -> set[str]:
    """Names of the modules of ``base`` whose tensors a LoRA run never changes and that a sync
    can leave out: embeddings, the output head and norms that hold no adapter and no trainable
    parameter."""
    output = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    names = set()
    for name, module in base.named_modules():
        if name.removesuffix(".base_layer") in adapted or any(
            p.requires_grad for p in module.parameters(recurse=False)
        ):
            continue
        is_norm = "Norm" in type(module).__name__
        if isinstance(module, torch.nn.Embedding) or module is output or is_norm:
            names.add(name)
    return names


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The merged model's float32 weights on the CPU (what :func:`save_merged` writes)."""
    return {name: tensor.detach().float().cpu() for name, tensor in merged_tensors(model)}


def save_merged(model: torch.nn.Module, folder: str | Path) -> Path:
    """Write the merged model of a peft ``model`` to ``folder`` in Hugging Face format."""
    folder = Path(folder)
    base = model.get_base_model()
    base.save_pretrained(folder, state_dict=merged_state_dict(model))
    return folder


def write_adapter(folder: str | Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """Write ``tensors`` and ``config`` as a peft adapter folder (``adapter_model.safetensors`` and
    ``adapter_config.json``). Each file is written beside its name and renamed into place, so a
    reader never sees half of one."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, write in (
        (ADAPTER_WEIGHTS, lambda path: save_file({k: v.contiguous() for k, v in tensors.items()}, path)),
        (ADAPTER_CONFIG, lambda path: Path(path).write_text(json.dumps(config, indent=2, sort_keys=True))),
    ):
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=folder)
        os.close(fd)
        try:
            write(tmp)
            os.replace(tmp, folder / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return folder


def is_adapter_checkpoint(folder: str | Path) -> bool:
    """A checkpoint folder written by a LoRA learner (its adapter, not a whole model)."""
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def merged_model_for(checkpoint: str | Path, base_model: str, dest: str | Path, *, trust_remote_code=False) -> Path:
    """A Hugging Face model folder with the weights a LoRA ``checkpoint`` stands for: its own
    ``merged/`` when it was saved with one, or else the base model with the adapter merged in,
    written to ``dest``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = Path(checkpoint)
    if (checkpoint / MERGED_FOLDER / "config.json").is_file():
        return checkpoint / MERGED_FOLDER
    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32, trust_remote_code=trust_remote_code)
    merged = PeftModel.from_pretrained(base, checkpoint).merge_and_unload()
    merged.save_pretrained(dest)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(dest)
    return Path(dest)


def adapter_dropouts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The dropout modules on the adapters' inputs of a peft model (each ``lora_dropout``)."""
    from peft.tuners.lora import LoraLayer

    return [
        dropout
        for module in model.modules()
        if isinstance(module, LoraLayer)
        for dropout in module.lora_dropout.values()
        if isinstance(dropout, torch.nn.Dropout)
    ]


def engine_supports_lora(model_path: str, *, trust_remote_code: bool = False) -> bool:
    """Whether vLLM can serve a LoRA adapter on this model: its architecture (``config.json``) is
    one of vLLM's own model classes that implement LoRA. (vLLM's check runs in the engine's
    worker process and ends its start-up; asking first lets a worker start without LoRA.)"""
    from transformers import AutoConfig
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    architectures = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).architectures or []
    known = [arch for arch in architectures if arch in ModelRegistry.get_supported_archs()]
    return bool(known) and all(supports_lora(ModelRegistry.models[arch].load_model_cls()) for arch in known)
