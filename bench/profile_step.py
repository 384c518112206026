"""Profile of one sync GRPO step, phase by phase, with rlpost's plain classes in one process.

Where does a step's time go? The same objects the actors hold, without Ray: an
``InferenceWorker`` (its own vLLM engine), an ``GroupCollector`` collecting through it, a ``Learner``,
and the gloo weight bus between them (publisher here, receiver in the engine's worker process).
Each repeat times: collect (generate + reward + groups), train (one learner step), weight sync
(publish -> receive -> in-place reload; the bus part and the reload part apart), and the probe
(one scoring call on each side), as the controller's sync loop does them.

The learner's torch thread count is the variable: a Ray actor with ``num_cpus`` < 2 runs with
``OMP_NUM_THREADS=1`` (Ray sets it from the CPUs it reserves: 0.5 -> 1), so the learner actor of
configs/tiny-cpu.yaml trains on one of the machine's two cores; TRL's trainer uses both.

    python -m bench.profile_step [--quick] [--model tiny|qwen05b] [--threads 1,2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

from bench.common import CONFIG, TINY_MODEL, Result, median, qwen05b_model, summary, wait_for_quiet
from bench.runs import Workload, model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="tiny", choices=["tiny", "qwen05b"])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    from rlpost.actors.env_pool import EnvPoolSettings, GroupCollector
    from rlpost.actors.inference import InferenceWorker
    from rlpost.actors.learner import Learner, LearnerSettings
    from rlpost.config import load_config
    from rlpost.service.loop import probe_sequence
    from rlpost.transport.weight_bus import TorchWeightPublisher

    if args.model == "tiny":
        work = (
            Workload(model_path(TINY_MODEL), steps=1)
            if not args.quick
            else Workload(model_path(TINY_MODEL), steps=1, prompts_per_step=4, group_size=4, max_tokens=8)
        )
    else:
        work = Workload(
            model_path(qwen05b_model(args.quick)), steps=1, prompts_per_step=2, group_size=4, max_tokens=8, lr=1e-6
        )
    cfg = load_config(CONFIG, work.rlpost_overrides())
    threads = [int(t) for t in args.threads.split(",")]
    result = Result(
        f"profile_step_{args.model}",
        args.quick,
        {
            "workload": vars(work),
            "threads": threads,
            "repeats": args.repeats,
            "bucket_mb": cfg.weight_sync.bucket_mb,
        },
    )
    wait_for_quiet(args.quick)
    t0 = time.perf_counter()
    worker = InferenceWorker(cfg.model.name_or_path, cfg.rollout.engine, dtype=cfg.model.dtype)
    pool = GroupCollector(EnvPoolSettings.from_job(cfg), 0, worker.client)
    learner = Learner(LearnerSettings.from_job(cfg))
    publisher = TorchWeightPublisher(
        2,
        host="127.0.0.1",
        backend="gloo",
        bucket_mb=cfg.weight_sync.bucket_mb,
        timeout_s=cfg.weight_sync.timeout_s * 5,
    )
    learner.publisher = publisher
    worker.join_bus(dataclasses.asdict(publisher.spec), 1)
    probe = probe_sequence(cfg)
    result.data["startup_s"] = time.perf_counter() - t0
    executor = ThreadPoolExecutor(1)
    try:
        for n in threads:
            torch.set_num_threads(n)
            phases: dict[str, list[float]] = {}
            for r in range(args.repeats + 1):  # the first repeat warms every path up
                times = _one_step(pool, learner, worker, executor, probe, cfg)
                if r:
                    for k, v in times.items():
                        phases.setdefault(k, []).append(v)
            case = {k: summary(v) for k, v in phases.items()}
            result.cases[f"learner torch threads = {n}"] = case
            print(f"  threads {n}: " + ", ".join(f"{k} {median(v):.3f}" for k, v in phases.items()), flush=True)
            result.write()
    finally:
        executor.shutdown()
        publisher.close()
        worker.shutdown()
    if len(threads) > 1:
        a, b = (result.cases[f"learner torch threads = {n}"] for n in threads[:2])
        for k in ("train_s", "step_s"):
            result.ratios[f"{k}: {threads[0]} thread(s) / {threads[1]} threads"] = a[k]["median"] / b[k]["median"]
    result.write()


def _one_step(pool, learner, worker, executor, probe, cfg) -> dict[str, float]:
    t0 = time.perf_counter()
    groups = pool.collect(cfg.trainer.prompts_per_step)
    t1 = time.perf_counter()
    learner.train_step(groups)
    t2 = time.perf_counter()
    receive = executor.submit(worker.update_weights, cfg.weight_sync.timeout_s * 5)
    published = learner.publish()
    info = receive.result()
    t3 = time.perf_counter()
    worker.score([probe], cfg.rollout.temperature)
    learner.score([probe])
    t4 = time.perf_counter()
    return {
        "collect_s": t1 - t0,
        "train_s": t2 - t1,
        "weight_sync_s": t3 - t2,
        "publish_s (bus, learner side)": published["weight_sync_s"],
        "receive_s (bus, worker side)": info["receive_s"],
        "reload_s (vLLM reload_weights)": info["load_s"],
        "probe_s": t4 - t3,
        "step_s": t4 - t0,
    }


if __name__ == "__main__":
    main()
