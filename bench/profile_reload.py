"""Where vLLM's CPU weight reload spends its time: the in-place reload of the 0.5B-shaped model.

An inference worker applies a full weight update with vLLM's ``reload_weights`` (the call that
works on the CPU backend): every layer's parameters are re-created, the checkpoint tensors are
loaded into them (q/k/v and gate/up fused on the way) and the layer is processed again for its
kernels (on CPU: the linear weights repacked). This benchmark runs that reload inside the
engine's own worker process (``collective_rpc`` with a function), on tensors already in that
process's memory, so nothing else is timed: ``--repeats`` reloads after a warm-up, then one more
under cProfile, whose functions are grouped into the phases below. rlpost's direct reload
(``rollout.engine.direct_reload``: the linear weights packed straight from the update, the rest
copied in place) is timed the same way on the same tensors, alternating with vLLM's.

The floor: copying the same bytes into preallocated tensors in the same process
(``Tensor.copy_``), the least an update of these weights can cost there.

    python -m bench profile_reload [--quick] [-- --model qwen05b --repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time

from bench.common import TINY_MODEL, Result, median, qwen05b_model, summary, wait_for_quiet

# cProfile functions whose cumulative time makes a phase (a function's name, or file:name)
PHASES = {
    "process_weights_after_loading (kernel repack)": ("process_weights_after_loading",),
    "weight loaders (copy into parameters, fusing)": ("weight_loader", "weight_loader_v2", "default_weight_loader"),
    "materialize layers (allocate parameters)": ("materialize_layer",),
    "restore layers to meta (free)": ("restore_layer_on_meta", "capture_layer_to_meta"),
}
# the same for rlpost's direct reload (rollout.engine.direct_reload)
DIRECT_PHASES = {
    "kernel packs (vLLM's CPU GEMM dispatch)": ("dispatch_cpu_unquantized_gemm",),
    "fused layers' concatenation": ("_fuse",),
    "in-place copies (embeddings, norms, biases)": ("_copy_into",),
}


def _reload_in_worker(self, model_dir: str, repeats: int) -> dict:
    """Run in the vLLM worker process (``self`` is the worker): time ``repeats`` reloads and the
    copy floor, then profile one reload."""
    import cProfile
    import pstats

    import torch
    from safetensors.torch import load_file

    tensors = load_file(f"{model_dir}/model.safetensors")
    if "lm_head.weight" not in tensors:  # tied: rlpost sends the head too (vLLM's CPU copy of it)
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    items = sorted(tensors.items())
    loader = self._rlpost_direct_loader()
    reload_s, direct_s = [], []
    for _ in range(repeats + 1):  # the first one warms up; the two paths alternate
        start = time.perf_counter()
        self.reload_weights(weights_iterator=iter(items))
        reload_s.append(time.perf_counter() - start)
        if loader is not None:
            start = time.perf_counter()
            self._rlpost_reload(items, loader)
            direct_s.append(time.perf_counter() - start)
    direct_phases = {}
    if loader is not None:
        profiler = cProfile.Profile()
        profiler.enable()
        self._rlpost_reload(items, loader)
        profiler.disable()
        direct_stats = pstats.Stats(profiler).stats
        direct_total = max(cum for (_, _, name), (_, _, _, cum, _) in direct_stats.items() if name == "_rlpost_reload")
        for phase, names in DIRECT_PHASES.items():
            cums = [cum for (_, _, name), (_, _, _, cum, callers) in direct_stats.items()
                    if name in names and not any(c[2] in names for c in callers)]  # fmt: skip
            direct_phases[phase] = sum(cums)
        direct_phases["total"] = direct_total
    buffers = [torch.empty_like(t) for _, t in items]
    copy_s = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for buffer, (_, tensor) in zip(buffers, items):
            buffer.copy_(tensor)
        copy_s.append(time.perf_counter() - start)
    profiler = cProfile.Profile()
    profiler.enable()
    self.reload_weights(weights_iterator=iter(items))
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    total = max(cum for (_, _, name), (_, _, _, cum, _) in stats.items() if name == "reload_weights")
    phases = {}
    for phase, names in PHASES.items():
        # the outermost calls only: a phase's functions may call each other
        cums = [cum for (_, _, name), (_, _, _, cum, callers) in stats.items()
                if name in names and not any(c[2] in names for c in callers)]  # fmt: skip
        phases[phase] = sum(cums)
    top = sorted(((cum, tot, f"{path.rsplit('site-packages/', 1)[-1]}:{line} {name}")
                  for (path, line, name), (_, _, tot, cum, _) in stats.items()), reverse=True)[:25]  # fmt: skip
    return {
        "reload_s": reload_s[1:],
        "direct_s": direct_s[1:],
        "direct_reason": self._rlpost_direct_reason,
        "direct_phases_s": direct_phases,
        "copy_floor_s": copy_s[1:],
        "bytes": sum(t.numel() * t.element_size() for _, t in items),
        "profiled_reload_s": total,
        "phases_s": phases,
        "top_cumulative": [{"cum_s": round(c, 4), "self_s": round(s, 4), "function": f} for c, s, f in top],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="qwen05b", choices=["tiny", "qwen05b"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from rlpost.actors.vllm_workers import make_vllm_worker
    from rlpost.config import EngineConfig

    # the engine's worker runs _reload_in_worker (a function, sent pickled: vLLM asks for this switch)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    repeats = 1 if args.quick else args.repeats
    path = TINY_MODEL if args.model == "tiny" else qwen05b_model(args.quick)
    result = Result("profile_reload", args.quick, {"model": args.model, "repeats": repeats,
                                                   "engine": "vLLM CPU, float32, enforce_eager"})  # fmt: skip
    busy = wait_for_quiet(args.quick)
    worker = make_vllm_worker(str(path), make_ray_worker=False,
                              engine_config=EngineConfig(kv_cache_space_gb=0.25, max_model_len=256))  # fmt: skip
    try:
        out = worker.llm.collective_rpc(_reload_in_worker, args=(str(path), repeats), timeout=3600)[0]
    finally:
        worker.shutdown()
    gb = out["bytes"] / 1e9
    result.cases["reload_weights"] = {**summary(out["reload_s"]), "GB_per_s": round(gb / median(out["reload_s"]), 3)}
    result.cases["copy floor"] = {
        **summary(out["copy_floor_s"]),
        "GB_per_s": round(gb / median(out["copy_floor_s"]), 3),
    }
    result.cases["profiled reload"] = {"total_s": out["profiled_reload_s"], "phases_s": out["phases_s"],
                                       "top_cumulative": out["top_cumulative"], "busy_cores_at_start": busy}  # fmt: skip
    result.ratios["reload_weights / copy floor (time)"] = round(
        median(out["reload_s"]) / median(out["copy_floor_s"]), 1
    )
    if out["direct_s"]:
        result.cases["direct reload"] = {
            **summary(out["direct_s"]),
            "GB_per_s": round(gb / median(out["direct_s"]), 3),
            "profiled_phases_s": out["direct_phases_s"],
        }
        result.ratios["direct reload / copy floor (time)"] = round(
            median(out["direct_s"]) / median(out["copy_floor_s"]), 1
        )
        result.ratios["reload_weights / direct reload (time)"] = round(
            median(out["reload_s"]) / median(out["direct_s"]), 2
        )
    else:
        result.note(f"no direct reload for this model: {out['direct_reason']}")
    for phase, seconds in out["phases_s"].items():
        result.ratios[f"share of the profiled reload: {phase}"] = round(seconds / out["profiled_reload_s"], 3)
    result.note(f"{gb:.2f} GB of float32 weights (the tied LM head sent too, as rlpost publishes it)")
    result.write()


if __name__ == "__main__":
    main()
