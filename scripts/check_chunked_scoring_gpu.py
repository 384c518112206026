"""Check chunked scoring, sequence packing and the auto token budget on a GPU; prints JSON.

    python scripts/check_chunked_scoring_gpu.py [--lengths 1024 4096 16384 32768] [--out FILE]

Needs torch with CUDA, transformers and tensordict (no Ray, no vLLM); builds its models from the
Qwen2.5-0.5B shape with random weights (nothing downloaded) and the tokenizer in
models/tiny-model (``make tiny-model``). Checks (each reports ok and its figures):

- equal_fp32: on CUDA in float32, chunked scoring with rows packed end to end gives the dense
  padded path's log-probs, exact entropies and gradients (2-layer model, skewed rows).
- fsdp2_nccl: the model sharded by FSDP2 over NCCL (one rank) scores chunked and gets the
  unsharded model's gradients.
- memory_<N>: one row of N tokens scored and back-propagated under bf16 autocast (the learner's
  GPU setting), the full 24-layer model: peak CUDA memory above the model and its gradients,
  dense against chunked (dense skipped where its logits alone would not fit), and seconds.
- packed_skewed: tokens/s of a length-skewed batch (half the rows 8x shorter), packed against
  padded, bf16 autocast, 24 layers.
- auto_budget: the learner's default token budget on this GPU (``auto_token_budget``) and a
  micro-batch that fills it trained once: its peak must stay under the device's memory.
Exit status 0 when every check is ok.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import QWEN25_05B  # noqa: E402

TOKENIZER = REPO / "models" / "tiny-model"


def build_model(layers: int, dtype=torch.float32):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = {k: v for k, v in QWEN25_05B.items() if k != "rope_theta"}
    config = Qwen2Config(**dict(spec, num_hidden_layers=layers), dtype="float32",
                         rope_parameters={"rope_type": "default", "rope_theta": QWEN25_05B["rope_theta"]})  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(dtype)
    model.config._attn_implementation = "sdpa"
    return model


def wrapper_for(model, **options):
    from transformers import AutoTokenizer

    from rlpost.policies import TransformersWrapper

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    return TransformersWrapper(model, tokenizer=tokenizer, generate=False, **options)


def random_rows(lengths, vocab=QWEN25_05B["vocab_size"], seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def grads_of(model):
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = g.detach().float().clone()
    return out


def max_rel(got: dict, want: dict) -> float:
    return max(float((got[n] - w).abs().max() / w.abs().max().clamp_min(1e-12)) for n, w in want.items())


def score_backward(wrapper, rows, entropy=False):
    wrapper.model.zero_grad(set_to_none=True)
    if entropy:
        lps, hs = wrapper.log_probs_and_entropy(rows)
        loss = sum(lp.sum() - 0.5 * h.sum() for lp, h in zip(lps, hs))
    else:
        lps, hs = wrapper._score_ids(rows), None
        loss = sum(lp.sum() for lp in lps)
    loss.backward()
    return lps, hs


def check_equal_fp32() -> dict:
    model = build_model(2)
    rows = random_rows([300, 40, 290, 37, 12, 300, 5])
    dense = wrapper_for(model, chunked_scoring=False)
    packed = wrapper_for(model, score_chunk_tokens=64)
    assert packed.packs_sequences
    want_lp, want_h = score_backward(dense, rows, entropy=True)
    want_g = grads_of(model)
    got_lp, got_h = score_backward(packed, rows, entropy=True)
    got_g = grads_of(model)
    lp_diff = max(float((a - b).abs().max()) for a, b in zip(got_lp, want_lp))
    h_diff = max(float((a - b).abs().max()) for a, b in zip(got_h, want_h))
    grad_rel = max_rel(got_g, want_g)
    bins = packed._packed_inputs(rows).input_ids.shape[0]
    ok = lp_diff < 1e-4 and h_diff < 1e-4 and grad_rel < 1e-4
    return {"ok": ok, "logprob_max_abs_diff": lp_diff, "entropy_max_abs_diff": h_diff,
            "grad_max_rel_diff": grad_rel, "rows": len(rows), "packed_rows": bins}  # fmt: skip


def check_fsdp2_nccl() -> dict:
    import torch.distributed as dist

    from rlpost.actors.sharding import shard_model

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        rows = random_rows([200, 31, 150])
        plain = build_model(2)
        score_backward(wrapper_for(plain), rows)
        want = grads_of(plain)
        sharded = build_model(2)
        shard_model(sharded)
        wrapper = wrapper_for(sharded)
        assert wrapper.scores_in_chunks
        score_backward(wrapper, rows)
        rel = max_rel(grads_of(sharded), want)
        return {"ok": rel < 1e-4, "grad_max_rel_diff": rel}
    finally:
        dist.destroy_process_group()


def peak_run(wrapper, rows) -> tuple[float, float]:
    """(seconds, peak GB above what was allocated before) of scoring + backward, bf16 autocast."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lps = wrapper._score_ids(rows)
    sum(lp.sum() for lp in lps).backward()
    torch.cuda.synchronize()
    return time.perf_counter() - start, (torch.cuda.max_memory_allocated() - base) / 2**30


def check_memory(model, lengths) -> dict:
    results = {}
    free = torch.cuda.mem_get_info()[0]
    for n in lengths:
        rows = random_rows([n])
        entry = {}
        for name, options in (("chunked", {}), ("dense", {"chunked_scoring": False})):
            if name == "dense" and 4 * 4 * n * QWEN25_05B["vocab_size"] > 0.6 * free:
                entry["dense"] = "skipped: its float32 logits and their copies would not fit"
                continue
            wrapper = wrapper_for(model, **options)
            score_backward(wrapper, random_rows([1024]))  # warm: kernels chosen, gradients allocated
            seconds, peak = peak_run(wrapper, rows)
            entry[name] = {"seconds": round(seconds, 3), "peak_gb": round(peak, 3)}
        if isinstance(entry.get("dense"), dict):
            entry["peak_chunked_over_dense"] = round(entry["chunked"]["peak_gb"] / entry["dense"]["peak_gb"], 4)
            entry["time_chunked_over_dense"] = round(entry["chunked"]["seconds"] / entry["dense"]["seconds"], 3)
        entry["ok"] = True
        results[f"memory_{n}"] = entry
        torch.cuda.empty_cache()
    return results


def check_packed_skewed(model, longest=2048, rows=8, repeats=3) -> dict:
    lengths = [longest if i % 2 == 0 else longest // 8 for i in range(rows)]
    batch = random_rows(lengths)
    rates = {}
    for name, options in (("dense padded", {"chunked_scoring": False}), ("padded", {"pack_sequences": False}),
                          ("packed", {})):  # fmt: skip
        wrapper = wrapper_for(model, **options)
        peak_run(wrapper, random_rows([64, 8]))  # warm
        times = sorted(peak_run(wrapper, batch)[0] for _ in range(repeats))
        rates[name] = sum(lengths) / times[len(times) // 2]
    ratio = rates["packed"] / rates["padded"]
    return {"ok": ratio > 1.0, "tokens_per_s": {k: round(v) for k, v in rates.items()},
            "packed_over_padded": round(ratio, 3), "packed_over_dense_padded": round(rates["packed"] / rates["dense padded"], 3),
            "lengths": f"{longest} and {longest // 8}, {rows} rows"}  # fmt: skip


def check_auto_budget(model) -> dict:
    from rlpost.actors.token_budget import auto_token_budget

    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    budget = auto_token_budget(model, torch.device("cuda"), gradient_checkpointing=False, chunked=True,
                               bf16_autocast=True, optimizer_allocated=False)  # fmt: skip
    row = 8192
    rows = random_rows([row] * max(1, budget.tokens // row))
    wrapper = wrapper_for(model)
    total = torch.cuda.get_device_properties(0).total_memory
    seconds, peak = peak_run(wrapper, rows)
    used = torch.cuda.max_memory_allocated()
    tokens = sum(map(len, rows))
    measured = peak * 2**30 / tokens
    # safe, not tight: the estimate may exceed what a token costs, never fall short of it
    return {"ok": used < total and measured <= budget.bytes_per_token, "budget": budget.describe(),
            "tokens_trained": tokens, "seconds": round(seconds, 2),
            "peak_gb_above_model": round(peak, 2), "device_peak_gb": round(used / 2**30, 2),
            "device_total_gb": round(total / 2**30, 2),
            "measured_bytes_per_token": round(measured),
            "estimated_bytes_per_token": budget.bytes_per_token}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    checks = [("equal_fp32", check_equal_fp32), ("fsdp2_nccl", check_fsdp2_nccl)]
    for name, fn in checks:
        try:
            report[name] = fn()
        except Exception as err:  # a failed check is reported, the others still run
            report[name] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        print(name, json.dumps(report[name]), flush=True)
    model = build_model(QWEN25_05B["num_hidden_layers"])  # float32 masters, bf16 autocast (the learner's)
    for name, fn in (("memory", lambda: check_memory(model, args.lengths)),
                     ("packed_skewed", lambda: {"packed_skewed": check_packed_skewed(model)}),
                     ("auto_budget", lambda: {"auto_budget": check_auto_budget(model)})):  # fmt: skip
        try:
            found = fn()
        except Exception as err:
            found = {name: {"ok": False, "error": f"{type(err).__name__}: {err}"}}
        for key, value in found.items():
            report[key] = value
            print(key, json.dumps(value), flush=True)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text)
    ok = all(v.get("ok", True) for v in report.values() if isinstance(v, dict))
    print("ALL OK" if ok else "SOME CHECK FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
