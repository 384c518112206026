"""What a weight sync sends, and by which route; the LoRA adapters' dropout in training.

A Learner's ``publish()`` sends, by its ``sync_mode``: ``"full"`` (no ``model.lora``), the
``state_dict()``; ``"adapter"``, the LoRA adapter's tensors under peft's names (loaded as a vLLM
LoRA adapter); ``"merged"``, the base weights with the adapter merged in, for engines that serve
no LoRA (the frozen embeddings, output head and norms left out: the engines loaded the same base).
The route starts as the config chose it (:func:`lora_route`); :func:`choose_sync_mode` turns an
adapter route merged where a worker cannot serve LoRA. Stateless: the Learner passes model and mode.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from rlpost.actors import sharding
from rlpost.policies import lora
from rlpost.transport.bucketing import StreamedTensors

if TYPE_CHECKING:
    from rlpost.actors.learner.settings import LearnerSettings
    from rlpost.config import LoraConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger("rlpost")


def lora_route(cfg: LearnerSettings) -> str:
    """The route the config chose (``LearnerSettings.lora_sync``), before any fallback."""
    return cfg.lora_sync or ("merged" if cfg.model.lora.sync == "merged" else "adapter")


def choose_sync_mode(cfg: LearnerSettings, current: str, workers_serve_lora: Sequence[bool]) -> str:
    """With LoRA: the adapter when every worker serves LoRA (``workers_serve_lora``), otherwise
    the merged weights (``model.lora.sync: auto``, with a warning) or refuse (``sync: adapter``).
    ``current`` (the learner's ``sync_mode``) without LoRA or on a merged route."""
    section = cfg.model.lora
    if section is None or lora_route(cfg) == "merged":
        return current
    without = [i for i, serves in enumerate(workers_serve_lora) if not serves]
    if not without:
        return "adapter"
    if section.sync == "adapter":
        raise RuntimeError(
            f"model.lora.sync=adapter, but inference workers {without} cannot serve a LoRA adapter (their "
            "log says why); set model.lora.sync=merged or auto to send merged weights instead"
        )
    log.warning("inference workers %s cannot serve a LoRA adapter: each weight sync sends the merged "
                "model instead (model.lora.sync=auto)", without)  # fmt: skip
    return "merged"


def sync_tensors(
    model: torch.nn.Module, sync_mode: str, *, materialise: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """What a sync sends by ``sync_mode`` (module docstring), before any gather or cast;
    ``materialise=False``: "merged" unmerged, for the shapes."""
    if sync_mode == "adapter":
        return lora.adapter_tensors(model)
    if sync_mode == "merged":
        return lora.merged_tensors(model, merge=materialise, changing_only=True)
    return iter(model.state_dict().items())


def named_parameters_for_sync(
    model: torch.nn.Module, sync_mode: str, dtype: str, device: str | torch.device = "cpu"
) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of :func:`sync_tensors` for the engines, lazily: contiguous copies on
    ``device`` in ``dtype``, under the HF names vLLM's ``load_weights`` expects (peft's for an
    adapter). Trap: with tied embeddings ``lm_head.weight`` is still sent, since vLLM's CPU
    backend keeps its own repacked copy of the head (sync_logprob_diff 2e-2 without it, 3e-6 with).
    A sharded model's tensors are gathered in turn (a collective, same order on every rank).
    """
    torch_dtype = _DTYPES[dtype]
    for name, tensor in sync_tensors(model, sync_mode):
        yield name, sharding.full_tensor(tensor.detach()).to(device=device, dtype=torch_dtype).contiguous()


def weights_for_sync(
    model: torch.nn.Module, sync_mode: str, dtype: str, tensors: Iterator[tuple[str, torch.Tensor]]
) -> StreamedTensors:
    """``tensors`` as :class:`~rlpost.transport.bucketing.StreamedTensors`: names, dtypes and shapes
    up front, each tensor made only when the bus fills its bucket."""
    torch_dtype = _DTYPES[dtype]
    specs = tuple((name, torch_dtype, tuple(t.shape)) for name, t in sync_tensors(model, sync_mode, materialise=False))
    return StreamedTensors(specs, lambda: tensors)


@contextlib.contextmanager
def adapter_dropout(model: torch.nn.Module, section: LoraConfig | None):
    """The LoRA adapters' dropout on, for one training pass (``model.lora.dropout``; the
    model stays in eval mode otherwise, so scoring never drops anything)."""
    dropouts = [] if section is None or section.dropout == 0 else lora.adapter_dropouts(model)
    for module in dropouts:
        module.training = True
    try:
        yield
    finally:
        for module in dropouts:
            module.training = False
