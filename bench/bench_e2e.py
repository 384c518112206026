"""End to end: N GRPO steps of rlpost (sync, async) against TRL's GRPOTrainer, same workload.

Both systems train the same model folder on the same synthetic arithmetic task with the same
reward (rlpost.envs.rewards.answer_reward), group size, prompts per step, completion length and
optimizer settings (see bench/trl_grpo.py for the field-by-field mapping). rlpost runs go
through the real service (``rlpost train configs/tiny-cpu.yaml <overrides>``, a local Ray
cluster, vLLM inference worker, env pool, learner, buffer, gloo weight bus); figures come from
its metrics.jsonl. Each repeat runs every system once, interleaved, so load drift hits all alike.

Workloads:
- ``tiny``: the offline tiny model (models/tiny-model), 16 prompts x 8 samples, 16 tokens, lr
  3e-4 (the demo's settings); its reward curves compare learning per sample.
- ``qwen05b``: a random-initialised model of Qwen2.5-0.5B's shape (494M parameters, built
  offline), 2 prompts x 4 samples, 8 tokens, few steps: a throughput test only (rewards are 0).
  Its rlpost sync runs bind the engine's threads to both cores (``rollout.engine.cpu_threads=2``),
  as TRL generates with both; so do genheavy's and tiny's.
- ``genheavy``: generation-heavy, as real post-training is: the same shape with 8 layers, 4
  prompts x 8 samples, 128 tokens each (random weights never stop early, so every completion is
  128 tokens), GSM8K-sized prompts (TorchRL's GSM8K system prompt before each arithmetic
  question: 229 tokens), few steps; rlpost's learner packs micro-batches to its default token
  budget (``trainer.max_tokens_per_microbatch: auto``; 2400 was set by hand before the auto budget),
  TRL keeps its defaults (one pass over the 32 rows).

- ``qwen05b_lora``: the qwen05b workload with a rank-16 LoRA adapter on both sides (rlpost's
  ``model.lora``; TRL's ``peft_config`` with the same rank, alpha, dropout and projections).

Headline ratios: samples/s of rlpost sync and async over TRL (medians of the repeats).

    python -m bench bench_e2e [--quick] [--workloads tiny,qwen05b] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from bench.common import TINY_MODEL, Result, qwen05b_model, summary, wait_for_quiet
from bench.runs import LEARNER_ONE_THREAD, PHASES, PROBE_EVERY, Workload, model_path, run_rlpost, run_trl
from rlpost.envs.gsm8k import GSM8K_SYSTEM_PROMPT

SYSTEMS = {
    # as docs/demo.md runs them: sync trains on both cores (configs/tiny-cpu.yaml); async on one,
    # leaving the other to the engine that generates alongside, except where the workload says
    # otherwise (Workload.rlpost_async_extra: on both where generation is a small share of a step)
    "rlpost sync": ["trainer.mode=sync"],
    "rlpost async": ["trainer.mode=async"],
    "rlpost async (learner 1 thread)": ["trainer.mode=async", "resources.learner.num_threads=1"],
    "TRL GRPOTrainer": None,
    # before the engine ran in the inference worker's process on CPU: vLLM's engine-core and worker
    # processes, the model on vLLM's choice of threads (1 on 2 cores)
    "rlpost sync (engine in vLLM's processes)": [
        "trainer.mode=sync",
        "rollout.engine.in_process=false",
        "rollout.engine.cpu_threads=null",
    ],
    "rlpost async (engine in vLLM's processes)": ["trainer.mode=async", "rollout.engine.in_process=false"],
    # the engine's model compiled by vLLM (torch.compile; rollout.engine.enforce_eager=false)
    # instead of run op by op: a slower start (the compile), fewer per-op dispatches a step
    "rlpost sync (compiled engine)": ["trainer.mode=sync", "rollout.engine.enforce_eager=false"],
    "rlpost async (compiled engine)": ["trainer.mode=async", "rollout.engine.enforce_eager=false"],
    # before item 6's fix: the learner on Ray's default of 1 torch thread (its 0.5 reserved CPU)
    "rlpost sync (learner 1 thread)": ["trainer.mode=sync", "resources.learner.num_threads=null"],
    # 2 learner threads and the engine oversubscribe the 2 cores: slower on the tiny model, faster
    # on the 0.5B-shaped one (section 2)
    "rlpost async (learner 2 threads)": ["trainer.mode=async", "resources.learner.num_threads=2"],
    # async mode whose every sync waits for the workers' reload (before weight_sync.train_during_reload)
    "rlpost async (waits for reload)": ["trainer.mode=async", "weight_sync.train_during_reload=false"],
    # LoRA: the sync sends the merged weights and the engine serves no adapter (vLLM's CPU engine
    # generates at under half its speed through an unmerged one), for a reload of the projections
    # each sync; model.lora.sync's default (auto) does so on CPU engines
    "rlpost sync (LoRA merged)": ["trainer.mode=sync", "model.lora.sync=merged"],
    # LoRA: the sync sends the adapter alone, which the engine serves with vLLM's LoRA kernels (the
    # default on GPU engines; on CPUs the A/B of the merged route)
    "rlpost sync (LoRA adapter)": ["trainer.mode=sync", "model.lora.sync=adapter"],
}
# per workload: the current systems against TRL; the two tiny-model systems of an earlier fix (the
# learner's thread count) stay selectable with --systems
DEFAULT_SYSTEMS = {
    "tiny": ["rlpost sync", "rlpost async", "TRL GRPOTrainer"],
    "qwen05b": ["rlpost sync", "rlpost async", "TRL GRPOTrainer"],
    "genheavy": ["rlpost sync", "rlpost async", "TRL GRPOTrainer"],
    "qwen05b_lora": ["rlpost sync", "rlpost sync (LoRA adapter)", "rlpost async", "TRL GRPOTrainer"],
}


# Sync runs generate on both cores, as TRL's model.generate does (the learner waits meanwhile).
# With the engine in the inference worker's process (the CPU default) the tiny model gains from
# the second thread too (a generate call 0.33 s against 0.45 s; section 14); in vLLM's own
# processes it did not.
SYNC_ENGINE_ON_EVERY_CORE = ("rollout.engine.cpu_threads=2",)


def workloads(quick: bool, tiny_steps: int | None, big_steps: int | None) -> dict[str, Workload]:
    chosen = _workloads(quick, tiny_steps, big_steps)
    # the qwen05b workload with a LoRA adapter on both sides (LoRA trains at a larger lr)
    # (its async learner on one thread: raced so, and not measured on two)
    chosen["qwen05b_lora"] = dataclasses.replace(
        chosen["qwen05b"], lr=1e-5, lora_rank=8 if quick else 16, rlpost_async_extra=LEARNER_ONE_THREAD
    )
    return chosen


def _workloads(quick: bool, tiny_steps: int | None, big_steps: int | None) -> dict[str, Workload]:
    if quick:
        return {
            "tiny": Workload(
                model_path(TINY_MODEL), steps=tiny_steps or 3, prompts_per_step=4, group_size=4, max_tokens=8
            ),
            "qwen05b": Workload(
                model_path(qwen05b_model(quick=True)),
                steps=big_steps or 2,
                prompts_per_step=2,
                group_size=2,
                max_tokens=4,
                lr=1e-6,
            ),
            "genheavy": Workload(
                model_path(qwen05b_model(quick=True)),
                steps=2,
                prompts_per_step=2,
                group_size=2,
                max_tokens=16,
                lr=1e-6,
                system_prompt=GSM8K_SYSTEM_PROMPT,
            ),
        }
    return {
        "tiny": Workload(model_path(TINY_MODEL), steps=tiny_steps or 50, rlpost_sync_extra=SYNC_ENGINE_ON_EVERY_CORE),
        "qwen05b": Workload(
            model_path(qwen05b_model(quick=False)),
            steps=big_steps or 5,
            prompts_per_step=2,
            group_size=4,
            max_tokens=8,
            lr=1e-6,
            rlpost_sync_extra=SYNC_ENGINE_ON_EVERY_CORE,
            # async: the learner on both cores; the engine generates for ~2 s of a 13 s step
            # (measured: 0.81x TRL against 0.69x on one thread, 2026-11-26)
            rlpost_async_extra=(),
        ),
        "genheavy": Workload(
            model_path(qwen05b_model(quick=False, layers=8)),
            steps=big_steps or 3,
            prompts_per_step=4,
            group_size=8,
            max_tokens=128,
            lr=1e-6,
            # GSM8K-sized prompts: TorchRL's GSM8K system prompt before each question (229 tokens)
            system_prompt=GSM8K_SYSTEM_PROMPT,
            # no hand-set token budget: the learner's auto budget packs the 32 rows of 357 tokens
            # (before chunked scoring and the auto budget, one pass over them held ~2.5 GB of
            # logits, their log-softmax and gradients, and ran this machine out of memory);
            # the engine holds prompt + completion (229 + 128 tokens; the demo's 256 would cut the
            # completions at 27 tokens, while TRL's model.generate has no such limit)
            rlpost_extra=("rollout.engine.max_model_len=512",),
            rlpost_sync_extra=SYNC_ENGINE_ON_EVERY_CORE,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny sizes, 1 repeat")
    parser.add_argument("--workloads", default="tiny,qwen05b")
    parser.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated, from {list(SYSTEMS)} (default: per workload, {DEFAULT_SYSTEMS})",
    )
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--tiny-steps", type=int, default=None)
    parser.add_argument("--big-steps", type=int, default=None)
    parser.add_argument("--name", default="e2e", help="results file name (bench/results/<name>.json)")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    chosen = {
        k: w
        for k, w in workloads(args.quick, args.tiny_steps, args.big_steps).items()
        if k in args.workloads.split(",")
    }
    systems_of = {
        k: [s.strip() for s in args.systems.split(",")] if args.systems else DEFAULT_SYSTEMS[k] for k in chosen
    }
    unknown = [s for names in systems_of.values() for s in names if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
    result = Result(
        args.name,
        args.quick,
        {
            "repeats": repeats,
            "systems": systems_of,
            "workloads": {k: vars(w) | {"samples_per_step": w.samples_per_step} for k, w in chosen.items()},
            "rlpost_config": "configs/tiny-cpu.yaml + workload overrides + logging.progress=false",
        },
    )
    for key, work in chosen.items():
        systems = systems_of[key]
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        for r in range(repeats):
            for system in systems:
                load = wait_for_quiet(args.quick)
                tag = f"{args.name}-{key}-{system.replace(' ', '_').replace(',', '').replace('(', '').replace(')', '')}-{r}"
                print(f"== {key} repeat {r + 1}/{repeats}: {system} (busy cores {load:.2f})", flush=True)
                run = (
                    run_trl(tag, work, seed=r, quick=args.quick)
                    if SYSTEMS[system] is None
                    else run_rlpost(tag, work, work.rlpost_system_overrides(SYSTEMS[system]), quick=args.quick)
                )
                print(
                    f"   {run.steps} steps in {run.steps_wall_s:.1f} s: {run.samples_per_s:.2f} samples/s "
                    f"(process {run.process_wall_s:.0f} s)",
                    flush=True,
                )
                runs[system].append(run.to_dict() | {"busy_cores_at_start": load})
                result.cases[key] = _summarise(runs, work)
                result.write()  # partial results survive an interrupted session
        _ratios(result, key, systems)
    result.note(
        f"rlpost checks its first weight sync and every {PROBE_EVERY}th with the probe "
        f"(weight_sync.probe_every={PROBE_EVERY}; the default checks every sync); TRL checks none"
    )
    for key, work in chosen.items():
        if work.rlpost_async_extra != LEARNER_ONE_THREAD:
            result.note(
                f"{key}: rlpost async with {list(work.rlpost_async_extra) or 'the config (learner on 2 threads)'}"
            )
    if "tiny" in chosen:
        result.note(
            "tiny: reward_gain = mean reward of the last quarter of steps minus the first quarter "
            "(per run; samples per step are equal, so per step is per sample)"
        )
    if "qwen05b" in chosen:
        result.note("qwen05b: random weights never answer (reward 0) nor stop early: a throughput test")
    if "qwen05b_lora" in chosen:
        result.note("qwen05b_lora: rank 16 on every attention and MLP projection, both systems; rlpost's "
                    "default (model.lora.sync=auto) sends CPU engines the merged projections (1.4 of 2.5 GB) "
                    "and they serve no adapter; 'LoRA adapter' syncs the adapter only (34 MiB), which its "
                    "engine serves with vLLM's LoRA")  # fmt: skip
    if "genheavy" in chosen:
        result.note("genheavy: 8-layer 0.5B-shaped model, 32 completions of 128 tokens a step: a throughput "
                    "test where generation dominates, as in real post-training")  # fmt: skip
    result.write()


def _summarise(runs: dict[str, list[dict]], work: Workload) -> dict:
    out = {}
    for system, items in runs.items():
        if not items:
            continue
        out[system] = {
            "samples_per_s": summary([i["samples_per_s"] for i in items]),
            "steady_samples_per_s": summary([i["steady_samples_per_s"] for i in items]),
            "steps_wall_s": summary([i["steps_wall_s"] for i in items]),
            "process_wall_s": summary([i["process_wall_s"] for i in items]),
            "reward_gain": summary([_gain(i["rewards"]) for i in items]),
            "final_reward": summary([statistics.mean(i["rewards"][-max(1, len(i["rewards"]) // 4) :]) for i in items]),
            "phases_s": _phases(items),
            "runs": items,
        }
    return out


def _phases(items: list[dict]) -> dict:
    """Per phase of an rlpost step (metrics.jsonl's split), the median over repeats of its mean
    over the steady steps (step 1 left out); TRL's runs have step_s, collect_s (its generation)
    and train_s."""
    out = {}
    for key in ("step_s", "weight_sync_s", *PHASES):
        means = []
        for item in items:
            values = [v for v in (item.get(key) or [])[1:] if v is not None]
            if values:
                means.append(statistics.mean(values))
        if means:
            out[key] = statistics.median(means)
    return out


def _gain(rewards: list[float]) -> float | None:
    q = len(rewards) // 4
    if q < 1:
        return None
    return statistics.mean(rewards[-q:]) - statistics.mean(rewards[:q])


def _ratios(result: Result, key: str, systems: list[str]) -> None:
    cases = result.cases.get(key, {})
    base = cases.get("TRL GRPOTrainer")
    if base is None:
        return
    for system in systems:
        if system == "TRL GRPOTrainer" or system not in cases:
            continue
        for metric in ("samples_per_s", "steady_samples_per_s"):
            ours, theirs = cases[system][metric]["median"], base[metric]["median"]
            if ours and theirs:
                result.ratios[f"{key}: {system} / TRL, {metric}"] = ours / theirs
        if key == "tiny":
            ours, theirs = cases[system]["reward_gain"]["median"], base["reward_gain"]["median"]
            if ours is not None and theirs is not None:
                result.ratios[f"{key}: {system} - TRL, reward_gain"] = ours - theirs
    print("  ratios:", {k: round(v, 3) for k, v in result.ratios.items()}, flush=True)


if __name__ == "__main__":
    main()
