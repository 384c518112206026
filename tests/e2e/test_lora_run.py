"""A LoRA run through the CLI (model.lora): it learns on the tiny task while each weight sync
carries only the adapter (model.lora.sync=adapter), and its checkpoints hold the adapter and the
merged model. (A LoRA checkpoint resumed, and the merged projections ``model.lora.sync=auto``
sends engines on CPUs, each served by a real engine: tests/integration/test_lora.py; the merged
weights of a peft model in whole runs: tests/e2e/test_torchrl_grpo_scripts.py.)

Every step practises the same 2 questions (data.num_synthetic_rows=2, 32 completions a step), as in
the learner-group runs. Measured: the last 4 steps' mean reward beat the first 4's by +0.36 with
lr 3e-3 (full fine-tuning at its lr 3e-4: +0.25 on the same run); each sync sent 311 KB of
adapter (rank 16) instead of the model's 2.0 MB, 0.67x the full sync's weight_sync_s on this tiny
model (on the 0.5B-shaped model, bench/bench_lora.py: 1.4% of the bytes, 0.021x the time)."""

import json
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM

# a run through the CLI (12 steps): in make test-long
pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(600)]

PRACTICE = [
    "trainer.prompts_per_step=2",
    "data.group_size=16",
    "data.num_synthetic_rows=2",
    "model.lora.save_merged=true",
    "model.lora.sync=adapter",
    "optimizer.lr=3e-3",
    "logging.progress=false",
    "logging.dashboard=false",
]


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def train(*args):
    out = subprocess.run([sys.executable, "-m", "rlpost.ops.cli", "train", *args], capture_output=True, text=True,
                         timeout=540)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_a_lora_run_learns_syncs_only_the_adapter_and_checkpoints_it(tmp_path, tiny_model_path):
    run_dir = tmp_path / "lora"
    train("configs/tiny-cpu.yaml", f"model.name_or_path={tiny_model_path}", "trainer.steps=12",
          "trainer.checkpoint_interval=6", *PRACTICE, "--run-dir", str(run_dir))  # fmt: skip
    rows = read(run_dir / "metrics.jsonl")
    assert [r["policy_version"] for r in rows] == list(range(1, 13))
    assert all(r["sync_logprob_diff"] <= 1e-3 for r in rows)  # the engine serves the adapter the learner trains
    rewards = [r["reward_mean"] for r in rows]
    assert sum(rewards[-4:]) / 4 - sum(rewards[:4]) / 4 > 0.08, rewards
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # the adapter (rank 16 on every projection): 15% of the weights a full sync sends
    assert all(r["weight_sync_bytes"] < 0.2 * full_bytes for r in rows), [r["weight_sync_bytes"] for r in rows]
    checkpoint = run_dir / "checkpoints" / "step_12"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    merged = AutoModelForCausalLM.from_pretrained(checkpoint / "merged")
    assert type(merged).__name__ == "Qwen2ForCausalLM"
