"""Weight sync with the engine's reload: the gloo collectives against same-node shared memory.

One ``InferenceWorker`` (its own vLLM engine, in its own process) and one ``Learner`` of the
Qwen2.5-0.5B-shaped model in this process, joined by rlpost's weight bus exactly as in a run: the
learner publishes (``Learner.publish``) while the worker receives and reloads in place, loading
each bucket as it arrives (``InferenceWorker.update_weights``). The route alternates between the
gloo collectives ("bus", ``weight_sync.shared_memory: false``) and shared memory ("shm", the
default on one node), ``--rounds`` times each; every round starts a fresh publisher, whose first
sync (page faults of fresh buffers, forming the group) is recorded apart from the ``--syncs``
steady ones that follow.

Figures: ``weight_sync_s`` (publish call to the worker's confirmation) and its split on the
worker, ``receive_s`` (waiting for bytes) and ``load_s`` (vLLM's ``reload_weights`` minus the
waiting); ratios shm over bus of the steady medians.

    python -m bench sync_route [--quick] [-- --rounds 3 --syncs 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor

from bench.common import CONFIG, TINY_MODEL, Result, median, qwen05b_model, summary, wait_for_quiet
from bench.runs import Workload, model_path

ROUTES = ("bus", "shm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--syncs", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from rlpost.actors.inference import InferenceWorker
    from rlpost.actors.learner import Learner, LearnerSettings
    from rlpost.config import load_config
    from rlpost.transport.weight_bus import TorchWeightPublisher

    path = TINY_MODEL if args.quick else qwen05b_model(False)
    work = Workload(model_path(path), steps=1, prompts_per_step=2, group_size=4, max_tokens=8, lr=1e-6)
    cfg = load_config(CONFIG, work.rlpost_overrides())
    rounds, syncs = (1, 1) if args.quick else (args.rounds, args.syncs)
    result = Result("sync_route", args.quick, {"model": path.name, "engine": cfg.rollout.engine.model_dump(),
                                               "bucket_mb": cfg.weight_sync.bucket_mb, "rounds": rounds,
                                               "syncs_per_round": syncs})  # fmt: skip
    worker = InferenceWorker(cfg.model.name_or_path, cfg.rollout.engine, dtype=cfg.model.dtype)
    learner = Learner(LearnerSettings.from_job(cfg))
    pool = ThreadPoolExecutor(1)
    records: dict[str, dict[str, list[float]]] = {
        route: {k: [] for k in ("first_sync_s", "weight_sync_s", "receive_s", "load_s")} for route in ROUTES
    }
    try:
        for _ in range(rounds):
            for route in ROUTES:
                wait_for_quiet(args.quick)
                publisher = TorchWeightPublisher(
                    2, host="127.0.0.1", backend="gloo", bucket_mb=cfg.weight_sync.bucket_mb,
                    timeout_s=cfg.weight_sync.timeout_s * 5, shared_memory=route == "shm",
                )  # fmt: skip
                learner.publisher = publisher
                worker.join_bus(dataclasses.asdict(publisher.spec), 1)
                for index in range(syncs + 1):
                    learner._version += 1  # a new version each time, as after a training step
                    start = time.perf_counter()
                    receiving = pool.submit(worker.update_weights, cfg.weight_sync.timeout_s * 5)
                    learner.publish()
                    info = receiving.result()
                    seconds = time.perf_counter() - start
                    rec = records[route]
                    if index == 0:
                        rec["first_sync_s"].append(seconds)
                    else:
                        rec["weight_sync_s"].append(seconds)
                        rec["receive_s"].append(info["receive_s"])
                        rec["load_s"].append(info["load_s"])
                    print(f"  {route}: sync {index}: {seconds:.2f} s (worker: receive {info['receive_s']:.2f} s, "
                          f"load {info['load_s']:.2f} s)", flush=True)  # fmt: skip
                if route == "shm":
                    assert publisher.shared_memory_ranks == [1], "the worker did not take shared memory"
                publisher.close()
    finally:
        worker.shutdown()
        pool.shutdown()
    for route in ROUTES:
        result.cases[route] = {k: summary(v) for k, v in records[route].items()}
    bus, shm = records["bus"], records["shm"]
    result.ratios["steady weight_sync_s, shm / bus"] = round(
        median(shm["weight_sync_s"]) / median(bus["weight_sync_s"]), 3
    )
    result.ratios["steady worker load_s, shm / bus"] = round(median(shm["load_s"]) / median(bus["load_s"]), 3)
    result.ratios["steady weight_sync_s, shm (s)"] = round(median(shm["weight_sync_s"]), 3)
    result.ratios["steady weight_sync_s, bus (s)"] = round(median(bus["weight_sync_s"]), 3)
    result.note("on 2 cores the gloo transfer's copies compete with the reload's repacking for the same cores; "
                "shared memory leaves the publisher one copy into the segment")  # fmt: skip
    result.write()


if __name__ == "__main__":
    main()
