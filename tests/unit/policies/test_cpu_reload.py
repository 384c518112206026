"""The direct CPU reload's planning: how update names map onto an engine's layers, and what it
refuses. Loading itself needs a real engine: tests/integration/actors/test_inference_worker.py."""

from __future__ import annotations

import pytest
import torch

from rlpost.policies.cpu_reload import DirectCpuReload, _shard_index, unsupported_reason

pytestmark = pytest.mark.unit


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = torch.nn.Linear(4, 12)


class PlainModel(torch.nn.Module):
    """torch layers, not vLLM's: the direct reload knows none of them."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block()])


def test_names_map_through_the_models_packed_modules():
    loader = DirectCpuReload(PlainModel())
    assert loader._map("layers.0.k_proj.weight") == ("layers.0.qkv_proj", "weight", 1)
    assert loader._map("layers.0.v_proj.bias") == ("layers.0.qkv_proj", "bias", 2)
    assert loader._map("layers.0.o_proj.weight") == ("layers.0.o_proj", "weight", None)
    assert loader._map("layers.0.up_proj.weight") == ("layers.0.gate_up_proj", "weight", 1)


def test_names_map_through_vllms_own_mapper_when_the_model_has_one():
    from vllm.model_executor.models.utils import WeightsMapper

    model = PlainModel()
    model.hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k")}
    )
    loader = DirectCpuReload(model)
    assert loader._map("model.layers.3.self_attn.k_proj.weight") == ("model.layers.3.self_attn.qkv_proj", "weight", 1)
    assert loader._map("model.norm.weight") == ("model.norm", "weight", None)


def test_what_it_cannot_place_is_named_and_left_to_reload_weights():
    model = PlainModel()
    reason = unsupported_reason(model)
    assert reason == "layers.0.qkv_proj is a Linear, not a layer the direct reload knows"
    plan = DirectCpuReload(model).plan(["layers.0.q_proj.weight"])
    assert plan == "layers.0.q_proj.weight maps to layers.0.qkv_proj, which the direct reload does not handle"
    assert "does not handle" in DirectCpuReload(model).plan(["nowhere.weight"])


def test_shard_ids_are_positions_in_the_fused_weight():
    assert [_shard_index(s) for s in ("q", "k", "v", 0, 1, None)] == [0, 1, 2, 0, 1, None]


def test_a_fused_layer_must_come_whole():
    model = PlainModel()
    model.layers[0].qkv_proj.output_sizes = [4, 4, 4]  # as vLLM's QKVParallelLinear has
    loader = DirectCpuReload(model)
    partial = {"q": ("layers.0.qkv_proj", "weight", 0), "v": ("layers.0.qkv_proj", "weight", 2)}
    assert loader._check_fused_complete(partial) == (
        "the update brings shards [0, 2] of layers.0.qkv_proj.weight, which has [0, 1, 2]"
    )
    whole = {**partial, "k": ("layers.0.qkv_proj", "weight", 1), "o": ("layers.0.o_proj", "weight", None)}
    assert loader._check_fused_complete(whole) is whole
