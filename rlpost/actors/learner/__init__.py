"""The learner role: trains the policy with GRPO, publishes its weights, writes checkpoints.

Modules, in reading order: ``core`` (:class:`Learner`, plain; its docstring describes one step),
``settings``, ``checkpoint`` (:class:`Checkpointer`, :class:`CheckpointWriteError`), ``lora_sync``
(what a weight sync sends, by which route), ``memory`` (the model's and the process's memory and
threads), ``step_metrics``, ``actor`` (:class:`LearnerActor`, :func:`start_learner`,
:func:`start_learner_group`). A learner group shards one model with :mod:`rlpost.actors.sharding`
(outside this package: the benchmarks and GPU checks use it too).
"""

from __future__ import annotations

from rlpost.actors.learner.actor import LearnerActor, start_learner, start_learner_group
from rlpost.actors.learner.checkpoint import Checkpointer, CheckpointWriteError
from rlpost.actors.learner.core import LOSS_TYPES, Learner
from rlpost.actors.learner.memory import (
    enable_activation_checkpointing,
    own_trainable_weights,
    release_freed_memory,
    return_freed_memory_to_os,
    set_torch_threads,
)
from rlpost.actors.learner.settings import LearnerSettings

__all__ = [
    "LOSS_TYPES",
    "CheckpointWriteError",
    "Checkpointer",
    "Learner",
    "LearnerActor",
    "LearnerSettings",
    "enable_activation_checkpointing",
    "own_trainable_weights",
    "release_freed_memory",
    "return_freed_memory_to_os",
    "set_torch_threads",
    "start_learner",
    "start_learner_group",
]
