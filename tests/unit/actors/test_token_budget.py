"""The learner's auto token budget: the per-token estimate and what free memory makes of it."""

from types import SimpleNamespace

import pytest
import torch

from rlpost.actors import token_budget
from rlpost.actors.token_budget import GRANULE, MAX_BUDGET, auto_token_budget, bytes_per_token

pytestmark = pytest.mark.unit

# Qwen2.5-0.5B's shape with 2 layers (the scoring bench's model)
QWEN = SimpleNamespace(hidden_size=896, num_hidden_layers=2, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=151936)  # fmt: skip


def test_bytes_per_token_counts_layers_checkpointing_and_the_dense_logits():
    chunked = bytes_per_token(QWEN, activation_bytes=4, gradient_checkpointing=False, chunked=True)
    per_layer = 9 * 896 + 3 * 128 + 4 * 4864
    assert chunked == 4 * (2 * per_layer + 4 * 896)  # 0.24 MB: the bench measured 0.14 MB
    assert 1.5 < chunked / 0.142e6 < 1.8  # safe, not wildly so
    dense = bytes_per_token(QWEN, activation_bytes=4, gradient_checkpointing=False, chunked=False)
    assert dense - chunked == 12 * 151936  # logits, log-softmax and their gradient, float32
    recomputed = bytes_per_token(QWEN, activation_bytes=4, gradient_checkpointing=True, chunked=True)
    assert recomputed == 4 * (2 * 896 + per_layer + 4 * 896) < chunked
    assert bytes_per_token(QWEN, activation_bytes=2, gradient_checkpointing=False, chunked=True) == chunked // 2


def test_bf16_autocast_counts_three_bytes_an_activation_and_a_gpu_chunk_is_bigger(monkeypatch):
    """Measured on an H200 (full 0.5B shape, autocast): 1.63 MB a token; 2 bytes would say 1.35."""
    full = SimpleNamespace(**{**vars(QWEN), "num_hidden_layers": 24})
    model = Shaped(full, trainable=10**6)
    monkeypatch.setattr(token_budget, "free_bytes", lambda device: (100 * 2**30, "100.0 GiB free on cuda"))
    budget = auto_token_budget(model, torch.device("cuda"), gradient_checkpointing=False, chunked=True,
                               bf16_autocast=True)  # fmt: skip
    assert budget.bytes_per_token == bytes_per_token(full, activation_bytes=3, gradient_checkpointing=False,
                                                     chunked=True)  # fmt: skip
    assert 1.63e6 < budget.bytes_per_token < 1.3 * 1.63e6  # safe, not wildly so
    usable = int((100 * 2**30 - 12 * 10**6) * 0.8)
    fixed = 2 * 4 * token_budget.default_chunk_tokens(151936, "cuda") * 151936  # 883 tokens a chunk
    assert budget.tokens == (usable - fixed) // budget.bytes_per_token // GRANULE * GRANULE


class Shaped(torch.nn.Module):
    def __init__(self, config, trainable: int):
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.zeros(trainable))


def test_the_auto_budget_is_the_usable_share_of_free_memory_over_the_per_token_cost(monkeypatch):
    model = Shaped(QWEN, trainable=10**6)
    free = 16 * 2**30
    monkeypatch.setattr(token_budget, "free_bytes", lambda device: (free, "16.0 GiB available RAM"))
    budget = auto_token_budget(model, torch.device("cpu"), gradient_checkpointing=False, chunked=True)
    per_token = bytes_per_token(QWEN, activation_bytes=4, gradient_checkpointing=False, chunked=True)
    usable = int((free - 12 * 10**6) * 0.5)  # gradients and AdamW's moments set aside, half of the rest
    fixed = 2 * 4 * token_budget.default_chunk_tokens(151936) * 151936
    assert budget.tokens == (usable - fixed) // per_token // GRANULE * GRANULE and budget.tokens % GRANULE == 0
    assert budget.usable_bytes == usable and "KiB per token" in budget.describe()
    stepped = auto_token_budget(model, torch.device("cpu"), gradient_checkpointing=False, chunked=True,
                                optimizer_allocated=True)  # fmt: skip
    assert stepped.tokens > budget.tokens

    monkeypatch.setattr(token_budget, "free_bytes", lambda device: (2**50, "a lot"))
    assert (
        auto_token_budget(model, torch.device("cpu"), gradient_checkpointing=False, chunked=True).tokens == MAX_BUDGET
    )
    monkeypatch.setattr(token_budget, "free_bytes", lambda device: (0, "nothing"))
    assert auto_token_budget(model, torch.device("cpu"), gradient_checkpointing=False, chunked=True).tokens == GRANULE


def test_free_bytes_reads_this_machine():
    free, source = token_budget.free_bytes(torch.device("cpu"))
    assert free > 0 and "available RAM" in source
