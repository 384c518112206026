"""The whole job: :class:`JobConfig` (every section), its cross-field checks, YAML and dotted overrides in, YAML out."""

from __future__ import annotations

import datetime as _dt
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from rlpost.config.base import ConfigError, Section
from rlpost.config.data import DataConfig, ToolsConfig
from rlpost.config.model import ModelConfig
from rlpost.config.resources import ResourcesConfig, WatchdogConfig
from rlpost.config.rewards import RewardModelConfig
from rlpost.config.rollout import EvalConfig, RolloutConfig
from rlpost.config.tracking import LoggingConfig
from rlpost.config.training import LossConfig, OptimizerConfig, ReferenceConfig, TrainerConfig, WeightSyncConfig


class JobConfig(Section):
    """A whole rlpost job."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompts, rewards and group size.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Sampling and worker counts.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation on held-out prompts.")
    tools: ToolsConfig = Field(default_factory=ToolsConfig, description="Tools the model may call.")
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig, description="Reference model and KL.")
    reward_model: RewardModelConfig | None = Field(
        None, description="A learned reward model or LLM judge beside the task's reward (null: none)."
    )
    loss: LossConfig = Field(default_factory=LossConfig, description="GRPO loss family.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Training loop.")
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig, description="Weight bus.")
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig, description="Ray resources per role.")
    watchdog: WatchdogConfig = Field(
        default_factory=WatchdogConfig, description="Frozen and hung actors: found by heartbeat, killed, replaced."
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Run directory and metrics.")

    @model_validator(mode="after")
    def _cross_field_checks(self) -> JobConfig:
        for message in _cross_field_errors(self):
            raise ValueError(message)
        return self

    @property
    def samples_per_step(self) -> int:
        return self.trainer.prompts_per_step * self.data.group_size


def _cross_field_errors(cfg: JobConfig) -> list[str]:
    errors = []
    if cfg.eval.greedy and cfg.eval.samples_per_prompt > 1:
        errors.append(
            f"eval.samples_per_prompt is {cfg.eval.samples_per_prompt} with eval.greedy=true: greedy decoding "
            "gives the same completion every time; set eval.greedy=false for pass@k"
        )
    if cfg.data.group_size < 2:
        errors.append(
            f"data.group_size is {cfg.data.group_size}; GRPO compares samples of a prompt, so it must be >= 2"
        )
    if cfg.data.task in ("gsm8k", "custom") and not cfg.data.dataset:
        errors.append(f"data.dataset is required for data.task={cfg.data.task}")
    if cfg.data.task == "custom" and not cfg.data.reward_fn:
        errors.append("data.reward_fn is required for data.task=custom ('package.module:function')")
    if cfg.tools.enabled and cfg.rollout.max_turns < 2:
        errors.append(
            f"tools are enabled but rollout.max_turns is {cfg.rollout.max_turns}; a tool's result is read on the "
            "next turn, so set rollout.max_turns >= 2"
        )
    if cfg.data.task == "reasoning_gym" and not cfg.data.reasoning_gym.tasks:
        errors.append("data.task=reasoning_gym needs data.reasoning_gym.tasks: {NAME: WEIGHT, ...}")
    if cfg.data.task == "reasoning_gym" and cfg.data.dataset:
        errors.append("data.task=reasoning_gym generates its rows: leave data.dataset empty")
    if cfg.data.task == "code" and not cfg.data.dataset:
        errors.append("data.dataset is required for data.task=code (rows with prompt, test and entry_point)")
    if cfg.data.task == "code" and cfg.data.code.require_answer_tag is False and cfg.tools.python.enabled:
        errors.append(
            "data.code.require_answer_tag=false with tools.python: the Python tool runs ```python blocks, so the "
            "graded answer must be inside <answer> tags; leave require_answer_tag unset or true"
        )
    rm = cfg.reward_model
    if rm is not None and rm.weight == 0 and rm.rule_weight == 0:
        errors.append("reward_model.weight and reward_model.rule_weight are both 0: every reward would be 0")
    if rm is not None and rm.kind == "generative" and rm.judge.max_tokens >= rm.engine.max_model_len:
        errors.append(
            f"reward_model.judge.max_tokens ({rm.judge.max_tokens}) must be below reward_model.engine.max_model_len "
            f"({rm.engine.max_model_len})"
        )
    if cfg.data.task == "tool_arithmetic" and not cfg.tools.python.enabled:
        errors.append("data.task=tool_arithmetic needs the Python tool: set tools.python.enabled=true")
    if cfg.trainer.prompts_per_step % cfg.rollout.num_env_pools:
        errors.append(
            f"trainer.prompts_per_step ({cfg.trainer.prompts_per_step}) must be divisible by "
            f"rollout.num_env_pools ({cfg.rollout.num_env_pools}) so every pool collects whole groups"
        )
    if cfg.samples_per_step % cfg.optimizer.grad_accumulation:
        errors.append(
            f"optimizer.grad_accumulation ({cfg.optimizer.grad_accumulation}) must divide the samples per step "
            f"(trainer.prompts_per_step * data.group_size = {cfg.samples_per_step})"
        )
    distill = cfg.loss.distillation
    if distill.coef > 0 and cfg.reference.kl_goes_to != "loss":
        errors.append(
            f"loss.distillation.coef is {distill.coef}: the teacher's log-probs come from the reference actor; set "
            "reference.enabled=true (with reference.model the teacher) and reference.kl_in=loss"
        )
    if distill.coef > 0 and cfg.loss.type == "sft":
        errors.append("loss.distillation with loss.type=sft: SFT has no advantage to carry the teacher's term")
    if not distill.use_reward and distill.coef == 0:
        errors.append("loss.distillation.use_reward=false without loss.distillation.coef: nothing would be trained")
    if cfg.loss.filter_equal_rewards and cfg.reference.kl_goes_to == "reward":
        errors.append(
            "loss.filter_equal_rewards with reference.kl_in=reward: the KL-shaped rewards of a group are never all "
            "equal, so the filter would drop nothing; use reference.kl_in=loss (or turn the filter off)"
        )
    if cfg.reference.kl_coef > 0 and not cfg.reference.enabled:
        errors.append(f"reference.kl_coef is {cfg.reference.kl_coef} but reference.enabled is false")
    if cfg.weight_sync.backend == "nccl" and (
        cfg.resources.inference.num_gpus == 0 or cfg.resources.learner.num_gpus == 0
    ):
        errors.append(
            "weight_sync.backend=nccl needs GPUs: set resources.inference.num_gpus and resources.learner.num_gpus"
        )
    if cfg.model.lora is not None and cfg.resources.learner.num_workers > 1:
        errors.append(
            f"model.lora with resources.learner.num_workers={cfg.resources.learner.num_workers}: a LoRA "
            "learner is one rank (its trainable state is the small adapter); set resources.learner.num_workers=1"
        )
    if cfg.rollout.max_tokens >= cfg.rollout.engine.max_model_len:
        errors.append(
            f"rollout.max_tokens ({cfg.rollout.max_tokens}) must be below rollout.engine.max_model_len "
            f"({cfg.rollout.engine.max_model_len}) to leave room for the prompt"
        )
    return errors


# ---------------------------------------------------------------------------- local paths

# the keys whose value may be a local file or folder (else a hub name, or inline text)
LOCAL_PATH_KEYS = ("model.name_or_path", "model.tokenizer", "model.chat_template", "data.dataset", "eval.dataset",
                   "reference.model", "reward_model.name_or_path")  # fmt: skip


def path_values(cfg: JobConfig) -> dict[str, str]:
    """The values of LOCAL_PATH_KEYS that are set (a file, a folder or a hub name; inline templates
    left out)."""
    values = {}
    for key in LOCAL_PATH_KEYS:
        section, field = key.split(".")
        value = getattr(getattr(cfg, section), field, None) if getattr(cfg, section) is not None else None
        if isinstance(value, str) and value and "{" not in value:
            values[key] = value
    return values


def resolve_local_paths(cfg: JobConfig, base: Path) -> dict[str, tuple[str, str]]:
    """Make every relative local path of ``cfg`` (LOCAL_PATH_KEYS: a value that names a file or
    folder under ``base``) absolute, in place; returns ``{key: (as written, absolute)}``. A run
    on an existing cluster calls it with the directory it was started in: its actors start
    elsewhere (the raylet's directory), where a relative path names nothing. Values that name
    nothing under ``base`` (hub names, inline templates) are left as they are."""
    resolved = {}
    for key, value in path_values(cfg).items():
        path = base / value
        if not Path(value).expanduser().is_absolute() and path.exists():
            section, field = key.split(".")
            setattr(getattr(cfg, section), field, str(path.resolve()))
            resolved[key] = (value, str(path.resolve()))
    return resolved


# ---------------------------------------------------------------------------- loading and saving


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                schema: type[Section] = JobConfig) -> Any:  # fmt: skip
    """Load a YAML config of ``schema`` (a :class:`JobConfig` unless told; the defaults when
    ``path`` is None) and apply dotted overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    for item in overrides:
        _apply_override(raw, item, schema)
    return validate_config(raw, source=str(path) if path else "defaults", schema=schema)


def validate_config(raw: dict[str, Any], *, source: str = "config", schema: type[Section] = JobConfig) -> Any:
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_describe(exc)}") from None


def save_config(cfg: JobConfig, path: str | Path) -> Path:
    """Write the resolved config (every default filled in) as YAML."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path


def default_run_name() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    return raw


def check_overrides(overrides: list[str] | tuple[str, ...]) -> None:
    """Raise ConfigError for an override that is not ``section.key=value`` or names an unknown
    key (for callers that have no config file to apply them to yet)."""
    for item in overrides:
        _apply_override({}, item)


def _apply_override(raw: dict[str, Any], item: str, schema: type[BaseModel] = JobConfig) -> None:
    """Apply ``a.b.c=value``; the value is parsed as YAML (so 20 is an int, [0.9, 0.95] a list)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    _check_known_path(key, schema)
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def _check_known_path(key: str, schema: type[BaseModel] = JobConfig) -> None:
    model: type[BaseModel] | None = schema
    walked = []
    for part in key.split("."):
        walked.append(part)
        if model is None:
            raise ConfigError(f"unknown config key: {'.'.join(walked)}")
        if part not in model.model_fields:
            raise ConfigError(f"unknown config key: {'.'.join(walked)}")
        annotation = model.model_fields[part].annotation
        model = section_type(annotation)
        if annotation is not None and getattr(annotation, "__origin__", None) is dict:
            return  # free-form mapping (engine.extra): any sub-key is allowed


def section_type(annotation: Any) -> type[BaseModel] | None:
    """The config section a field holds: its type, or the section of an optional one
    (``LoraConfig | None``); None for a plain value."""
    union = typing.get_origin(annotation) in (types.UnionType, typing.Union)
    candidates = typing.get_args(annotation) if union else (annotation,)
    sections = [t for t in candidates if isinstance(t, type) and issubclass(t, BaseModel)]
    return sections[0] if len(sections) == 1 else None


def _describe(exc: ValidationError) -> str:
    """One line per problem, each naming the full dotted key path."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown config key: {loc}")
        elif err["type"] == "value_error" and not loc:
            lines.append(str(err["ctx"]["error"]) if "ctx" in err else err["msg"])
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{loc}: {err['msg']}{shown}")
    return "; ".join(lines)
