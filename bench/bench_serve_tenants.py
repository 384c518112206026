"""K tenants on one ``rlpost serve`` fleet against K separate fleets on the same machine.

Each tenant drives the official tinker SDK as fast as it can for ``--seconds``: a training step
(``forward_backward`` of 4 sequences of 32 tokens, then ``optim_step``), then a sample (4
completions of 16 tokens) from a sampler of its adapter made before the timed window. For K = 1,
2, 4, 8 (1, 2 in quick mode):

- **one fleet**: one trainer and one vLLM engine serve the K tenants (K LoRA adapters on one
  base model), behind one HTTP server;
- **K fleets**: K trainers and K engines, one fleet and one server per tenant (K = 1 is the same
  as one fleet and is not run twice).

Figures (same run): the fleets' resident memory (the actors' processes), tokens/s (trained and
sampled, every tenant together) and the median step latency, one fleet over K fleets; and on one
fleet, the smallest tenant's share of the trainer's and of the engine's busy time, times K (1.0
is an equal share; the target for 4 tenants is each >= 20%, i.e. >= 0.8 here). Actors reserve
no CPU so that K fleets fit: on 2 cores they share them, as K fleets on one machine would.

    python -m bench serve_tenants [--quick] [-- --tenants 1,2,4,8 --seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import threading
import time

from bench.common import TINY_MODEL, Result, wait_for_quiet

PROMPT = list(range(20, 52))  # 32 tokens


def actor_rss(fleets) -> int:
    """Resident bytes of every trainer and engine process of ``fleets`` (their children too)."""
    import psutil
    import ray

    total = 0
    for fleet in fleets:
        for actor in [fleet.trainer, *fleet.inference]:
            pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
            process = psutil.Process(pid)
            total += sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])
    return total


def start_service(cfg, keys, prefix):
    from rlpost.serve.fleet import ServiceFleet
    from rlpost.serve.server import RunningServer

    fleet = ServiceFleet.start(cfg, cfg.base_model, name_prefix=prefix)
    running = RunningServer(cfg, keys, fleet)
    ready = threading.Event()
    thread = threading.Thread(target=lambda: asyncio.run(running.serve(lambda url: ready.set())), daemon=True)
    thread.start()
    assert ready.wait(60), "the HTTP server did not start"
    return fleet, running, thread


def tenant_loop(url: str, key: str, model: str, seconds: float, start: threading.Barrier) -> dict:
    import tinker
    from tinker import types

    datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)})  # fmt: skip
    adam = types.AdamParams(learning_rate=1e-4)
    params = types.SamplingParams(max_tokens=16, temperature=1.0)
    with tinker.ServiceClient(base_url=url, api_key=key) as client:
        training = client.create_lora_training_client(base_model=model, rank=8, seed=0).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        sampler.sample(types.ModelInput.from_ints(PROMPT[:8]), 1, params).result()  # the engine has the adapter
        start.wait()
        steps, trained, sampled, latencies = 0, 0, 0, []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            training.forward_backward([datum] * 4, "cross_entropy").result()
            training.optim_step(adam).result()
            latencies.append(time.perf_counter() - t0)
            trained += 4 * len(datum.model_input.to_ints())
            result = sampler.sample(types.ModelInput.from_ints(PROMPT[:8]), 4, params).result()
            sampled += sum(len(s.tokens) for s in result.sequences)
            steps += 1
    return {"steps": steps, "tokens_trained": trained, "tokens_sampled": sampled, "step_latency_s": latencies}


def drive(services, keys_of, model, seconds) -> dict:
    """Every tenant's loop at once against its service: per-tenant results and the totals."""
    tenants = [(running.url, key) for running, keys in zip(services, keys_of) for key in keys]
    barrier = threading.Barrier(len(tenants) + 1)
    results: list[dict | None] = [None] * len(tenants)

    def one(i, url, key):
        results[i] = tenant_loop(url, key, model, seconds, barrier)

    threads = [threading.Thread(target=one, args=(i, url, key)) for i, (url, key) in enumerate(tenants)]
    for thread in threads:
        thread.start()
    barrier.wait(600)
    t0 = time.perf_counter()
    for thread in threads:
        thread.join(seconds + 600)
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens_trained"] + r["tokens_sampled"] for r in results)
    latencies = [s for r in results for s in r["step_latency_s"]]
    return {"tenants": [{k: v for k, v in r.items() if k != "step_latency_s"} for r in results], "wall_s": wall,
            "tokens_per_s": tokens / wall, "step_latency_median_s": statistics.median(latencies)}  # fmt: skip


def run_case(k: int, separate: bool, seconds: float, model: str) -> dict:
    from rlpost.config import ServeConfig
    from rlpost.serve.access import ApiKeys

    keys = [f"tml-bench-tenant{i}-0123456789" for i in range(k)]
    cfg = ServeConfig(base_model=model, port=0, storage_dir=tempfile.mkdtemp(prefix="bench-serve-"),
                      engine={"max_model_len": 256, "kv_cache_space_gb": 0.25},
                      resources={"trainer": {"num_cpus": 0}, "inference": {"num_cpus": 0}})  # fmt: skip
    groups = [[key] for key in keys] if separate else [keys]
    started = []
    try:
        for g, group in enumerate(groups):
            tenants = ApiKeys({key: f"tenant{keys.index(key)}" for key in group})
            started.append(start_service(cfg, tenants, f"k{k}-{'sep' if separate else 'one'}{g}-"))
        fleets = [fleet for fleet, _, _ in started]
        memory = actor_rss(fleets)
        case = drive([running for _, running, _ in started], groups, cfg.served_name, seconds)
        case["actor_rss_bytes"] = memory
        if not separate:
            service = started[0][1].service
            for actor, turns in (("trainer", service.trainer_turns), ("engine", service.worker_turns[0])):
                held = [turns.held_s.get(f"tenant{i}", 0.0) for i in range(k)]
                case[f"{actor} busy share per tenant"] = [round(h / sum(held), 3) for h in held]
        return case
    finally:
        for fleet, running, thread in started:
            running.stop()
            thread.join(10)
            fleet.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tenants", default="1,2,4,8")
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    import ray

    os.environ["TINKER_TELEMETRY"] = "0"
    counts = [1, 2] if args.quick else [int(k) for k in args.tenants.split(",")]
    seconds = 8.0 if args.quick else args.seconds
    result = Result("serve_tenants", args.quick, {
        "tenants": counts, "seconds": seconds, "model": "tiny", "lora": "rank 8",
        "step": "forward_backward of 4 x 32 tokens + optim_step, then 4 samples of 16 tokens",
        "fleet": "one trainer + one vLLM CPU engine per fleet, actors reserving no CPU"})  # fmt: skip
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="rlpost-bench-serve")
    try:
        for k in counts:
            for separate in [False, True] if k > 1 else [False]:
                name = f"{k} tenants, {f'{k} fleets' if separate else 'one fleet'}"
                busy = wait_for_quiet(args.quick)
                print(f"  {name}", flush=True)
                result.cases[name] = run_case(k, separate, seconds, str(TINY_MODEL))
                result.cases[name]["busy_cores_at_start"] = busy
            if k == 1:
                continue
            one, sep = result.cases[f"{k} tenants, one fleet"], result.cases[f"{k} tenants, {k} fleets"]
            result.ratios[f"{k} tenants: memory, one fleet / {k} fleets"] = round(
                one["actor_rss_bytes"] / sep["actor_rss_bytes"], 3
            )
            result.ratios[f"{k} tenants: tokens/s, one fleet / {k} fleets"] = round(
                one["tokens_per_s"] / sep["tokens_per_s"], 3
            )
            result.ratios[f"{k} tenants: step latency, one fleet / {k} fleets"] = round(
                one["step_latency_median_s"] / sep["step_latency_median_s"], 3
            )
            for actor in ("trainer", "engine"):
                result.ratios[f"{k} tenants on one fleet: smallest {actor} share x {k}"] = round(
                    min(one[f"{actor} busy share per tenant"]) * k, 3
                )
    finally:
        ray.shutdown()
    result.note("memory is the actors' resident bytes (trainers and engines, their children included), not the "
                "HTTP servers in the driver; on 2 CPU cores K fleets share the same cores, so their tokens/s is "
                "what K fleets on one machine get")  # fmt: skip
    result.write()


if __name__ == "__main__":
    main()
