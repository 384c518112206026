"""Pipes between roles: the weight-sync bus (learner -> inference workers), and the stateless
process group it is built like (:func:`stateless_init_process_group`)."""

from rlpost.transport.bucketing import StreamedTensors
from rlpost.transport.process_group import StatelessProcessGroup, stateless_init_process_group
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
    "StatelessProcessGroup",
    "StreamedTensors",
    "TorchWeightPublisher",
    "TorchWeightReceiver",
    "WeightPublisher",
    "WeightReceiver",
    "WeightSyncError",
    "WeightUpdate",
    "stateless_init_process_group",
]
