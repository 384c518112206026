"""Check the weight bus on a GPU machine: NCCL exactness, timeouts and recovery, and the CUDA IPC
route to a receiver on the publisher's GPU; prints JSON.

    python scripts/check_nccl_bus.py [--timeout-s 5] [--bucket-mb 16] [--big-mb 256] [--device cpu]
        [--ipc-buckets 64,256,1024] [--ipc-models qwen05b-fp32,qwen7b-bf16] [--repeats 3] [--only ipc_]

Needs torch with CUDA only (no Ray, no vLLM). The publisher (rank 0) runs in this process on
cuda:0, a receiver (rank 1) in a spawned process on cuda:1. NCCL refuses two ranks of one
communicator on the same GPU ("Duplicate GPU detected") before 2.28 or so, so with a single GPU
a probe first tries that: where NCCL refuses, the refusal must surface as a bounded
`WeightSyncError` (no hang); where it runs, the NCCL checks run with both ranks on cuda:0. The
same checks also run over gloo with CUDA tensors (the GPU side of bucketing and unflattening).

Checks (each reports ok, seconds and details):
- exact: versions 1..3 of a model-like state dict (fp32 / bf16 / int64, odd shapes, one tensor
  larger than a bucket) arrive bit for bit; plus a bandwidth figure for a `--big-mb` payload.
- stalled_peer: the receiver joins, then never receives; publish raises within timeout + slack,
  the learner process survives (NCCL watchdog does not kill it), and after `reform` the same
  receiver gets the weights again, exact.
- dead_peer: the receiver is killed; publish raises within timeout + slack.
- streamed: versions published as ``StreamedTensors`` (a sharded learner's way) arrive exact.
- ipc_*: the same three with the receiver process on the publisher's GPU, which must take the
  CUDA IPC route (``shared_memory``: it maps the publisher's bucket memory, no collective);
  ipc_same_process_stays_on_bus: a receiver in the publisher's process falls back to the bus;
  ipc_bandwidth_<model>: publish seconds of Qwen2.5-shaped payloads through CUDA IPC against a
  device-to-device copy of the same tensors (the floor), per bucket size.
Exit status 0 when every check that ran is ok.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlpost.transport import (  # noqa: E402
    BusSpec,
    StreamedTensors,
    TorchWeightPublisher,
    TorchWeightReceiver,
    WeightSyncError,
)

SLACK_S = 5.0
WAIT_S = 60.0  # joining, and a reply from the receiver process: a broken check fails, it does not hang


def model_weights(version: int, device: str, big_mb: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    weights = {"embed": torch.randn(5000, 1031, generator=g)}  # ~20 MB fp32: bigger than a bucket
    for i in range(4):
        weights[f"layers.{i}.qkv"] = torch.randn(1031, 3 * 1031 + 1, generator=g).to(torch.bfloat16)
        weights[f"layers.{i}.norm"] = torch.randn(1031, generator=g)
        weights[f"layers.{i}.down"] = torch.randn(777, 1031, generator=g).to(torch.bfloat16).t()
    weights["position_ids"] = torch.arange(4097) * version
    if big_mb:
        weights["big"] = torch.full((big_mb * 2**18,), float(version))
    return {name: t.to(device) for name, t in weights.items()}


def mismatches(version: int, tensors: dict[str, torch.Tensor], big_mb: int) -> list[str]:
    expected = model_weights(version, "cpu", big_mb)
    if list(tensors) != list(expected):
        return ["<names or order differ>"]
    bad = []
    for name, want in expected.items():
        got = tensors[name].cpu()
        same = got.dtype == want.dtype and got.shape == want.shape
        if not (
            same
            and torch.equal(got.contiguous().view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8))
        ):
            bad.append(name)
    return bad


def receiver_main(spec: BusSpec, device: str, commands, replies) -> None:
    logging.basicConfig(level=logging.INFO, format="receiver %(levelname)s %(name)s: %(message)s")
    logging.getLogger("rlpost").setLevel(logging.DEBUG)  # why a receiver stays on the bus
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    receiver = TorchWeightReceiver(spec, 1, device=device)
    loaded: dict[str, torch.Tensor] = {}  # "receive_timed" with copies: the worker's weights

    def load(_: int, tensors) -> None:  # what an engine's loader does: copy each tensor in place
        for name, tensor in tensors:
            if name not in loaded:
                loaded[name] = torch.empty_like(tensor)
            loaded[name].copy_(tensor)

    def look(_: int, tensors) -> None:  # the transfer alone: take the views, copy nothing
        for _ in tensors:
            pass

    while True:
        command, arg = commands.get()
        try:
            if command == "receive":
                version, tensors = receiver.receive(60.0)
                replies.put(("ok", version, mismatches(version, tensors, arg)))
            elif command == "receive_timed":  # arg: (copy into loaded tensors?, how many updates)
                copy, count = arg
                versions = [receiver.receive_streamed(load if copy else look, 60.0) for _ in range(count)]
                replies.put(("ok", versions[-1], []))
            elif command == "connect":
                receiver.connect(WAIT_S)
                replies.put(("ok", None, []))
            elif command == "reform":
                receiver.reform(arg, 1)
                replies.put(("ok", None, []))
            else:
                return
        except WeightSyncError as exc:
            replies.put(("error", exc.version, str(exc)[:500]))


class Peer:
    def __init__(self, spec: BusSpec, device: str):
        ctx = mp.get_context("spawn")
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=receiver_main, args=(spec, device, self.commands, self.replies), daemon=True)
        self.process.start()

    def call(self, command: str, arg=None, wait: bool = True):
        self.commands.put((command, arg))
        return self.replies.get(timeout=WAIT_S + SLACK_S) if wait else None

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)


def exchange(publisher: TorchWeightPublisher, peer: Peer, version: int, big_mb: int = 0) -> dict:
    peer.call("receive", big_mb, wait=False)
    stats = publisher.publish(model_weights(version, str(publisher.device), big_mb), version)
    status, got, bad = peer.replies.get(timeout=WAIT_S + SLACK_S)
    return {
        "version": version,
        "ok": status == "ok" and got == version and not bad,
        "reply": [status, got, bad],
        "seconds": round(stats.seconds, 4),
        "bytes": stats.num_bytes,
        "buckets": stats.num_buckets,
    }


def start(args, backend: str, receiver_device: str, route: str = "bus",
          bucket_mb: float | None = None) -> tuple[TorchWeightPublisher, Peer]:  # fmt: skip
    """A publisher on ``args.device`` and one receiver process; ``route``: "bus" (collectives)
    or "ipc" (the receiver maps the publisher's GPU memory, ``shared_memory``)."""
    publisher = TorchWeightPublisher(
        2,
        backend=backend,
        device=args.device,
        bucket_mb=bucket_mb or args.bucket_mb,
        timeout_s=args.timeout_s,
        shared_memory=route == "ipc",
    )
    peer = Peer(publisher.spec, receiver_device)
    peer.call("connect", wait=False)
    publisher.connect(WAIT_S)
    assert peer.replies.get(timeout=WAIT_S + SLACK_S)[0] == "ok"
    expected = [1] if route == "ipc" else []
    if publisher.shared_memory_ranks != expected:
        peer.stop()
        publisher.close()
        raise AssertionError(f"route {route}: shared-memory ranks {publisher.shared_memory_ranks}, not {expected}")
    return publisher, peer


def expect_failure(publisher: TorchWeightPublisher, version: int, limit_s: float) -> dict:
    start_s = time.monotonic()
    try:
        publisher.publish(model_weights(version, str(publisher.device)), version)
        return {"ok": False, "error": "publish succeeded although the peer was gone"}
    except WeightSyncError as exc:
        elapsed = time.monotonic() - start_s
        return {"ok": elapsed < limit_s, "seconds": round(elapsed, 2), "peers": exc.peers, "error": str(exc)[:300]}


def check_exact(args, backend: str, receiver_device: str, route: str = "bus") -> dict:
    publisher, peer = start(args, backend, receiver_device, route)
    try:
        rounds = [exchange(publisher, peer, v) for v in (1, 2, 3)]
        big = exchange(publisher, peer, 4, args.big_mb)
        big["gb_per_s"] = round(big["bytes"] / big["seconds"] / 1e9, 2)
        return {"ok": all(r["ok"] for r in rounds) and big["ok"], "rounds": rounds, "bandwidth": big}
    finally:
        peer.stop()
        publisher.close()


def check_streamed(args, backend: str, receiver_device: str, route: str = "bus") -> dict:
    """Publish as a sharded learner does: ``StreamedTensors`` made while the buckets fill (the
    layout in the tensors' order, each bucket filled from the stream); versions 1..2 exact."""
    publisher, peer = start(args, backend, receiver_device, route)
    try:
        rounds = []
        for version in (1, 2):
            weights = model_weights(version, str(publisher.device))
            specs = tuple((name, t.dtype, tuple(t.shape)) for name, t in weights.items())
            peer.call("receive", 0, wait=False)
            stats = publisher.publish(StreamedTensors(specs, lambda w=weights: iter(w.items())), version)
            status, got, bad = peer.replies.get(timeout=WAIT_S + SLACK_S)
            ok = status == "ok" and got == version and not bad
            rounds.append({"version": version, "ok": ok, "reply": [status, got, bad], "buckets": stats.num_buckets})
        return {"ok": all(r["ok"] for r in rounds), "rounds": rounds}
    finally:
        peer.stop()
        publisher.close()


def check_stalled_peer(args, backend: str, receiver_device: str, route: str = "bus") -> dict:
    publisher, peer = start(args, backend, receiver_device, route)
    try:
        result = expect_failure(publisher, 1, args.timeout_s + SLACK_S)
        spec = publisher.reform()
        peer.call("reform", spec)
        peer.commands.put(("connect", None))
        publisher.connect(WAIT_S)
        peer.replies.get(timeout=WAIT_S + SLACK_S)
        result["after_reform"] = exchange(publisher, peer, 1)
        result["ok"] = result["ok"] and result["after_reform"]["ok"]
        return result
    finally:
        peer.stop()
        publisher.close()


def check_dead_peer(args, backend: str, receiver_device: str, route: str = "bus") -> dict:
    publisher, peer = start(args, backend, receiver_device, route)
    try:
        assert exchange(publisher, peer, 1)["ok"]
        peer.stop()
        return expect_failure(publisher, 2, args.timeout_s + SLACK_S)
    finally:
        publisher.close()


# Qwen2.5 shapes: hidden, intermediate, key/value width, vocabulary, layers, the dtype published
SHAPES = {
    "qwen05b-fp32": (896, 4864, 128, 151936, 24, torch.float32),  # 2.52 GB, as bench weight_sync
    "qwen7b-bf16": (3584, 18944, 512, 152064, 28, torch.bfloat16),  # 15.2 GB, a GPU learner's usual
}


def model_shaped(model: str, device: str) -> dict[str, torch.Tensor]:
    """A Qwen2.5 model's parameter names and shapes (``SHAPES``), lm_head sent too, as the
    learner publishes them; values are random (only bytes and layout matter here)."""
    hidden, inter, kv, vocab, layers, dtype = SHAPES[model]
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "self_attn.q_proj.weight": (hidden, hidden),
            layer + "self_attn.q_proj.bias": (hidden,),
            layer + "self_attn.k_proj.weight": (kv, hidden),
            layer + "self_attn.k_proj.bias": (kv,),
            layer + "self_attn.v_proj.weight": (kv, hidden),
            layer + "self_attn.v_proj.bias": (kv,),
            layer + "self_attn.o_proj.weight": (hidden, hidden),
            layer + "mlp.gate_proj.weight": (inter, hidden),
            layer + "mlp.up_proj.weight": (inter, hidden),
            layer + "mlp.down_proj.weight": (hidden, inter),
            layer + "input_layernorm.weight": (hidden,),
            layer + "post_attention_layernorm.weight": (hidden,),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return {name: torch.randn(shape, device=device, dtype=dtype) for name, shape in shapes.items()}


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def check_ipc_bandwidth(args, model: str) -> dict:
    """Publish a model's weights (``SHAPES``) to a receiver process on the same GPU through CUDA IPC,
    against the floor: a plain device-to-device copy of the same tensors in this process.
    ``view``: the receiver takes each bucket's views (the transfer alone, as bench
    weight_sync measures the CPU routes); ``load``: it also copies every tensor into weights of
    its own, as an engine's loader does (two copies of the bytes in all)."""
    weights = model_shaped(model, args.device)
    payload = sum(t.numel() * t.element_size() for t in weights.values())
    targets = {name: torch.empty_like(t) for name, t in weights.items()}
    floor = timed(lambda: [targets[n].copy_(t) for n, t in weights.items()], args.repeats + 1)[1:]
    targets.clear()  # free the floor's copy before the publishes
    floor_s = statistics.median(floor)
    result = {"payload_gb": round(payload / 1e9, 3), "floor_s": round(floor_s, 5),
              "floor_gb_per_s": round(payload / floor_s / 1e9, 1), "points": []}  # fmt: skip
    version = 0
    for bucket_mb in args.ipc_buckets:
        publisher, peer = start(args, "nccl", args.device, "ipc", bucket_mb)
        try:
            for copy in (False, True):
                peer.call("receive_timed", (copy, args.repeats + 1), wait=False)
                times = []
                for _ in range(args.repeats + 1):  # the first also grows the segment: warm-up
                    version += 1
                    times.append(publisher.publish(weights, version).seconds)
                status, got, _ = peer.replies.get(timeout=WAIT_S + SLACK_S)
                seconds = statistics.median(times[1:])
                result["points"].append({
                    "bucket_mb": bucket_mb,
                    "receiver": "load" if copy else "view",
                    "ok": status == "ok" and got == version,
                    "publish_s": round(seconds, 5),
                    "gb_per_s": round(payload / seconds / 1e9, 1),
                    "share_of_floor": round(floor_s / seconds, 3),
                    "repeats_s": [round(t, 5) for t in times],
                })  # fmt: skip
        finally:
            peer.stop()
            publisher.close()
    views = [p for p in result["points"] if p["receiver"] == "view"]
    result["best_view_share_of_floor"] = max(p["share_of_floor"] for p in views)
    result["ok"] = all(p["ok"] for p in result["points"])
    return result


def check_same_process_stays_on_bus(args) -> dict:
    """A receiver in the publisher's own process cannot map its CUDA IPC export: it must fall
    back to the collectives (gloo here: NCCL refuses two ranks on one GPU) and get exact bytes."""
    publisher = TorchWeightPublisher(2, backend="gloo", device=args.device, bucket_mb=args.bucket_mb,
                                     timeout_s=args.timeout_s)  # fmt: skip
    receiver = TorchWeightReceiver(publisher.spec, 1, device=args.device)
    joined = threading.Thread(target=receiver.connect, args=(60.0,))
    try:
        joined.start()
        publisher.connect(60.0)
        joined.join(60)
        received: dict = {}
        thread = threading.Thread(target=lambda: received.update(update=receiver.receive(60.0)))
        thread.start()
        publisher.publish(model_weights(1, args.device), 1)
        thread.join(60)
        version, tensors = received["update"]
        bad = mismatches(version, tensors, 0)
        routes = publisher.shared_memory_ranks
        return {"ok": routes == [] and version == 1 and not bad, "shared_memory_ranks": routes, "mismatches": bad}
    finally:
        receiver.close()
        publisher.close()


def probe_same_device(args) -> dict:
    """NCCL with both ranks on cuda:0: expected to be refused, in bounded time, without a hang."""
    publisher = TorchWeightPublisher(
        2, backend="nccl", device="cuda:0", bucket_mb=args.bucket_mb, timeout_s=args.timeout_s, shared_memory=False
    )
    peer = Peer(publisher.spec, "cuda:0")
    start_s = time.monotonic()
    try:
        peer.call("connect", wait=False)
        publisher.connect(60.0)
        peer.replies.get(timeout=WAIT_S + SLACK_S)
        return {"ok": exchange(publisher, peer, 1)["ok"], "refused": False}
    except WeightSyncError as exc:
        elapsed = time.monotonic() - start_s
        return {"ok": elapsed < 60.0 + SLACK_S, "refused": True, "seconds": round(elapsed, 2), "error": str(exc)[:300]}
    finally:
        peer.stop()
        publisher.close()


def run_checks(args) -> dict:
    """Every check that this machine allows (``--only``: those whose names start so), the CUDA
    IPC ones first; each result is also printed to stderr as soon as it is in (a run cut short
    keeps what it had)."""
    checks = {"exact": check_exact, "stalled_peer": check_stalled_peer, "dead_peer": check_dead_peer}
    results = {}

    def run(name: str, check, *check_args) -> dict | None:
        if args.only and not any(name.startswith(prefix) for prefix in args.only):
            return None
        results[name] = guarded(check, *check_args)
        print(f"check {name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
        return results[name]

    if args.device != "cpu":
        for name, check in checks.items():  # a receiver process on the publisher's GPU: CUDA IPC
            run(f"ipc_{name}", check, args, "nccl", args.device, "ipc")
        run("ipc_streamed", check_streamed, args, "nccl", args.device, "ipc")
        run("ipc_same_process_stays_on_bus", check_same_process_stays_on_bus, args)
        for model in args.ipc_models:
            run(f"ipc_bandwidth_{model}", check_ipc_bandwidth, args, model)
    if args.device == "cpu":
        results["nccl_skipped"] = "--device cpu: smoke test of this script over gloo only"
    elif torch.cuda.device_count() >= 2:
        for name, check in checks.items():
            run(f"nccl_{name}", check, args, "nccl", "cuda:1")
    else:
        probe = run("nccl_same_device_probe", probe_same_device, args)
        if probe and probe["ok"] and not probe.get("refused"):  # this NCCL runs two ranks on one GPU
            for name, check in checks.items():
                run(f"nccl_same_gpu_{name}", check, args, "nccl", args.device)
        else:
            results["nccl_skipped"] = "needs 2 GPUs: this NCCL refuses two ranks on one device"
    for name, check in checks.items():
        run(f"gloo_{args.device.split(':')[0]}_{name}", check, args, "gloo", args.device)
    run(f"gloo_{args.device.split(':')[0]}_streamed", check_streamed, args, "gloo", args.device)
    return results


def guarded(check, *args) -> dict:
    start_s = time.monotonic()
    try:
        return check(*args)
    except Exception as exc:  # report every check, whatever one of them does
        return {
            "ok": False,
            "seconds": round(time.monotonic() - start_s, 2),
            "error": f"{type(exc).__name__}: {exc}"[:500],
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--bucket-mb", type=float, default=16.0)
    parser.add_argument("--big-mb", type=int, default=256)
    parser.add_argument(
        "--ipc-buckets",
        type=lambda text: [float(x) for x in text.split(",")],
        default=[64.0, 256.0, 1024.0],
        help="bucket sizes (MB) of the CUDA IPC bandwidth sweep",
    )
    parser.add_argument("--ipc-models", type=lambda text: text.split(","), default=list(SHAPES),
                        help=f"payloads of the CUDA IPC bandwidth check, of {list(SHAPES)}")  # fmt: skip
    parser.add_argument("--only", type=lambda text: text.split(","), default=[],
                        help="run only the checks whose names start with one of these (comma-separated)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="timed publishes per bandwidth point")  # fmt: skip
    parser.add_argument(
        "--device",
        choices=["cuda:0", "cpu"],
        default="cuda:0",
        help="cpu: smoke-test this script without a GPU (gloo checks only)",
    )
    args = parser.parse_args()
    if args.device != "cpu":
        if not torch.cuda.is_available():
            print(json.dumps({"ok": False, "error": "no CUDA device"}))
            return 1
        torch.cuda.set_device(0)
    results = run_checks(args)
    ok = all(r["ok"] for r in results.values() if isinstance(r, dict))
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    nccl = str(torch.cuda.nccl.version()) if gpus else None
    summary = {"ok": ok, "torch": torch.__version__, "nccl": nccl, "gpus": gpus, "checks": results}
    print(json.dumps(summary, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
