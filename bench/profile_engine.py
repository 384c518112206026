"""Where vLLM's CPU engine spends a generate call of the tiny race: 16 prompts x 8 samples x 16 tokens.

On the tiny model rlpost's collect takes more than twice TRL's (section 2), on the same FLOPs.
This benchmark names where the difference goes. A child process builds the engine as an inference
worker does (configs/tiny-cpu.yaml's engine section; its model on 1 bound thread, vLLM's choice on
2 cores, then on 2, as the race's sync runs set it), once in the child's own process (the CPU
default, ``rollout.engine.in_process``) and once in processes of its own (vLLM's layout), and
generates the race's workload: first ``--repeats`` calls timed with nothing watching, then
``--profiled`` calls sampled by py-spy in the engine's processes (in vLLM's layout three: the
caller, vLLM's EngineCore with its scheduler, and the worker that runs the model). Each
process's main-thread samples are grouped into the phases below, in CPU-seconds per generate call
(py-spy samples running threads only: a busy-poll counts, a blocking wait does not; the
profiler's own sampling slows the calls, which the figures show). The baseline is transformers'
``generate`` on the same prompts and settings (both cores, sampling, the same number of tokens),
the path TRL's trainer generates with here.

py-spy (in the bench extra) has to be allowed to read the child's memory (root, or
``kernel.yama.ptrace_scope`` 0); without it the profile is left out and the timings remain.

    python -m bench profile_engine [--quick] [-- --repeats 20 --profiled 20]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.common import CONFIG, TINY_MODEL, Result, median, wait_for_quiet

PROMPTS, SAMPLES, TOKENS = 16, 8, 16  # the tiny race's step: 128 completions of 16 tokens
LAYOUTS = {"in_process": "in process", "processes": "in its own processes"}


def phase(process: str, frames: str) -> str | None:
    """The phase of one sampled main-thread stack (None: not a main-thread frame of interest)."""
    if "VLLM::Worker" in process:
        if "worker_busy_loop" not in frames:
            return None
        if "acquire_read" in frames or "dequeue" in frames:
            return "worker: waits for the scheduler's next step (busy-polls)"
        if "enqueue" in frames:
            return "worker: sends the step's output"
        if "sample_tokens" in frames or "Sampler" in frames or "TopKTopP" in frames:
            return "worker: sampling and sampled-token log-probs"
        if "_prepare_inputs" in frames or "_update_states" in frames:
            return "worker: prepares the step's inputs"
        if "execute_model" in frames:
            return "worker: model forward"
        return "worker: other"
    if "VLLM::EngineCore" in process:
        if "run_busy_loop" not in frames:
            return None
        if "get_response" in frames or "_wait_for_response" in frames:
            return "EngineCore: waits for the worker (busy-polls)"
        if "Scheduler.schedule" in frames:
            return "EngineCore: schedules the step"
        if "update_from_output" in frames:
            return "EngineCore: updates the requests from the step's output"
        if "collective_rpc" in frames:
            return "EngineCore: sends the step to the worker"
        if "_process_input_queue" in frames:
            return "EngineCore: waits for requests (between calls)"
        return "EngineCore: other"
    if "_generate_loop" not in frames:
        return None
    # an engine in the caller's process (rollout.engine.in_process): the caller steps it
    in_process = "EngineCore.step" in frames
    if in_process and ("execute_model" in frames or "sample_tokens" in frames):
        if "sample_tokens" in frames or "Sampler" in frames or "TopKTopP" in frames:
            return "in process: sampling and sampled-token log-probs"
        if "_prepare_inputs" in frames or "_update_states" in frames:
            return "in process: prepares the step's inputs"
        return "in process: model forward"
    if in_process and "Scheduler.schedule" in frames:
        return "in process: schedules the step"
    if in_process and "update_from_output" in frames:
        return "in process: updates the requests from the step's output"
    if "get_output" in frames:
        return "caller: waits for the engine's outputs"
    if "add_request" in frames or "_render" in frames:
        return "caller: adds the requests"
    if "process_outputs" in frames:
        return "caller: processes the outputs"
    return "caller: other"


def phases_from_raw(path: Path, rate: int, calls: int) -> dict[str, float]:
    """py-spy's raw output (``frame;frame;... count`` per line) -> seconds per call by phase."""
    counts: Counter = Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        processes = [f for f in frames if f.startswith("process ")]
        name = phase(processes[-1] if processes else "", stack)
        if name is not None:
            counts[name] += int(n)
    return {k: round(v / rate / calls, 4) for k, v in sorted(counts.items())}


# ------------------------------------------------------------------------------- child process


def _generate_loop(llm, prompts, params, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return times


def child(args) -> None:
    """Build the engine, time it, wait for the profiler, time it again; then transformers."""
    import torch
    from vllm import SamplingParams

    from rlpost.actors.inference import engine_kwargs
    from rlpost.config import load_config
    from rlpost.data import History
    from rlpost.envs.arithmetic import ARITHMETIC_SYSTEM_PROMPT, make_arithmetic_rows
    from rlpost.policies import make_vllm_engine, shutdown_vllm_engine
    from rlpost.policies.vllm_wrapper import engine_cpu_cores

    engine = load_config(CONFIG).rollout.engine
    kwargs = engine_kwargs(engine, on_gpu=False)
    kwargs["in_process"] = args.in_process
    llm = make_vllm_engine(args.model, dtype="float32", cpu_cores=engine_cpu_cores(int(args.cpu_threads)), **kwargs)
    tokenizer = llm.get_tokenizer()
    system = {"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT}
    rows = make_arithmetic_rows(PROMPTS, seed=0)
    history = History.from_chats([[system, {"role": "user", "content": r["question"]}] for r in rows])
    prompt_ids = [p.tolist() for p in history.apply_chat_template(tokenizer, tokenize=True)]
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    # every completion runs its 16 tokens (min_tokens), so both sides generate the same number
    params = SamplingParams(n=SAMPLES, max_tokens=TOKENS, min_tokens=TOKENS, temperature=1.0, seed=0, logprobs=0,
                            detokenize=False)  # fmt: skip
    _generate_loop(llm, prompts, params, 3)  # warm-up
    out = {"engine_s": _generate_loop(llm, prompts, params, args.repeats)}
    print("PROFILE-START", flush=True)
    sys.stdin.readline()  # the parent's profiler is attached
    out["profiled_engine_s"] = _generate_loop(llm, prompts, params, args.profiled)
    print("PROFILE-END", flush=True)
    sys.stdin.readline()  # the profiler has written its samples
    shutdown_vllm_engine(llm)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer.pad({"input_ids": prompt_ids}, return_tensors="pt")
    hf_times = []
    for i in range(args.repeats + 2):  # two warm-ups
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=TOKENS,
                           min_new_tokens=TOKENS, num_return_sequences=SAMPLES,
                           pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        if i >= 2:
            hf_times.append(time.perf_counter() - start)
    out["transformers_s"] = hf_times
    print("RESULT " + json.dumps(out), flush=True)


# ------------------------------------------------------------------------------- parent process


def profile_child(args, threads: int, in_process: bool, result: Result) -> dict:
    """Run one child (the engine on ``threads`` threads, in the child's process or in processes
    of its own), with py-spy over its profiled calls."""
    cmd = [sys.executable, "-m", "bench.profile_engine", "--child", "--model", args.model, "--cpu-threads",
           str(threads), "--repeats", str(args.repeats), "--profiled", str(args.profiled)]  # fmt: skip
    if in_process:
        cmd.append("--in-process")
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    spy_bin = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    raw = Path(tempfile.mkdtemp(prefix="rlpost-profile-engine-")) / "raw.txt"
    spy, out = None, None
    for line in proc.stdout:  # the child says where it is; vLLM's own lines pass by
        if line.strip() == "PROFILE-START":
            if Path(spy_bin).exists():
                spy = subprocess.Popen([spy_bin, "record", "--pid", str(proc.pid), "--subprocesses",
                                        "--rate", str(args.rate), "--format", "raw", "-o", str(raw)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
                time.sleep(2)  # py-spy attaches
            else:
                result.note("py-spy is not installed (pip install -e .[bench]): the profile is left out")
            proc.stdin.write("go\n")
            proc.stdin.flush()
        elif line.strip() == "PROFILE-END":
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its samples on SIGINT
                _, err = spy.communicate(timeout=60)
                if not raw.is_file():
                    result.note(f"py-spy wrote no profile (is ptrace allowed?): {err.strip()[-300:]}")
            proc.stdin.write("go\n")
            proc.stdin.flush()
        elif line.startswith("RESULT "):
            out = json.loads(line[len("RESULT ") :])
    if proc.wait() != 0 or out is None:
        raise SystemExit(f"the profiled child ({threads} engine threads) failed (exit {proc.returncode})")
    if raw.is_file():
        out["phases_s_per_call"] = phases_from_raw(raw, args.rate, len(out["profiled_engine_s"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: 3 timed and 3 profiled calls")
    parser.add_argument("--model", default=str(TINY_MODEL))
    parser.add_argument("--repeats", type=int, default=None, help="timed generate calls per side (default 20)")
    parser.add_argument("--profiled", type=int, default=None, help="generate calls under py-spy (default 20)")
    parser.add_argument("--rate", type=int, default=50, help="py-spy samples per second (more disturb the 2 cores)")
    parser.add_argument("--cpu-threads", default="1,2", help="the engine's model threads, one child each")
    parser.add_argument("--layouts", default="in_process,processes",
                        help="where the engine runs, one child each: in the caller's process (rollout.engine."
                        "in_process, the CPU default) and/or in processes of its own (vLLM's layout)")  # fmt: skip
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.repeats = args.repeats or (3 if args.quick else 20)
    args.profiled = args.profiled or (3 if args.quick else 20)
    if args.child:
        child(args)
        return
    threads = [int(t) for t in str(args.cpu_threads).split(",")]
    layouts = [layout.strip() for layout in args.layouts.split(",")]
    unknown = set(layouts) - set(LAYOUTS)
    if unknown:
        parser.error(f"--layouts: unknown {sorted(unknown)}; choose from {sorted(LAYOUTS)}")
    result = Result(
        "profile_engine",
        args.quick,
        {"model": args.model, "prompts": PROMPTS, "samples": SAMPLES, "max_tokens": TOKENS, "cpu_threads": threads,
         "layouts": layouts, "repeats": args.repeats, "profiled_calls": args.profiled, "py_spy_rate": args.rate},
    )  # fmt: skip
    wait_for_quiet(args.quick)
    hf, engines = [], {}
    for layout in layouts:
        for n in threads:
            out = profile_child(args, n, layout == "in_process", result)
            hf += out["transformers_s"]  # the baseline does not depend on the engine: pooled
            engines[f"{LAYOUTS[layout]}, {n} thread(s)"] = {
                "median_s": median(out["engine_s"]),
                "repeats": out["engine_s"],
                "under_py_spy_median_s": median(out["profiled_engine_s"]),
                "phases_s_per_call": out.get("phases_s_per_call"),
            }
    result.cases["transformers generate (2 threads)"] = {"median_s": median(hf), "repeats": hf}
    for name, case in engines.items():
        result.cases[f"vllm engine {name}"] = case
        result.ratios[f"vllm engine ({name}) / transformers generate, s per call"] = round(
            case["median_s"] / median(hf), 3
        )
    result.write()


if __name__ == "__main__":
    main()
