"""The learner's default token budget per micro-batch (``trainer.max_tokens_per_microbatch: auto``).

A micro-batch's forward holds rows (or packed bins) x its longest row tokens, and the peak memory
grows with that: every decoder layer keeps its activations for the backward, and without chunked
scoring the ``[tokens, vocabulary]`` logits come on top. ``auto`` sets the budget at the first
step (when the node's engines hold their memory) from the model's shape and the free memory::

    budget = (usable bytes - fixed bytes) / bytes per token        (a multiple of 64, capped)

    usable    = free memory now (CUDA: the device's free memory; CPU: the memory the OS reports
                available, which the node's other processes share), less the gradients and
                AdamW's two moments not allocated yet (3 x the trainable float32 weights), times
                a safety share (CUDA 0.8, CPU 0.5)
    per token = activation bytes x (layers x A, or with gradient checkpointing layers x h + A)
                + 4 h (embedding, final norm, head input) + without chunked scoring 3 V float32
                (logits, log-softmax, their gradient)
    A         = 9 h + 3 kv + 4 i elements per layer per token (norms, q/k/v and rotated copies,
                attention and MLP outputs, the MLP's gate/up/activation/product), h the hidden
                size, kv the key/value width, i the MLP width, V the vocabulary
    fixed     = with chunked scoring, two [chunk, V] float32 buffers

Activations count 4 bytes (float32), 3 under CUDA bf16 autocast: autocast keeps the residual
stream and the norms in float32 beside the bf16 copies the matrix products read, so a token cost
1.63 MB on the full Qwen2.5-0.5B shape on an H200, where 2 bytes would estimate 1.35 MB and 3
give 2.0 MB (``scripts/check_chunked_scoring_gpu.py``). The estimate is meant to be safe rather
than tight: on the Qwen2.5-0.5B shape (2 layers, float32, CPU) it gives 0.24 MB per token
against 0.14 MB measured (``make bench BENCH=scoring``). Attention is assumed not to
materialise ``[tokens, tokens]`` scores (SDPA's memory-efficient kernels).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from rlpost.algo.chunked import default_chunk_tokens

SAFE_SHARE = {"cuda": 0.8, "cpu": 0.5}  # of the free memory, for the activations
MAX_BUDGET = 1 << 20  # tokens: more would never be one micro-batch's worth
GRANULE = 64  # the budget is a multiple of this many tokens


@dataclass(frozen=True)
class TokenBudget:
    """A learner's token budget per micro-batch and how it was set."""

    tokens: int
    source: str  # "trainer.max_tokens_per_microbatch" or what "auto" measured
    bytes_per_token: int = 0
    usable_bytes: int = 0

    def describe(self) -> str:
        if not self.bytes_per_token:
            return f"{self.tokens} tokens ({self.source})"
        return (
            f"{self.tokens} tokens (auto: {self.usable_bytes / 2**30:.1f} GiB usable of {self.source}, "
            f"{self.bytes_per_token / 2**10:.0f} KiB per token)"
        )


def bytes_per_token(config: Any, *, activation_bytes: int, gradient_checkpointing: bool, chunked: bool) -> int:
    """Peak bytes one more padded token of a micro-batch costs a training step (module docstring)."""
    h = int(config.hidden_size)
    layers = int(config.num_hidden_layers)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads) * head_dim
    inner = int(getattr(config, "intermediate_size", None) or 4 * h)
    per_layer = 9 * h + 3 * kv + 4 * inner
    stored = layers * h + per_layer if gradient_checkpointing else layers * per_layer
    total = activation_bytes * (stored + 4 * h)
    if not chunked:
        total += 3 * 4 * int(config.vocab_size)
    return total


def free_bytes(device: torch.device) -> tuple[int, str]:
    """The memory ``device`` has free now, and what was read."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), f"{free / 2**30:.1f} GiB free on {device} ({total / 2**30:.0f} GiB)"
    try:
        import psutil

        available = int(psutil.virtual_memory().available)
    except ImportError:  # Linux without psutil: the kernel's figure
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available, f"{available / 2**30:.1f} GiB available RAM"


def auto_token_budget(
    model: torch.nn.Module, device: torch.device, *, gradient_checkpointing: bool, chunked: bool,
    bf16_autocast: bool = False, optimizer_allocated: bool = False,
) -> TokenBudget:  # fmt: skip
    """The ``auto`` budget (module docstring). ``optimizer_allocated``: the gradients and AdamW's
    moments already hold their memory (a learner that has stepped): not set aside again."""
    config = model.config
    per_token = bytes_per_token(
        config, activation_bytes=3 if bf16_autocast else 4, gradient_checkpointing=gradient_checkpointing,
        chunked=chunked,
    )  # fmt: skip
    free, source = free_bytes(device)
    pending = 0 if optimizer_allocated else 3 * 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    usable = int((free - pending) * SAFE_SHARE.get(device.type, 0.5))
    vocab = int(config.vocab_size)
    fixed = 2 * 4 * default_chunk_tokens(vocab, device.type) * vocab if chunked else 0
    tokens = max(0, usable - fixed) // per_token
    tokens = min(MAX_BUDGET, max(GRANULE, tokens // GRANULE * GRANULE))
    return TokenBudget(tokens=tokens, source=source, bytes_per_token=per_token, usable_bytes=max(0, usable))
