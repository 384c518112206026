"""tinker-cookbook's own loops against `rlpost serve`: `recipes/sl_loop.py` and `recipes/rl_loop.py`
(tinker-cookbook 0.6.1, unchanged), run as a user would, with only the base URL, the model name and
local data changed.

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
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(1500)]
pytest.importorskip("tinker_cookbook", reason="make test-long installs tinker-cookbook (make tinker-cookbook)")

REPO = Path(__file__).resolve().parents[2]
KEY = "tml-cookbook-0123456789"
MODEL = "Qwen/Qwen3-4B-Instruct-2507"
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


def _start_server(root: Path, env: dict) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "rlpost.ops.cli", "serve", "configs/serve-tiny-cpu.yaml", f"model_name={MODEL}",
               f"tokenizer_id={REPO / 'models' / 'tiny-model'}", f"storage_dir={root / 'storage'}",
               "resources.trainer.num_cpus=0.5", "resources.inference.num_cpus=0.5", "--port", "0"]  # fmt: skip
    server = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)  # fmt: skip
    seen, deadline = [], time.monotonic() + 300
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line:
            break
        seen.append(line)
        match = re.search(r"the Tinker API on (http://[\d.]+:\d+)", line)
        if match:
            return server, match.group(1)
    server.kill()
    raise AssertionError("rlpost serve did not start:\n" + "".join(seen))


def _recipe(name: str, root: Path, env: dict, *overrides: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", f"tinker_cookbook.recipes.{name}", *overrides], cwd=root, env=env,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    log_path = next(o.split("=", 1)[1] for o in overrides if o.startswith("log_path="))
    return [json.loads(line) for line in (Path(log_path) / "metrics.jsonl").read_text().splitlines()]


def test_the_cookbooks_supervised_and_rl_loops_train_through_rlpost_serve(tmp_path):
    root = _workdir(tmp_path / "work")
    env = {**os.environ, "RLPOST_SERVE_API_KEYS": f"cookbook={KEY}", "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"), "PYTHONUNBUFFERED": "1"}  # fmt: skip
    server, url = _start_server(root, env)
    try:
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
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
