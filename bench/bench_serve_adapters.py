"""The service trainer's memory per client model, and what parking a model out of the trainer costs.

``rlpost serve``'s trainer (:class:`rlpost.actors.adapters.AdapterTrainer`, in this process) holds
one base model and, per client model, a LoRA adapter, its gradient and AdamW's two moments; past
``adapters.trainer_resident`` models the least recently used are parked in host memory, past
``adapters.trainer_in_memory`` written to files. For each model shape (the Qwen2.5-0.5B-shaped
one with random weights, 2 layers in quick mode; the tiny one):

- bytes per resident model: the process's resident memory (RSS) grown by ``--models`` models, each
  created and stepped once (so its gradient and AdamW state exist), over their count; against the
  formula ``4 x rank x (inputs + outputs) x 4 bytes`` summed over the adapted layers;
- bytes per parked model: the same with the trainer bounded to one resident model;
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
    """4 fp32 copies (parameters, gradient, two AdamW moments) of every adapted layer's A and B."""
    total = 0
    for name, module in trainer._base.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in trainer.layers_for(spec):
            total += spec.rank * (module.in_features + module.out_features)
    return 4 * total * 4


def step(trainer, model_id, datum, adam) -> float:
    start = time.perf_counter()
    trainer.forward_backward(model_id, [datum], "cross_entropy")
    trainer.optim_step(model_id, adam)
    return time.perf_counter() - start


def measure(path, models: int, rank: int, repeats: int) -> dict:
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
            trainer.create("warm", spec)  # the first adapter wraps the model in peft: not a model's cost
            step(trainer, "warm", datum, adam)
            before = rss_bytes()
            for i in range(models):
                trainer.create(f"m{i}", spec)
                step(trainer, f"m{i}", datum, adam)
            case[f"{kind}: bytes per model"] = (rss_bytes() - before) / models
            if kind == "resident":
                case["formula bytes per model"] = formula_bytes(trainer, spec)
                case["resident step s"] = [step(trainer, "m0", datum, adam) for _ in range(repeats)]
            else:  # each step first brings back the least recently used model, parking another
                case[f"{kind}: step s"] = [step(trainer, f"m{i % models}", datum, adam) for i in range(repeats)]
            case[f"{kind}: memory()"] = trainer.memory()
            del trainer
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--shapes", default="qwen05b,tiny")
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
        resident = median(case["resident step s"])
        result.ratios[f"{shape}: resident bytes per model / formula"] = round(
            case["resident: bytes per model"] / case["formula bytes per model"], 3
        )
        result.ratios[f"{shape}: formula MB per model"] = round(case["formula bytes per model"] / 2**20, 2)
        result.ratios[f"{shape}: parked-in-memory bytes per model / resident"] = round(
            case["parked in memory: bytes per model"] / case["resident: bytes per model"], 3
        )
        result.ratios[f"{shape}: parked-on-disk bytes per model / resident"] = round(
            case["parked on disk: bytes per model"] / case["resident: bytes per model"], 3
        )
        for kind in ("parked in memory", "parked on disk"):
            result.ratios[f"{shape}: step of a model {kind} / resident"] = round(
                median(case[f"{kind}: step s"]) / resident, 3
            )
    result.note("a parked model's step includes parking the least recently used resident one; RSS counts what "
                "the allocator keeps, so a freed adapter's memory may stay counted (the parked-on-disk figure is then "
                "an upper bound)")  # fmt: skip
    result.write()


if __name__ == "__main__":
    main()
