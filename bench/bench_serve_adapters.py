"""The service trainer's memory per client model, and what parking a model out of the trainer costs.

``rlpost serve``'s trainer (:class:`rlpost.actors.adapters.AdapterTrainer`, in this process) holds
one base model and, per client model, a LoRA adapter, its gradient and AdamW's two moments; past
``adapters.trainer_resident`` models the least recently used are parked in host memory, past
``adapters.trainer_in_memory`` written to files. For each model shape (the Qwen2.5-0.5B-shaped
one with random weights, 2 layers in quick mode; the tiny one):

- bytes per resident model (``--models`` models, each created and stepped once, so that its AdamW
  state exists): its tensors' bytes (``AdapterTrainer.memory_bytes``) and the process's RSS growth,
  against the formula ``3 x rank x (inputs + outputs) x 4 bytes`` summed over the adapted layers
  (the adapter and two AdamW moments in fp32; a gradient pending adds a fourth copy);
- bytes per parked model, in host memory and in a file, with the trainer bounded to one resident
  model;
- a step (forward_backward + optim_step of one 64-token sequence) of a model that must first come
  back from host memory, or from a file, over the same step of a resident model (medians of
  ``--repeats``).

    python -m bench serve_adapters [--quick] [-- --models 16 --rank 32]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from bench.common import TINY_MODEL, Result, median, qwen05b_model, wait_for_quiet


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def formula_bytes(trainer, spec) -> int:
    """3 fp32 copies (the adapter and AdamW's two moments, after a step) of every adapted layer's
    A and B: rank x (inputs + outputs) each; a gradient pending adds a fourth."""
    total = 0
    for name, module in trainer._base.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in trainer.layers_for(spec):
            total += spec.rank * (module.in_features + module.out_features)
    return 3 * total * 4


def step(trainer, model_id, datum, adam) -> float:
    start = time.perf_counter()
    trainer.forward_backward(model_id, [datum], "cross_entropy")
    trainer.optim_step(model_id, adam)
    return time.perf_counter() - start


def measure(path, models: int, rank: int, repeats: int) -> dict:
    """The three placements in turn, in this process: the resident one first, on a fresh heap, so
    that its RSS growth is the allocations' (the later ones reuse what it freed)."""
    from rlpost.actors.adapters import AdamParams, AdapterSpec, AdapterTrainer, Datum

    tokens = list(range(10, 75))
    datum = Datum(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]), "weights": torch.ones(len(tokens) - 1)})
    adam = AdamParams(learning_rate=1e-4)
    spec = AdapterSpec(rank=rank, seed=0)
    case: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-parked-") as spill:
        for kind, bounds in (("resident", {}), ("parked in memory", {"max_resident": 1}),
                             ("parked on disk", {"max_resident": 1, "max_parked_in_memory": 1})):  # fmt: skip
            trainer = AdapterTrainer(str(path), max_rank=max(64, rank), spill_dir=spill, **bounds)
            if kind == "resident":  # the bare base's layers (peft wraps them once an adapter exists)
                case["formula bytes per model"] = formula_bytes(trainer, spec)
            trainer.create("warm", spec)  # the first adapter wraps the model in peft: not a model's cost
            step(trainer, "warm", datum, adam)
            before = rss_bytes()
            for i in range(models):
                trainer.create(f"model{i}", spec)
                step(trainer, f"model{i}", datum, adam)
            memory = trainer.memory() | {f"{where}_bytes": n for where, n in trainer.memory_bytes().items()}
            case[f"{kind}: memory()"] = memory
            if kind == "resident":
                case["resident: RSS growth per model"] = (rss_bytes() - before) / models
                case["resident: bytes per model"] = memory["resident_bytes"] / memory["resident"]
                case["resident step s"] = [step(trainer, "model0", datum, adam) for _ in range(repeats)]
            else:  # each step first brings back the least recently used model, parking another
                case[f"{kind}: step s"] = [step(trainer, f"model{i % models}", datum, adam) for i in range(repeats)]
            del trainer
    parked, spilled = case["parked in memory: memory()"], case["parked on disk: memory()"]
    case["parked in memory: bytes per model"] = parked["in_memory_bytes"] / parked["in_memory"]
    case["parked on disk: file bytes per model"] = spilled["on_disk_bytes"] / spilled["on_disk"]
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--shapes", default="tiny,qwen05b")  # the small first: its RSS growth is on a fresh heap
    parser.add_argument("--models", type=int, default=16)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    models, repeats = (3, 3) if args.quick else (args.models, args.repeats)
    result = Result("serve_adapters", args.quick, {
        "models": models, "rank": args.rank, "repeats": repeats, "dtype": "float32",
        "step": "forward_backward (cross_entropy) + optim_step of one 64-token sequence",
        "lora": "attention and MLP projections, alpha 32", "threads": torch.get_num_threads()})  # fmt: skip
    for shape in args.shapes.split(","):
        path = TINY_MODEL if shape == "tiny" else qwen05b_model(args.quick)
        result.cases[shape] = case = {"busy_cores_at_start": wait_for_quiet(args.quick)}
        print(f"  {shape}", flush=True)
        case.update(measure(path, models, args.rank, repeats))
        resident, formula = median(case["resident step s"]), case["formula bytes per model"]
        result.ratios[f"{shape}: formula MB per model"] = round(formula / 2**20, 2)
        result.ratios[f"{shape}: resident tensor bytes per model / formula"] = round(
            case["resident: bytes per model"] / formula, 3
        )
        result.ratios[f"{shape}: resident RSS growth per model / formula"] = round(
            case["resident: RSS growth per model"] / formula, 3
        )
        result.ratios[f"{shape}: parked in memory, bytes per model / resident"] = round(
            case["parked in memory: bytes per model"] / case["resident: bytes per model"], 3
        )
        result.ratios[f"{shape}: on disk, file bytes per model / resident"] = round(
            case["parked on disk: file bytes per model"] / case["resident: bytes per model"], 3
        )
        for kind in ("parked in memory", "parked on disk"):
            result.ratios[f"{shape}: step of a model {kind} / resident"] = round(
                median(case[f"{kind}: step s"]) / resident, 3
            )
    result.note("bytes are the tensors' own (adapter, gradient, AdamW state; a parked one's copy; a file's "
                "size); the RSS growth, of the resident placement only, checks them against what the process holds. "
                "A parked model's step includes parking the least recently used resident one.")  # fmt: skip
    result.write()


if __name__ == "__main__":
    main()
