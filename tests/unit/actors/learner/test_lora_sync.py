"""What a learner's weight sync sends and by which route (rlpost.actors.learner.lora_sync): the
route the config chose, the fallback to merged weights where a worker serves no LoRA, the tensors
of each mode, and the adapters' dropout in training (small models built in memory)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from rlpost.actors.learner import LearnerSettings
from rlpost.actors.learner.lora_sync import (
    adapter_dropout,
    choose_sync_mode,
    lora_route,
    named_parameters_for_sync,
    sync_tensors,
    weights_for_sync,
)
from rlpost.config import load_config
from rlpost.policies import lora

pytestmark = pytest.mark.unit


def settings(*overrides: str, lora_sync: str | None = "keep") -> LearnerSettings:
    """The learner's settings of the default job with ``overrides``; ``lora_sync`` replaces the
    route the job chose (None: as an in-process Learner built without one)."""
    chosen = LearnerSettings.from_job(load_config(None, list(overrides)))
    return chosen if lora_sync == "keep" else dataclasses.replace(chosen, lora_sync=lora_sync)


def qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


def test_the_route_is_the_jobs_choice_or_without_one_the_sections():
    assert lora_route(settings("model.lora={}")) == "merged"  # auto, engines on CPUs
    assert lora_route(settings("model.lora.sync=adapter")) == "adapter"
    assert lora_route(settings("model.lora={}", lora_sync=None)) == "adapter"  # auto: adapter first
    assert lora_route(settings("model.lora.sync=merged", lora_sync=None)) == "merged"


def test_the_adapter_goes_where_every_worker_serves_lora_and_merged_weights_elsewhere(caplog):
    auto = settings("model.lora={}", lora_sync="adapter")
    assert choose_sync_mode(auto, "adapter", [True, True]) == "adapter"
    with caplog.at_level(logging.WARNING, logger="rlpost"):
        assert choose_sync_mode(auto, "adapter", [True, False]) == "merged"
    assert "inference workers [1] cannot serve a LoRA adapter" in caplog.text
    assert choose_sync_mode(auto, "merged", [True, True]) == "adapter"  # workers restarted: back to the adapter
    with pytest.raises(RuntimeError, match=r"model.lora.sync=adapter, but inference workers \[0, 2\] cannot"):
        choose_sync_mode(settings("model.lora.sync=adapter"), "adapter", [False, True, False])


def test_without_lora_or_on_a_merged_route_the_mode_stays():
    assert choose_sync_mode(settings(), "full", [False]) == "full"
    assert choose_sync_mode(settings("model.lora={}"), "merged", [True]) == "merged"


def test_each_mode_sends_its_tensors_cast_for_the_engines():
    base = qwen2()
    full = dict(named_parameters_for_sync(base, "full", "bfloat16"))
    assert list(full) == list(base.state_dict())  # lm_head.weight too, though tied
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous() for t in full.values())
    adapted = lora.apply_lora(base, load_config(None, ["model.lora={rank: 4}"]).model.lora)
    adapter = dict(sync_tensors(adapted, "adapter"))
    assert adapter and all(".lora_A." in name or ".lora_B." in name for name in adapter)
    merged = [name for name, _ in sync_tensors(adapted, "merged")]
    assert merged and not [name for name in merged if "lora_" in name or "embed_tokens" in name or "norm" in name]
    streamed = weights_for_sync(adapted, "adapter", "float32", iter(()))
    assert [(name, shape) for name, _, shape in streamed.specs] == [(n, tuple(t.shape)) for n, t in adapter.items()]


def test_the_adapters_dropout_is_on_for_a_training_pass_only():
    section = load_config(None, ["model.lora={rank: 4, dropout: 0.1}"]).model.lora
    model = lora.apply_lora(qwen2(), section).eval()
    dropouts = lora.adapter_dropouts(model)
    assert dropouts and not any(d.training for d in dropouts)
    with adapter_dropout(model, section):
        assert all(d.training for d in dropouts)
    assert not any(d.training for d in dropouts)
    with pytest.raises(ValueError, match="a failed pass"), adapter_dropout(model, section):
        raise ValueError("a failed pass")
    assert not any(d.training for d in dropouts)  # off again whatever the pass did
    with adapter_dropout(model, section.model_copy(update={"dropout": 0.0})):  # dropout 0: nothing to turn on
        assert not any(d.training for d in dropouts)
