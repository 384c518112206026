"""Buffer: groups/s through the ``buffer`` actor against the rate the collectors produce them.

The buffer is rlpost's real one (``start_buffer``: the Ray actor around LocalBuffer, reached
through RayBuffer, as the controller starts it for the demo job: capacity one step of 16 groups,
staleness cap 1). The groups are real ``rlpost.data.samples.Group`` objects shaped like the tiny demo's
(8 samples of a ~30-token prompt + 9 generated tokens, log-probs, masks, text).

- throughput: a producer actor puts batches of 16 groups (one env-pool put per step) as fast as
  it can while the driver takes batches of 16 (the controller's get); groups/s end to end.
- per step: one put of 16 groups from an actor, then one get of 16 on the driver, alone: the
  buffer's cost in one training step. Its share of step time uses the median step time of the
  rlpost tiny runs in bench/results/e2e.json (same workload) when that file exists, and the
  collectors' production rate (groups/s) comes from the same runs.

    python -m bench bench_buffer [--quick]
"""

from __future__ import annotations

import argparse
import random
import time

from bench.common import Result, load_result, median, summary, wait_for_quiet

PROMPTS_PER_STEP, GROUP_SIZE, PROMPT_LEN, GEN_LEN = 16, 8, 30, 9


def make_groups(num_groups: int, seed: int = 0, version: int = 0) -> list:
    from rlpost.data.samples import Group, Sample

    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        samples = []
        for _ in range(GROUP_SIZE):
            n = PROMPT_LEN + GEN_LEN
            samples.append(
                Sample(
                    prompt_id=g,
                    token_ids=[rng.randrange(446) for _ in range(n)],
                    logprobs=[0.0] * PROMPT_LEN + [-rng.random() for _ in range(GEN_LEN)],
                    loss_mask=[False] * PROMPT_LEN + [True] * GEN_LEN,
                    prompt_len=PROMPT_LEN,
                    reward=rng.choice([0.0, 0.1, 1.0]),
                    policy_version=version,
                    finished=True,
                    completion_text="<answer>12</answer>",
                )
            )
        rewards = [s.reward for s in samples]
        mean = sum(rewards) / len(rewards)
        groups.append(
            Group(
                prompt_id=g,
                samples=samples,
                advantages=[r - mean for r in rewards],
                policy_version=version,
                info={"env_pool": 0},
            )
        )
    return groups


def _producer_class():
    import ray

    @ray.remote(num_cpus=0)
    class Producer:
        """Stands in for an env pool: puts pre-built batches through its own RayBuffer client."""

        def __init__(self, buffer, groups):
            self.buffer, self.groups = buffer, groups

        def put_batches(self, num_batches: int) -> float:
            t0 = time.perf_counter()
            for i in range(num_batches):
                self.buffer.put(
                    self.groups,
                    timeout_s=120,
                    producer="env-pool-0",
                    producer_state={"num_prompts_collected": (i + 1) * len(self.groups)},
                )
            return time.perf_counter() - t0

        def put_once(self) -> float:
            t0 = time.perf_counter()
            self.buffer.put(self.groups, timeout_s=120, producer="env-pool-0", producer_state={})
            return time.perf_counter() - t0

    return Producer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batches", type=int, default=None, help="batches per throughput repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    batches = args.batches or (10 if args.quick else 200)
    import ray

    from rlpost.actors.buffer import BufferSettings, start_buffer

    result = Result(
        "buffer",
        args.quick,
        {
            "groups_per_batch": PROMPTS_PER_STEP,
            "group_size": GROUP_SIZE,
            "prompt_len": PROMPT_LEN,
            "generated_len": GEN_LEN,
            "capacity": PROMPTS_PER_STEP,
            "max_staleness": 1,
            "batches_per_repeat": batches,
            "repeats": args.repeats,
        },
    )
    wait_for_quiet(args.quick)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="rlpost-bench-buffer")
    try:
        buffer = start_buffer(BufferSettings(PROMPTS_PER_STEP, 1, run_name="bench-buffer"))
        groups = make_groups(PROMPTS_PER_STEP)
        producer = _producer_class().remote(buffer, groups)
        ray.get(producer.put_once.remote())
        buffer.get(PROMPTS_PER_STEP, timeout_s=60, current_version=0)  # warm-up: actors up, code paths hot

        rates = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            done = producer.put_batches.remote(batches)
            for _ in range(batches):
                buffer.get(PROMPTS_PER_STEP, timeout_s=120, current_version=0)
            ray.get(done)
            rates.append(batches * PROMPTS_PER_STEP / (time.perf_counter() - t0))
        result.cases["throughput (groups/s)"] = summary(rates)
        print(f"  throughput: {median(rates):.0f} groups/s", flush=True)

        puts, gets = [], []
        for _ in range(max(args.repeats, 20 if not args.quick else 3)):
            puts.append(ray.get(producer.put_once.remote()))
            t0 = time.perf_counter()
            buffer.get(PROMPTS_PER_STEP, timeout_s=60, current_version=0)
            gets.append(time.perf_counter() - t0)
        per_step = [p + g for p, g in zip(puts, gets)]
        result.cases["put of one step (s)"] = summary(puts)
        result.cases["get of one step (s)"] = summary(gets)
        result.cases["buffer time per step (s)"] = summary(per_step)
        print(f"  per step: put {median(puts) * 1e3:.1f} ms + get {median(gets) * 1e3:.1f} ms", flush=True)
    finally:
        ray.shutdown()
    _compare_with_runs(result, median(rates), median(per_step))
    result.write()


def _compare_with_runs(result: Result, groups_per_s: float, buffer_s: float) -> None:
    """Production rate and step time of the rlpost tiny runs measured by bench_e2e (if present)."""
    e2e = load_result("e2e", quick=result.quick)
    tiny = (e2e or {}).get("cases", {}).get("tiny", {})
    if not tiny:
        result.note("no e2e tiny results yet: run bench_e2e first for the share of step time")
        return
    for system in ("rlpost sync", "rlpost async"):
        case = tiny.get(system)
        if not case:
            continue
        runs = case["runs"]
        group_size = result.data["settings"]["group_size"]
        produced = median([r["steady_samples_per_s"] or r["samples_per_s"] for r in runs]) / group_size
        step_s = median([s for r in runs for s in r["step_s"][1:]] or [r["steps_wall_s"] / r["steps"] for r in runs])
        result.cases[f"{system}: collectors produce (groups/s)"] = produced
        result.cases[f"{system}: median step time (s)"] = step_s
        result.ratios[f"{system}: buffer throughput / collector rate"] = groups_per_s / produced
        result.ratios[f"{system}: buffer share of step time"] = buffer_s / step_s
        print(
            f"  {system}: collectors {produced:.1f} groups/s, step {step_s:.3f} s, "
            f"buffer share {buffer_s / step_s:.2%}",
            flush=True,
        )


if __name__ == "__main__":
    main()
