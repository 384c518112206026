"""One typed config tree for a whole rlpost job: YAML in, dotted overrides on top, checked.

Every field has a description and a default (or is required). Unknown keys are errors that name
the full dotted path; cross-field mistakes raise :class:`ConfigError` naming the keys involved.
Treat renaming a key as a breaking change: configs and run directories outlive the code.

    cfg = load_config("configs/tiny-cpu.yaml", ["trainer.steps=20", "rollout.temperature=0.7"])
"""

from __future__ import annotations

import datetime as _dt
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message names the key or file."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# The adapter ranks vLLM's engines are built for (its ``max_lora_rank`` choices).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraConfig(_Section):
    """Train a LoRA adapter (``peft``) instead of every weight; the engines serve it with vLLM's LoRA."""

    rank: int = Field(
        16, ge=1, le=VLLM_LORA_RANKS[-1], description="The adapter's rank r (vLLM serves ranks up to 512)."
    )
    alpha: float = Field(32.0, gt=0, description="LoRA's alpha: the update is scaled by alpha / rank.")
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter's input in the training passes only (never when scoring or "
        "generating); it makes the new/old probability ratio noisy, so RL runs usually keep 0.",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Names (last part) of the linear layers that get an adapter; the default fits Llama, Qwen "
        "and Mistral models.",
    )
    sync: Literal["auto", "adapter", "merged"] = Field(
        "auto",
        description="What each weight sync sends: 'adapter' (only the adapter's tensors; the engines serve "
        "it with vLLM's LoRA), 'merged' (every projection's weight with the adapter merged in; the engines "
        "serve no LoRA and keep the base's embeddings, norms and head) or 'auto': merged where the inference engines "
        "run on CPUs (resources.inference.num_gpus: 0), whose vLLM LoRA kernels generate at about half the "
        "full-weight speed (0.5B-shaped model, rank 16, 2 cores: steady steps 15.2 s merged against 18.8 s "
        "adapter, BENCHMARKS.md section 13), else adapter, or merged with a warning where an engine cannot "
        "serve LoRA.",
    )
    save_merged: bool = Field(
        False,
        description="Checkpoints also hold the merged model in HF format (step_<N>/merged/, loadable "
        "with AutoModelForCausalLM); the adapter is always saved.",
    )


class ModelConfig(_Section):
    """The policy model (also the frozen reference and the learner's starting point)."""

    name_or_path: str = Field(
        "models/tiny-model",
        description="Hugging Face hub name (GPU users) or local folder; the default is the offline tiny "
        "model shipped in models/ (`rlpost make-tiny-model` rebuilds it).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype for inference and the reference; fp32 on CPU."
    )
    tokenizer: str | None = Field(None, description="Tokenizer name or path; defaults to `name_or_path`.")
    chat_template: str | None = Field(
        None,
        description="Jinja chat template (inline text or a path to a .jinja file) replacing the "
        "tokenizer's own; it must mark assistant turns with {% generation %} for assistant masks.",
    )
    trust_remote_code: bool = Field(False, description="Allow custom model code from the hub.")
    lora: LoraConfig | None = Field(
        None,
        description="Train a LoRA adapter on the frozen base model instead of every weight (null: full "
        "fine-tuning). Set `model.lora={}` for the defaults.",
    )
    chunked_scoring: bool = Field(
        True,
        description="The learner and the reference actor compute log-probs (and the exact entropy) from "
        "the model's final hidden states through the LM head in chunks of tokens, so the [tokens, "
        "vocabulary] logits are never held whole (measured: 0.21x the peak memory of the dense path for "
        "a 4,096-token row of a 151,936-token vocabulary on 2 layers, at 1.1-1.3x its time: each chunk's "
        "logits are computed again in backward). Applies to the Llama, Mistral, Qwen2/3 and Phi-3 families, LoRA "
        "and a sharded learner group included. false: always the dense logits.",
    )
    pack_sequences: bool = Field(
        True,
        description="With chunked scoring, the learner and the reference actor pack the rows of a "
        "forward pass end to end (each row with its own position ids, attending only to itself) in "
        "rows as wide as the longest, instead of padding every row to the longest: skewed completion "
        "lengths cost their tokens, not the longest row's. Needs an attention implementation that "
        "reads packed rows from their position ids (sdpa, eager, flash, flex); others pad. Same values "
        "and gradients as padding.",
    )

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.name_or_path


class ReasoningGymConfig(_Section):
    """data.task=reasoning_gym: procedural tasks of the ``reasoning-gym`` package, scored by its own verifiers."""

    tasks: dict[str, float | dict[str, Any] | None] = Field(
        default_factory=dict,
        description="The tasks and their weights in the mixture: NAME: WEIGHT, or NAME: {weight: W, OPTION: VALUE, "
        "...} with that task's own generator options (e.g. chain_sum: {weight: 2, min_terms: 2, max_terms: 2}); "
        "a bare NAME: is weight 1 with the defaults. Names are the package's (reasoning_gym.factory.DATASETS).",
    )
    size: int = Field(1000, ge=1, description="Rows generated for training (the tasks drawn by weight).")
    seed: int = Field(0, description="Seed of the generators; evaluation (split 'test') draws other rows.")


class CodeTaskConfig(_Section):
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


class DataConfig(_Section):
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
        description="Prompts longer than the engine can take with rollout.max_tokens to generate (rendered with the "
        "system prompt and chat template, longer than rollout.engine.max_model_len - rollout.max_tokens) are "
        "found before the run starts. false: the run is refused, naming the longest; true: they are left out of "
        "the prompt stream, with a count in the log. Off by default so that a dataset never shrinks unseen.",
    )
    shuffle: bool = Field(True, description="Shuffle prompts with `seed` (the order is reproducible).")
    seed: int = Field(0, description="Seed of the prompt shuffle and the synthetic task.")


class PythonToolConfig(_Section):
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


class ToolsConfig(_Section):
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


class EngineConfig(_Section):
    """Options handed to each vLLM engine."""

    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per inference worker (vLLM tensor parallel).")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="Share of GPU memory vLLM may take.")
    kv_cache_space_gb: float = Field(
        1.0, gt=0, description="KV cache size on the CPU backend (VLLM_CPU_KVCACHE_SPACE)."
    )
    max_model_len: int = Field(512, ge=16, description="Longest prompt + completion the engine accepts.")
    max_num_seqs: int = Field(256, ge=1, description="Most sequences one engine schedules at once.")
    enforce_eager: bool = Field(True, description="Skip CUDA-graph / compile warm-up (faster start, slower decode).")
    seed: int = Field(0, description="Engine sampling seed.")
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="CPU backend: threads that run the model, each bound to a core of the worker's node (worker i "
        "takes cores i*n .. i*n+n-1, wrapping round). None keeps vLLM's choice: all the cores but one, which it "
        "leaves to the engine's other threads and processes (1 thread on a 2-core node). Sync mode on a CPU-only node: the node's "
        "cores, since the learner waits while the engine generates (a model of 8 0.5B-shaped layers generates "
        "1.8x faster on 2 threads than on 1; configs/tiny-cpu.yaml's model, with the engine in process, 1.4x); "
        "async mode: leave the learner its cores. Ignored on GPU.",
    )
    direct_reload: bool = Field(
        True,
        description="CPU backend: load each weight update straight into the engine's kernels (linear weights "
        "packed by vLLM's own CPU GEMM dispatch from the update's memory, other tensors copied in place) instead "
        "of vLLM's reload_weights, which re-creates and copies every parameter first (0.5B-shaped model: "
        "BENCHMARKS.md, section 10). For dense models of unquantized linear, embedding and norm layers on one "
        "tensor-parallel rank; any other model, and an update with a name it cannot place, uses reload_weights "
        "(logged once). false: always reload_weights. Ignored on GPU.",
    )
    in_process: bool | None = Field(
        None,
        description="Run vLLM's engine core and model worker inside the inference worker's own process (vLLM's "
        "VLLM_ENABLE_V1_MULTIPROCESSING=0) instead of two child processes of their own; the worker then runs "
        "every engine call on one thread of its own, whose cpu_threads cores the model's threads inherit. None: "
        "true on the CPU backend, where the two child processes cost ~28 s of start-up per engine (each imports "
        "vLLM) and busy-poll beside the model (tiny race's generate call on 2 threads: 0.33 s in process against "
        "0.63 s; BENCHMARKS.md, section 14); false on a GPU (vLLM's own layout).",
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="Further vllm.LLM keyword arguments, passed as is.")


class RolloutConfig(_Section):
    """Sampling and the inference / environment worker counts."""

    temperature: float = Field(1.0, gt=0, description="Sampling temperature (log-probs are the processed ones).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    max_tokens: int = Field(64, ge=1, description="Most new tokens per completion (also Dr.GRPO's L_max).")
    max_turns: int = Field(1, ge=1, description="Most assistant turns per episode (tool turns continue it).")
    num_inference_workers: int = Field(
        1,
        ge=1,
        description="Inference worker actors started with the run, one vLLM engine each; the run waits for the "
        "cluster to place them (resources.placement_timeout_s). A range `A..B` (e.g. `1..4`) means A of them "
        "and max_inference_workers B.",
    )
    max_inference_workers: int | None = Field(
        None,
        ge=1,
        description="The most inference workers the run may have, and the bounds of `rlpost scale`: the run wants "
        "this many and starts each beyond num_inference_workers whenever the cluster can place it (each has its "
        "own placement group, which a cluster autoscaler sees as demand), serving without it meanwhile. None: "
        "num_inference_workers, and `rlpost scale` may ask for any number.",
    )
    num_env_pools: int = Field(
        1,
        ge=1,
        description="Env-pool actors started with the run, each running an LLM collector over its shard of the "
        "prompt stream. A range `A..B` means A of them and max_env_pools B.",
    )
    max_env_pools: int | None = Field(
        None,
        ge=1,
        description="The most env pools the run may have, and the bounds of `rlpost scale env_pools=M`: the prompt "
        "stream is split into this many shards (one a pool: env-pool-<j> takes shard j), and the run starts each "
        "pool beyond num_env_pools whenever the cluster can place it. A pool that is not running (no room for it, "
        "or scaled down) keeps its shard's position: its prompts wait for it, none is repeated or skipped. None: "
        "num_env_pools (scaling may lower it, and raise it back up to that).",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig, description="vLLM engine options.")

    @model_validator(mode="before")
    @classmethod
    def _worker_ranges(cls, data: Any) -> Any:
        """``num_<role>: A..B`` is ``num_<role>: A`` with ``max_<role>: B`` (inference workers, env pools)."""
        if not isinstance(data, dict):
            return data
        for role in ("inference_workers", "env_pools"):
            data = _split_range(data, f"num_{role}", f"max_{role}")
        return data

    @model_validator(mode="after")
    def _max_covers_start(self) -> RolloutConfig:
        for role in ("inference_workers", "env_pools"):
            start, most = getattr(self, f"num_{role}"), getattr(self, f"max_{role}")
            if most is not None and most < start:
                raise ValueError(f"max_{role} ({most}) is below num_{role} ({start})")
        return self

    def inference_worker_bounds(self) -> tuple[int, int | None]:
        """What `rlpost scale` may ask for: (least, most; None: no bound). With a range, the range;
        otherwise from one worker up."""
        if self.max_inference_workers is None:
            return 1, None
        return self.num_inference_workers, self.max_inference_workers

    def inference_worker_target(self) -> int:
        """The inference workers the run wants from its start."""
        return self.max_inference_workers or self.num_inference_workers

    def env_pool_shards(self) -> int:
        """The prompt stream's shards: the most env pools the run may have."""
        return self.max_env_pools or self.num_env_pools

    def scale_bounds(self) -> dict[str, tuple[int, int | None]]:
        """What `rlpost scale` may ask for, per key: (least, most; None: no bound). Inference
        workers: the range, or any number from one. Env pools: the range, or one up to
        num_env_pools (the prompt stream's shards are fixed when the run starts)."""
        low = self.num_env_pools if self.max_env_pools is not None else 1
        return {"inference": self.inference_worker_bounds(), "env_pools": (low, self.env_pool_shards())}


class EvalConfig(_Section):
    """Evaluation on held-out prompts with the current weights, on the inference workers."""

    interval: int = Field(
        0,
        ge=0,
        description="Learner steps between evaluations (after that step's weight sync); 0: none during training.",
    )
    before_training: bool = Field(
        False, description="Also evaluate the initial weights before step 1 (logged as step 0 in eval.jsonl)."
    )
    dataset: str | None = Field(
        None,
        description="Held-out dataset (hub name or local file); None: the training data's source (data.dataset, "
        "or the synthetic task's held-out questions).",
    )
    subset: str | None = Field(None, description="Configuration name of eval.dataset; None: data.subset.")
    split: str = Field(
        "test",
        description="Split evaluated. For the synthetic arithmetic tasks 'test' is the held-out eighth of "
        "the questions, which data.split 'train' never draws.",
    )
    num_prompts: int = Field(
        64, ge=1, description="Prompts per evaluation: the split's first rows, the same every time."
    )
    samples_per_prompt: int = Field(1, ge=1, description="Completions per prompt (k of pass@k).")
    greedy: bool = Field(True, description="Greedy decoding; false samples at eval.temperature (needed for k > 1).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature when eval.greedy is false.")
    max_tokens: int | None = Field(None, ge=1, description="Most new tokens per completion; None: rollout.max_tokens.")
    pass_threshold: float = Field(1.0, description="A completion passes when its reward is at least this.")
    seed: int = Field(0, description="Sampling seed: the same weights give the same score every time.")

    @property
    def enabled(self) -> bool:
        """Whether a run evaluates at all (during training or before it)."""
        return self.interval > 0 or self.before_training


class ReferenceConfig(_Section):
    """The frozen reference model and the KL penalty to it (or the teacher of loss.distillation)."""

    enabled: bool = Field(False, description="Start the reference actor and compute KL to the initial model.")
    model: str | None = Field(
        None,
        description="The reference model, a hub name or local path: the teacher of loss.distillation. It must "
        "share the policy's tokenizer (the same token ids). None: model.name_or_path, the policy's initial weights.",
    )
    kl_coef: float = Field(0.0, ge=0, description="KL coefficient (beta).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator (Schulman).")
    kl_in: Literal["loss", "reward"] = Field(
        "loss",
        description="Add KL as a loss term ('loss', GRPO) or subtract it from the reward ('reward', k1, RLHF: each "
        "env pool has its batch scored by the reference actor before it computes the group advantages).",
    )
    timeout_s: float = Field(
        300.0,
        gt=0,
        description="Bound of one env pool's call scoring a batch for the KL-shaped reward (kl_in: reward).",
    )
    restart_wait_s: float = Field(
        180.0,
        gt=0,
        description="How long an env pool waits for the supervisor to start a lost reference actor again before its "
        "collection fails (kl_in: reward).",
    )

    @property
    def kl_goes_to(self) -> Literal["loss", "reward"] | None:
        """Where the KL to the reference goes: ``None`` without a reference actor, else ``kl_in``.
        The one place this is decided: the learner puts a KL term in its loss when it says
        ``"loss"``, the env pools have each batch's rewards penalised when it says ``"reward"``,
        and the loop has each step's groups annotated only in the first case."""
        return self.kl_in if self.enabled else None


class DistillationConfig(_Section):
    """On-policy distillation toward the reference actor's model (reference.model, the teacher)."""

    coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the teacher in each token's advantage: coef * (teacher log-prob - sampled "
        "log-prob), the negative per-token reverse KL to the teacher, whose policy gradient descends that KL. "
        "0: off. Needs reference.enabled with reference.kl_in=loss.",
    )
    use_reward: bool = Field(
        True,
        description="Keep the reward's group advantage beside the teacher's term; false: pure distillation "
        "(the reward is logged but not trained on).",
    )


DAPO_CLIP_EPS_HIGH = 0.28  # DAPO's clip-higher (Yu et al. 2025, Eq. 10)


class LossConfig(_Section):
    """The policy loss: GRPO (with DAPO's clip-higher, Dr.GRPO's aggregation), DAPO, CISPO, or SFT on
    each group's best samples (expert iteration); on-policy distillation on top of any of them."""

    type: Literal["grpo", "dapo", "cispo", "sft"] = Field(
        "grpo",
        description="grpo: the clipped surrogate. dapo: the same with DAPO's defaults (clip_eps_high 0.28 and "
        "filter_equal_rewards true, unless set). cispo: the clipped importance weight held constant on every "
        "token's log-prob gradient (MiniMax-M1). sft: expert iteration, the negative log-likelihood of each "
        "group's samples above its median reward (at most loss.top_k).",
    )
    top_k: int | None = Field(
        None,
        ge=1,
        description="loss.type=sft: the most samples kept per group (best first, above the group's median "
        "reward); None: every sample above the median. A group whose rewards are all equal is dropped.",
    )
    distillation: DistillationConfig = Field(
        default_factory=DistillationConfig, description="On-policy distillation toward reference.model."
    )
    clip_eps_low: float = Field(0.2, gt=0, lt=1, description="Lower clip: ratio >= 1 - clip_eps_low.")
    clip_eps_high: float = Field(0.2, gt=0, description="Upper clip: ratio <= 1 + clip_eps_high (DAPO uses 0.28).")
    aggregation: Literal["token_mean", "sequence_mean", "sequence_sum_norm"] = Field(
        "token_mean", description="How per-token terms become a scalar (sequence_sum_norm = Dr.GRPO)."
    )
    advantage_scale: Literal["group", "batch", "none"] = Field(
        "group",
        description="Advantage normalisation: group std, batch std (over an env pool's batch, after the KL "
        "penalty with reference.kl_in=reward), or none (Dr.GRPO).",
    )
    filter_equal_rewards: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose rewards are all equal."
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    entropy_estimator: Literal["sampled", "exact"] = Field(
        "sampled",
        description="The entropy of the bonus: 'sampled' is -log p(token) of the sampled tokens (an "
        "unbiased estimate on on-policy samples, nothing extra to compute); 'exact' is the entropy of "
        "each token's whole next-token distribution (TorchRL's default), computed in chunks with the "
        "log-probs when model.chunked_scoring applies.",
    )
    kl_to_inference_coef: float = Field(
        0.0, ge=0, description="Penalty on the k3 KL between the learner and the behaviour (inference) log-probs."
    )
    off_policy_correction: Literal["none", "tis", "mis"] = Field(
        "none",
        description="Correct for tokens the learner's weights did not sample exactly (engine numerics, stale "
        "weights): weight each token's objective by w = p_learner / p_sampler, truncated at "
        "off_policy_threshold ('tis') or dropped above it ('mis'); the PPO ratio is then taken against the "
        "learner's own log-probs at the start of the step. 'none': the ratio against the sampler's log-probs.",
    )
    off_policy_threshold: float = Field(
        2.0, gt=1, description="The cap C on the importance weight w of loss.off_policy_correction (tis / mis)."
    )
    custom_fn: str | None = Field(
        None,
        description=(
            "A loss of your own, 'package.module:function', called instead of rlpost.algo.grpo_loss with its "
            "arguments (it returns GRPOLossTerms with at least `loss`); the module must be importable by the "
            "learner (installed, or in the job's working_dir). null: grpo_loss."
        ),
    )

    @model_validator(mode="after")
    def _type_defaults(self) -> LossConfig:
        if self.type == "dapo":  # DAPO's recipe where the config does not say otherwise
            if "clip_eps_high" not in self.model_fields_set:
                self.clip_eps_high = DAPO_CLIP_EPS_HIGH
            if "filter_equal_rewards" not in self.model_fields_set:
                self.filter_equal_rewards = True
            if self.clip_eps_high < self.clip_eps_low:
                raise ValueError(
                    f"loss.type=dapo is clip-higher: loss.clip_eps_high ({self.clip_eps_high}) must be >= "
                    f"loss.clip_eps_low ({self.clip_eps_low})"
                )
        if self.top_k is not None and self.type != "sft":
            raise ValueError(f"loss.top_k is set but loss.type is {self.type!r}: top_k selects samples for sft")
        if self.type == "sft" and self.off_policy_correction != "none":
            raise ValueError("loss.type=sft has no importance ratio: loss.off_policy_correction must be none")
        if self.type == "sft" and self.kl_to_inference_coef > 0:
            raise ValueError("loss.type=sft has no behaviour-policy term: loss.kl_to_inference_coef must be 0")
        if self.custom_fn and self.type != "grpo":
            raise ValueError(f"loss.custom_fn replaces grpo's loss; it cannot be combined with loss.type={self.type}")
        return self


class OptimizerConfig(_Section):
    """AdamW and its schedule."""

    lr: float = Field(1e-5, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Max global grad norm.")
    grad_accumulation: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps, then constant.")
    fused: bool = Field(
        True,
        description="AdamW's fused kernel: one multi-threaded pass over every parameter instead of a loop of "
        "per-tensor ops (transformers' Trainer default with torch >= 2.8). On 2 CPU cores the 0.5B-shaped "
        "model's update takes 0.3 s against 1.4-2.7 s. false: torch's per-tensor AdamW.",
    )


class TrainerConfig(_Section):
    """The training loop."""

    steps: int = Field(20, ge=1, description="Learner steps (one batch of prompts_per_step groups each).")
    prompts_per_step: int = Field(8, ge=1, description="Prompts (GRPO groups) per learner step.")
    epochs_per_batch: int = Field(1, ge=1, description="Passes over each batch (PPO epochs).")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: collect -> train -> publish; async: collection never stops."
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="async: drop groups more than this many policy versions old; the buffer holds this many steps.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass instead of keeping them "
        "(less learner memory for long completions; the tiny model's learner step took 16-34% longer).",
    )
    max_tokens_per_microbatch: typing.Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        "auto",
        description="Tokens per learner micro-batch as its forward holds them (rows x the longest row; with "
        "model.pack_sequences, the packed rows x the longest): rows are taken longest first up to it, and a step "
        "with a row longer than it fails before training, naming this key. auto: set at the "
        "learner's first step from the model's shape and its device's free memory (metrics.jsonl's token_budget; "
        "docs/architecture.md says how); None: no budget (optimizer.grad_accumulation slices only). The step's "
        "gradient is the same for any split.",
    )
    weight_sync_interval: int = Field(1, ge=1, description="Optimizer steps between weight publications.")
    checkpoint_interval: int = Field(0, ge=0, description="Steps between checkpoints; 0 = only at the end.")
    keep_checkpoints: int = Field(2, ge=1, description="Most recent checkpoints kept.")
    auto_resume: bool = Field(False, description="Resume from the last checkpoint by itself when the learner dies.")
    seed: int = Field(0, description="Seed of the learner (torch RNG).")


class WeightSyncConfig(_Section):
    """The learner -> inference weight bus (a torch.distributed group of its own)."""

    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="auto: NCCL when the roles have GPUs, else gloo."
    )
    bucket_mb: int = Field(64, ge=1, description="Size of the flattened parameter buckets sent per collective.")
    timeout_s: float = Field(60.0, gt=0, description="Timeout of every collective; a dead peer is detected after it.")
    inflight_updates: bool = Field(
        True,
        description="An update that reaches an inference worker while it generates is applied between two engine "
        "steps: running requests go on with the new weights (their KV cache kept) and every token records the "
        "version that sampled it (metrics token_staleness_mean, inflight_token_fraction). false: the update waits "
        "for the running generate call to finish. Matters in async mode, where updates meet running generation.",
    )
    train_during_reload: bool = Field(
        True,
        description="Async mode: once the learner has sent its weights it trains the next step while the "
        "inference workers reload them, and the loop waits for their reload at the next sync (at once before a "
        "probe check, an evaluation and the run's last step). A reload that fails is then found at that next sync "
        "and recovered as any failed sync. weight_load_s is then the reload of the update before. false: every "
        "sync waits for the workers. Sync mode always waits: the next collection needs the new weights.",
    )
    probe_every: int = Field(
        1,
        ge=0,
        description="Check every N-th weight sync (the run's first one always) by scoring a fixed probe sequence "
        "in one inference worker and in the learner: sync_logprob_diff, their largest log-prob difference, is "
        "null on the lines of unchecked syncs. The start-up sync before a fresh run's first step is checked too "
        "(its result in the log). 0: never. A check is a forward pass on each side: ~0.8 s of a "
        "13 s step on CPU with the 0.5B-shaped model, milliseconds on a GPU.",
    )
    shared_memory: bool = Field(
        True,
        description="Inference workers on the learner's node read the weights from memory the learner's process "
        "shares instead of the collectives: CPU weights from a shared-memory segment, GPU weights through CUDA IPC "
        "when the worker's engine runs on the learner's own GPU. The segment holds one whole copy of the published "
        "weights (host memory, or the learner's GPU memory for CUDA IPC), kept between updates. Workers on other "
        "nodes or other GPUs use the collectives. false: every worker on the collectives.",
    )


class RoleResources(_Section):
    num_cpus: float = Field(..., ge=0, description="CPUs reserved per actor of this role.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per actor of this role.")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources reserved per actor of this role, in its placement bundle: e.g. "
        '{"accelerator_type:H100": 0.001} to land on an H100 node, or a resource only some nodes declare '
        "(`ray start --resources`) to keep the role there.",
    )

    @field_validator("resources")
    @classmethod
    def _positive_amounts(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {name: amount for name, amount in value.items() if not amount > 0 or name in ("CPU", "GPU")}
        if bad:
            raise ValueError(f"custom resources need positive amounts and names other than CPU/GPU, got {bad}")
        return value


class TorchRoleResources(RoleResources):
    """A role that computes with torch in its own process (the learner, the reference)."""

    num_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads of this actor. None keeps Ray's default: OMP_NUM_THREADS = the "
        "reserved num_cpus rounded up, so a 0.5-CPU learner trains on 1 core. On a CPU-only node, sync mode: "
        "the node's cores (the engine idles while the learner trains); async mode: leave the engine its "
        "cores, or both slow down (BENCHMARKS.md).",
    )


class LearnerResources(TorchRoleResources):
    """The learner's ranks: one actor, or a group that shards the model between them."""

    num_workers: int = Field(
        1,
        ge=1,
        description="Learner ranks that shard one model between them with FSDP2 (each decoder layer a unit; "
        "NCCL on GPU, gloo on CPU): parameters, gradients and AdamW state are split N ways. Each rank reserves "
        "num_cpus / num_gpus; rank 0 is the actor `learner`, the others `learner-<r>`. The ranks split each "
        "step's groups and sum their gradients, so a step is the one-rank step. A dead rank restarts the run "
        "from its last checkpoint (trainer.auto_resume); a checkpoint of any num_workers resumes with any other.",
    )
    release_freed_memory: bool | None = Field(
        None,
        description="Give freed tensor memory back to the OS after every use (glibc's mmap and trim thresholds "
        "fixed at 128 KB), so one step's leftovers never sit under the next: a lower peak for slower steps, "
        "since every large allocation then faults in fresh pages. Measured on the 0.5B-shaped model: one "
        "learner's peak 12.0 -> 10.1 GB, its step 12.1 -> 15.3 s; a rank of a 2-rank group 8.7 -> 6.6 GB. "
        "None: on for a group of ranks (num_workers > 1), off for one learner.",
    )
    timeout_s: float = Field(
        300.0,
        gt=0,
        description="Bound of every collective of a learner group (num_workers > 1) and of forming it: a rank "
        "that died or hangs makes the others fail after it instead of waiting for ever.",
    )


class ResourcesConfig(_Section):
    """What each role reserves on the Ray cluster (declared, never assumed)."""

    address: str | None = Field(
        None, description="Ray address; None starts a local cluster (RAY_ADDRESS/--address override)."
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy for the run's bundles."
    )
    placement_timeout_s: float = Field(
        120.0,
        gt=0,
        description="How long to wait for the cluster to place every actor (raise it when an autoscaler adds GPU nodes).",
    )
    replacement_wait_s: float = Field(
        10.0,
        ge=0,
        description="How long a lost inference worker's or env pool's start waits for the cluster to have room for "
        "it (after a node's loss Ray moves its bundles to other nodes where they fit, at once). Past it, and with "
        "another of its role serving, the run goes on with fewer (`inference_workers`, `env_pools` in "
        "metrics.jsonl) and starts it again once its bundle is placed (the node's replacement, or a node added).",
    )
    inference: RoleResources = Field(
        default_factory=lambda: RoleResources(num_cpus=0.5), description="Per inference worker."
    )
    env_pool: RoleResources = Field(default_factory=lambda: RoleResources(num_cpus=0.25), description="Per env pool.")
    learner: LearnerResources = Field(
        default_factory=lambda: LearnerResources(num_cpus=0.5), description="The learner (per rank)."
    )
    reference: TorchRoleResources = Field(
        default_factory=lambda: TorchRoleResources(num_cpus=0.25), description="The reference actor."
    )
    reward: TorchRoleResources = Field(
        default_factory=lambda: TorchRoleResources(num_cpus=0.25),
        description="The reward actor (reward_model): its GPUs hold the classifier or the judge's engine.",
    )
    buffer: RoleResources = Field(
        default_factory=lambda: RoleResources(num_cpus=0.0),
        description="The buffer actor. It reserves no placement bundle and runs on the head node (whose loss "
        "ends the run anyway) unless `resources` names custom resources that send it elsewhere.",
    )
    python_hash_seed: int = Field(
        0,
        ge=0,
        le=4294967295,
        description="PYTHONHASHSEED of every process of the run: the driver (rlpost train starts its Python again "
        "with it when the shell's differs) and every actor. Python's string hashing orders sets of strings, "
        "which some generators iterate over (reasoning-gym's isomorphic_strings, knight_swap, "
        "polynomial_multiplication, ransom_note, word_ladder): with one seed their rows, the held-out split and "
        "the shuffles agree across processes and across runs.",
    )
    env_vars: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables for every process of the run (Ray runtime_env), over rlpost's own: "
        "TOKENIZERS_PARALLELISM=false, and THP_MEM_ALLOC_ENABLE=1 (torch's large CPU tensors on transparent huge "
        'pages: vLLM\'s CPU weight reload 2.3 s against 3.0 s on the 0.5B-shaped model; "0" turns it off).',
    )

    @field_validator("env_vars")
    @classmethod
    def _no_hash_seed(cls, value: dict[str, str]) -> dict[str, str]:
        if "PYTHONHASHSEED" in value:
            raise ValueError("PYTHONHASHSEED is resources.python_hash_seed (the driver's too), not an env var")
        return value


class RoleDeadlines(_Section):
    """How long one actor of a role may stay silent, or busy without progress, before the watchdog
    takes it for frozen or hung and kills it (its loss is then handled as a death)."""

    answer_s: float = Field(
        ...,
        gt=0,
        description="Most seconds an actor may leave the watchdog's heartbeat unanswered. The heartbeat runs on "
        "a thread of its own, beside the actor's calls, so only a process that runs no Python misses it: stopped "
        "(SIGSTOP), on a frozen node, or with a thread holding the GIL for ever. Counted once the actor's "
        "constructor returned (a model still loading is bounded by the start's own timeout).",
    )
    progress_s: float | None = Field(
        None,
        gt=0,
        description="Most seconds the actor's own work (an engine step, a micro-batch, a checkpoint file) may go "
        "without progress while a call is working: a thread blocked inside it (a deadlock, a wait that never "
        "ends). Waiting on another actor is not work and never counts. null: the role is judged by its answers "
        "alone (its calls only wait on others, each with a timeout of its own).",
    )


class WatchdogConfig(_Section):
    """The watchdog (rlpost.service.watchdog): an actor alive to Ray but frozen or hung is killed and replaced.

    Ray's record of an actor says ALIVE for a stopped or deadlocked process; the run asks every actor
    itself instead, every ``interval_s`` (docs/failures.md, "Frozen and hung actors")."""

    enabled: bool = Field(True, description="Ask every actor for a heartbeat and kill the frozen or hung ones.")
    interval_s: float = Field(2.0, gt=0, description="Seconds between two heartbeats of an actor.")
    inference: RoleDeadlines = Field(
        default_factory=lambda: RoleDeadlines(answer_s=30.0, progress_s=300.0),
        description="Each inference worker: its work is its engine's steps in a generate call, and each scoring "
        "call (a weight update waits on the learner, bounded by weight_sync.timeout_s).",
    )
    env_pool: RoleDeadlines = Field(
        default_factory=lambda: RoleDeadlines(answer_s=30.0),
        description="Each env pool: judged by its answers (its collection waits on the workers, the reward and "
        "reference actors and the buffer, each call bounded; its rewards and tools run in bounded subprocesses).",
    )
    learner: RoleDeadlines = Field(
        default_factory=lambda: RoleDeadlines(answer_s=120.0, progress_s=900.0),
        description="The learner and each of its ranks: its work is each micro-batch's forward and backward, the "
        "optimizer step, the scoring of the probe and each checkpoint file (a rank waiting in a collective for a "
        "slower rank counts as working: keep progress_s above the longest micro-batch).",
    )
    reference: RoleDeadlines = Field(
        default_factory=lambda: RoleDeadlines(answer_s=30.0, progress_s=300.0),
        description="The reference actor: its work is scoring each chunk of rows.",
    )
    reward: RoleDeadlines = Field(
        default_factory=lambda: RoleDeadlines(answer_s=30.0, progress_s=300.0),
        description="The reward actor (reward_model): its work is scoring each batch.",
    )
    buffer: RoleDeadlines = Field(
        default_factory=lambda: RoleDeadlines(answer_s=30.0),
        description="The buffer: judged by its answers (its calls hold a lock briefly or wait, bounded, for data).",
    )
    control: RoleDeadlines = Field(
        default_factory=lambda: RoleDeadlines(answer_s=30.0),
        description="The run's control mailbox (rlpost scale): judged by its answers.",
    )


# tracker name -> (module that must be importable, pip requirement that provides it)
TRACKER_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard (a dependency of rlpost: reinstall it)"),
    "wandb": ("wandb", "'rlpost[wandb]'"),
    "mlflow": ("mlflow", "'rlpost[mlflow]'"),
}


def missing_tracker_packages(names: list[str]) -> list[str]:
    """For each tracker in ``names`` whose package cannot be imported here, a sentence naming
    what to install. Looks the module up with :func:`importlib.util.find_spec` (nothing is
    imported)."""
    import importlib.util

    problems = []
    for name in names:
        module, requirement = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            problems.append(
                f"tracker {name!r} needs the {module} package, which is not installed: pip install {requirement}"
            )
    return problems


class LoggingConfig(_Section):
    run_dir: str = Field("runs", description="Parent folder of run directories.")
    run_name: str | None = Field(None, description="Run name (Ray namespace rlpost-<run_name>); default: a timestamp.")
    metrics_interval: int = Field(1, ge=1, description="Learner steps between metrics.jsonl lines.")
    progress: bool = Field(
        True, description="Show progress on the driver: a bar on a terminal, a plain line every few steps otherwise."
    )
    dashboard: bool = Field(
        True,
        description="On a local run (no resources.address): start Ray's dashboard on 127.0.0.1 and print its URL, "
        "the Ray namespace and the Prometheus metrics URL at start; a dashboard that cannot start is reported and "
        "the run goes on without it. Ignored when connecting to an existing cluster (its dashboard is the cluster's). "
        "Its processes take CPU: on 2 cores the demo's steps were ~9% slower with it than without.",
    )
    dashboard_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port of the local run's dashboard; None: 8265, or the next free port when 8265 is taken. "
        "An explicit port that is taken leaves the run without a dashboard.",
    )
    trackers: list[str] = Field(
        default_factory=lambda: ["tensorboard"],
        validate_default=True,
        description="Where every metrics.jsonl record also goes: any of tensorboard (RUN_DIR/tensorboard/), "
        "wandb (pip install 'rlpost[wandb]'; offline unless WANDB_MODE or WANDB_API_KEY say otherwise) and "
        "mlflow (pip install 'rlpost[mlflow]'; RUN_DIR/mlruns/ unless MLFLOW_TRACKING_URI is set); [] for none.",
    )

    @field_validator("trackers", mode="before")
    @classmethod
    def _trackers_from_text(cls, value: Any) -> Any:
        """Accept one name or a comma-separated string (``logging.trackers=wandb``) as a list."""
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("trackers")
    @classmethod
    def _trackers_known_and_installed(cls, value: list[str]) -> list[str]:
        """Each tracker is a known name, named once, and its package is importable here (checked
        with importlib's find_spec, nothing imported), so a missing one fails before any actor starts."""
        valid = ", ".join(TRACKER_PACKAGES)
        for name in value:
            if name not in TRACKER_PACKAGES:
                raise PydanticCustomError(
                    "unknown_tracker",
                    "unknown tracker {name}; valid trackers: {valid}",
                    {"name": repr(name), "valid": valid},
                )
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise PydanticCustomError(
                "repeated_tracker", "tracker {names} named more than once", {"names": ", ".join(repeated)}
            )
        problems = missing_tracker_packages(value)
        if problems:
            raise PydanticCustomError("tracker_not_installed", "{problems}", {"problems": "; ".join(problems)})
        return value


class JudgeConfig(_Section):
    """The generative judge of reward_model.kind=generative: its prompt and how its verdict is read."""

    template: str = Field(
        "Rate the answer to the question from 0 to 10.\nQuestion: {prompt}\nAnswer: {completion}\n"
        "Reply with 'Score: N'.",
        description="The judge's user message (inline text, or a path to a text file) with {prompt} (the row's "
        "prompt), {completion} (the final response) and {answer} (the row's reference answer, '' without one).",
    )
    system_prompt: str | None = Field(None, description="A system message before the judge's user message.")
    pattern: str = Field(
        r"Score:\s*(-?\d+(?:\.\d+)?)",
        description="Regular expression whose first group is the verdict, searched in the judge's reply (the last "
        "match counts). A reply without a match scores 0 and counts in reward_errors as 'unparsed_verdict'.",
    )
    verdicts: dict[str, float] | None = Field(
        None,
        description="Score of each verdict text (matched without case), e.g. {yes: 1, no: 0}; None reads the "
        "verdict as a number. A verdict not in the mapping counts as unparsed.",
    )
    scale: float = Field(10.0, gt=0, description="The verdict is divided by this (0-10 ratings become 0-1 scores).")
    max_tokens: int = Field(64, ge=1, description="Most tokens of the judge's reply (greedy decoding).")

    @field_validator("pattern")
    @classmethod
    def _one_group(cls, value: str) -> str:
        import re

        try:
            compiled = re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a regular expression ({exc})") from None
        if compiled.groups < 1:
            raise ValueError("needs a group around the verdict, e.g. 'Score: (\\d+)'")
        return value


class RewardModelConfig(_Section):
    """A learned reward: the supervised Ray actor ``reward`` scores each episode's final response."""

    name_or_path: str = Field(
        ..., description="The reward model: a hub name (GPU users) or a local folder (`rlpost make-tiny-reward-model`)."
    )
    kind: Literal["classifier", "generative"] = Field(
        "classifier",
        description="'classifier': a Hugging Face sequence-classification model with one label, scoring the "
        "conversation (user prompt + response) rendered with its own tokenizer's chat template; 'generative': an LLM "
        "judge on a vLLM engine of its own (reward_model.judge).",
    )
    weight: float = Field(1.0, description="Weight of the model's score in the reward.")
    rule_weight: float = Field(
        1.0,
        description="Weight of the task's own reward (data.task's rule, data.reward_fn) beside it: reward = "
        "rule_weight * rule + weight * score. 0 trains on the model's score alone.",
    )
    batch_size: int = Field(16, ge=1, description="Conversations per forward pass of the classifier.")
    max_length: int = Field(
        1024, ge=8, description="Most tokens of a scored conversation; longer ones keep their last tokens."
    )
    timeout_s: float = Field(120.0, gt=0, description="Bound of one scoring call from an env pool.")
    restart_wait_s: float = Field(
        180.0,
        gt=0,
        description="How long an env pool waits for the supervisor to start a lost reward actor again before its "
        "collection fails.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="The reward model's dtype on GPU; None: model.dtype (CPUs always use float32)."
    )
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="The generative judge (kind=generative).")
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="The judge's own vLLM engine (kind=generative)."
    )


class JobConfig(_Section):
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


def _split_range(data: dict[str, Any], key: str, max_key: str) -> dict[str, Any]:
    """``data`` with a range ``key: "A..B"`` read as ``key: A`` and ``max_key: B``; anything else
    as it is (a plain number as text is pydantic's to read, or to name as a bad value)."""
    text = data.get(key)
    if not isinstance(text, str) or ".." not in text:
        return data
    low, _, high = text.strip().partition("..")
    try:
        low_n, high_n = int(low), int(high)
    except ValueError:
        raise ValueError(f"{key}: a range is two whole numbers A..B, got {text!r}") from None
    if not 1 <= low_n <= high_n:
        raise ValueError(f"{key}: the range {text!r} needs 1 <= A <= B")
    if data.get(max_key) not in (None, high_n):
        raise ValueError(f"{key} {text!r} and {max_key} {data[max_key]} disagree: give one of them")
    return {**data, key: low_n, max_key: high_n}


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


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Load a YAML job config (or the defaults when ``path`` is None) and apply dotted overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    for item in overrides:
        _apply_override(raw, item)
    return validate_config(raw, source=str(path) if path else "defaults")


def validate_config(raw: dict[str, Any], *, source: str = "config") -> JobConfig:
    try:
        return JobConfig.model_validate(raw)
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


def _apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply ``a.b.c=value``; the value is parsed as YAML (so 20 is an int, [0.9, 0.95] a list)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    _check_known_path(key)
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


def _check_known_path(key: str) -> None:
    model: type[BaseModel] | None = JobConfig
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
