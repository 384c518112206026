"""Where the roles run and how long they may be silent: ``resources`` (CPUs, GPUs, custom
resources per role, the placement) and ``watchdog``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from rlpost.config.base import Section


class RoleResources(Section):
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
        description="Learner ranks that shard one model with FSDP2 (NCCL on GPU, gloo on CPU): parameters, "
        "gradients and AdamW state split N ways, each rank reserving num_cpus / num_gpus (actors `learner`, "
        "`learner-<r>`). A step equals the one-rank step. A dead rank restarts the run from its last checkpoint "
        "(trainer.auto_resume); a checkpoint of any num_workers resumes with any other.",
    )
    release_freed_memory: bool | None = Field(
        None,
        description="Give freed tensor memory back to the OS (glibc's mmap and trim thresholds fixed at 128 KB): "
        "a lower peak for slower steps (0.5B shape: 12.0 -> 10.1 GB, step 12.1 -> 15.3 s; a 2-rank group's rank "
        "8.7 -> 6.6 GB). None: on for a group of ranks (num_workers > 1), off for one learner.",
    )
    timeout_s: float = Field(
        300.0,
        gt=0,
        description="Bound of every collective of a learner group (num_workers > 1) and of forming it: a rank "
        "that died or hangs makes the others fail after it instead of waiting for ever.",
    )


class ResourcesConfig(Section):
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
        description="How long a lost inference worker's or env pool's start waits for room in the cluster. Past "
        "it, with another of its role serving, the run goes on with fewer (`inference_workers`, `env_pools` in "
        "metrics.jsonl) and starts it once its bundle is placed (a replacement node, or one added).",
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
        description="PYTHONHASHSEED of every process of the run (rlpost train restarts its Python when the "
        "shell's differs). String hashing orders sets that some generators iterate over (reasoning-gym's "
        "isomorphic_strings, knight_swap, ransom_note, word_ladder, ...): one seed makes their rows, the held-out "
        "split and shuffles agree across processes and runs.",
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


class RoleDeadlines(Section):
    """How long one actor of a role may stay silent, or busy without progress, before the watchdog
    takes it for frozen or hung and kills it (its loss is then handled as a death)."""

    answer_s: float = Field(
        ...,
        gt=0,
        description="Most seconds an actor may leave the watchdog's heartbeat unanswered. It is answered on its "
        "own thread, so only a process running no Python misses it (SIGSTOP, a frozen node, the GIL held for "
        "ever). Counted once the constructor returned.",
    )
    progress_s: float | None = Field(
        None,
        gt=0,
        description="Most seconds the actor's own work (an engine step, a micro-batch, a checkpoint file) may go "
        "without progress (a deadlock, a wait that never ends); waiting on another actor never counts. null: "
        "judged by its answers alone (its calls only wait on others, each bounded).",
    )


class WatchdogConfig(Section):
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
