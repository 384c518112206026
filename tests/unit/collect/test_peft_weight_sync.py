"""What a weight push sends for a peft model (TorchRL's GRPO scripts train with LoRA): the base
model's names and the merged weights, as TorchRL's ``merge_and_unload()`` gives them, and the
trained model left as it was (small random Qwen2 models built in memory, adapters set as
TorchRL's ``get_hf_model`` sets them)."""

from __future__ import annotations

import copy

import pytest
import torch

from rlpost.collect.weight_update import (
    _check_metadata,
    _weights_to_send,
    get_model_metadata,
    peft_merged_weights,
    vLLMUpdater,
)
from rlpost.policies import TransformersWrapper
from rlpost.transport.bucketing import StreamedTensors

pytestmark = pytest.mark.unit


def torchrl_lora_model(dtype: torch.dtype = torch.float32, seed: int = 0):
    """A tiny Qwen2 with TorchRL's default LoRA (``get_hf_model``: rank 8, alpha 16, every linear
    layer, no dropout; the adapters kept in fp32 on a base of ``dtype``), its B set non-zero (a
    fresh adapter merges to nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    base = Qwen2ForCausalLM(config).to(dtype)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, bias="none",
                      task_type="CAUSAL_LM", inference_mode=False, init_lora_weights=True)  # fmt: skip
    model = get_peft_model(base, lora, autocast_adapter_dtype=True)
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(torch.float32)
            if "lora_B" in name:
                param.data.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval()


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_unchanged(model, before: dict[str, torch.Tensor]) -> None:
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    assert isinstance(model, PeftModel) and any(isinstance(m, LoraLayer) for m in model.modules())
    after = model.state_dict()
    assert list(after) == list(before)  # the adapters are still there, under peft's names
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_peft_model_sends_the_merged_base_weights_and_stays_as_it_was(dtype, tiny_tokenizer):
    model = torchrl_lora_model(dtype)
    before = snapshot(model)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()  # TorchRL's scheme's weights
    assert not any("lora_" in name or "base_layer" in name for name in reference)

    sent = _weights_to_send(model)
    assert isinstance(sent, StreamedTensors)  # made while the bus sends them, not all at once
    pairs = list(sent)
    assert [name for name, _ in pairs] == [name for name, _, _ in sent.specs] == list(reference)
    tolerance = 1e-6 if dtype == torch.float32 else 0.0  # bf16: peft's own cast-then-add, exactly
    for (name, tensor), (_, spec_dtype, spec_shape) in zip(pairs, sent.specs):
        want = reference[name]
        assert tensor.dtype == spec_dtype == want.dtype == dtype and tuple(tensor.shape) == spec_shape, name
        assert not tensor.requires_grad, name
        assert torch.allclose(tensor, want, atol=tolerance, rtol=0), name
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    base_q_proj = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert not torch.equal(dict(pairs)[q_proj], before[base_q_proj])  # the adapter is in what is sent
    assert_unchanged(model, before)

    # TorchRL's get_model_metadata of a peft model: its merged state_dict's names, dtypes, shapes
    metadata = get_model_metadata(model)
    assert metadata == {name: (t.dtype, t.shape) for name, t in reference.items()}
    wrapper = TransformersWrapper(model, tokenizer=tiny_tokenizer, generate=False)
    assert vLLMUpdater.get_model_metadata(wrapper) == metadata
    _check_metadata(sent, metadata)  # what is sent passes the check against it
    without_head = StreamedTensors(tuple(spec for spec in sent.specs if spec[0] != "lm_head.weight"), lambda: iter(()))
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        _check_metadata(without_head, metadata)
    assert_unchanged(model, before)


def test_training_after_a_push_moves_the_adapter_and_the_next_push_sends_it():
    """The push leaves the trained model trainable: a step after it changes the adapter (not the
    frozen base), and the next push sends the new merge."""
    model = torchrl_lora_model()
    first = dict(peft_merged_weights(model))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss.backward()
    optimizer.step()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    second = dict(peft_merged_weights(model))
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(first[q_proj], second[q_proj])
    assert all(torch.allclose(second[name], want, atol=1e-6) for name, want in reference.items())


def test_a_plain_model_and_its_state_dict_send_as_before():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    for weights in (model, model.state_dict()):
        sent = _weights_to_send(weights)
        assert isinstance(sent, list) and [n for n, _ in sent] == ["0.weight", "0.bias", "1.weight", "1.bias"]
