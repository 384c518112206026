"""The learner's weights in memory of their own, on the real tiny model
(rlpost.actors.learner.memory.own_trainable_weights): transformers maps the checkpoint file, and
the trainable weights are copied out of it."""

from __future__ import annotations

import pytest
import torch

from rlpost.actors.learner import Learner
from rlpost.actors.learner.memory import own_trainable_weights
from tests.integration.actors.learner.test_learner import make_cfg

pytestmark = pytest.mark.integration


def _inside(param, ranges: list[tuple[int, int]]) -> bool:
    return any(lo <= param.data_ptr() < hi for lo, hi in ranges)


def _mapped_ranges(path) -> list[tuple[int, int]]:
    """The address ranges of this process that map the file ``path``."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == str(path):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def test_own_trainable_weights_copies_them_out_of_the_mapped_checkpoint(tiny_model_path):
    """transformers maps the safetensors file and its CPU parameters are views of it: the first
    optimizer step would copy each page of them on a fault. The trainable ones are copied out
    (frozen ones stay mapped); tied weights stay tied and the values are unchanged."""
    from transformers import AutoModelForCausalLM

    checkpoint = (tiny_model_path / "model.safetensors").resolve()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    mapped = _mapped_ranges(checkpoint)
    params = list(model.parameters())
    assert mapped and all(_inside(p, mapped) for p in params), "transformers no longer maps the checkpoint"
    frozen = model.model.norm.weight
    frozen.requires_grad_(False)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert own_trainable_weights(model) == len(params) - 1
    assert _inside(frozen, mapped) and not any(_inside(p, mapped) for p in params if p is not frozen)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_the_learner_keeps_no_view_of_the_checkpoint_file(tiny_model_path):
    """Every weight of a full fine-tuning learner is its own copy, outside any mapping of the
    checkpoint file (other models of the test session may still map it)."""
    checkpoint = (tiny_model_path / "model.safetensors").resolve()
    learner = Learner(make_cfg(tiny_model_path))
    mapped = _mapped_ranges(checkpoint)
    params = list(learner.model.parameters())
    assert params and not [p for p in params if _inside(p, mapped)]
