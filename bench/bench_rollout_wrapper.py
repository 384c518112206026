"""Rollout throughput of vLLMWrapper against calling ``vllm.LLM.generate`` directly.

Both sides get the same prompt token ids and the same SamplingParams (n samples, max tokens,
temperature 1, sampled-token log-probs, no detokenisation in the engine); the wrapper also
builds its TensorDict outputs (and decodes text unless "ids only"), which is the overhead
measured. Cases run interleaved after ``gc.freeze()`` (see the comment there); the "overhead"
rows time the wrapper alone on replayed completions, which CPU contention from other processes
disturbs less than the end-to-end ratios. Target
(issue 3): wrapper throughput within 5% of the direct call. Also reports the resident memory of
the engine's processes (target: under 2 GB for the tiny model).

    python bench/bench_rollout_wrapper.py [--model .cache/tiny-model] [--prompts 64] [--samples 8]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / ".cache" / "tiny-model"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--no-gc-freeze", action="store_true", help="keep start-up objects in the collected generations"
    )
    args = parser.parse_args()

    import psutil
    import torch
    from tensordict import TensorDict, lazy_stack
    from vllm import SamplingParams

    from rlpost.data import ChatHistory, History, Tokens
    from rlpost.envs.arithmetic import ARITHMETIC_SYSTEM_PROMPT, make_arithmetic_rows
    from rlpost.policies import LocalVLLMClient, make_vllm_engine, shutdown_vllm_engine, vLLMWrapper

    llm = make_vllm_engine(args.model)
    tokenizer = llm.get_tokenizer()
    rows = make_arithmetic_rows(args.prompts, seed=0)
    system = {"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT}
    chats = [[system, {"role": "user", "content": r["question"]}] for r in rows]
    history = History.from_chats(chats)
    prompt_ids = history.apply_chat_template(tokenizer, tokenize=True)
    sampling = dict(n=args.samples, max_tokens=args.max_tokens, temperature=1.0, seed=0)

    def direct():
        params = SamplingParams(**sampling, logprobs=0, detokenize=False)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs)

    def wrapper(engine, mode: str, pad_output: bool, return_text: bool = True):
        policy = vLLMWrapper(
            engine, tokenizer=tokenizer, input_mode=mode, num_samples=args.samples, pad_output=pad_output,
            return_text=return_text,
            generate_kwargs={"max_tokens": args.max_tokens, "temperature": 1.0, "seed": 0},
        )
        if mode == "tokens":
            tokens = lazy_stack([Tokens(prompt=torch.tensor(ids), padded=False) for ids in prompt_ids])
            td = TensorDict(tokens=tokens, batch_size=[len(prompt_ids)])
        else:
            td = TensorDict(history=ChatHistory(prompt=history, batch_size=[len(chats)]), batch_size=[len(chats)])

        def run():
            out = policy(td.copy())
            attention = out.get(("masks", "all_attention_mask"), as_list=not pad_output)
            return _count(attention) - args.samples * sum(len(p) for p in prompt_ids)

        return run

    cases = {
        "vllm.LLM.generate": direct,
        "vLLMWrapper tokens, ragged": wrapper(llm, "tokens", False),
        "vLLMWrapper tokens, ragged, ids only": wrapper(llm, "tokens", False, return_text=False),
        "vLLMWrapper tokens, padded": wrapper(llm, "tokens", True),
        "vLLMWrapper history, ragged": wrapper(llm, "history", False),
    }
    # The wrapper's own cost, engine excluded: the same calls on a client that replays recorded
    # completions. Robust to CPU contention from other processes, unlike the end-to-end ratios.
    recorded = LocalVLLMClient(llm).generate(prompt_ids, dict(sampling, logprobs=True))
    replay = _ReplayClient(recorded)
    overhead = {
        "overhead tokens, ragged": wrapper(replay, "tokens", False),
        "overhead tokens, ragged, ids only": wrapper(replay, "tokens", False, return_text=False),
        "overhead tokens, padded": wrapper(replay, "tokens", True),
        "overhead history, ragged": wrapper(replay, "history", False),
    }
    if not args.no_gc_freeze:
        # Start-up leaves millions of long-lived objects (vLLM, transformers, torch); a full
        # collection walks them all, and TensorDict outputs allocate enough to trigger one every
        # few calls (~0.2 s here). Freezing them is what a long-running rollout process should do.
        gc.collect()
        gc.freeze()
    times = {name: [] for name in cases}
    tokens = {name: fn() for name, fn in cases.items()}  # warm-up
    for _ in range(args.repeats):  # interleaved, so that load drift hits every case alike
        for name, fn in cases.items():
            start = time.perf_counter()
            tokens[name] = fn()
            times[name].append(time.perf_counter() - start)
    results = {name: (statistics.median(times[name]), tokens[name]) for name in cases}

    base_time, base_tokens = results["vllm.LLM.generate"]
    sequences = args.prompts * args.samples
    print(f"{args.prompts} prompts x {args.samples} samples, max_tokens={args.max_tokens}, median of {args.repeats}")
    for name, (seconds, tokens) in results.items():
        ratio = (tokens / seconds) / (base_tokens / base_time)
        rates = f"{sequences / seconds:8.0f} seq/s  {tokens / seconds:9.0f} tok/s"
        print(f"  {name:38s} {seconds * 1e3:8.1f} ms  {rates}  ratio {ratio:.3f}")
    engine = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]
    engine_rss = sum(p.memory_info().rss for p in engine) / 2**30
    driver_rss = psutil.Process().memory_info().rss / 2**30
    for name, fn in overhead.items():
        fn()
        seconds = statistics.median([_timed(fn) for _ in range(args.repeats)])
        print(f"  {name:38s} {seconds * 1e3:8.1f} ms  ({seconds / base_time:.1%} of the direct call)")
    names = ", ".join(p.name() for p in engine)
    print(f"resident memory: engine processes {engine_rss:.2f} GiB ({names}), driver {driver_rss:.2f} GiB")
    shutdown_vllm_engine(llm)
    gc.unfreeze()  # let interpreter shutdown free the start-up objects normally


class _ReplayClient:
    """An engine client that returns recorded completions (to time the wrapper alone)."""

    def __init__(self, completions):
        self.completions = completions

    def generate(self, prompt_token_ids, sampling):
        return self.completions

    def score(self, token_ids, *, temperature):
        raise NotImplementedError


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _count(mask) -> int:
    """True entries of a mask given as a tensor or (nested) lists of row tensors."""
    return int(mask.sum()) if hasattr(mask, "sum") else sum(_count(m) for m in mask)


if __name__ == "__main__":
    main()
