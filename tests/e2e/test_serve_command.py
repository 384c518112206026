"""`rlpost serve` as an operator runs it, and tinker-cookbook's own loops against it.

The command starts its own Ray cluster and fleet; the tinker SDK trains and samples through it,
the node's Prometheus endpoint shows the service's metrics, `rlpost scale STORAGE_DIR` adds an
engine and takes it away, tinker-cookbook's `recipes/sl_loop.py` and `recipes/rl_loop.py`
(tinker-cookbook 0.6.1, unchanged) train through the same service as a second tenant, and SIGTERM
stops it (exit 143) leaving none of its processes behind. One service for both, since its start
is most of each one's time.

The cookbook's loops run as a user would run them, with only the base URL, the model name and
local data changed:

- The model name: the recipes accept only names the cookbook knows, so the server serves the
  tiny model under the name `Qwen/Qwen3-4B-Instruct-2507` (its chat template is that model's
  format), and the working folder holds `Qwen/Qwen3-4B-Instruct-2507`, a link to the tiny model, where
  the cookbook loads its tokenizer from.
- The data: the recipes load `HuggingFaceH4/no_robots` and `openai/gsm8k` by name; `datasets`
  reads a folder of that name in the working folder first, so local JSONL files stand in.
- The loops: small batches and few steps; `rl_loop`'s loss is `importance_sampling` (its default,
  `stable_reinforce`, is one this server does not compute) and its completions short enough for the
  tiny model's 512 tokens. `rl_loop` starts from the SFT loop's last state, through the cookbook's
  own resume (a `checkpoints.jsonl` line in its log folder): the service's load path.

What the RL loop cannot show here: its reward is 1 only for an answer written as `\\boxed{...}`,
and the tiny model cannot learn to write one with LoRA. Its letters' embeddings (`b`, `o`, `x`)
were never trained (it learned arithmetic only), the output head is those embeddings (tied), and
the service does not adapt the head (vLLM serves no LoRA on it): SFT on `\\boxed{c}` lowers the
digits' loss but leaves those letters at about -5.5 nats whatever the rank or learning rate
(measured). So every group's rewards are equal, 0, and `rl_loop` skips each gradient step ("all
advantages zero"); it still samples, grades, saves and logs through the service for every batch.
The RL step itself (sample, importance_sampling, optim_step) is tested with the SDK in
tests/integration/serve/test_tinker_sdk.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(1500)]
tinker = pytest.importorskip("tinker", reason="the tinker SDK is in the dev extra")
from tinker import types  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KEY = "tml-operator-0123456789"
COOKBOOK_KEY = "tml-cookbook-0123456789"
MODEL = "Qwen/Qwen3-4B-Instruct-2507"  # the name the cookbook knows; the tiny model serves under it
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
# rl_loop's few-shot turn, so that the SFT rows are the prompts rl_loop renders
FEW_SHOT = [
    {"role": "user", "content": "How many r's are in strawberry?" + SUFFIX},
    {"role": "assistant", "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) "
     "w 6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}"},
]  # fmt: skip


def _workdir(root: Path) -> Path:
    rng = random.Random(0)
    pairs = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(256)]
    (root / "Qwen").mkdir(parents=True)
    (root / "Qwen" / "Qwen3-4B-Instruct-2507").symlink_to(REPO / "models" / "tiny-model")
    sft = root / "HuggingFaceH4" / "no_robots" / "data"
    sft.mkdir(parents=True)
    with open(sft / "train.jsonl", "w") as f:
        for a, b in pairs:
            question = {"role": "user", "content": f"What is {a} + {b}?" + SUFFIX}
            answer = {"role": "assistant", "content": f"\\boxed{{{a + b}}}"}
            f.write(json.dumps({"messages": [*FEW_SHOT, question, answer]}) + "\n")
    gsm8k = root / "openai" / "gsm8k"
    (gsm8k / "main").mkdir(parents=True)
    (gsm8k / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n---\n"
    )
    with open(gsm8k / "main" / "train.jsonl", "w") as f:
        for a, b in pairs:
            f.write(json.dumps({"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n")  # fmt: skip
    return root


def _session_pids(session: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session:
                found.append(int(entry))
    return found


def _read_until(process, pattern: str, timeout_s: float, seen: list[str]) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"no line matching {pattern!r}; the command printed:\n{''.join(seen)}")


def _recipe(name: str, root: Path, env: dict, *overrides: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", f"tinker_cookbook.recipes.{name}", *overrides], cwd=root, env=env,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    log_path = next(o.split("=", 1)[1] for o in overrides if o.startswith("log_path="))
    return [json.loads(line) for line in (Path(log_path) / "metrics.jsonl").read_text().splitlines()]


def _cookbook_loops(url: str, root: Path, env: dict) -> None:
    """sl_loop, then rl_loop from its last state, as the cookbook's tenant (module docstring)."""
    sl_log = root / "runs" / "sl"
    sl = _recipe("sl_loop", root, env, f"base_url={url}", f"model_name={MODEL}", f"log_path={sl_log}",
                 "batch_size=16", "max_steps=12", "max_length=512", "lora_rank=8", "learning_rate=5e-3",
                 "save_every=6", "ttl_seconds=None", "train_on_what=last_assistant_message")  # fmt: skip
    nll = [row["train_mean_nll"] for row in sl if "train_mean_nll" in row]
    assert len(nll) == 12 and nll[-1] < 0.7 * nll[0], nll

    rl_log = root / "runs" / "rl"
    rl_log.mkdir(parents=True)
    last = json.loads((sl_log / "checkpoints.jsonl").read_text().splitlines()[-1])
    (rl_log / "checkpoints.jsonl").write_text(json.dumps({**last, "batch": 0}) + "\n")
    rl = _recipe("rl_loop", root, env, f"base_url={url}", f"model_name={MODEL}", f"log_path={rl_log}",
                 "batch_size=4", "group_size=4", "max_tokens=16", "max_steps=3", "lora_rank=8",
                 "learning_rate=1e-3", "save_every=2", "ttl_seconds=None", "loss_fn=importance_sampling")  # fmt: skip
    rewards = [row["reward/total"] for row in rl if "reward/total" in row]
    assert rewards == [0.0, 0.0, 0.0], rl  # sampled and graded each batch (the docstring says why 0)
    saved = [json.loads(line) for line in (rl_log / "checkpoints.jsonl").read_text().splitlines()]
    assert any(c.get("sampler_path", "").startswith("tinker://") for c in saved[1:]), saved


def test_serve_trains_samples_exports_metrics_scales_runs_the_cookbook_and_stops_on_sigterm(tmp_path):
    # here, not at import: make test collects this module (and deselects it) before make test-long installs it
    pytest.importorskip("tinker_cookbook", reason="make test-long installs tinker-cookbook (make tinker-cookbook)")
    # Ctrl-C's SIGINT takes the same path (tests/unit/serve/test_server_signals.py); one run here
    stop, code = signal.SIGTERM, 143
    env = {**os.environ, "RLPOST_SERVE_API_KEYS": f"operator={KEY},cookbook={COOKBOOK_KEY}", "TINKER_TELEMETRY": "0",
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    # (the options after the overrides: argparse reads no positional after an option)
    command = [sys.executable, "-m", "rlpost.ops.cli", "serve", "configs/serve-tiny-cpu.yaml", f"model_name={MODEL}",
               f"tokenizer_id={REPO / 'models' / 'tiny-model'}", f"storage_dir={tmp_path / 'storage'}",
               "resources.trainer.num_cpus=0.5",
               "resources.inference.num_cpus=0.5", "inference_workers=1..2", "--port", "0"]  # fmt: skip
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)  # fmt: skip
    seen: list[str] = []
    try:
        metrics_url = _read_until(process, r"metrics at (http://\S+/metrics)", 120, seen).group(1)
        url = _read_until(process, r"the Tinker API on (http://[\d.]+:\d+)", 300, seen).group(1)

        client = tinker.ServiceClient(base_url=url, api_key=KEY)
        training = client.create_lora_training_client(base_model=MODEL, rank=8).result()
        tokens = training.get_tokenizer().encode("What is 2 + 2? 4")
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})  # fmt: skip
        assert training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        sample = sampler.sample(types.ModelInput.from_ints(tokens[:4]), 1, types.SamplingParams(max_tokens=3)).result()
        assert len(sample.sequences[0].tokens) == 3
        with pytest.raises(tinker.RequestFailedError, match="unknown loss"):  # a user error, counted
            training.forward_backward([datum], "dpo").result()

        deadline, text = time.monotonic() + 90, ""
        while time.monotonic() < deadline and not ('kind="forward_backward"' in text and "request_errors" in text):
            time.sleep(3)
            text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        assert re.search(r'ray_rlpost_serve_requests_total\{[^}]*kind="forward_backward"[^}]*tenant="operator"', text)
        assert re.search(r"ray_rlpost_serve_tokens_sampled_total\{[^}]*tenant=\"operator\"[^}]*\} 3", text)
        assert re.search(r"ray_rlpost_serve_models\{[^}]*\} 1", text)
        assert re.search(r'ray_rlpost_serve_tenant_pending\{[^}]*tenant="operator"[^}]*\} 0', text)
        assert re.search(r'ray_rlpost_serve_trainer_adapters\{[^}]*where="resident"[^}]*\} 1', text)
        from rlpost.ops import dashboards

        for title, expr in dashboards.panel_queries(dashboards.SERVE_ROWS):  # the service dashboard has data
            for name in re.findall(r"\bray_rlpost_serve_\w+", expr):
                assert re.search(rf"^{name}\{{", text, re.MULTILINE), (title, name)

        # an operator adds an engine and takes it away again, as for a training run
        def scale(*words):
            return subprocess.run([sys.executable, "-m", "rlpost.ops.cli", "scale", str(tmp_path / "storage"), *words],
                                  cwd=REPO, env=env, capture_output=True, text=True, timeout=400)  # fmt: skip

        grown = scale("inference=2", "--wait", "300")
        assert grown.returncode == 0 and "inference workers: 2 serving of 2 wanted" in grown.stdout, grown
        prompt, params = types.ModelInput.from_ints(tokens[:4]), types.SamplingParams(max_tokens=3)
        for _ in range(2):  # one on each engine (the new one gets the adapter on its first use)
            assert len(sampler.sample(prompt, 1, params).result().sequences[0].tokens) == 3
        beyond = scale("inference=3")
        assert beyond.returncode == 2 and "outside the service's range 1..2" in beyond.stderr, beyond
        shrunk = scale("inference=1", "--wait", "120")
        assert shrunk.returncode == 0 and "inference workers: 1 serving of 1 wanted" in shrunk.stdout, shrunk
        assert len(sampler.sample(prompt, 1, params).result().sequences[0].tokens) == 3
        client.close("success").result(timeout=60)  # its session ends; the SDK's heartbeats stop

        # tinker-cookbook's loops, as a second tenant of the same service
        root = _workdir(tmp_path / "work")
        _cookbook_loops(url, root, {**env, "TINKER_API_KEY": COOKBOOK_KEY, "HF_HUB_OFFLINE": "1",
                                    "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                    "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets")})  # fmt: skip

        started = time.monotonic()
        process.send_signal(stop)
        exited = process.wait(timeout=120)
        seen += process.stdout.readlines()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    output = "".join(seen)
    assert exited == code, output
    assert "rlpost serve: stopping the fleet" in output and f"stopped by {stop.name}" in output
    assert time.monotonic() - started < 90
    deadline = time.monotonic() + 30
    while _session_pids(process.pid) and time.monotonic() < deadline:
        time.sleep(1)
    assert not _session_pids(process.pid), "processes of the service outlived it"
