"""Pipes between roles: the weight-sync bus (learner -> inference workers)."""

from rlpost.transport.weight_bus import (
    BusSpec,
    LocalWeightBus,
    LocalWeightReceiver,
    PublishStats,
    TorchWeightPublisher,
    TorchWeightReceiver,
    WeightPublisher,
    WeightReceiver,
    WeightSyncError,
    WeightUpdate,
)

__all__ = [
    "BusSpec",
    "LocalWeightBus",
    "LocalWeightReceiver",
    "PublishStats",
    "TorchWeightPublisher",
    "TorchWeightReceiver",
    "WeightPublisher",
    "WeightReceiver",
    "WeightSyncError",
    "WeightUpdate",
]
