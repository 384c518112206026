"""`make bench` / `python -m bench`: run the benchmarks, then render BENCHMARKS.md.

    python -m bench                          the default set (~65 min on 2 CPU cores), then the report
    python -m bench --all                    the default set and the long races (~2 h)
    python -m bench weight_sync buffer       only these (names as below, or their module names)
    python -m bench --quick weight_sync      smoke test: tiny sizes, results in bench/results/quick/
    python -m bench --report                 only render BENCHMARKS.md from bench/results/*.json

Each benchmark runs in a process of its own (a fresh Ray cluster and vLLM engines each time) and
writes bench/results/<name>.json; options after ``--`` go to every benchmark named
(``python -m bench e2e -- --workloads tiny``). Every figure is a ratio against a baseline
measured in the same process or session, the median of at least 3 repeats.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from bench.common import REPO
from rlpost.runtime.ray_start import RUN_ENV_VARS

# name -> module (and its arguments), in the order `make bench` runs them (the buffer benchmark
# reads the e2e runs; profile_* are the phase profiles of one sync step, issue 8 item 6)
BENCHMARKS = {
    "rollout": "bench.bench_rollout_wrapper",
    "e2e": "bench.bench_e2e",
    "weight_sync": "bench.bench_weight_sync",
    "buffer": "bench.bench_buffer",
    "scaling": "bench.bench_scaling",
    "sandbox": "bench.bench_sandbox",
    "grpo_by_hand": "bench.bench_grpo_by_hand",  # learning of the hand-composed loop (~10 min)
    "grpo_async": "bench.bench_grpo_async",  # learning of the TorchRL-shaped async script (~8 min)
    "learner_group": "bench.bench_learner_group",  # 1 vs 2 sharded learner ranks (~10 min)
    "lora": "bench.bench_lora",  # LoRA vs full fine-tuning: weight sync, step, state (~10 min)
    "profile_reload": "bench.profile_reload",  # where vLLM's CPU weight reload spends its time (~3 min)
    "profile_engine": "bench.profile_engine",  # where the engine's generate call goes, tiny race (~2 min)
    "sync_route": "bench.bench_sync_route",  # weight sync + reload, gloo vs shared memory (~4 min)
    "scoring": "bench.bench_scoring",  # scoring for training: chunked vs dense LM head, packed vs padded (~8 min)
    # which reasoning-gym tasks the tiny model learns: one 300-step GRPO run on a 4-task mixture (~4 min; ~6 loaded)
    "reasoning_gym": "bench.bench_reasoning_gym",
    # the service's trainer: bytes per client model resident / parked, a parked model's step (~3 min)
    "serve_adapters": "bench.bench_serve_adapters",
    # K tenants on one service fleet against K fleets: memory, tokens/s, step latency, fairness (~15 min)
    "serve_tenants": "bench.bench_serve_tenants",
    # the load policy (rollout.autoscale) against the env-pool range's minimum and maximum fixed,
    # 200 steps so that its ramp is a few percent of a run (~50 min: 48 on the AMD EPYC)
    "autoscale": "bench.bench_autoscale",
    # rlpost sync / async against TRL where generation dominates: 32 x 128 tokens a step (~25 min)
    "race_genheavy": "bench.bench_e2e --workloads genheavy --name race_genheavy --repeats 2",
    # the qwen05b race with a rank-16 LoRA adapter on both sides (~20 min)
    "race_lora": "bench.bench_e2e --workloads qwen05b_lora --name race_lora --repeats 2",
    "profile_tiny": "bench.profile_step --model tiny",  # the e2e runs now carry the same split
    "profile_qwen05b": "bench.profile_step --model qwen05b",
}


# the benchmarks that take ~20 min a repeat: run when named (or with --all), not by default, so that the
# default set stays near an hour
LONG = ("race_genheavy", "race_lora", "autoscale")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m bench", description="rlpost benchmarks")
    parser.add_argument(
        "names", nargs="*", help=f"benchmarks to run (default: all but {list(LONG)}): {list(BENCHMARKS)}"
    )
    parser.add_argument("--all", action="store_true", help=f"run every benchmark, {list(LONG)} included")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny sizes, 1 repeat where possible")
    parser.add_argument("--report", action="store_true", help="only render BENCHMARKS.md")
    args = parser.parse_args(argv)
    if not args.report:
        names = [_resolve(n) for n in args.names] or [n for n in BENCHMARKS if args.all or n not in LONG]
        failed = []
        for name in names:
            print(f"== {name} ({BENCHMARKS[name]})", flush=True)
            t0 = time.perf_counter()
            cmd = [sys.executable, "-m", *BENCHMARKS[name].split(), *(["--quick"] if args.quick else []), *extra]
            # in the environment of a run's processes (huge pages, ...), as `rlpost train` gives its actors
            code = subprocess.run(cmd, cwd=REPO, env={**os.environ, **RUN_ENV_VARS}).returncode
            print(f"== {name}: exit {code} after {time.perf_counter() - t0:.0f} s", flush=True)
            if code:
                failed.append(name)
        if failed:
            print(f"failed: {failed}", flush=True)
    from bench.report import render

    out = render(quick=args.quick)
    print(f"wrote {out.relative_to(REPO)}")
    return 1 if not args.report and failed else 0


def _resolve(name: str) -> str:
    for key, module in BENCHMARKS.items():
        module = module.split()[0]
        if name in (key, module, module.split(".")[-1], module.split(".")[-1] + ".py"):
            return key
    raise SystemExit(f"unknown benchmark {name!r}; choose from {list(BENCHMARKS)}")


if __name__ == "__main__":
    sys.exit(main())
