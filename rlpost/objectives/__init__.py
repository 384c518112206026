"""TorchRL's LLM objectives (``torchrl.objectives.llm``) over TensorDict batches, on the pure math
of :mod:`rlpost.algo`: the policy losses GRPOLoss, DAPO and CISPOLoss; SFTLoss and
DistillationLoss on chat histories; MCAdvantage (group advantages on write) with its
MCAdvantageSelector and RayMCAdvantage (its state in a Ray actor), and TopKRewardSelector (expert
iteration's top-k)."""

from rlpost.algo.kl import k3_kl_token_estimate
from rlpost.objectives.distillation import DistillationLoss, DistillationLossOutput
from rlpost.objectives.grpo import GRPOLoss
from rlpost.objectives.grpo_variants import DAPO, CISPOLoss
from rlpost.objectives.loss_output import CISPOLossOutput, DAPOLossOutput, GRPOLossOutput, LLMLossOutput
from rlpost.objectives.mc_advantage import MCAdvantage
from rlpost.objectives.ray_mc_advantage import RayMCAdvantage
from rlpost.objectives.selection import MCAdvantageSelector, TopKRewardSelector
from rlpost.objectives.sft import SFTLoss, SFTLossOutput

__all__ = [
    "CISPOLoss",
    "CISPOLossOutput",
    "DAPO",
    "DAPOLossOutput",
    "DistillationLoss",
    "DistillationLossOutput",
    "GRPOLoss",
    "GRPOLossOutput",
    "LLMLossOutput",
    "MCAdvantage",
    "MCAdvantageSelector",
    "RayMCAdvantage",
    "SFTLoss",
    "SFTLossOutput",
    "TopKRewardSelector",
    "k3_kl_token_estimate",
]
