"""The model.lora section: parsing, cross-field checks, what the engines and workers are given."""

from __future__ import annotations

import pytest
import torch

from rlpost.actors.inference import InferenceSettings
from rlpost.actors.learner import LearnerSettings
from rlpost.config import ConfigError, load_config
from rlpost.policies.lora import adapter_config_dict, apply_lora, engine_lora_kwargs, sync_route

pytestmark = pytest.mark.unit


def test_lora_is_off_by_default_and_an_empty_section_gives_the_defaults():
    assert load_config(None).model.lora is None
    section = load_config(None, ["model.lora={}"]).model.lora
    assert (section.rank, section.alpha, section.dropout, section.sync, section.save_merged) == (
        16,
        32.0,
        0.0,
        "auto",
        False,
    )
    assert section.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # a dotted override reaches into the optional section and turns it on
    assert load_config(None, ["model.lora.rank=8"]).model.lora.rank == 8


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.lora.rank=0", "model.lora.rank"),
        ("model.lora.rank=1024", "model.lora.rank"),
        ("model.lora.dropout=1.0", "model.lora.dropout"),
        ("model.lora.sync=full", "model.lora.sync"),
        ("model.lora.target_modules=[]", "model.lora.target_modules"),
        ("model.lora.bogus=1", "unknown config key: model.lora.bogus"),
    ],
)
def test_bad_lora_values_name_their_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_lora_needs_a_single_learner_rank():
    with pytest.raises(ConfigError, match="model.lora with resources.learner.num_workers=2"):
        load_config(None, ["model.lora={}", "resources.learner={num_cpus: 1, num_workers: 2}"])


def test_engines_are_built_for_the_smallest_vllm_rank_that_holds_the_adapter():
    def rank(r):
        return engine_lora_kwargs(load_config(None, [f"model.lora.rank={r}"]).model.lora)["max_lora_rank"]

    assert [rank(r) for r in (1, 8, 10, 64, 300, 512)] == [1, 8, 16, 64, 320, 512]
    assert engine_lora_kwargs(load_config(None, ["model.lora={}"]).model.lora)["enable_lora"] is True


@pytest.mark.parametrize(
    "overrides, route",
    [
        ([], None),
        (["model.lora={}"], "merged"),  # auto, engines on CPUs: vLLM's CPU LoRA kernels are the slower
        (["model.lora={}", "resources.inference.num_gpus=1", "resources.learner.num_gpus=1"], "adapter"),
        (["model.lora.sync=adapter"], "adapter"),
        (["model.lora.sync=merged", "resources.inference.num_gpus=1", "resources.learner.num_gpus=1"], "merged"),
    ],
)
def test_workers_serve_the_adapter_only_where_the_syncs_send_it(overrides, route):
    cfg = load_config("configs/tiny-cpu.yaml", overrides)
    assert sync_route(cfg) == route and LearnerSettings.from_job(cfg).lora_sync == route
    served = InferenceSettings.from_job(cfg).lora
    assert (served is not None) == (route == "adapter") and (served is None or served.rank == 16)


def test_the_adapter_config_a_worker_writes_matches_the_section():
    section = load_config(None, ["model.lora.rank=8", "model.lora.alpha=4", "model.lora.target_modules=[q_proj]"])
    config = adapter_config_dict(section.model.lora, "/models/base")
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 4.0, "LORA")
    assert config["target_modules"] == ["q_proj"] and config["base_model_name_or_path"] == "/models/base"


def test_a_target_module_the_model_lacks_is_named():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.out = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    section = load_config(None, ["model.lora.target_modules=[q_proj, v_proj]"]).model.lora
    with pytest.raises(ValueError, match=r"no layer named \['v_proj'\]; its linear layers are \['out', 'q_proj'\]"):
        apply_lora(Block(), section)
