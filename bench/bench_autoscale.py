"""The load policy against fixed fleets: the same steps with ``rollout.autoscale`` on a range
versus the range's minimum and its maximum fixed, on a workload whose generation dominates.

The workload (sync mode, the tiny model, 16 prompts x 8 samples a step) scores every sample with
a reward behind a 20 ms round trip (``bench/slow_reward.py``), as a hosted judge or a sandbox
would take: its env pools hold generation back, so the role the policy grows is the env pools
(``rollout.num_env_pools: 1..MAX``; the inference worker stays one, since on this machine's two
cores a second engine only shares them). MAX (8) is twice the size past which a pool adds little
here (the 4th adds 5-12%), as a range set without knowing the useful size is. Each case is a whole
run of the same steps:

    min      rollout.num_env_pools=1
    max      rollout.num_env_pools=MAX
    policy   rollout.num_env_pools=1..MAX with rollout.autoscale (its defaults but cooldown_s and
             window_steps, scaled to a run of a few minutes): grows as many pools as the learner's
             wait calls for (at most 4 times as many at once) while each grow pays
    policy, min_gain 0.25: the same, keeping a pool that adds a quarter of its proportional gain
             (the default, 0.5, asks half): more pools, a shorter run

Cost is pool-seconds: each step's wall time times the pools the run held in it (serving or
starting: their slots were reserved); wall is the steps' wall time (the first step's start to
the last's end). Ratios are against the max case of the same repeat; medians of the repeats.

    python -m bench bench_autoscale [--quick] [--steps 60] [--repeats 2] [--max-pools 8]
"""

from __future__ import annotations

import argparse
import json

from bench.common import TINY_MODEL, Result, results_dir, summary, wait_for_quiet
from bench.runs import Workload, model_path, run_rlpost

# every case: pools reserve a tenth of a core (they mostly wait on the judge), so that MAX fit the two
SHARED = ("resources.env_pool.num_cpus=0.1",)
POLICY = ("rollout.autoscale.enabled=true", "rollout.autoscale.cooldown_s=10", "rollout.autoscale.window_steps=2")


def cases(max_pools: int) -> dict[str, list[str]]:
    policy = [f"rollout.num_env_pools=1..{max_pools}", *POLICY]
    return {
        "min (1 pool)": ["rollout.num_env_pools=1"],
        f"max ({max_pools} pools)": [f"rollout.num_env_pools={max_pools}"],
        f"policy (1..{max_pools} pools)": policy,
        # the same policy keeping a pool that raises throughput by a quarter of its proportional share
        f"policy, min_gain 0.25 (1..{max_pools} pools)": [*policy, "rollout.autoscale.min_gain=0.25"],
    }


def pool_seconds(tag: str, quick: bool) -> tuple[float, list[int], list[str]]:
    """The run's pool-seconds, the pools it held at each step and its policy's decisions."""
    rows = [json.loads(line) for line in (results_dir(quick) / "runs" / tag / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time_s" in r]
    held = [int(r["env_pools_target"]) for r in rows]
    decisions = [f"step {r['step']}: {r['autoscale_decision']}" for r in rows if r.get("autoscale_decision")]
    return sum(r["step_time_s"] * n for r, n in zip(rows, held)), held, decisions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--max-pools", type=int, default=8)
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 2)
    steps = args.steps or (6 if args.quick else 60)
    work = Workload(model_path(TINY_MODEL), steps=steps,
                    rlpost_extra=("data.reward_fn=bench.slow_reward:judged", "data.reward_timeout_s=5"))  # fmt: skip
    plan = cases(args.max_pools)
    result = Result("autoscale", args.quick, {"workload": vars(work), "repeats": repeats, "cases": plan,
                                              "reward_latency_s": 0.02, "mode": "sync"})  # fmt: skip
    runs: dict[str, list[dict]] = {case: [] for case in plan}
    for r in range(repeats):
        for case, overrides in plan.items():
            load = wait_for_quiet(args.quick)
            tag = f"autoscale-{case.split()[0].rstrip(',')}{'-gain025' if 'min_gain' in case else ''}-{r}"
            print(f"== repeat {r + 1}/{repeats}: {case} (busy cores {load:.2f})", flush=True)
            run = run_rlpost(tag, work, ["trainer.mode=sync", *SHARED, *overrides], quick=args.quick)
            cost, held, decisions = pool_seconds(tag, args.quick)
            print(f"   steps {run.steps_wall_s:.1f} s, {cost:.0f} pool-seconds, pools per step {held}", flush=True)
            for line in decisions:
                print(f"   {line}", flush=True)
            runs[case].append(run.to_dict() | {"pool_seconds": cost, "pools_held": held, "decisions": decisions,
                                               "busy_cores_at_start": load})  # fmt: skip
            result.cases[case] = {
                "steps_wall_s": summary([i["steps_wall_s"] for i in runs[case]]),
                "pool_seconds": summary([i["pool_seconds"] for i in runs[case]]),
                "process_wall_s": summary([i["process_wall_s"] for i in runs[case]]),
                "runs": runs[case],
            }
            result.write()
    top = f"max ({args.max_pools} pools)"
    for case in plan:
        if case != top and case in result.cases and top in result.cases:
            for metric in ("steps_wall_s", "pool_seconds"):
                result.ratios[f"{case} / {top}, {metric}"] = (
                    result.cases[case][metric]["median"] / result.cases[top][metric]["median"]
                )
    result.write()


if __name__ == "__main__":
    main()
