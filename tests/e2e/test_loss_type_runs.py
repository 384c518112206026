"""The shipped configs of the other losses (DAPO, expert iteration, on-policy distillation) run as
``rlpost train`` on the tier's shared cluster, a few steps each on the tiny model. CISPO's config
differs from DAPO's in its loss section only: tests/unit/test_config.py loads it, and
tests/integration/actors/learner/test_learner_loss_types.py trains the tiny model with its loss."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(900)]


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def train(config: str, run_dir, ray_head, *overrides: str):
    out = subprocess.run(
        [sys.executable, "-m", "rlpost.ops.cli", "train", config, "trainer.steps=3", "trainer.prompts_per_step=4",
         "eval.interval=0", "logging.progress=false", *overrides, "--address", ray_head.gcs_address,
         "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=540, env=ray_head.env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    return rows


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tiny_model_path):
    """A teacher with the tiny model's tokenizer that scores differently: its weights nudged."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("teacher")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(folder)
    return folder


def test_dapo_and_expert_iteration_configs_train(tmp_path, tiny_model_path, ray_head):
    dapo = train("configs/tiny-cpu-dapo.yaml", tmp_path / "dapo", ray_head, f"model.name_or_path={tiny_model_path}")
    assert all(0.0 <= r["clip_fraction"] <= 1.0 for r in dapo)
    expert = train(
        "configs/tiny-cpu-expert-iteration.yaml", tmp_path / "expert", ray_head, f"model.name_or_path={tiny_model_path}"
    )
    for r in expert:
        assert r["loss"] > 0  # the NLL of the kept samples
        assert r["clip_fraction"] is None  # no importance ratio in SFT
        # at most top_k=2 of each group's 8 are trained on (4 groups a step)
        assert 1 <= r["num_samples"] <= 2 * 4


def test_the_distillation_config_trains_toward_its_teacher(tmp_path, tiny_model_path, teacher, ray_head):
    rows = train(
        "configs/tiny-cpu-distillation.yaml", tmp_path / "distill", ray_head,
        f"model.name_or_path={tiny_model_path}", f"reference.model={teacher}",
    )  # fmt: skip
    for r in rows:
        assert r["kl_to_ref"] > 0  # the KL to the teacher, measured on every step
    text = (tmp_path / "distill" / "config.yaml").read_text()
    assert str(teacher) in text and "coef: 1.0" in text
