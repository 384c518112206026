"""Log-probs of the taken tokens from the final hidden states, through the LM head in chunks.

The plain way materialises ``[tokens, vocabulary]`` logits, a float32 copy for the softmax and
their gradients: about 0.6 GB per 1,024 tokens of a 152k vocabulary. Only the taken token's logit
and the log-sum-exp are needed, so :func:`chunked_token_logprobs` runs the LM head ``chunk_tokens``
at a time and keeps those; its backward recomputes each chunk's logits (one more matrix product),
so ``[chunk, vocabulary]`` logits live one chunk at a time.

Per token ``t`` with hidden state ``h_t``, taken token ``y_t`` and temperature ``T``::

    z_t  = (W h_t + b) / T                     (float32, or float64 for float64 states)
    lp_t = z_t[y_t] - logsumexp(z_t)
    H_t  = -sum p log p                        (the entropy of p = softmax(z_t))
    d lp_t / d z_t = onehot(y_t) - p
    d H_t  / d z_t = -p * (log p + H_t)

:func:`chunked_logprobs_and_entropy` returns the entropy too, from the same chunks: the exact
entropy bonus without the ``[tokens, vocabulary]`` distribution.

Logits in the hidden states' dtype (as the model's head) and the softmax in float32 (float64 for
float64 states), so values equal the dense path's.
"""

from __future__ import annotations

import torch

# float32 logits of one chunk, per device type: on a GPU a chunk must be a large enough matrix
# product to keep it busy (at 64 MB, about 110 tokens of a 152k vocabulary, an H200 scored at
# half the dense path's speed); on a CPU a small one costs nothing in speed
CHUNK_BYTES = {"cpu": 64 * 2**20, "cuda": 512 * 2**20}


def default_chunk_tokens(vocab_size: int, device_type: str = "cpu") -> int:
    """Tokens per chunk so that a chunk's float32 logits take ``CHUNK_BYTES`` of the device type."""
    return max(1, CHUNK_BYTES.get(device_type, CHUNK_BYTES["cpu"]) // (4 * vocab_size))


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                           *, temperature: float = 1.0, chunk_tokens: int | None = None) -> torch.Tensor:  # fmt: skip
    """Log-probs ``[N]`` of ``targets`` ``[N]`` under ``softmax((hidden @ weight.T + bias) / temperature)``,
    in float32 (float64 for float64 ``hidden``).

    Args:
        hidden: ``[N, H]`` final hidden states (after the model's last norm).
        weight: ``[V, H]`` the LM head's weight (the input embedding when tied).
        targets: ``[N]`` token ids in ``[0, V)``.
        chunk_tokens: tokens per chunk (default: :func:`default_chunk_tokens` of ``V`` on
            ``hidden``'s device type).

    Gradients flow to ``hidden``, ``weight`` and ``bias`` as through the dense computation.
    """
    chunk = _check(hidden, weight, targets, temperature, chunk_tokens)
    logprobs, _ = _ChunkedScores.apply(hidden, weight, bias, targets, float(temperature), chunk, False)
    return logprobs


def chunked_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 targets: torch.Tensor, *, temperature: float = 1.0,
                                 chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(log-probs [N], entropies [N])``: :func:`chunked_token_logprobs` and the entropy of each
    token's whole tempered next-token distribution, from the same chunks; gradients flow from
    both, as through the dense ``log_softmax`` and ``Categorical(logits).entropy()``."""
    chunk = _check(hidden, weight, targets, temperature, chunk_tokens)
    return _ChunkedScores.apply(hidden, weight, bias, targets, float(temperature), chunk, True)


def _check(hidden, weight, targets, temperature, chunk_tokens) -> int:
    """The chunk size, after checking the arguments' shapes and values."""
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [N, H] and weight [V, H] expected, got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk = chunk_tokens if chunk_tokens is not None else default_chunk_tokens(weight.shape[0], hidden.device.type)
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk}")
    return int(chunk)


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where log-softmax is computed for logits of ``dtype``: float32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def matmul_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the LM head's products run in: autocast's where it is on for ``hidden``'s device
    (as the model's own head would run under it), else the hidden states'."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float):
    """A chunk's tempered logits (``hidden``, ``weight`` and ``bias`` in one dtype), in a fresh
    tensor of the softmax dtype the caller may overwrite (no autograd)."""
    logits = torch.nn.functional.linear(hidden, weight, bias).to(softmax_dtype(hidden.dtype))
    return logits.div_(temperature)


class _ChunkedScores(torch.autograd.Function):
    """Log-probs and (``with_entropy``) entropies; the entropy output is zeros otherwise.

    The products run in :func:`matmul_dtype` in forward and backward alike (autocast is turned
    off inside and the dtype chosen explicitly: a backward pass does not run under the forward's
    autocast, and recomputing a chunk's logits in another dtype than the forward's would give
    probabilities that do not match the forward's log-sum-exp)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy):
        compute = matmul_dtype(hidden)
        out = torch.empty(hidden.shape[0], dtype=softmax_dtype(compute), device=hidden.device)
        lse, entropy = torch.empty_like(out), torch.zeros_like(out)
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
            head_weight, head_bias = weight.to(compute), None if bias is None else bias.to(compute)
            for start in range(0, hidden.shape[0], chunk):
                stop = min(start + chunk, hidden.shape[0])
                logits = _chunk_logits(hidden[start:stop].to(compute), head_weight, head_bias, temperature)
                lse[start:stop] = torch.logsumexp(logits, dim=-1)
                out[start:stop] = logits.gather(-1, targets[start:stop, None]).squeeze(-1) - lse[start:stop]
                if with_entropy:  # H = -sum p log p (the sum of p z would cancel with lse)
                    logp = logits.sub_(lse[start:stop, None])
                    entropy[start:stop] = -logp.exp().mul_(logp).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.with_entropy, ctx.compute = temperature, chunk, with_entropy, compute
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(ctx, grad_out, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        use_entropy = ctx.with_entropy and grad_entropy is not None
        compute = ctx.compute
        acc = torch.promote_types(weight.dtype, torch.float32)  # bf16 weights accumulate in float32
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_bias and bias is not None else None
        if grad_out is None:
            grad_out = torch.zeros_like(lse)
        with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
            head_weight, head_bias = weight.to(compute), None if bias is None else bias.to(compute)
            for start in range(0, hidden.shape[0], ctx.chunk):
                stop = min(start + ctx.chunk, hidden.shape[0])
                states = hidden[start:stop].to(compute)
                logits = _chunk_logits(states, head_weight, head_bias, ctx.temperature)
                g_lp = grad_out[start:stop, None].to(logits.dtype)
                if use_entropy:
                    # d/dz of g_lp lp + g_H H = g_lp onehot - p (g_lp + g_H (log p + H)), as
                    # z - E_p z = log p + H; in the logits buffer and one for p: two [chunk, V]
                    logp = logits.sub_(lse[start:stop, None])
                    probs = logp.exp()
                    g_h = grad_entropy[start:stop, None].to(logits.dtype)
                    grad_logits = logp.add_(entropy[start:stop, None]).mul_(g_h).add_(g_lp).mul_(probs).neg_()
                    del probs
                else:  # g_lp (onehot - p), in place in the logits buffer
                    grad_logits = logits.sub_(lse[start:stop, None]).exp_().mul_(g_lp).neg_()
                grad_logits.scatter_add_(-1, targets[start:stop, None], g_lp)
                grad_logits.div_(ctx.temperature)
                if grad_bias is not None:
                    grad_bias += grad_logits.sum(dim=0).to(acc)
                grad_logits = grad_logits.to(compute)
                if grad_hidden is not None:
                    grad_hidden[start:stop] = (grad_logits @ head_weight).to(hidden.dtype)
                if grad_weight is not None and compute == acc:
                    grad_weight.addmm_(grad_logits.t(), states)
                elif grad_weight is not None:  # a bf16 product, summed over the chunks in float32
                    grad_weight += (grad_logits.t() @ states).to(acc)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None
