"""Seed-named objectives wrapping the pure math of :mod:`rlpost.algo` for batches of samples."""

from rlpost.algo.kl import k3_kl_token_estimate
from rlpost.objectives.grpo import GRPOLoss, GRPOLossOutput, LLMLossOutput
from rlpost.objectives.mc_advantage import MCAdvantage

__all__ = ["GRPOLoss", "GRPOLossOutput", "LLMLossOutput", "MCAdvantage", "k3_kl_token_estimate"]
