"""Seed-named objectives wrapping the pure math of :mod:`rlpost.algo` for batches of samples."""

from rlpost.objectives.mc_advantage import MCAdvantage

__all__ = ["MCAdvantage"]
