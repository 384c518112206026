"""The ``rollout`` section (sampling, turns, the inference workers and env pools, the engine's
settings) and ``eval``."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from rlpost.config.base import Section


def split_range(data: dict[str, Any], key: str, max_key: str) -> dict[str, Any]:
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


class EngineConfig(Section):
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
        description="CPU backend: threads that run the model, each bound to a core (worker i takes cores i*n .. "
        "i*n+n-1, wrapping round). None: vLLM's choice, all cores but one. Sync mode on a CPU-only node: the "
        "node's cores, since the learner waits meanwhile (8 0.5B-shaped layers: 1.8x faster on 2 threads than 1); "
        "async mode: leave the learner its cores. Ignored on GPU.",
    )
    direct_reload: bool = Field(
        True,
        description="CPU backend: load each weight update straight into the engine's kernels (linear weights "
        "packed by vLLM's CPU GEMM dispatch, other tensors copied in place) instead of vLLM's reload_weights, which "
        "re-creates every parameter first (BENCHMARKS.md, section 10). Dense unquantized models on one "
        "tensor-parallel rank only; otherwise reload_weights (logged once). Ignored on GPU.",
    )
    in_process: bool | None = Field(
        None,
        description="Run vLLM's engine core and model worker inside the inference worker's process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0), every engine call on one thread whose cpu_threads cores the model "
        "inherits. None: true on CPU, where the two child processes cost ~28 s of start-up and busy-poll beside "
        "the model (a generate call 0.33 s against 0.63 s; BENCHMARKS.md, section 14); false on GPU.",
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="Further vllm.LLM keyword arguments, passed as is.")


class AutoscaleConfig(Section):
    """The load policy (``rollout.autoscale``): the run sizes its inference workers and env pools
    within their ranges from where its time goes (:mod:`rlpost.service.autoscale`).

    Read over ``window_steps`` steps all taken with the fleet as it is: when the learner waits for
    data (``grow_wait``) the role that holds generation back grows (the engines when they are busy,
    ``busy_share``; else the env pools), by as many actors as the wait calls for (at most
    ``max_grow_factor`` times as many at once); when it barely waits (``shrink_wait``) and, in async
    mode, groups go stale or the buffer stays full, the inference fleet (then the env pools)
    shrinks by one. A grow that did not raise generation's throughput (``min_gain``) or found no
    room in the cluster (``room_wait_s``) is undone; a move that is reversed holds the count
    (``hold_s``); no change follows another within ``cooldown_s``. ``rlpost scale`` pins a role
    until ``rlpost scale RUN_DIR KEY=auto`` releases it."""

    enabled: bool = Field(
        False,
        description="Size the fleet by load within the ranges (rollout.num_inference_workers: A..B, "
        "rollout.num_env_pools: A..B); the run starts at each range's minimum. Off: a range's top is wanted "
        "from the start.",
    )
    window_steps: int = Field(
        3, ge=1, description="Learner steps of signals one decision reads, all taken with the fleet as it is now."
    )
    cooldown_s: float = Field(
        60.0, ge=0, description="Seconds after a change before the next one (a new worker starts and serves first)."
    )
    grow_wait: float = Field(
        0.25,
        gt=0,
        le=1,
        description="Grow when the learner waited for its groups at least this share of its steps (in sync mode: "
        "when generation took this share; each grow must also pay, min_gain).",
    )
    shrink_wait: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Shrink when the learner waited at most this share of its steps (and, in async "
        "mode, shrink_stale or shrink_fill holds).",
    )
    shrink_stale: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Async: groups dropped as stale per group trained at which generation counts "
        "as more than the learner uses.",
    )
    shrink_fill: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Async: the buffer's fill at the steps' ends (share of its room) at which "
        "generation counts as more than the learner uses.",
    )
    busy_share: float = Field(
        0.7,
        gt=0,
        le=1,
        description="The engines are what holds generation back when busy at least this share of "
        "the time the pools generate; below it a starving learner gets another env pool instead.",
    )
    min_gain: float = Field(
        0.5,
        ge=0,
        description="A grow from n to n+k must raise generation's throughput by at least this share of "
        "the proportional gain (k/n), or it is undone and n held (hold_s).",
    )
    max_grow_factor: float = Field(
        4.0,
        ge=1,
        description="The most one grow multiplies a role's count by (at least one more actor): a grow asks for "
        "as many as the learner's wait predicts bring it to the middle of the band (grow_wait, shrink_wait), "
        "generation taking n/n' as long, and no more actors than the role's last grow was worth; 1 grows one actor "
        "at a time.",
    )
    room_wait_s: float = Field(
        600.0,
        gt=0,
        description="A grow whose actor found no room in the cluster this long (the autoscaler added "
        "no node) is given up and its count held (hold_s).",
    )
    hold_s: float = Field(
        900.0,
        ge=0,
        description="How long an undone grow's count stays the most, and a reversed move's count the "
        "least, the policy asks for.",
    )

    @model_validator(mode="after")
    def _bands(self) -> AutoscaleConfig:
        if self.shrink_wait >= self.grow_wait:
            raise ValueError(f"shrink_wait ({self.shrink_wait}) must be below grow_wait ({self.grow_wait}): "
                             "between them the fleet stays as it is")  # fmt: skip
        return self


class RolloutConfig(Section):
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
        "this many (with rollout.autoscale, as many as its load calls for) and starts each beyond "
        "num_inference_workers whenever the cluster can place it (each has its own placement group, which a "
        "cluster autoscaler sees as demand), serving without it meanwhile. None: "
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
        "stream is split into this many shards (env-pool-<j> takes shard j); pools beyond num_env_pools start "
        "whenever the cluster can place them. A pool not running keeps its shard's position (no prompt repeated "
        "or skipped). None: num_env_pools (scaling may lower it, and raise it back up to that).",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig, description="vLLM engine options.")
    autoscale: AutoscaleConfig = Field(
        default_factory=AutoscaleConfig, description="The load policy: the fleet's size by where the time goes."
    )

    @model_validator(mode="before")
    @classmethod
    def _worker_ranges(cls, data: Any) -> Any:
        """``num_<role>: A..B`` is ``num_<role>: A`` with ``max_<role>: B`` (inference workers, env pools)."""
        if not isinstance(data, dict):
            return data
        for role in ("inference_workers", "env_pools"):
            data = split_range(data, f"num_{role}", f"max_{role}")
        return data

    @model_validator(mode="after")
    def _max_covers_start(self) -> RolloutConfig:
        for role in ("inference_workers", "env_pools"):
            start, most = getattr(self, f"num_{role}"), getattr(self, f"max_{role}")
            if most is not None and most < start:
                raise ValueError(f"max_{role} ({most}) is below num_{role} ({start})")
        if self.autoscale.enabled and not self.autoscale_ranges():
            raise ValueError("rollout.autoscale.enabled needs a range to move in: rollout.num_inference_workers: A..B "
                             "and/or rollout.num_env_pools: A..B (with A < B)")  # fmt: skip
        return self

    def autoscale_ranges(self) -> dict[str, tuple[int, int]]:
        """The ranges the load policy moves in, per scale key (a role without a range has none)."""
        ranges = {}
        if self.max_inference_workers is not None and self.max_inference_workers > self.num_inference_workers:
            ranges["inference"] = (self.num_inference_workers, self.max_inference_workers)
        if self.max_env_pools is not None and self.max_env_pools > self.num_env_pools:
            ranges["env_pools"] = (self.num_env_pools, self.max_env_pools)
        return ranges

    def inference_worker_bounds(self) -> tuple[int, int | None]:
        """What `rlpost scale` may ask for: (least, most; None: no bound). With a range, the range;
        otherwise from one worker up."""
        if self.max_inference_workers is None:
            return 1, None
        return self.num_inference_workers, self.max_inference_workers

    def inference_worker_target(self) -> int:
        """The inference workers the run wants from its start: the range's top, or with the load
        policy its minimum."""
        if self.autoscale.enabled:
            return self.num_inference_workers
        return self.max_inference_workers or self.num_inference_workers

    def env_pool_target(self) -> int:
        """The env pools the run wants from its start: every shard, or with the load policy the
        range's minimum."""
        return self.num_env_pools if self.autoscale.enabled else self.env_pool_shards()

    def env_pool_shards(self) -> int:
        """The prompt stream's shards: the most env pools the run may have."""
        return self.max_env_pools or self.num_env_pools

    def scale_bounds(self) -> dict[str, tuple[int, int | None]]:
        """What `rlpost scale` may ask for, per key: (least, most; None: no bound). Inference
        workers: the range, or any number from one. Env pools: the range, or one up to
        num_env_pools (the prompt stream's shards are fixed when the run starts)."""
        low = self.num_env_pools if self.max_env_pools is not None else 1
        return {"inference": self.inference_worker_bounds(), "env_pools": (low, self.env_pool_shards())}


class EvalConfig(Section):
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
