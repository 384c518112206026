"""Check a sharded learner group on a machine with GPUs: FSDP2 over NCCL, mixed precision, and
publishing the gathered weights on the weight bus; prints JSON.

    python scripts/gpu_learner_group_check.py [--ranks 2] [--hidden 1024] [--layers 8] [--device cpu]

Needs torch only (no Ray, vLLM or transformers): the model is a small pure-torch decoder (token
embedding, pre-norm attention + MLP blocks, LM head) sharded with rlpost's own ``shard_model``.
Each rank is a spawned process on its own GPU (``cuda:<rank>``); NCCL refuses two ranks on one
GPU, so with fewer GPUs than ``--ranks`` the group runs over gloo with CPU tensors and says so.

Checks (each reports ok and its figures):
- same_step: ``--ranks`` ranks, each on its share of a fixed batch with the loss divided by the
  whole batch's token count and gradients summed, take the same 3 AdamW steps as one unsharded
  fp32 model on the whole batch: losses and weights within ``--tolerance`` (fp32), or the
  bf16 figures reported (parameters in bf16, reductions and master weights fp32).
- memory: each rank's bytes of parameters + gradients + AdamW state against the unsharded
  model's (the target with 2 ranks is <= 0.6x), and its peak GPU memory.
- publish: rank 0 streams the gathered weights on the bus (NCCL when a GPU is left for the
  receiver, else gloo) while every rank gathers with it; the receiver's tensors equal the
  group's weights bit for bit.
Exit status 0 when every check is ok.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlpost.actors import sharding  # noqa: E402
from rlpost.transport import BusSpec, StreamedTensors, TorchWeightPublisher, TorchWeightReceiver  # noqa: E402


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyDecoder(nn.Module):
    _no_split_modules = ["Block"]  # what shard_model wraps one by one (as transformers models name it)

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def nll_sum(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1]).float()
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")


def train(model, ids, tokens_total, steps, lr, sharded):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = nll_sum(model, ids) / tokens_total if ids.shape[0] else None
        if loss is not None:
            loss.backward()
        value = float(loss.detach()) if loss is not None else 0.0
        if sharded:
            value = sharding.all_reduce_scalar(value, "sum")
        sharding.full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the gradients' memory counted
        losses.append(value)
    return optimizer, losses


def to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """Tensors as bytes for a queue (a tensor sent as is lives in its sender's shared memory,
    gone once that process ends)."""
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(data), weights_only=True)


def rank_main(rank: int, args, store_port: int, bus_spec: BusSpec | None, results) -> None:
    on_gpu = args.device == "cuda"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    spec = sharding.GroupSpec("127.0.0.1", store_port, args.ranks, "nccl" if on_gpu else "gloo", args.timeout_s)
    sharding.join_group(spec, rank)
    torch.manual_seed(0)
    cfg = dict(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads)
    model = TinyDecoder(**cfg).to(device)
    reference = TinyDecoder(**cfg).to(device) if rank == 0 else None
    if reference is not None:
        reference.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    tokens_total = batch.shape[0] * (batch.shape[1] - 1)
    bf16 = args.bf16 and on_gpu
    sharding.shard_model(model, param_dtype=torch.bfloat16 if bf16 else None)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    optimizer, losses = train(model, batch[rank :: args.ranks], tokens_total, 3, args.lr, sharded=True)
    out = {"rank": rank, "losses": losses, "state_bytes": sharding.local_state_bytes(model, optimizer)}
    if on_gpu:
        out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    gathered = {n: sharding.full_tensor(t.detach()).float().cpu() for n, t in model.state_dict().items()}
    if rank == 0:
        ref_optimizer, ref_losses = train(reference, batch, tokens_total, 3, args.lr, sharded=False)
        out["reference_losses"] = ref_losses
        out["reference_state_bytes"] = sharding.local_state_bytes(reference, ref_optimizer)
        ref = {n: t.detach().float().cpu() for n, t in reference.state_dict().items()}
        out["max_weight_diff"] = max(float((gathered[n] - ref[n]).abs().max()) for n in ref)
    # publish: every rank gathers tensor by tensor as rank 0's bus fills each bucket
    specs = tuple((n, torch.bfloat16, tuple(t.shape)) for n, t in model.state_dict().items())

    def produce():
        for name, tensor in model.state_dict().items():
            yield name, sharding.full_tensor(tensor.detach()).to(torch.bfloat16)

    if rank == 0 and bus_spec is not None:
        publisher = TorchWeightPublisher(bus_spec.world_size, host=bus_spec.host, port=bus_spec.port,
                                         backend=bus_spec.backend, device=device, bucket_mb=16,
                                         timeout_s=args.timeout_s)  # fmt: skip
        results.put(("bus", publisher.spec))
        publisher.connect(120)
        start = time.perf_counter()
        stats = publisher.publish(StreamedTensors(specs, produce), 1)
        out["publish_s"], out["publish_bytes"] = time.perf_counter() - start, stats.num_bytes
        out["published"] = to_bytes({n: t.to(torch.bfloat16) for n, t in gathered.items()})
        publisher.close()
    else:
        for _ in produce():
            pass
    results.put(("rank", out))
    sharding.leave_group()


def receiver_main(args, results_in, results_out) -> None:
    _, spec = results_in.get(timeout=300)
    device = f"cuda:{args.ranks}" if spec.backend == "nccl" else "cpu"
    receiver = TorchWeightReceiver(spec, 1, device=device)
    receiver.connect(120)
    update = receiver.receive(120)
    results_out.put(("received", to_bytes({n: t.cpu() for n, t in update.tensors.items()})))
    receiver.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    # AdamW's step is lr * g / (|g| + eps): summation-order noise in a near-zero gradient moves a
    # weight by up to ~lr / 10 (measured on CPU: 2.4e-5 at lr 1e-3, 2.3e-6 at 1e-4), so the
    # default lr keeps that under the 1e-5 tolerance
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters in compute (GPU only)")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args()
    notes = []
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        notes.append(f"{torch.cuda.device_count()} GPU(s) for {args.ranks} ranks: the group runs over gloo on CPU")
        args.device = "cpu"
    ctx = mp.get_context("spawn")
    store = torch.distributed.TCPStore("127.0.0.1", 0, args.ranks + 1, is_master=True, wait_for_workers=False)
    gpus_left = torch.cuda.device_count() - args.ranks if args.device == "cuda" else 0
    bus_backend = "nccl" if gpus_left >= 1 else "gloo"
    if args.device == "cuda" and bus_backend == "gloo":
        notes.append("no GPU left for the bus receiver: the bus check runs over gloo")
    bus_spec = BusSpec("127.0.0.1", 0, 2, backend=bus_backend, timeout_s=args.timeout_s)
    results, bus_specs = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args, store.port, bus_spec, results)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    received, ranks = None, {}
    receiver = None
    deadline = time.monotonic() + 600
    while len(ranks) < args.ranks or received is None:
        kind, value = results.get(timeout=max(1.0, deadline - time.monotonic()))
        if kind == "bus":
            bus_specs.put((kind, value))
            receiver = ctx.Process(target=receiver_main, args=(args, bus_specs, results))
            receiver.start()
        elif kind == "received":
            received = from_bytes(value)
        else:
            ranks[value["rank"]] = value
    for proc in [*procs, receiver]:
        proc.join(60)
    zero = ranks[0]
    loss_diff = max(abs(a - b) for a, b in zip(zero["losses"], zero["reference_losses"]))
    fp32 = args.device == "cpu" or not args.bf16
    same_step = {
        "ok": (loss_diff <= args.tolerance * max(1.0, abs(zero["reference_losses"][0])) and
               zero["max_weight_diff"] <= args.tolerance) if fp32 else math.isfinite(loss_diff),  # fmt: skip
        "losses": zero["losses"], "reference_losses": zero["reference_losses"],
        "max_loss_diff": loss_diff, "max_weight_diff": zero["max_weight_diff"], "precision": "fp32" if fp32 else "bf16",
    }  # fmt: skip
    ratios = [ranks[r]["state_bytes"] / zero["reference_state_bytes"] for r in sorted(ranks)]
    memory = {"ok": max(ratios) <= (0.6 if args.ranks == 2 else 1.2 / args.ranks), "state_bytes_vs_one_rank": ratios,
              "peak_gpu_bytes": [ranks[r].get("peak_gpu_bytes") for r in sorted(ranks)]}  # fmt: skip
    published = from_bytes(zero["published"])
    publish = {
        "ok": set(received) == set(published) and all(torch.equal(received[n], published[n]) for n in published),
        "backend": bus_backend, "seconds": zero["publish_s"], "bytes": zero["publish_bytes"],
    }  # fmt: skip
    report = {"device": args.device, "ranks": args.ranks, "notes": notes,
              "checks": {"same_step": same_step, "memory": memory, "publish": publish}}  # fmt: skip
    print(json.dumps(report, indent=2))
    return 0 if all(c["ok"] for c in report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
