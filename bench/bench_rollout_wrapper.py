"""Rollout throughput through rlpost's inference worker against ``vllm.LLM.generate`` called directly.

The headline case is the path an env pool uses in a run: ``vLLMWrapper`` (tokens in, TensorDict
out) -> ``RemoteVLLMClient`` (least-busy worker, version stamp) -> the Ray actor ``inference-0``
(``InferenceActor``: its own vLLM engine, metrics) and back. The baseline is a second engine,
built with the same arguments (``engine_kwargs`` of configs/tiny-cpu.yaml's engine section),
called directly in this process: same prompt token ids, same SamplingParams (n samples, max
tokens, temperature 1, seed 0 so that both sides generate the same tokens, sampled-token
log-probs, no detokenisation). Cases run interleaved (each repeat runs every case once) after
``gc.freeze()`` (see the comment there), so load drift hits every case alike.

Further rows split the overhead: the actor's ``generate`` alone (Ray call + version stamp), the
wrapper on the in-process engine, and the wrapper alone on replayed completions (engine
excluded), which CPU contention from other processes disturbs less than the end-to-end ratios.
Targets: rlpost path >= 0.95 of the direct call (issue 8), wrapper within 5% (issue 3); the
resident memory of an engine's processes under 2 GB for the tiny model.

    python -m bench bench_rollout_wrapper [--quick] [--prompts 64] [--samples 8] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from bench.common import CONFIG, TINY_MODEL, Result, summary, wait_for_quiet
from rlpost.actors.inference import InferenceActor

DIRECT = "vllm.LLM.generate (direct)"
RLPOST = "rlpost: vLLMWrapper -> RemoteVLLMClient -> inference-0 actor"
DIRECT_TEXT = "vllm.LLM.generate (direct, detokenize=True: vLLM's default, returns text)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: 8 prompts x 4 samples x 8 tokens")
    parser.add_argument("--model", default=str(TINY_MODEL))
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--no-gc-freeze", action="store_true", help="keep start-up objects in the collected generations"
    )
    args = parser.parse_args()
    q = args.quick
    prompts, samples = args.prompts or (8 if q else 64), args.samples or (4 if q else 8)
    max_tokens, repeats = args.max_tokens or (8 if q else 32), args.repeats or (3 if q else 11)

    import psutil
    import ray
    import torch
    from tensordict import TensorDict, lazy_stack

    from rlpost.actors.inference import engine_kwargs
    from rlpost.config import load_config
    from rlpost.data import ChatHistory, History, Tokens
    from rlpost.envs.arithmetic import ARITHMETIC_SYSTEM_PROMPT, make_arithmetic_rows
    from rlpost.policies import LocalVLLMClient, RemoteVLLMClient, make_vllm_engine, shutdown_vllm_engine, vLLMWrapper

    engine_cfg = load_config(CONFIG).rollout.engine
    result = Result(
        "rollout",
        q,
        {
            "model": args.model,
            "prompts": prompts,
            "samples": samples,
            "max_tokens": max_tokens,
            "repeats": repeats,
            "engine": engine_cfg.model_dump(),
            "temperature": 1.0,
            "seed": 0,
            "gc_freeze": not args.no_gc_freeze,
        },
    )
    wait_for_quiet(q)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="rlpost-bench-rollout")
    actor = (
        ray.remote(TimedInferenceActor)
        .options(name="inference-0", num_cpus=0.5)
        .remote(args.model, engine_cfg, dtype="float32", index=0, run_name="bench-rollout")
    )
    llm = make_vllm_engine(args.model, dtype="float32", **engine_kwargs(engine_cfg, on_gpu=False))
    ray.get(actor.get_version.remote(), timeout=600)
    tokenizer = llm.get_tokenizer()
    rows = make_arithmetic_rows(prompts, seed=0)
    system = {"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT}
    chats = [[system, {"role": "user", "content": r["question"]}] for r in rows]
    history = History.from_chats(chats)
    prompt_ids = [p.tolist() for p in history.apply_chat_template(tokenizer, tokenize=True)]
    sampling = dict(n=samples, max_tokens=max_tokens, temperature=1.0, seed=0)
    prompt_tokens = samples * sum(len(p) for p in prompt_ids)

    def direct():
        from vllm import SamplingParams

        params = SamplingParams(**sampling, logprobs=0, detokenize=False)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs)

    def direct_with_text():
        from vllm import SamplingParams

        params = SamplingParams(**sampling, logprobs=0)  # vLLM's default: detokenize, text returned
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs)

    def actor_generate():
        completions, _version = ray.get(actor.generate.remote(prompt_ids, dict(sampling, logprobs=True)))
        return sum(len(c.token_ids) for group in completions for c in group)

    def wrapper(engine, mode: str = "tokens", pad_output: bool = False, return_text: bool = True):
        policy = vLLMWrapper(
            engine,
            tokenizer=tokenizer,
            input_mode=mode,
            num_samples=samples,
            pad_output=pad_output,
            return_text=return_text,
            return_log_probs=True,
            return_tokens=True,
            generate_kwargs={"max_tokens": max_tokens, "temperature": 1.0, "seed": 0},
        )
        if mode == "tokens":
            tokens = lazy_stack([Tokens(prompt=torch.tensor(ids), padded=False) for ids in prompt_ids])
            td = TensorDict(tokens=tokens, batch_size=[len(prompt_ids)])
        else:
            td = TensorDict(history=ChatHistory(prompt=history, batch_size=[len(chats)]), batch_size=[len(chats)])

        def run():
            out = policy(td.copy())
            attention = out.get(("masks", "all_attention_mask"), as_list=not pad_output)
            return _count(attention) - prompt_tokens

        return run

    remote = RemoteVLLMClient([actor], tokenizer=tokenizer)
    cases = {
        DIRECT: direct,
        RLPOST: wrapper(remote),
        "inference-0 actor generate (ray.get, no wrapper)": actor_generate,
        DIRECT_TEXT: direct_with_text,
        "vLLMWrapper on the in-process engine, tokens, ragged": wrapper(llm),
        "vLLMWrapper on the in-process engine, history, ragged": wrapper(llm, "history"),
    }
    # The wrapper's own cost, engine excluded: the same calls on a client that replays recorded
    # completions. Robust to CPU contention from other processes, unlike the end-to-end ratios.
    recorded = LocalVLLMClient(llm).generate(prompt_ids, dict(sampling, logprobs=True))
    replay = _ReplayClient(recorded)
    overhead = {
        "wrapper alone (replayed completions), tokens, ragged": wrapper(replay),
        "wrapper alone, tokens, ragged, ids only": wrapper(replay, return_text=False),
        "wrapper alone, tokens, padded": wrapper(replay, pad_output=True),
        "wrapper alone, history, ragged": wrapper(replay, "history"),
    }
    if not args.no_gc_freeze:
        # Start-up leaves millions of long-lived objects (vLLM, transformers, torch); a full
        # collection walks them all, and TensorDict outputs allocate enough to trigger one every
        # few calls (~0.2 s here). Freezing them is what a long-running rollout process should do.
        gc.collect()
        gc.freeze()
    # The actor's time from inside it, and the Ray call's own cost: the round trip minus the time
    # the actor spent, measured on the same call (so CPU drift cancels).
    inside: dict[str, list[float]] = {
        "in the actor: llm.generate alone": [],
        "in the actor: InferenceActor.generate (engine + plain completions + metrics)": [],
        "Ray call overhead (round trip - time in the actor, same call)": [],
    }

    def split_actor_time() -> list[float]:
        engine_s = ray.get(actor.timed_engine.remote(prompt_ids, sampling))
        start = time.perf_counter()
        _, in_actor_s = ray.get(actor.timed_generate.remote(prompt_ids, sampling))
        return [engine_s, in_actor_s, time.perf_counter() - start - in_actor_s]

    times = {name: [] for name in cases}
    tokens = {name: fn() for name, fn in cases.items()}  # warm-up
    split_actor_time()
    for _ in range(repeats):  # interleaved, so that load drift hits every case alike
        for name, fn in cases.items():
            start = time.perf_counter()
            tokens[name] = fn()
            times[name].append(time.perf_counter() - start)
        for name, value in zip(inside, split_actor_time()):
            inside[name].append(value)
    base_s = statistics.median(times[DIRECT])
    base_rate = tokens[DIRECT] / base_s
    sequences = prompts * samples
    print(f"{prompts} prompts x {samples} samples, max_tokens={max_tokens}, median of {repeats}")
    for name in cases:
        seconds = statistics.median(times[name])
        rate = tokens[name] / seconds
        # paired: each repeat's case against the direct call next to it, so drift in the machine's
        # speed over the run (it is there: see the repeats) cancels out of each pair
        paired = statistics.median(
            (tokens[name] / t) / (tokens[DIRECT] / d) for t, d in zip(times[name], times[DIRECT])
        )
        result.cases[name] = {
            "seconds": summary(times[name]),
            "generated_tokens": tokens[name],
            "tokens_per_s": rate,
            "sequences_per_s": sequences / seconds,
            "ratio": rate / base_rate,
            "paired_ratio": paired,
        }
        print(
            f"  {name:58s} {seconds * 1e3:8.1f} ms {rate:9.0f} tok/s  ratio {rate / base_rate:.3f} "
            f"(paired {paired:.3f})",
            flush=True,
        )
    for name, seconds_list in inside.items():
        seconds = statistics.median(seconds_list)
        result.cases[name] = {"seconds": summary(seconds_list), "share_of_direct_call": seconds / base_s}
        print(f"  {name:58s} {seconds * 1e3:8.1f} ms  ({seconds / base_s:.1%} of the direct call)", flush=True)
    for name, fn in overhead.items():
        fn()
        seconds_list = [_timed(fn) for _ in range(repeats)]
        seconds = statistics.median(seconds_list)
        result.cases[name] = {"seconds": summary(seconds_list), "share_of_direct_call": seconds / base_s}
        print(f"  {name:58s} {seconds * 1e3:8.1f} ms  ({seconds / base_s:.1%} of the direct call)", flush=True)
    result.ratios["rlpost rollout path / direct vllm.LLM.generate, tokens/s"] = result.cases[RLPOST]["ratio"]
    result.ratios["the same, median of the per-repeat (paired) ratios"] = result.cases[RLPOST]["paired_ratio"]
    result.ratios["rlpost rollout path / direct call returning text (detokenize=True), paired"] = statistics.median(
        d / t for t, d in zip(times[RLPOST], times[DIRECT_TEXT])
    )
    result.ratios["inference-0 actor generate / direct, tokens/s"] = result.cases[
        "inference-0 actor generate (ray.get, no wrapper)"
    ]["ratio"]
    result.ratios["vLLMWrapper in-process / direct, tokens/s"] = result.cases[
        "vLLMWrapper on the in-process engine, tokens, ragged"
    ]["ratio"]
    if tokens[RLPOST] != tokens[DIRECT]:
        result.note(
            f"generated tokens differ: direct {tokens[DIRECT]}, rlpost path {tokens[RLPOST]} (ratios use tokens/s)"
        )
    engine = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]
    result.data["memory_gib"] = {
        "driver_engine_processes": sum(p.memory_info().rss for p in engine) / 2**30,
        "driver": psutil.Process().memory_info().rss / 2**30,
    }
    print(
        f"resident memory: engine processes {result.data['memory_gib']['driver_engine_processes']:.2f} GiB", flush=True
    )
    result.write()
    shutdown_vllm_engine(llm)
    ray.get(actor.shutdown.remote(), timeout=60)
    ray.shutdown()
    gc.unfreeze()  # let interpreter shutdown free the start-up objects normally


class TimedInferenceActor(InferenceActor):
    """``InferenceActor`` plus timers read inside the actor, to split the round trip into the engine
    in the actor's process, the actor's own work (completions as plain objects, metrics) and Ray."""

    def timed_engine(self, prompt_ids, sampling):
        from vllm import SamplingParams

        params = SamplingParams(**sampling, logprobs=0, detokenize=False)
        start = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        return time.perf_counter() - start

    def timed_generate(self, prompt_ids, sampling):
        """The completions too, so that the caller's round trip includes returning them."""
        start = time.perf_counter()
        completions = self.generate(prompt_ids, dict(sampling, logprobs=True))
        return completions, time.perf_counter() - start


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
