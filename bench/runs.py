"""Whole training runs as the benchmarks start them: rlpost through its CLI, TRL through trl_grpo.py.

Each run is a process of its own (a fresh Ray cluster for rlpost), so runs cannot disturb each
other's state. rlpost's figures come from the run's metrics.jsonl: ``elapsed_s`` of the last
step is the wall time of the N steps (the controller starts its clock once every actor is up,
so engine and model start-up are excluded, as TRL's ``train()`` excludes model loading); the
process wall time, start-up included, is recorded beside it. The run directory lives in /tmp
(the final checkpoint of a 0.5B-shaped run is ~6 GB) and only metrics.jsonl and config.yaml
are kept, under ``bench/results/runs/``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import CONFIG, REPO, python, results_dir, run_logged

# TRL checks none of its weight syncs; rlpost's races check their first and every 10th with the probe
PROBE_EVERY = 10
LEARNER_ONE_THREAD = ("resources.learner.num_threads=1",)


@dataclass
class Workload:
    """What both systems train: the same model, batch shape, completion length and optimizer."""

    model: str
    steps: int
    prompts_per_step: int = 16
    group_size: int = 8
    max_tokens: int = 16
    lr: float = 3e-4
    rlpost_extra: tuple[str, ...] = ()  # more rlpost overrides (e.g. a micro-batch token budget)
    # rlpost overrides for its sync-mode runs only (e.g. the engine on every core: in sync mode the
    # learner waits while the engine generates, in async mode they share the cores)
    rlpost_sync_extra: tuple[str, ...] = ()
    # rlpost overrides for its async-mode runs only. By default the learner trains on one thread
    # and leaves the other core to the engine that generates alongside (the config gives it 2)
    rlpost_async_extra: tuple[str, ...] = LEARNER_ONE_THREAD
    system_prompt: str | None = None  # None: the arithmetic task's own (data.system_prompt)
    lora_rank: int = 0  # both systems train a LoRA adapter of this rank (rlpost's model.lora); 0: every weight

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    def rlpost_overrides(self) -> list[str]:
        return [
            f"model.name_or_path={self.model}",
            f"trainer.steps={self.steps}",
            f"trainer.prompts_per_step={self.prompts_per_step}",
            f"data.group_size={self.group_size}",
            f"rollout.max_tokens={self.max_tokens}",
            f"optimizer.lr={self.lr}",
            "logging.progress=false",
            "eval.interval=0",  # the race compares training; TRL evaluates nothing either
            f"weight_sync.probe_every={PROBE_EVERY}",
            *([f"data.system_prompt={json.dumps(self.system_prompt)}"] if self.system_prompt else []),
            *([f"model.lora={{rank: {self.lora_rank}}}"] if self.lora_rank else []),
            *self.rlpost_extra,
        ]

    def rlpost_system_overrides(self, system_overrides: list[str]) -> list[str]:
        """A system's own overrides, after this workload's ones for the system's mode (so that a
        system naming the same key, e.g. the learner's threads, keeps its own value)."""
        extra = self.rlpost_sync_extra if "trainer.mode=sync" in system_overrides else self.rlpost_async_extra
        return [*extra, *system_overrides]


@dataclass
class RunResult:
    system: str
    steps: int
    samples_per_step: int
    step_s: list[float]
    steps_wall_s: float  # first step's start to last step's end
    process_wall_s: float  # the whole process, start-up and shutdown included
    rewards: list[float]
    extra: dict = field(default_factory=dict)

    @property
    def samples_per_s(self) -> float:
        return self.steps * self.samples_per_step / self.steps_wall_s

    @property
    def steady_samples_per_s(self) -> float | None:
        """Samples/s without the first step (which pays first-call costs on both systems)."""
        if self.steps < 2:
            return None
        return (self.steps - 1) * self.samples_per_step / sum(self.step_s[1:])

    def to_dict(self) -> dict:
        return {
            "system": self.system,
            "steps": self.steps,
            "samples_per_step": self.samples_per_step,
            "samples_per_s": self.samples_per_s,
            "steady_samples_per_s": self.steady_samples_per_s,
            "steps_wall_s": self.steps_wall_s,
            "process_wall_s": self.process_wall_s,
            "step_s": self.step_s,
            "rewards": self.rewards,
            **self.extra,
        }


PHASES = ("collect_s", "train_s", "learner_step_s", "weight_load_s")


def run_rlpost(
    tag: str, work: Workload, overrides: list[str] = (), *, quick: bool = False, timeout_s: float = 1200.0
) -> RunResult:
    """``rlpost train configs/tiny-cpu.yaml <workload> <overrides>``; figures from metrics.jsonl."""
    keep = results_dir(quick) / "runs" / tag
    tmp = Path(tempfile.mkdtemp(prefix="rlpost-bench-"))
    run_dir = tmp / tag
    cmd = [
        python(),
        "-m",
        "rlpost.ops.cli",
        "train",
        str(CONFIG),
        *work.rlpost_overrides(),
        *overrides,
        f"logging.run_name=bench-{tag}-{int(time.time())}",
        "--run-dir",
        str(run_dir),
    ]
    try:
        wall = run_logged(cmd, keep / "run.log", timeout_s)
        keep.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "config.yaml"):
            shutil.copy(run_dir / name, keep / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    records = [json.loads(line) for line in (keep / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_s, steps_wall_s, before_first_step_s = step_times(records)
    mode = next((o.split("=", 1)[1] for o in overrides if o.startswith("trainer.mode=")), "sync")
    return RunResult(
        system=f"rlpost {mode}",
        steps=len(records),
        samples_per_step=work.samples_per_step,
        step_s=step_s,
        steps_wall_s=steps_wall_s,
        process_wall_s=wall,
        rewards=[r["reward_mean"] for r in records],
        extra={
            "before_first_step_s": before_first_step_s,
            "weight_sync_s": [r.get("weight_sync_s") for r in records],
            # where each step's time went (metrics.jsonl's split; absent in runs before it existed)
            **{key: [r.get(key) for r in records] for key in PHASES},
            "staleness_mean": [r.get("staleness_mean") for r in records],
            "completion_len": [r.get("completion_len_mean") for r in records],
            "samples_generated": [r.get("samples_generated") for r in records],
            "groups_dropped_stale": records[-1].get("groups_dropped_stale"),
            "overrides": list(overrides),
        },
    )


def step_times(records: list[dict]) -> tuple[list[float], float, float]:
    """Per-step wall times, the steps' wall time and the time before the first step, from
    metrics.jsonl's rows.

    ``elapsed_s`` counts from the controller's start, so it includes what the run does before its
    first step (the start-up weight sync: the workers load version 0 and the probe checks it,
    ~2.3 s for the tiny model). That is start-up, which TRL's window (its first step's
    ``on_step_begin`` to its last step's end) leaves out too, so the first step starts its own
    ``step_time_s`` before its row; every later step lasts from one row to the next (the rows'
    own bookkeeping included)."""
    elapsed = [r["elapsed_s"] for r in records]
    first_start = elapsed[0] - records[0]["step_time_s"]
    step_s = [records[0]["step_time_s"]] + [b - a for a, b in zip(elapsed, elapsed[1:])]
    return step_s, elapsed[-1] - first_start, first_start


def run_trl(tag: str, work: Workload, *, seed: int = 0, quick: bool = False, timeout_s: float = 1800.0) -> RunResult:
    """TRL's GRPOTrainer on the same workload (bench/trl_grpo.py in a process of its own).

    TRL is deterministic at a fixed seed, so each repeat gets its own ``seed`` (sampling and
    prompt order) to show its run-to-run spread, as rlpost's runs show theirs."""
    keep = results_dir(quick) / "runs" / tag
    keep.mkdir(parents=True, exist_ok=True)
    out = keep / "trl.json"
    cmd = [
        python(),
        "-m",
        "bench.trl_grpo",
        "--model",
        work.model,
        "--steps",
        str(work.steps),
        "--prompts-per-step",
        str(work.prompts_per_step),
        "--group-size",
        str(work.group_size),
        "--max-tokens",
        str(work.max_tokens),
        "--lr",
        str(work.lr),
        "--seed",
        str(seed),
        "--out",
        str(out),
        *(["--system-prompt", work.system_prompt] if work.system_prompt else []),
        *(["--lora-rank", str(work.lora_rank)] if work.lora_rank else []),
    ]
    # TRL as its users run it: without the huge pages that the benchmark runner (and every rlpost
    # run) gives its processes; "0" overrides the runner's "1"
    wall = run_logged(cmd, keep / "run.log", timeout_s, env={"THP_MEM_ALLOC_ENABLE": "0"})
    data = json.loads(out.read_text())
    return RunResult(
        system="TRL GRPOTrainer",
        steps=data["steps"],
        samples_per_step=data["samples_per_step"],
        step_s=data["step_s"],
        steps_wall_s=data["steps_wall_s"],
        process_wall_s=wall,
        rewards=data["rewards"],
        extra={
            "completion_len": data["completion_len"],
            # the phase split of rlpost's metrics: generation (and reward) is collect_s, the rest
            # of the step train_s; TRL moves no weights
            "collect_s": data.get("generate_s"),
            "train_s": [s - g for s, g in zip(data["step_s"], data.get("generate_s") or [])] or None,
            "startup_s": data["startup_s"],
            "torch_threads": data["torch_threads"],
            "trl_config": data["trl_config"],
        },
    )


def model_path(path: Path) -> str:
    """A model folder as the configs name it (relative to the repo when inside it)."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)
