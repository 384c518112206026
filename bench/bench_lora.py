"""LoRA against full fine-tuning: weight sync, learner step and learner state on one machine.

For each of "full" and "lora" (``model.lora`` rank 16 on every attention and MLP projection), a
learner (``Learner``, in this process) publishes through a ``vLLMUpdater`` to a real vLLM
engine (``make_vllm_worker(..., make_ray_worker=False)``: its engine runs in child processes), as
a run does: ``weight_sync_s`` is the learner's publish, from the first byte sent to the engine
serving the new version (full: receive + in-place reload; LoRA: receive + adapter folder + vLLM
adapter load). Each publish follows a learner step on the same synthetic batch (``--groups``
groups of 4 samples, 32 prompt + 32 completion tokens), so both the sync and the step are timed.
One warm-up step and publish, then ``--repeats`` measured ones. Models: the Qwen2.5-0.5B-shaped
one (random weights; 2 layers in quick mode) and the tiny one.

Figures (same run): LoRA's weight_sync_s, bytes sent, learner step time and learner state
(parameters + AdamW state) over full fine-tuning's; and full fine-tuning's weight_sync_s with the
engine loading each bucket as it arrives (what runs do) over loading after the whole update.

    python -m bench lora [--quick] [-- --models qwen05b,tiny --repeats 3]
"""

from __future__ import annotations

import argparse
import time

from bench.bench_learner_group import make_groups
from bench.common import TINY_MODEL, Result, median, qwen05b_model, summary, wait_for_quiet

BASELINE = "full, reload after the whole update"  # each bucket loaded once the whole update is in


def run_case(model_path, lora: bool, groups, repeats: int, overlap: bool = True) -> dict:
    from rlpost.actors import sharding
    from rlpost.actors.learner import Learner, LearnerSettings
    from rlpost.actors.vllm_workers import make_vllm_worker
    from rlpost.collect.weight_update import vLLMUpdater
    from rlpost.config import JobConfig

    raw = {"model": {"name_or_path": str(model_path)}, "optimizer": {"lr": 1e-6},
           "rollout": {"engine": {"kv_cache_space_gb": 0.25, "max_model_len": 256}}}  # fmt: skip
    if lora:
        raw["model"]["lora"] = {}
    cfg = JobConfig.model_validate(raw)
    learner = Learner(LearnerSettings.from_job(cfg))
    worker = make_vllm_worker(str(model_path), make_ray_worker=False, engine_config=cfg.rollout.engine,
                              lora=cfg.model.lora)  # fmt: skip
    worker.overlap_reload = overlap
    updater = vLLMUpdater([worker], timeout_s=600, bucket_mb=64)
    try:
        updater.init()
        learner.publisher = updater
        if lora:
            assert learner.choose_sync_mode(updater.workers_serve_lora()) == "adapter"
        steps, syncs, loads, sent = [], [], [], 0.0
        for repeat in range(repeats + 1):  # the first one warms up (allocations, AdamW state, the bus)
            metrics = learner.train_step(groups)
            stats = learner.publish()
            if repeat:
                steps.append(metrics["step_time_s"])
                syncs.append(stats["weight_sync_s"])
                loads.append(stats["weight_load_s"])
                sent = stats["bytes"]
        assert worker.version == repeats + 1
        return {
            "weight_sync_s": summary(syncs),
            "weight_load_s": summary(loads),
            "learner_step_s": summary(steps),
            "bytes": sent,
            "state_bytes": float(sharding.local_state_bytes(learner.model, learner.optimizer)),
            "trainable_params": sum(p.numel() for p in learner.model.parameters() if p.requires_grad),
        }
    finally:
        updater.close()
        worker.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default="qwen05b,tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--groups", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    repeats = 1 if args.quick else args.repeats
    result = Result("lora", args.quick, {"models": args.models, "repeats": repeats, "groups": args.groups,
                                         "samples": "4 per group, 32 prompt + 32 completion tokens",
                                         "lora": "rank 16, alpha 32, q/k/v/o/gate/up/down projections",
                                         "engine": "vLLM CPU, float32, one worker in this process's children"})  # fmt: skip
    for model in args.models.split(","):
        path = TINY_MODEL if model == "tiny" else qwen05b_model(args.quick)
        groups = make_groups(args.groups, len(AutoTokenizer.from_pretrained(path)))
        cases = {}
        for kind in ("full, reload after the whole update", "full", "lora"):
            busy = wait_for_quiet(args.quick)
            print(f"  {model}: {kind}", flush=True)
            start = time.perf_counter()
            cases[kind] = run_case(path, kind == "lora", groups, repeats, overlap=kind != BASELINE)
            cases[kind].update(busy_cores_at_start=busy, case_wall_s=round(time.perf_counter() - start, 1))
            result.cases[f"{model}, {kind}"] = cases[kind]
        full, lora, whole = cases["full"], cases["lora"], cases[BASELINE]
        result.ratios[f"{model}: weight_sync_s, reload overlapping the transfer / after it"] = round(
            median(full["weight_sync_s"]["repeats"]) / median(whole["weight_sync_s"]["repeats"]), 3
        )
        for key, label in (("weight_sync_s", "weight_sync_s"), ("learner_step_s", "learner step time")):
            result.ratios[f"{model}: {label}, LoRA / full"] = round(
                median(lora[key]["repeats"]) / median(full[key]["repeats"]), 3
            )
        result.ratios[f"{model}: bytes per sync, LoRA / full"] = round(lora["bytes"] / full["bytes"], 4)
        result.ratios[f"{model}: learner state bytes, LoRA / full"] = round(
            lora["state_bytes"] / full["state_bytes"], 3
        )
    result.note("LoRA's learner state still holds the frozen base weights (float32): only the AdamW state and the "
                "gradients shrink to the adapter's size")  # fmt: skip
    result.write()


if __name__ == "__main__":
    main()
