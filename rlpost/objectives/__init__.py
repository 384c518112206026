"""Seed-named objectives wrapping the pure math of :mod:`rlpost.algo` for batches of samples."""

from rlpost.objectives.grpo import GRPOLoss, GRPOLossOutput
from rlpost.objectives.mc_advantage import MCAdvantage

__all__ = ["GRPOLoss", "GRPOLossOutput", "MCAdvantage"]
