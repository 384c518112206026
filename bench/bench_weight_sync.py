"""Weight sync: publish the Qwen2.5-0.5B-shaped model to 1 and 2 receivers on this node, over the
gloo collectives ("bus") and through shared memory ("shm", ``weight_sync.shared_memory``).

The publisher is rlpost's ``TorchWeightPublisher`` in this process, holding the model's
``state_dict()`` exactly as the learner publishes it (``Learner.named_parameters_for_sync``:
float32, the tied ``lm_head.weight`` sent too, so 2.5 GB of payload for 2.0 GB of parameters).
Each receiver is a ``TorchWeightReceiver`` in a process of its own, as in an inference worker,
receiving as the worker does (``receive_streamed``: each bucket's tensors handed over as they
arrive) without the vLLM reload (that part is in the e2e runs' ``weight_sync_s``). The sweep
covers the bucket size; every point is the median of ``--repeats`` publishes after one warm-up
publish (the first one also forms the group).

The floor: a plain in-memory copy of the same tensors into preallocated buffers in this process
(``Tensor.copy_``), the least any transfer of these bytes can cost on this machine. Ratios are
bus GB/s over floor GB/s. GB/s counts the payload once (not once per receiver).

    python -m bench bench_weight_sync [--quick] [--buckets 16,64,256,1024] [--workers 1,2] [--routes bus,shm]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

from bench.common import TINY_MODEL, Result, median, qwen05b_model, summary, wait_for_quiet

RECEIVE_TIMEOUT_S = 300.0


def _receiver_main(conn) -> None:
    """A receiver process: joins the bus it is told to and reports each receive's seconds."""
    from rlpost.transport.weight_bus import BusSpec, TorchWeightReceiver

    receiver = None
    while True:
        cmd, *args = conn.recv()
        if cmd == "join":
            spec, rank = args
            receiver = TorchWeightReceiver(BusSpec(**spec), rank)
            conn.send("ok")
        elif cmd == "receive":
            times = []
            for _ in range(args[0]):
                t0 = time.perf_counter()
                receiver.receive_streamed(_take_all, RECEIVE_TIMEOUT_S)
                times.append(time.perf_counter() - t0)
            conn.send(times)
        elif cmd == "leave":
            receiver.close()
            receiver = None
            conn.send("ok")
        else:
            conn.send("bye")
            return


def _take_all(version, tensors) -> None:
    """What the worker's loader does with each arriving tensor, minus the engine's copy."""
    for _ in tensors:
        pass


def _state_dict(model_dir):
    """The learner's published tensors: state_dict() names (lm_head.weight included), float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    named = [(k, v.detach().contiguous()) for k, v in model.state_dict().items()]
    return named, sum(v.numel() * v.element_size() for _, v in named)


def _floor(named, repeats: int) -> list[float]:
    """Seconds to copy every tensor into a preallocated buffer of its own (median of repeats)."""
    import torch

    dst = [torch.empty_like(v) for _, v in named]
    for d, (_, v) in zip(dst, named):  # first touch of the pages, outside the timing
        d.copy_(v)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for d, (_, v) in zip(dst, named):
            d.copy_(v)
        times.append(time.perf_counter() - t0)
    return times


def _sweep_point(named, conns, bucket_mb: int, repeats: int, route: str) -> tuple[list[float], list[list[float]], int]:
    """Publish ``repeats + 1`` versions with one bucket size; returns publish seconds (warm-up
    dropped), each receiver's receive seconds, and the number of buckets."""
    import dataclasses

    from rlpost.transport.weight_bus import TorchWeightPublisher

    publisher = TorchWeightPublisher(
        len(conns) + 1, host="127.0.0.1", backend="gloo", bucket_mb=bucket_mb, timeout_s=RECEIVE_TIMEOUT_S,
        shared_memory=route == "shm",
    )  # fmt: skip
    try:
        spec = dataclasses.asdict(publisher.spec)
        for rank, conn in enumerate(conns, start=1):
            conn.send(("join", spec, rank))
        assert all(conn.recv() == "ok" for conn in conns)
        for conn in conns:
            conn.send(("receive", repeats + 1))
        publisher.connect(RECEIVE_TIMEOUT_S)
        expected = list(range(1, len(conns) + 1)) if route == "shm" else []
        assert publisher.shared_memory_ranks == expected, publisher.shared_memory_ranks
        seconds, buckets = [], 0
        for version in range(repeats + 1):
            stats = publisher.publish(named, version)
            seconds.append(stats.seconds)
            buckets = stats.num_buckets
        received = [conn.recv()[1:] for conn in conns]
        for conn in conns:
            conn.send(("leave",))
        assert all(conn.recv() == "ok" for conn in conns)
    finally:
        publisher.close()
    return seconds[1:], received, buckets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: the tiny model, small sweep")
    parser.add_argument("--buckets", default=None, help="bucket sizes in MB, comma-separated")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--routes", default="bus,shm")
    args = parser.parse_args()
    routes = args.routes.split(",")
    buckets = [int(b) for b in (args.buckets or ("1,4" if args.quick else "16,64,256,1024")).split(",")]
    workers = [int(w) for w in args.workers.split(",")]
    import torch

    model_dir = TINY_MODEL if args.quick else qwen05b_model(quick=False)
    named, num_bytes = _state_dict(model_dir)
    result = Result(
        "weight_sync",
        args.quick,
        {
            "model": str(model_dir.name),
            "payload_bytes": num_bytes,
            "num_tensors": len(named),
            "bucket_mb": buckets,
            "workers": workers,
            "repeats": args.repeats,
            "routes": {"bus": "gloo collectives over loopback", "shm": "shared memory (memfd)"},
            "publisher_torch_threads": torch.get_num_threads(),
        },
    )
    gb = num_bytes / 1e9
    print(f"payload {gb:.2f} GB in {len(named)} tensors", flush=True)
    wait_for_quiet(args.quick)
    floor = _floor(named, args.repeats)
    result.cases["floor: in-memory copy"] = {"seconds": summary(floor), "gb_per_s": gb / median(floor)}
    print(f"  floor (in-memory copy): {median(floor):.3f} s, {gb / median(floor):.2f} GB/s", flush=True)
    ctx = mp.get_context("spawn")
    for n in workers:
        pipes = [ctx.Pipe() for _ in range(n)]
        procs = [ctx.Process(target=_receiver_main, args=(child,), daemon=True) for _, child in pipes]
        for p in procs:
            p.start()
        conns = [parent for parent, _ in pipes]
        try:
            for route in routes:
                for bucket_mb in buckets:
                    wait_for_quiet(args.quick)
                    seconds, received, num_buckets = _sweep_point(named, conns, bucket_mb, args.repeats, route)
                    s = median(seconds)
                    result.cases[f"{n} receiver(s), {route}, bucket {bucket_mb} MB"] = {
                        "workers": n,
                        "route": route,
                        "bucket_mb": bucket_mb,
                        "num_buckets": num_buckets,
                        "seconds": summary(seconds),
                        "gb_per_s": gb / s,
                        "receiver_seconds": [summary(r) for r in received],
                        "vs_floor": (gb / s) / (gb / median(floor)),
                    }
                    print(
                        f"  {n} receiver(s), {route}, bucket {bucket_mb:5d} MB ({num_buckets:3d} buckets): {s:.3f} s, "
                        f"{gb / s:.2f} GB/s ({(gb / s) / (gb / median(floor)):.2f} of the floor)",
                        flush=True,
                    )
                    result.write()
        finally:
            for conn in conns:
                conn.send(("exit",))
            for p in procs:
                p.join(timeout=30)
    for n in workers:
        for route in routes:
            case = min(
                (c for c in result.cases.values() if c.get("workers") == n and c.get("route") == route),
                key=lambda c: c["seconds"]["median"],
            )
            name = f"{n} receiver(s), {route}"
            result.ratios[f"{name}: best GB/s / floor GB/s (bucket {case['bucket_mb']} MB)"] = case["vs_floor"]
            result.ratios[f"{name}: best publish seconds"] = case["seconds"]["median"]
    result.write()


if __name__ == "__main__":
    main()
