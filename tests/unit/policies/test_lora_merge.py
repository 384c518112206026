"""What a LoRA run's merged weight sync sends: each adapted weight merged as peft merges it, and
only the layers training can change (small random models built in memory)."""

from __future__ import annotations

import pytest
import torch

from rlpost.config import load_config
from rlpost.policies import lora

pytestmark = pytest.mark.unit


def _randomised(model, seed: int = 0):
    """``model`` with a LoRA adapter whose B is not zero (a fresh adapter merges to nothing)."""
    peft_model = lora.apply_lora(model, load_config(None, ["model.lora={rank: 4}"]).model.lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return peft_model


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    return Qwen2ForCausalLM(config)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2, n_positions=64))


@pytest.mark.parametrize("make, targets", [(_qwen2, None), (_gpt2, ["c_attn", "c_proj", "c_fc"])])
def test_each_adapted_weight_is_merged_as_peft_merges_it(make, targets):
    from peft.tuners.lora import LoraLayer

    model = make()
    section = ["model.lora={rank: 4}"] + ([f"model.lora.target_modules=[{', '.join(targets)}]"] if targets else [])
    peft_model = lora.apply_lora(model, load_config(None, section).model.lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    layers = {n: m for n, m in peft_model.get_base_model().named_modules() if isinstance(m, LoraLayer)}
    merged = dict(lora.merged_tensors(peft_model))
    assert layers
    for name, layer in layers.items():
        want = layer.base_layer.weight + layer.get_delta_weight("default")  # peft's own merge
        assert torch.allclose(merged[f"{name}.weight"], want, atol=1e-6), name
        assert not torch.allclose(merged[f"{name}.weight"], layer.base_layer.weight, atol=1e-3), name


def test_the_sync_leaves_out_the_frozen_embeddings_head_and_norms():
    peft_model = _randomised(_qwen2())
    every = dict(lora.merged_tensors(peft_model))
    sent = dict(lora.merged_tensors(peft_model, changing_only=True))
    left_out = set(every) - set(sent)
    assert left_out == {name for name in every if "embed_tokens" in name or "norm" in name or name == "lm_head.weight"}
    assert all(torch.equal(sent[name], every[name]) for name in sent)
    # every projection is sent, with its bias: an engine fuses q/k/v and gate/up into one layer
    assert {name.rsplit(".", 2)[-2] for name in sent} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"}  # fmt: skip
    assert {name for name in sent if name.endswith(".bias")} == {
        f"model.layers.{i}.self_attn.{p}.bias" for i in range(2) for p in ("q_proj", "k_proj", "v_proj")
    }


def test_an_adapted_or_trainable_embedding_is_sent():
    model = _qwen2()
    section = load_config(None, ["model.lora={rank: 4, target_modules: [q_proj, embed_tokens]}"]).model.lora
    peft_model = lora.apply_lora(model, section)
    sent = {name for name, _ in lora.merged_tensors(peft_model, changing_only=True)}
    assert "model.embed_tokens.weight" in sent and "model.norm.weight" not in sent
    peft_model = _randomised(_qwen2())
    peft_model.get_base_model().model.norm.weight.requires_grad_(True)  # a norm trained beside the adapter
    assert "model.norm.weight" in {name for name, _ in lora.merged_tensors(peft_model, changing_only=True)}
