"""Check the weight bus on a GPU machine: NCCL exactness, timeouts and recovery; prints JSON.

    python scripts/check_nccl_bus.py [--timeout-s 5] [--bucket-mb 16] [--big-mb 256] [--device cpu]

Needs torch with CUDA only (no Ray, no vLLM). The publisher (rank 0) runs in this process on
cuda:0, a receiver (rank 1) in a spawned process on cuda:1. NCCL refuses two ranks of one
communicator on the same GPU ("Duplicate GPU detected"), so with a single GPU the NCCL checks
become a probe that this refusal surfaces as a bounded `WeightSyncError` (no hang), and the
same checks run over gloo with CUDA tensors (the GPU side of bucketing and unflattening).

Checks (each reports ok, seconds and details):
- exact: versions 1..3 of a model-like state dict (fp32 / bf16 / int64, odd shapes, one tensor
  larger than a bucket) arrive bit for bit; plus a bandwidth figure for a `--big-mb` payload.
- stalled_peer: the receiver joins, then never receives; publish raises within timeout + slack,
  the learner process survives (NCCL watchdog does not kill it), and after `reform` the same
  receiver gets the weights again, exact.
- dead_peer: the receiver is killed; publish raises within timeout + slack.
Exit status 0 when every check that ran is ok.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlpost.transport import BusSpec, TorchWeightPublisher, TorchWeightReceiver, WeightSyncError  # noqa: E402

SLACK_S = 5.0


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
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    receiver = TorchWeightReceiver(spec, 1, device=device)
    while True:
        command, arg = commands.get()
        try:
            if command == "receive":
                version, tensors = receiver.receive(60.0)
                replies.put(("ok", version, mismatches(version, tensors, arg)))
            elif command == "connect":
                receiver.connect(120.0)
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
        return self.replies.get(timeout=180) if wait else None

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)


def exchange(publisher: TorchWeightPublisher, peer: Peer, version: int, big_mb: int = 0) -> dict:
    peer.call("receive", big_mb, wait=False)
    stats = publisher.publish(model_weights(version, str(publisher.device), big_mb), version)
    status, got, bad = peer.replies.get(timeout=180)
    return {
        "version": version,
        "ok": status == "ok" and got == version and not bad,
        "reply": [status, got, bad],
        "seconds": round(stats.seconds, 4),
        "bytes": stats.num_bytes,
        "buckets": stats.num_buckets,
    }


def start(args, backend: str, receiver_device: str) -> tuple[TorchWeightPublisher, Peer]:
    publisher = TorchWeightPublisher(
        2, backend=backend, device=args.device, bucket_mb=args.bucket_mb, timeout_s=args.timeout_s
    )
    peer = Peer(publisher.spec, receiver_device)
    peer.call("connect", wait=False)
    publisher.connect(120.0)
    assert peer.replies.get(timeout=180)[0] == "ok"
    return publisher, peer


def expect_failure(publisher: TorchWeightPublisher, version: int, limit_s: float) -> dict:
    start_s = time.monotonic()
    try:
        publisher.publish(model_weights(version, str(publisher.device)), version)
        return {"ok": False, "error": "publish succeeded although the peer was gone"}
    except WeightSyncError as exc:
        elapsed = time.monotonic() - start_s
        return {"ok": elapsed < limit_s, "seconds": round(elapsed, 2), "peers": exc.peers, "error": str(exc)[:300]}


def check_exact(args, backend: str, receiver_device: str) -> dict:
    publisher, peer = start(args, backend, receiver_device)
    try:
        rounds = [exchange(publisher, peer, v) for v in (1, 2, 3)]
        big = exchange(publisher, peer, 4, args.big_mb)
        big["gb_per_s"] = round(big["bytes"] / big["seconds"] / 1e9, 2)
        return {"ok": all(r["ok"] for r in rounds) and big["ok"], "rounds": rounds, "bandwidth": big}
    finally:
        peer.stop()
        publisher.close()


def check_stalled_peer(args, backend: str, receiver_device: str) -> dict:
    publisher, peer = start(args, backend, receiver_device)
    try:
        result = expect_failure(publisher, 1, args.timeout_s + SLACK_S)
        spec = publisher.reform()
        peer.call("reform", spec)
        peer.commands.put(("connect", None))
        publisher.connect(120.0)
        peer.replies.get(timeout=180)
        result["after_reform"] = exchange(publisher, peer, 1)
        result["ok"] = result["ok"] and result["after_reform"]["ok"]
        return result
    finally:
        peer.stop()
        publisher.close()


def check_dead_peer(args, backend: str, receiver_device: str) -> dict:
    publisher, peer = start(args, backend, receiver_device)
    try:
        assert exchange(publisher, peer, 1)["ok"]
        peer.stop()
        return expect_failure(publisher, 2, args.timeout_s + SLACK_S)
    finally:
        publisher.close()


def probe_same_device(args) -> dict:
    """NCCL with both ranks on cuda:0: expected to be refused, in bounded time, without a hang."""
    publisher = TorchWeightPublisher(
        2, backend="nccl", device="cuda:0", bucket_mb=args.bucket_mb, timeout_s=args.timeout_s
    )
    peer = Peer(publisher.spec, "cuda:0")
    start_s = time.monotonic()
    try:
        peer.call("connect", wait=False)
        publisher.connect(60.0)
        peer.replies.get(timeout=180)
        return {"ok": exchange(publisher, peer, 1)["ok"], "refused": False}
    except WeightSyncError as exc:
        elapsed = time.monotonic() - start_s
        return {"ok": elapsed < 60.0 + SLACK_S, "refused": True, "seconds": round(elapsed, 2), "error": str(exc)[:300]}
    finally:
        peer.stop()
        publisher.close()


def run_checks(args) -> dict:
    checks = {"exact": check_exact, "stalled_peer": check_stalled_peer, "dead_peer": check_dead_peer}
    results = {}
    if args.device == "cpu":
        results["nccl_skipped"] = "--device cpu: smoke test of this script over gloo only"
    elif torch.cuda.device_count() >= 2:
        for name, check in checks.items():
            results[f"nccl_{name}"] = guarded(check, args, "nccl", "cuda:1")
    else:
        results["nccl_skipped"] = "needs 2 GPUs: NCCL refuses two ranks on one device"
        results["nccl_same_device_probe"] = guarded(probe_same_device, args)
    for name, check in checks.items():
        results[f"gloo_{args.device.split(':')[0]}_{name}"] = guarded(check, args, "gloo", args.device)
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
