"""Scaling on this machine: samples/s with 1 or 2 inference workers and 1 or 2 env pools.

Every point is a whole rlpost run in async mode (collection never waits for the learner, so more
collectors can show up as more samples/s) on the tiny model with the demo workload (16 prompts x
8 samples, 16 tokens), ``rollout.num_inference_workers`` and ``rollout.num_env_pools`` set by
override; the resources of configs/tiny-cpu.yaml (inference 0.5 CPU, env pool 0.25, learner 0.5)
fit 2 workers + 2 pools + the learner in the machine's 2 CPUs. The ratio of each point is its
median samples/s over the 1 worker / 1 pool point's, measured in the same session; the points
run interleaved within each repeat. (A sync 1x1 point can be added with --points; the e2e
benchmark has the sync runs of the same workload.)

    python -m bench bench_scaling [--quick] [--steps 20] [--repeats 3]
"""

from __future__ import annotations

import argparse

from bench.common import TINY_MODEL, Result, summary, wait_for_quiet
from bench.runs import Workload, model_path, run_rlpost

POINTS = {  # id -> (mode, inference workers, env pools)
    "async-1w1p": ("async", 1, 1),
    "async-2w1p": ("async", 2, 1),
    "async-1w2p": ("async", 1, 2),
    "async-2w2p": ("async", 2, 2),
    "sync-1w1p": ("sync", 1, 1),
}
DEFAULT_POINTS = [p for p in POINTS if p.startswith("async")]  # sync 1x1: see the e2e results
BASE = "async, 1 worker, 1 pool"


def label(point: str) -> str:
    mode, workers, pools = POINTS[point]
    return f"{mode}, {workers} worker{'s' if workers > 1 else ''}, {pools} pool{'s' if pools > 1 else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--points", default=",".join(DEFAULT_POINTS), help=f"comma-separated, from {list(POINTS)}")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    points = [p.strip() for p in args.points.split(",") if p.strip()]
    if args.quick:
        work = Workload(model_path(TINY_MODEL), steps=args.steps or 3, prompts_per_step=4, group_size=4, max_tokens=8)
    else:
        work = Workload(model_path(TINY_MODEL), steps=args.steps or 20)
    result = Result(
        "scaling",
        args.quick,
        {
            "workload": vars(work),
            "repeats": repeats,
            "points": points,
            "resources": "configs/tiny-cpu.yaml (inference 0.5, env_pool 0.25, learner 0.5 CPU; 1 torch thread in async, 2 in sync)",
        },
    )
    unknown = [p for p in points if p not in POINTS]
    if unknown:
        raise SystemExit(f"unknown points {unknown}; choose from {list(POINTS)}")
    runs: dict[str, list[dict]] = {label(p): [] for p in points}
    for r in range(repeats):
        for point_id in points:
            mode, workers, pools = POINTS[point_id]
            point = label(point_id)
            load = wait_for_quiet(args.quick)
            # async as docs/demo.md runs it: the learner on 1 thread, the engines on the other core
            threads = 1 if mode == "async" else 2
            overrides = [
                f"trainer.mode={mode}",
                f"rollout.num_inference_workers={workers}",
                f"rollout.num_env_pools={pools}",
                f"resources.learner.num_threads={threads}",
            ]
            tag = f"scaling-{mode}-{workers}w{pools}p-{r}"
            print(f"== repeat {r + 1}/{repeats}: {point} (busy cores {load:.2f})", flush=True)
            run = run_rlpost(tag, work, overrides, quick=args.quick)
            print(
                f"   {run.samples_per_s:.1f} samples/s (steady {run.steady_samples_per_s or 0:.1f}), "
                f"process {run.process_wall_s:.0f} s",
                flush=True,
            )
            runs[point].append(run.to_dict() | {"busy_cores_at_start": load})
            result.cases[point] = {
                "mode": mode,
                "workers": workers,
                "pools": pools,
                "samples_per_s": summary([i["samples_per_s"] for i in runs[point]]),
                "steady_samples_per_s": summary([i["steady_samples_per_s"] for i in runs[point]]),
                "process_wall_s": summary([i["process_wall_s"] for i in runs[point]]),
                "groups_dropped_stale": summary([i["groups_dropped_stale"] for i in runs[point]]),
                "runs": runs[point],
            }
            result.write()
    base = result.cases.get(BASE)
    if base:
        for point in map(label, points):
            if point != BASE and point in result.cases:
                for metric in ("samples_per_s", "steady_samples_per_s"):
                    ours, ref = result.cases[point][metric]["median"], base[metric]["median"]
                    if ours and ref:
                        result.ratios[f"{point} / {BASE}, {metric}"] = ours / ref
    result.write()


if __name__ == "__main__":
    main()
