"""``rlpost serve``'s config: the base model the service trains adapters on, its engines, where it
listens, who may call it and where it keeps what clients save (:class:`ServeConfig`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlpost.config.base import Section
from rlpost.config.model import VLLM_LORA_RANKS
from rlpost.config.resources import RoleResources, TorchRoleResources
from rlpost.config.rollout import EngineConfig, split_range


class ServeResources(Section):
    """Where the service's actors run."""

    address: str | None = Field(
        None, description="Ray address of an existing cluster (None: start a local one, as `rlpost train` does)."
    )
    trainer: TorchRoleResources = Field(
        default_factory=lambda: TorchRoleResources(num_cpus=1),
        description="The trainer actor (the base model and every client's adapter and optimizer).",
    )
    inference: RoleResources = Field(
        default_factory=lambda: RoleResources(num_cpus=1), description="Each inference worker (one vLLM engine)."
    )


class AdapterMemory(Section):
    """How many clients' adapters each actor holds where; the least recently used move further
    out and come back unchanged when used. Per model the trainer holds the adapter and AdamW's two
    moments, 3 x the adapter's parameters in fp32 (4 x while a gradient waits for its optim_step),
    the parameters being rank x (inputs + outputs) summed over the adapted layers."""

    trainer_resident: int = Field(
        16, ge=1, description="Models whose adapter, gradient and optimizer state stay in the trainer's model (on "
        "its device); using another moves the least recently used one to host memory.",
    )  # fmt: skip
    trainer_in_memory: int = Field(
        64, ge=1, description="Models parked in the trainer's host memory; past that the oldest is written to a file "
        "in spill_dir.",
    )  # fmt: skip
    spill_dir: str | None = Field(
        None, description="Folder on the trainer's node for parked models' files (None: the system's temporary "
        "folder); a new trainer starts with none (the service's snapshots bring models back).",
    )  # fmt: skip
    engine_in_memory: int = Field(
        8, ge=1, description="Adapters each engine keeps loaded in host memory beside the loras_per_batch it samples "
        "with (vLLM's max_cpu_loras); others are read from the engine's files when asked for.",
    )  # fmt: skip
    engine_files: int = Field(
        64, ge=1, description="Adapters each engine keeps as files; past that the least recently used is dropped "
        "and sent again from the service when next sampled.",
    )  # fmt: skip


class ServeConfig(Section):
    """A Tinker-API service over one base model."""

    base_model: str = Field(
        "models/tiny-model",
        description="Hugging Face hub name or local folder of the base model every client's LoRA adapter is trained "
        "on; the default is the offline tiny model shipped in models/.",
    )
    model_name: str | None = Field(
        None,
        description="The name clients ask for in create_model and see in get_info (e.g. the hub name of a local "
        "copy, so that tinker-cookbook recognises it). None: base_model.",
    )
    tokenizer_id: str | None = Field(
        None, description="What get_info tells clients to load as the tokenizer. None: model_name (or base_model)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="The base model's dtype in the trainer and the engines; fp32 on CPU."
    )
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Options of each vLLM engine.")
    inference_workers: int = Field(
        1, ge=1, description="Inference workers (one vLLM engine each) that sample, started with the service; "
        "`inference_workers: A..B` is A with max_inference_workers B.",
    )  # fmt: skip
    max_inference_workers: int | None = Field(
        None, ge=1, description="The most inference workers `rlpost scale STORAGE_DIR inference=N` may ask for "
        "(and inference_workers the least). None: inference_workers, and `rlpost scale` may ask for any number.",
    )  # fmt: skip
    max_lora_rank: int = Field(
        64,
        ge=1,
        le=max(VLLM_LORA_RANKS),
        description="Largest LoRA rank a client may ask for (the engines size for it).",
    )
    loras_per_batch: int = Field(
        4, ge=1, description="Different adapters an engine samples with in one batch (vLLM's max_loras)."
    )
    max_batch_tokens: int = Field(
        8192, ge=64, description="Padded tokens per trainer forward pass; a larger request runs in several."
    )
    host: str = Field("127.0.0.1", description="Interface the HTTP API listens on (0.0.0.0: every interface).")
    port: int = Field(8000, ge=0, le=65535, description="TCP port of the HTTP API (0: any free port, printed).")
    api_keys_file: str | None = Field(
        None,
        description="YAML file mapping each tenant to its API key or list of keys ({alice: tml-..., bob: [...]}). "
        "None: the keys in $RLPOST_SERVE_API_KEYS (tenant=key,tenant=key). There is no built-in key; the tinker SDK "
        "only sends keys that start with tml-.",
    )
    storage_dir: str = Field(
        "serve-storage", description="Folder of every run's saved weights and optimizer states (kept across restarts)."
    )
    long_poll_s: float = Field(
        30.0, gt=0, lt=45, description="How long a retrieve_future waits for a result before 'try again' (SDK: 45 s)."
    )
    gap_timeout_s: float = Field(
        120.0, gt=0, description="How long a model's requests wait for a missing seq_id before they fail."
    )
    max_pending_per_tenant: int = Field(
        256,
        ge=1,
        description="Requests one tenant may have accepted and not finished; past that a request is answered 429 "
        "(the SDK retries it later). Each actor serves the waiting tenants in rotation.",
    )
    keep_results_s: float = Field(3600.0, gt=0, description="How long a finished request's result can be read again.")
    session_timeout_s: float = Field(
        600.0, gt=30, description="A session nothing is heard from for this long (the SDK sends a heartbeat every "
        "10 s) ends: its models are saved as tinker://<model>/weights/session-end and leave the trainer.",
    )  # fmt: skip
    max_models_per_tenant: int = Field(
        32, ge=1, description="Models one tenant may hold at once (over all its sessions); another create_model is "
        "refused until one is unloaded or its session ends.",
    )  # fmt: skip
    call_timeout_s: float = Field(
        600.0, gt=0, description="Longest one trainer or engine call may take before it fails as a server error."
    )
    parity_check: bool = Field(
        True,
        description="Check each adapter snapshot an engine loads: the engine's log-probs of a fixed 32-token "
        "sequence against the trainer's at the snapshot (metric rlpost_serve_logprob_diff).",
    )
    parity_warn: float = Field(
        1e-3, gt=0, description="A parity difference above this is logged as a warning (fp32: ~1e-6 expected)."
    )
    adapters: AdapterMemory = Field(
        default_factory=AdapterMemory, description="How many adapters each actor holds in its model, memory, files."
    )
    resources: ServeResources = Field(default_factory=ServeResources, description="Where the actors run.")

    @model_validator(mode="before")
    @classmethod
    def _worker_range(cls, data: Any) -> Any:
        return split_range(data, "inference_workers", "max_inference_workers") if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _max_covers_start(self) -> ServeConfig:
        if self.max_inference_workers is not None and self.max_inference_workers < self.inference_workers:
            raise ValueError(f"max_inference_workers ({self.max_inference_workers}) is below inference_workers "
                             f"({self.inference_workers})")  # fmt: skip
        return self

    def scale_bounds(self) -> dict[str, tuple[int, int | None]]:
        """What `rlpost scale` may ask for: inference workers only, in the range (or from one up)."""
        if self.max_inference_workers is None:
            return {"inference": (1, None)}
        return {"inference": (self.inference_workers, self.max_inference_workers)}

    @property
    def served_name(self) -> str:
        return self.model_name or self.base_model
