"""TorchRL-shaped async GRPO: does examples/grpo_async.py learn? (RayLLMCollector x N,
RayReplayBuffer with MCAdvantage, AsyncVLLM, VLLMWeightSyncScheme, GSM8KEnv with ray_backend)

The script runs ``--steps`` optimizer steps on the tiny model on a fresh local Ray cluster,
``--repeats`` times with different seeds. The figure is learning, not speed: the mean reward of
the batches sampled in the last ``--window`` steps against the first ``--window`` steps of the
same run (a same-run ratio and a difference), with the wall time it took. Every step's update
must reach the fleet (the versions advance one per step).

Each step samples 4 groups of 8 completions; the prompts cycle through 4 questions, so what is
measured is the reward on questions the run practises (as the e2e test of grpo_by_hand does):
measured before this benchmark existed, 150 steps took the first tenth's reward 0.21 -> 0.51
(seed 0) and 0.35 -> 0.96 (seed 1) in about 100 s of training.

    python -m bench grpo_async [--quick] [-- --steps 200 --repeats 2]
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.common import REPO, Result, record_learning, wait_for_quiet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per repeat (default 200)")
    parser.add_argument("--repeats", type=int, default=None, help="runs with seeds 0, 1, ... (default 2)")
    parser.add_argument("--collectors", type=int, default=2, help="RayLLMCollector actors (default 2)")
    parser.add_argument("--questions", type=int, default=None, help="distinct questions (default 4)")
    parser.add_argument("--groups-per-batch", type=int, default=4, help="groups per collected and sampled batch")
    parser.add_argument("--window", type=int, default=None, help="steps averaged at each end (default steps // 10)")
    args = parser.parse_args()
    steps = args.steps or (6 if args.quick else 200)
    repeats = args.repeats or (1 if args.quick else 2)
    window = args.window or max(1, steps // 10)
    questions = args.questions or 4
    sys.path.insert(0, str(REPO / "examples"))
    import grpo_async
    import ray

    settings = {"steps": steps, "repeats": repeats, "collectors": args.collectors, "questions": questions,
                "groups_per_batch": args.groups_per_batch, "window": window, "model": "tiny"}  # fmt: skip
    result = Result("grpo_async", args.quick, settings)
    wait_for_quiet(args.quick)
    first, last, walls = [], [], []
    for seed in range(repeats):
        cfg = grpo_async.Config(model=str(REPO / "models" / "tiny-model"), steps=steps, num_collectors=args.collectors,
                                questions=questions, groups_per_batch=args.groups_per_batch, seed=seed,
                                dataloader_actor_name=f"bench-data-{seed}")  # fmt: skip
        cfg.buffer_size = 4 * cfg.dialog_turns_per_batch  # the newest four batches
        t0 = time.perf_counter()
        ray.init(include_dashboard=False, log_to_driver=False)
        try:
            run = grpo_async.main(cfg)
        finally:
            ray.shutdown()
        walls.append(time.perf_counter() - t0)
        if run.versions != list(range(2, steps + 2)):
            result.note(f"seed {seed}: versions {run.versions[:5]}... do not advance one per step")
        head, tail = sum(run.rewards[:window]) / window, sum(run.rewards[-window:]) / window
        first.append(head)
        last.append(tail)
        print(f"  seed {seed}: reward {head:.3f} (first {window} steps) -> {tail:.3f} (last {window}), "
              f"{run.seconds[-1]:.0f} s of training, {walls[-1]:.0f} s in all", flush=True)  # fmt: skip
    record_learning(result, first, last, walls)
    result.write()


if __name__ == "__main__":
    main()
