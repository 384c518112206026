"""The job config sections the learner reads, as one value built once per run
(``LearnerSettings.from_job(cfg)``) and shipped to each learner rank."""

from __future__ import annotations

from dataclasses import dataclass

from rlpost.config import (
    JobConfig,
    LearnerResources,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
    ReferenceConfig,
    RolloutConfig,
    TrainerConfig,
)
from rlpost.policies import lora


@dataclass(frozen=True)
class LearnerSettings:
    """The job config sections the learner reads (the YAML's sections of the same names)."""

    model: ModelConfig  # the weights to start from, their dtype, the tokenizer
    loss: LossConfig
    optimizer: OptimizerConfig
    reference: ReferenceConfig  # the KL-to-reference term: on or off, coefficient, estimator
    trainer: TrainerConfig  # epochs per batch, torch seed, checkpoints kept
    rollout: RolloutConfig  # the sampling temperature (log-probs) and max_tokens (Dr.GRPO's L_max)
    resources: LearnerResources  # ``resources.learner`` (per rank; num_workers ranks)
    run_name: str = ""  # the run whose metrics the actor reports under
    # with LoRA, what the syncs send ("adapter" or "merged", rlpost.policies.lora.sync_route: it also
    # depends on where the engines run); None: model.lora.sync as written, with auto as adapter
    lora_sync: str | None = None

    @classmethod
    def from_job(cls, cfg: JobConfig) -> LearnerSettings:
        return cls(cfg.model, cfg.loss, cfg.optimizer, cfg.reference, cfg.trainer, cfg.rollout,
                   cfg.resources.learner, cfg.logging.run_name or "", lora.sync_route(cfg))  # fmt: skip
