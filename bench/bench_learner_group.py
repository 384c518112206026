"""Learner group: step time and memory per rank with 1 and 2 ranks (FSDP2 over gloo on this CPU).

Each case starts the learner as Ray actors with ``start_learner_group`` and trains ``--steps``
steps (after one warm-up step) on the same synthetic batch: ``--groups`` groups of 4 samples, 32
prompt and 32 completion tokens each. The machine's 2 cores are split the same way in both: 1
rank on 2 torch threads, or 2 ranks on 1 thread each. Models: the tiny model and the
Qwen2.5-0.5B-shaped one (random weights; 2 layers in quick mode).

Figures (same run): the learner step time of 2 ranks over 1 rank, and each rank's bytes of
parameters + AdamW state (gradients are freed after each step) over the single learner's (the
issue's target with 2 ranks: <= 0.6x). Peak resident memory per rank is recorded too: each rank
receives only its shards at load time, so the peak is the training step's (the process itself,
activations and logits of its rows, each layer gathered whole in turn); freed tensors leave the
process in both cases (``resources.learner.release_freed_memory``, a group's default), so one
step's leftovers do not sit under the next.

    python -m bench learner_group [--quick] [-- --models tiny,qwen05b --steps 3]
"""

from __future__ import annotations

import argparse
import random
import time

from bench.common import TINY_MODEL, Result, median, qwen05b_model, summary, wait_for_quiet


def make_groups(num_groups: int, vocab: int, seed: int = 0):
    from rlpost.data.samples import Group, Sample

    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        prompt = [rng.randrange(3, vocab) for _ in range(32)]
        samples = []
        for _ in range(4):
            ids = prompt + [rng.randrange(3, vocab) for _ in range(32)]
            samples.append(Sample(prompt_id=g, token_ids=ids, logprobs=[-5.0] * len(ids),
                                  loss_mask=[False] * 32 + [True] * 32, prompt_len=32, reward=0.0,
                                  policy_version=0, finished=True))  # fmt: skip
        groups.append(Group(prompt_id=g, samples=samples, advantages=[1.0, -1.0, 0.5, -0.5], policy_version=0))
    return groups


def run_case(model_path, ranks: int, groups, steps: int) -> dict:
    import ray

    from rlpost.actors.learner import LearnerSettings, start_learner_group
    from rlpost.config import JobConfig

    threads = max(1, 2 // ranks)
    raw = {"model": {"name_or_path": str(model_path)}, "optimizer": {"lr": 1e-6},
           # both cases give freed memory back (a group's default), so their peaks compare alike
           "resources": {"learner": {"num_cpus": 0, "num_threads": threads, "num_workers": ranks,
                                     "release_freed_memory": True}}}  # fmt: skip
    settings = LearnerSettings.from_job(JobConfig.model_validate(raw))
    handles = start_learner_group(settings, ranks, options_for=lambda rank: {"num_cpus": 0}, timeout_s=900)
    try:
        ref = ray.put(groups)
        times = []
        for step in range(steps + 1):  # the first step warms up (allocations, AdamW state)
            start = time.perf_counter()
            metrics = ray.get([h.train_step.remote(ref) for h in handles], timeout=3600)[0]
            if step:
                times.append(time.perf_counter() - start)
        memory = ray.get([h.memory.remote() for h in handles], timeout=600)
        return {"step_s": summary(times), "learner_step_s": metrics["step_time_s"], "loss": metrics["loss"],
                "state_bytes": [m["state_bytes"] for m in memory],
                "peak_rss_bytes": [m["peak_rss_bytes"] for m in memory]}  # fmt: skip
    finally:
        ray.get([h.close.remote() for h in handles], timeout=120)
        for handle in handles:
            ray.kill(handle, no_restart=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default="tiny,qwen05b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=4)
    args = parser.parse_args()
    import ray

    steps = 1 if args.quick else args.steps
    result = Result("learner_group", args.quick, {"models": args.models, "steps": steps, "groups": args.groups,
                                                  "samples": "4 per group, 32 prompt + 32 completion tokens",
                                                  "threads": "1 rank x 2 threads; 2 ranks x 1 thread"})  # fmt: skip
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for model in args.models.split(","):
            path = TINY_MODEL if model == "tiny" else qwen05b_model(args.quick)
            from transformers import AutoTokenizer

            vocab = len(AutoTokenizer.from_pretrained(path))
            groups = make_groups(args.groups, vocab)
            cases = {}
            for ranks in (1, 2):
                busy = wait_for_quiet(args.quick)
                print(f"  {model}: {ranks} rank(s)", flush=True)
                cases[ranks] = run_case(path, ranks, groups, steps)
                cases[ranks]["busy_cores_at_start"] = busy
                result.cases[f"{model}, {ranks} rank(s)"] = cases[ranks]
            one, two = cases[1], cases[2]
            result.ratios[f"{model}: step time, 2 ranks / 1 rank"] = round(
                median(two["step_s"]["repeats"]) / median(one["step_s"]["repeats"]), 2
            )
            result.ratios[f"{model}: state bytes per rank, 2 ranks / 1 rank"] = round(
                max(two["state_bytes"]) / one["state_bytes"][0], 3
            )
            result.ratios[f"{model}: peak RSS per rank, 2 ranks / 1 rank"] = round(
                max(two["peak_rss_bytes"]) / one["peak_rss_bytes"][0], 2
            )
            result.ratios[f"{model}: loss, 2 ranks - 1 rank"] = two["loss"] - one["loss"]
    finally:
        ray.shutdown()
    result.note("2 ranks share the same 2 cores as 1 rank: on CPU the group pays its gloo collectives and "
                "gains no compute; on GPUs each rank brings its own device")  # fmt: skip
    result.write()


if __name__ == "__main__":
    main()
