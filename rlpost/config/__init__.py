"""One typed config tree for a whole rlpost job: YAML in, dotted overrides on top, checked.

Every field has a description and a default (or is required). Unknown keys are errors that name
the full dotted path; cross-field mistakes raise :class:`ConfigError` naming the keys involved.
Treat renaming a key as a breaking change: configs and run directories outlive the code.

    cfg = load_config("configs/tiny-cpu.yaml", ["trainer.steps=20", "rollout.temperature=0.7"])

One module per group of sections (``model``, ``data``, ``rollout``, ``training``, ``resources``,
``tracking``, ``rewards``); :mod:`rlpost.config.job` holds the whole :class:`JobConfig`, its
cross-field checks and the YAML and override parsing. Every public name is importable from
``rlpost.config``.
"""

from rlpost.config.base import ConfigError
from rlpost.config.data import CodeTaskConfig, DataConfig, PythonToolConfig, ReasoningGymConfig, ToolsConfig
from rlpost.config.job import (
    LOCAL_PATH_KEYS,
    JobConfig,
    check_overrides,
    default_run_name,
    load_config,
    path_values,
    resolve_local_paths,
    save_config,
    section_type,
    validate_config,
)
from rlpost.config.model import VLLM_LORA_RANKS, LoraConfig, ModelConfig
from rlpost.config.resources import (
    LearnerResources,
    ResourcesConfig,
    RoleDeadlines,
    RoleResources,
    TorchRoleResources,
    WatchdogConfig,
)
from rlpost.config.rewards import JudgeConfig, RewardModelConfig
from rlpost.config.rollout import EngineConfig, EvalConfig, RolloutConfig
from rlpost.config.serve import ServeConfig, ServeResources
from rlpost.config.tracking import TRACKER_PACKAGES, LoggingConfig, missing_tracker_packages
from rlpost.config.training import (
    DAPO_CLIP_EPS_HIGH,
    DistillationConfig,
    LossConfig,
    OptimizerConfig,
    ReferenceConfig,
    TrainerConfig,
    WeightSyncConfig,
)

__all__ = [
    "ConfigError", "LoraConfig", "ModelConfig", "ServeConfig", "ServeResources", "VLLM_LORA_RANKS", "ReasoningGymConfig", "CodeTaskConfig",
    "DataConfig", "PythonToolConfig", "ToolsConfig", "EngineConfig", "RolloutConfig", "EvalConfig",
    "ReferenceConfig", "DistillationConfig", "LossConfig", "OptimizerConfig", "TrainerConfig", "WeightSyncConfig",
    "DAPO_CLIP_EPS_HIGH", "RoleResources", "TorchRoleResources", "LearnerResources", "ResourcesConfig",
    "RoleDeadlines", "WatchdogConfig", "missing_tracker_packages", "LoggingConfig", "TRACKER_PACKAGES",
    "JudgeConfig", "RewardModelConfig", "JobConfig", "path_values", "resolve_local_paths", "load_config",
    "validate_config", "save_config", "default_run_name", "check_overrides", "section_type", "LOCAL_PATH_KEYS"
]  # fmt: skip
