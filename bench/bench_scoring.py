"""Scoring for training: chunked through the LM head against the dense logits, packed rows
against padded ones.

The Qwen2.5-0.5B-shaped model (151,936-token vocabulary, tied embedding) with 2 layers, scored the
way the learner scores (``TransformersWrapper`` with ``generate=False``), then ``backward`` of
the log-probs' sum. Each case runs in a fresh process, so its peak resident memory is its own.

Memory (one row of N tokens): dense (``chunked_scoring=False``: the ``[N, vocabulary]`` logits,
their float32 log-softmax and their gradients) against chunked (the default). The figure is the
peak above the process's memory once the model's weights are resident (a short scoring call
first: transformers maps the checkpoint and reads weights on first use, which is not the
scoring's memory). The dense path is not run past ``--dense-max`` tokens (16k tokens would need
about 30 GB for its logits alone); the chunked one must train a 16k-token row here.

Packing (a length-skewed batch: half the rows 8x shorter than the longest, as in reasoning RL):
learner tokens per second (real tokens over the forward and backward's seconds), rows packed end
to end (``pack_sequences=True``, the default) against rows padded to the longest, both chunked;
and the dense padded path as the baseline of both. Packing saves decoder-layer work (the chunked
LM head already skips padding), so this case runs the full 24 layers, where the layers are most
of a step's work as in a real model.

Ratios are of the same run: chunked / dense peak memory and time per length, the memory each
added token costs, packed / padded tokens per second.

    python -m bench scoring [--quick] [-- --tokens 1024 4096 16384 --repeats 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from bench.common import REPO, Result, median, qwen05b_model, summary, wait_for_quiet

LAYERS = 2  # the memory sweep's depth: the vocabulary's share of the memory shows best
SKEW_LAYERS = 24  # the packing case's: Qwen2.5-0.5B's own
CASES = {  # name: TransformersWrapper options
    "dense": {"chunked_scoring": False},
    "chunked": {"chunked_scoring": True},
    "padded": {"chunked_scoring": True, "pack_sequences": False},
    "packed": {"chunked_scoring": True, "pack_sequences": True},
}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def skewed_lengths(longest: int, rows: int = 8) -> list[int]:
    """Half the rows ``longest`` tokens, half 8x shorter, interleaved."""
    return [longest if i % 2 == 0 else longest // 8 for i in range(rows)]


def run_case(case: str, lengths: list[int], layers: int) -> dict:
    """One case in this process: seconds, peak MB above the resident model, tokens/s."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlpost.policies import TransformersWrapper

    torch.set_num_threads(2)
    path = qwen05b_model(False, log=lambda *_: None, layers=layers)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    wrapper = TransformersWrapper(model, tokenizer=tokenizer, generate=False, **CASES[case])
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    with torch.no_grad():  # every weight read once: resident before the baseline
        wrapper._score_ids([rows[0][:8]])
    base = _peak_rss_mb()
    start = time.perf_counter()
    logprobs = wrapper._score_ids(rows)
    sum(lp.sum() for lp in logprobs).backward()
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "peak_extra_mb": _peak_rss_mb() - base,
        "tokens_per_s": sum(lengths) / seconds,
        "mean_logprob": float(torch.cat([lp[1:] for lp in logprobs]).mean()),
    }


def run_in_process(case: str, lengths: list[int], layers: int = LAYERS) -> dict:
    cmd = [sys.executable, "-m", "bench.bench_scoring", "--case", case, "--layers", str(layers),
           "--tokens", *map(str, lengths)]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def same_scores(records: dict[str, list[dict]], what: str) -> None:
    """Every case scored the same tokens to the same values (a guard, not a measurement)."""
    values = {case: runs[0]["mean_logprob"] for case, runs in records.items()}
    first = next(iter(values.values()))
    if any(abs(v - first) > 1e-4 * abs(first) for v in values.values()):
        raise SystemExit(f"{what}: the cases' scores differ: {values}")


def memory_sweep(result: Result, lengths: list[int], repeats: int, dense_max: int) -> None:
    slopes_at: dict[str, list[int]] = {"dense": [], "chunked": []}
    for tokens in lengths:
        cases = ["dense", "chunked"] if tokens <= dense_max else ["chunked"]
        runs: dict[str, list[dict]] = {case: [] for case in cases}
        for _ in range(repeats if tokens <= dense_max else 1):
            for case in cases:
                runs[case].append(run_in_process(case, [tokens]))
        for case, records in runs.items():
            result.cases[f"{case} {tokens} tokens: seconds"] = summary([r["seconds"] for r in records])
            result.cases[f"{case} {tokens} tokens: peak extra MB"] = summary([r["peak_extra_mb"] for r in records])
            slopes_at[case].append(tokens)
        if "dense" not in runs:
            print(f"  {tokens} tokens: chunked trained, {median(r['peak_extra_mb'] for r in runs['chunked']):.0f} MB "
                  f"peak extra (dense not run past {dense_max} tokens)", flush=True)  # fmt: skip
            continue
        same_scores(runs, f"{tokens} tokens")
        memory = median(r["peak_extra_mb"] for r in runs["chunked"]) / median(r["peak_extra_mb"] for r in runs["dense"])
        speed = median(r["seconds"] for r in runs["chunked"]) / median(r["seconds"] for r in runs["dense"])
        result.ratios[f"{tokens} tokens: peak extra memory chunked / dense"] = memory
        result.ratios[f"{tokens} tokens: time chunked / dense"] = speed
        print(f"  {tokens} tokens: memory chunked/dense {memory:.3f}, time chunked/dense {speed:.2f}", flush=True)
    slopes = {}
    for case, measured in slopes_at.items():  # the memory that grows with the row, per token
        if len(measured) > 1:
            short, long = min(measured), max(measured)
            grow = result.cases[f"{case} {long} tokens: peak extra MB"]["median"]
            grow -= result.cases[f"{case} {short} tokens: peak extra MB"]["median"]
            slopes[case] = grow / (long - short)
            result.cases[f"{case}: peak MB per token ({short} to {long})"] = slopes[case]
    if len(slopes) == 2:
        result.ratios["peak memory per token chunked / dense"] = slopes["chunked"] / slopes["dense"]
        print(f"  memory per token: dense {slopes['dense']:.3f} MB, chunked {slopes['chunked']:.3f} MB", flush=True)


def packing(result: Result, longest: int, layers: int, repeats: int) -> None:
    lengths = skewed_lengths(longest)
    runs: dict[str, list[dict]] = {"dense": [], "padded": [], "packed": []}
    for _ in range(repeats):
        for case in runs:
            runs[case].append(run_in_process(case, lengths, layers))
    same_scores(runs, "skewed batch")
    name = f"skewed batch {'+'.join(map(str, sorted(set(lengths), reverse=True)))} x {len(lengths) // 2}"
    for case, records in runs.items():
        result.cases[f"{name}, {case}: tokens/s"] = summary([r["tokens_per_s"] for r in records])
        result.cases[f"{name}, {case}: peak extra MB"] = summary([r["peak_extra_mb"] for r in records])
    rate = {case: median(r["tokens_per_s"] for r in records) for case, records in runs.items()}
    result.ratios["skewed batch: tokens/s packed / padded"] = rate["packed"] / rate["padded"]
    result.ratios["skewed batch: tokens/s packed / dense padded"] = rate["packed"] / rate["dense"]
    print(f"  skewed batch: packed/padded {rate['packed'] / rate['padded']:.2f}x, "
          f"packed/dense padded {rate['packed'] / rate['dense']:.2f}x", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="row lengths of the memory sweep")
    parser.add_argument("--dense-max", type=int, default=4096, help="longest row the dense path is run on")
    parser.add_argument("--skew-longest", type=int, default=None, help="longest row of the skewed batch")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--case", choices=tuple(CASES), help=argparse.SUPPRESS)  # a worker process
    parser.add_argument("--layers", type=int, default=LAYERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.tokens, args.layers)), flush=True)
        return
    lengths = args.tokens or ([256] if args.quick else [1024, 4096, 16384])
    longest = args.skew_longest or 256
    skew_layers = LAYERS if args.quick else SKEW_LAYERS
    repeats = 1 if args.quick else args.repeats
    for layers in {LAYERS, skew_layers}:  # built once, before any timing
        qwen05b_model(False, layers=layers)
    result = Result("scoring", args.quick, {"model": f"Qwen2.5-0.5B-shaped, {LAYERS} layers", "vocab": 151936,
                                            "tokens": lengths, "dense_max": args.dense_max,
                                            "skewed": skewed_lengths(longest), "skewed_layers": skew_layers,
                                            "repeats": repeats,
                                            "dtype": "float32"})  # fmt: skip
    wait_for_quiet(args.quick)
    memory_sweep(result, lengths, repeats, args.dense_max)
    packing(result, longest, skew_layers, repeats)
    result.write()


if __name__ == "__main__":
    main()
