"""The ``data`` section (the task, its dataset or generator, the reward) and the ``tools`` section."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rlpost.config.base import Section


class ReasoningGymConfig(Section):
    """data.task=reasoning_gym: procedural tasks of the ``reasoning-gym`` package, scored by its own verifiers."""

    tasks: dict[str, float | dict[str, Any] | None] = Field(
        default_factory=dict,
        description="The tasks and their weights in the mixture: NAME: WEIGHT, or NAME: {weight: W, OPTION: VALUE, "
        "...} with that task's own generator options (e.g. chain_sum: {weight: 2, min_terms: 2, max_terms: 2}); "
        "a bare NAME: is weight 1 with the defaults. Names are the package's (reasoning_gym.factory.DATASETS).",
    )
    size: int = Field(1000, ge=1, description="Rows generated for training (the tasks drawn by weight).")
    seed: int = Field(0, description="Seed of the generators; evaluation (split 'test') draws other rows.")


class CodeTaskConfig(Section):
    """data.task=code: the model writes a function; the dataset's unit tests grade it in the sandbox."""

    reward: Literal["fraction", "binary"] = Field(
        "fraction", description="'fraction': the share of the tests passed; 'binary': 1 when every test passes, else 0."
    )
    timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit of grading one completion (all its tests).")
    call_timeout_s: float = Field(3.0, gt=0, description="Wall-clock limit of one call of the model's function.")
    memory_mb: int = Field(512, ge=64, description="Address-space limit of the sandboxed interpreter running it.")
    require_answer_tag: bool | None = Field(
        None,
        description="Grade only code inside <answer> tags. None: when tools.python is on (its ```python blocks are "
        "runs the model makes before answering), else the last ```python block also counts.",
    )


class DataConfig(Section):
    """Where prompts come from, how completions are rewarded, and the GRPO group size."""

    dataset: str | None = Field(
        None,
        description="Hugging Face dataset name or a local json/jsonl/parquet path. Leave empty with "
        "task=arithmetic to generate the synthetic task offline.",
    )
    subset: str | None = Field(None, description="Dataset configuration name (e.g. 'main' for openai/gsm8k).")
    split: str = Field(
        "train",
        description="Dataset split to draw prompts from. For the synthetic arithmetic tasks 'train' never "
        "draws the questions held out for evaluation ('test').",
    )
    prompt_column: str = Field("question", description="Column holding the user prompt.")
    answer_column: str = Field("answer", description="Column holding the reference answer for the reward.")
    task: Literal["arithmetic", "tool_arithmetic", "gsm8k", "reasoning_gym", "code", "custom"] = Field(
        "arithmetic",
        description="Reward and prompt format: 'arithmetic' (offline synthetic), 'tool_arithmetic' (offline "
        "synthetic products too large to do in the head: needs tools.python), 'gsm8k' (answer after ####), "
        "'reasoning_gym' (the package's generators and verifiers: data.reasoning_gym), 'code' (HumanEval-format "
        "rows graded by their unit tests in the sandbox: data.code) or 'custom' (reward_fn).",
    )
    reasoning_gym: ReasoningGymConfig = Field(
        default_factory=ReasoningGymConfig, description="The tasks of data.task=reasoning_gym."
    )
    code: CodeTaskConfig = Field(default_factory=CodeTaskConfig, description="Grading of data.task=code.")
    reward_fn: str | None = Field(
        None,
        description="Dotted path 'package.module:function' called as fn(completion, row) -> float; "
        "required for task=custom, optional extra reward otherwise.",
    )
    reward_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Wall-clock limit of one reward_fn call (it runs in a worker process); past it "
        "the sample scores 0 and counts in reward_errors.",
    )
    system_prompt: str | None = Field(None, description="System prompt; None uses the task's default.")
    group_size: int = Field(8, description="Samples per prompt (the GRPO group); at least 2.")
    num_synthetic_rows: int = Field(2000, ge=1, description="Rows generated for task=arithmetic without a dataset.")
    drop_long_prompts: bool = Field(
        False,
        description="Prompts longer than rollout.engine.max_model_len - rollout.max_tokens (rendered with the "
        "system prompt and chat template) are found before the run starts. false: the run is refused, naming the "
        "longest; true: they are left out, counted in the log (off by default: a dataset never shrinks unseen).",
    )
    shuffle: bool = Field(True, description="Shuffle prompts with `seed` (the order is reproducible).")
    seed: int = Field(0, description="Seed of the prompt shuffle and the synthetic task.")


class PythonToolConfig(Section):
    """The Python tool: ```python blocks in the model's answers run in the sandbox."""

    enabled: bool = Field(False, description="Run the ```python blocks of each assistant turn and show the output.")
    timeout_s: float = Field(5.0, gt=0, description="Wall-clock limit of one code block.")
    memory_mb: int = Field(512, ge=32, description="Address-space limit of the interpreter.")
    max_output_bytes: int = Field(4096, ge=1, description="Output shown to the model; more stops the block.")
    persistent: bool = Field(
        False,
        description="One interpreter per episode (names persist between blocks), as TorchRL's "
        "persistent=True; otherwise a fresh one per block.",
    )
    max_workers: int = Field(2, ge=1, description="Code blocks of one batch run at once per env pool.")


class ToolsConfig(Section):
    """Tools the model may call during an episode (multi-turn: set rollout.max_turns >= 2)."""

    python: PythonToolConfig = Field(default_factory=PythonToolConfig, description="The sandboxed Python tool.")
    functions: list[str] = Field(
        default_factory=list,
        description="Your tool functions as 'package.module:function' paths, called by name from "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks (Qwen/Hermes format).',
    )
    function_timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit of one tool function call.")
    sandbox: Literal["bwrap", "guard"] = Field(
        "bwrap",
        description="'bwrap': Linux namespaces (the run refuses where they are unavailable); 'guard': only the "
        "in-process guard and rlimits, NOT a security boundary (accept it explicitly on hosts without user "
        "namespaces).",
    )

    @property
    def enabled(self) -> bool:
        return self.python.enabled or bool(self.functions)
