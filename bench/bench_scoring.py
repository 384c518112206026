"""Scoring one long row for training: chunked through the LM head against the dense logits.

The Qwen2.5-0.5B-shaped model (151,936-token vocabulary, tied embedding) with 2 layers, scored the
way the learner scores (``TransformersWrapper`` with ``generate=False``) on one row of N tokens,
then ``backward`` of the log-probs' sum: once with ``chunked_scoring=False`` (the
``[N, vocabulary]`` logits, their float32 log-softmax and their gradients) and once chunked (the
default). Each case runs in a fresh process, so its peak resident memory is its own; the figure
is the peak above the process's memory after the model loaded. Also the wall time of the
forward and backward.

Ratios chunked / dense of the same run: peak extra memory and time, per length, and the peak
memory each added token costs between the shortest and the longest length (what grows with
``tokens x vocabulary`` in the dense path; activations of the model's layers in both).

    python -m bench scoring [--quick] [-- --tokens 1024 4096 --repeats 2]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from bench.common import REPO, Result, median, qwen05b_model, summary, wait_for_quiet

LAYERS = 2


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_case(chunked: bool, tokens: int) -> dict:
    """One case in this process: (seconds, peak MB above the loaded model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlpost.policies import TransformersWrapper

    torch.set_num_threads(2)
    path = qwen05b_model(False, log=lambda *_: None, layers=LAYERS)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    wrapper = TransformersWrapper(model, tokenizer=tokenizer, generate=False, chunked_scoring=chunked)
    row = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    base = _peak_rss_mb()
    start = time.perf_counter()
    (logprobs,) = wrapper._score_ids([row])
    logprobs.sum().backward()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_extra_mb": _peak_rss_mb() - base, "mean_logprob": float(logprobs[1:].mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--case", choices=("dense", "chunked"), help=argparse.SUPPRESS)  # a worker process
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case == "chunked", args.tokens[0])), flush=True)
        return
    lengths = args.tokens or ([256] if args.quick else [1024, 4096])
    repeats = 1 if args.quick else args.repeats
    qwen05b_model(False, layers=LAYERS)  # built once, before any timing
    result = Result("scoring", args.quick, {"model": f"Qwen2.5-0.5B-shaped, {LAYERS} layers", "vocab": 151936,
                                            "tokens": lengths, "repeats": repeats, "dtype": "float32"})  # fmt: skip
    wait_for_quiet(args.quick)
    for tokens in lengths:
        runs: dict[str, list[dict]] = {"dense": [], "chunked": []}
        for _ in range(repeats):
            for case in runs:
                cmd = [sys.executable, "-m", "bench.bench_scoring", "--case", case, "--tokens", str(tokens)]
                out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800, check=True)
                runs[case].append(json.loads(out.stdout.strip().splitlines()[-1]))
        for case, records in runs.items():
            result.cases[f"{case} {tokens} tokens: seconds"] = summary([r["seconds"] for r in records])
            result.cases[f"{case} {tokens} tokens: peak extra MB"] = summary([r["peak_extra_mb"] for r in records])
        dense_lp, chunked_lp = runs["dense"][0]["mean_logprob"], runs["chunked"][0]["mean_logprob"]
        if abs(dense_lp - chunked_lp) > 1e-4 * abs(dense_lp):
            raise SystemExit(f"chunked and dense scores differ at {tokens} tokens: {chunked_lp} vs {dense_lp}")
        memory = median(r["peak_extra_mb"] for r in runs["chunked"]) / median(r["peak_extra_mb"] for r in runs["dense"])
        speed = median(r["seconds"] for r in runs["chunked"]) / median(r["seconds"] for r in runs["dense"])
        result.ratios[f"{tokens} tokens: peak extra memory chunked / dense"] = memory
        result.ratios[f"{tokens} tokens: time chunked / dense"] = speed
        print(f"  {tokens} tokens: memory chunked/dense {memory:.3f}, time chunked/dense {speed:.2f}", flush=True)
    if len(lengths) > 1:  # the memory that grows with the row: per token, between the shortest and longest
        short, long = min(lengths), max(lengths)
        slopes = {}
        for case in ("dense", "chunked"):
            grow = result.cases[f"{case} {long} tokens: peak extra MB"]["median"]
            grow -= result.cases[f"{case} {short} tokens: peak extra MB"]["median"]
            slopes[case] = grow / (long - short)
            result.cases[f"{case}: peak MB per token ({short} to {long})"] = slopes[case]
        result.ratios["peak memory per token chunked / dense"] = slopes["chunked"] / slopes["dense"]
        print(f"  memory per token: dense {slopes['dense']:.3f} MB, chunked {slopes['chunked']:.3f} MB", flush=True)
    result.write()


if __name__ == "__main__":
    main()
