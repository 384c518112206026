"""What TorchRL's LLM policy losses return: :class:`LLMLossOutput` and its GRPO, DAPO and CISPO
subclasses (``torchrl.objectives.llm``'s output tensorclasses)."""

from __future__ import annotations

import torch
from tensordict import TensorClass

__all__ = ["CISPOLossOutput", "DAPOLossOutput", "GRPOLossOutput", "LLMLossOutput"]


class LLMLossOutput(TensorClass["nocast"]):
    """What an LLM policy loss returns (TorchRL's ``LLMLossOutput``). Always set:
    ``loss_objective`` (the clipped surrogate, with its graph), ``clip_fraction``, ``kl_approx``
    (mean ``old - new`` log-prob) and ``ESS`` (normalised effective sample size of the importance
    weights, 1 on-policy). None unless computed: ``entropy``, ``loss_entropy``
    (``entropy_bonus``), ``loss_kl_to_ref``, ``kl_to_ref`` (``kl_to_ref_coeff``),
    ``loss_kl_to_inference``, ``kl_to_inference`` (``kl_to_inference_coeff`` not None). The
    ``loss_*`` fields carry their coefficient and sign and keep their graph; the others are
    detached. Fields left None are not entries, so ``out.items()`` and ``out.mean(reduce=True)``
    see only the computed ones.
    """

    loss_objective: torch.Tensor
    clip_fraction: torch.Tensor
    kl_approx: torch.Tensor
    ESS: torch.Tensor
    entropy: torch.Tensor | None = None
    loss_entropy: torch.Tensor | None = None
    loss_kl_to_ref: torch.Tensor | None = None
    kl_to_ref: torch.Tensor | None = None
    loss_kl_to_inference: torch.Tensor | None = None
    kl_to_inference: torch.Tensor | None = None


class GRPOLossOutput(LLMLossOutput):
    """What :class:`~rlpost.objectives.GRPOLoss` returns (TorchRL's ``GRPOLossOutput``)."""


class DAPOLossOutput(LLMLossOutput):
    """What :class:`~rlpost.objectives.DAPO` returns (TorchRL's ``DAPOLossOutput``)."""


class CISPOLossOutput(LLMLossOutput):
    """What :class:`~rlpost.objectives.CISPOLoss` returns (TorchRL's ``CISPOLossOutput``)."""
