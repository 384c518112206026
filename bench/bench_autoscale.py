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
    policy, min_gain 0.25 (with --min-gain-case): the same, keeping a pool that adds a quarter of
             its proportional gain (the default, 0.5, asks half); at 1..8 it settled where the
             default does, so it is no longer run by default

Cost is pool-seconds: each step's wall time times the pools the run held in it (serving or
starting: their slots were reserved); wall is the steps' wall time (the first step's start to
the last's end). Ratios are of the cases' medians over the repeats, and (``paired``) the median of
each repeat's policy/max ratio, since the machine's noise moves whole repeats. ``settled`` splits a
run at the policy's last move: the steps after it against the same steps of the max case, the
fleet's speed once the ramp (starting pools, one at first) is paid.

    python -m bench bench_autoscale [--quick] [--steps 200] [--repeats 2] [--max-pools 8] [--min-gain-case]
"""

from __future__ import annotations

import argparse
import json

from bench.common import TINY_MODEL, Result, results_dir, summary, wait_for_quiet
from bench.runs import Workload, model_path, run_rlpost

# every case: pools reserve a tenth of a core (they mostly wait on the judge), so that MAX fit the two
SHARED = ("resources.env_pool.num_cpus=0.1",)
POLICY = ("rollout.autoscale.enabled=true", "rollout.autoscale.cooldown_s=10", "rollout.autoscale.window_steps=2")


def cases(max_pools: int, min_gain_case: bool) -> dict[str, list[str]]:
    policy = [f"rollout.num_env_pools=1..{max_pools}", *POLICY]
    plan = {
        "min (1 pool)": ["rollout.num_env_pools=1"],
        f"max ({max_pools} pools)": [f"rollout.num_env_pools={max_pools}"],
        f"policy (1..{max_pools} pools)": policy,
    }
    if min_gain_case:  # the same policy keeping a pool that raises throughput by a quarter of its share
        plan[f"policy, min_gain 0.25 (1..{max_pools} pools)"] = [*policy, "rollout.autoscale.min_gain=0.25"]
    return plan


def step_rows(tag: str, quick: bool) -> list[dict]:
    rows = [json.loads(line) for line in (results_dir(quick) / "runs" / tag / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "step_time_s" in r]


def pool_seconds(rows: list[dict]) -> tuple[float, list[int], list[str]]:
    """The run's pool-seconds, the pools it held at each step and its policy's decisions."""
    held = [int(r["env_pools_target"]) for r in rows]
    decisions = [f"step {r['step']}: {r['autoscale_decision']}" for r in rows if r.get("autoscale_decision")]
    return sum(r["step_time_s"] * n for r, n in zip(rows, held)), held, decisions


def runs_of(held: list[int]) -> str:
    """The pools held step by step, as runs: ``1 x2, 4 x6, 6 x192``."""
    out: list[list[int]] = []
    for n in held:
        if out and out[-1][0] == n:
            out[-1][1] += 1
        else:
            out.append([n, 1])
    return ", ".join(f"{n} x{k}" for n, k in out)


def settled(policy: list[dict], top: list[dict]) -> dict[str, float] | None:
    """The steps after the policy run's last move against the same steps of the max run: their
    wall times and ratio (None: the policy never moved, or moved at its last step)."""
    moves = [i for i, r in enumerate(policy) if r.get("autoscale_decision")]
    after = moves[-1] + 1 if moves else 0
    if not moves or after >= min(len(policy), len(top)):
        return None
    mine = sum(r["step_time_s"] for r in policy[after:])
    theirs = sum(r["step_time_s"] for r in top[after : len(policy)])
    return {"from_step": policy[after]["step"], "policy_s": mine, "max_s": theirs, "ratio": mine / theirs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--max-pools", type=int, default=8)
    parser.add_argument("--min-gain-case", action="store_true", help="also run the policy with min_gain 0.25")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 2)
    # long enough that the ramp (one pool at first, then pools starting) is a few percent of the run
    steps = args.steps or (6 if args.quick else 200)
    work = Workload(model_path(TINY_MODEL), steps=steps,
                    rlpost_extra=("data.reward_fn=bench.slow_reward:judged", "data.reward_timeout_s=5"))  # fmt: skip
    plan = cases(args.max_pools, args.min_gain_case)
    top = f"max ({args.max_pools} pools)"
    result = Result("autoscale", args.quick, {"workload": vars(work), "repeats": repeats, "cases": plan,
                                              "reward_latency_s": 0.02, "mode": "sync"})  # fmt: skip
    runs: dict[str, list[dict]] = {case: [] for case in plan}
    rows: dict[tuple[str, int], list[dict]] = {}
    for r in range(repeats):
        for case, overrides in plan.items():
            load = wait_for_quiet(args.quick)
            tag = f"autoscale-{case.split()[0].rstrip(',')}{'-gain025' if 'min_gain' in case else ''}-{r}"
            print(f"== repeat {r + 1}/{repeats}: {case} (busy cores {load:.2f})", flush=True)
            run = run_rlpost(tag, work, ["trainer.mode=sync", *SHARED, *overrides], quick=args.quick)
            rows[case, r] = step_rows(tag, args.quick)
            cost, held, decisions = pool_seconds(rows[case, r])
            print(f"   steps {run.steps_wall_s:.1f} s, {cost:.0f} pool-seconds, pools {runs_of(held)}", flush=True)
            for line in decisions:
                print(f"   {line}", flush=True)
            extra = {"pool_seconds": cost, "pools_held": held, "decisions": decisions, "busy_cores_at_start": load}
            if case.startswith("policy") and (top, r) in rows:
                extra["settled_vs_max"] = settled(rows[case, r], rows[top, r])
                extra["wall_vs_max"] = run.steps_wall_s / runs[top][r]["steps_wall_s"]
                print(f"   vs max in this repeat: wall {extra['wall_vs_max']:.2f}x, settled {extra['settled_vs_max']}",
                      flush=True)  # fmt: skip
            runs[case].append(run.to_dict() | extra)
            result.cases[case] = {
                "steps_wall_s": summary([i["steps_wall_s"] for i in runs[case]]),
                "pool_seconds": summary([i["pool_seconds"] for i in runs[case]]),
                "process_wall_s": summary([i["process_wall_s"] for i in runs[case]]),
                "runs": runs[case],
            }
            result.write()
    for case in plan:
        if case != top and case in result.cases and top in result.cases:
            for metric in ("steps_wall_s", "pool_seconds"):
                result.ratios[f"{case} / {top}, {metric}"] = (
                    result.cases[case][metric]["median"] / result.cases[top][metric]["median"]
                )
            if case.startswith("policy"):
                paired = [i["wall_vs_max"] for i in runs[case]]
                result.ratios[f"{case} / {top}, steps_wall_s, paired"] = summary(paired)["median"]
                after = [i["settled_vs_max"]["ratio"] for i in runs[case] if i.get("settled_vs_max")]
                if after:
                    result.ratios[f"{case} / {top}, steps after its last move"] = summary(after)["median"]
    result.write()


if __name__ == "__main__":
    main()
