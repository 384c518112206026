"""The learner role: trains the policy with GRPO, publishes its weights, writes checkpoints.

The role's modules, read in this order:

- :mod:`~rlpost.actors.learner.core`: :class:`LearnerSettings` (the job config sections the
  learner reads) and :class:`Learner`, a plain class (no Ray) holding the model, AdamW and the
  loss: collate, ``train_step`` (micro-batches, the optimizer step), ``score`` and ``publish``.
  Its module docstring describes one learner step.
- :mod:`~rlpost.actors.learner.checkpoint`: the checkpoint folders, written and read
  (:class:`Checkpointer`, :class:`CheckpointWriteError`), behind ``Learner.save_checkpoint`` and
  ``Learner.load_checkpoint``.
- :mod:`~rlpost.actors.learner.lora_sync`: what a weight sync sends (every weight, the LoRA
  adapter or the merged weights) and by which route, and the adapters' dropout in training.
- :mod:`~rlpost.actors.learner.memory`: the model's and the process's memory (weights copied out
  of the mapped checkpoint, activation checkpointing, freed memory back to the OS) and threads.
- :mod:`~rlpost.actors.learner.step_metrics`: the metrics a step reports.
- :mod:`~rlpost.actors.learner.actor`: :class:`LearnerActor`, the Learner as a Ray actor (a
  subclass adding the process's set-up, the metrics and the weight bus), and
  :func:`start_learner` / :func:`start_learner_group`, the ways it is started.

A learner group shards one model over its ranks with :mod:`rlpost.actors.sharding` (outside this
package: the benchmarks and GPU checks use it too). The names below are the role's public ones,
importable from ``rlpost.actors.learner``.
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
