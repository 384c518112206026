"""Log-probs of the taken tokens from the final hidden states, through the LM head in chunks.

Scoring a sequence the plain way materialises its ``[tokens, vocabulary]`` logits, a float32
copy of them for the softmax, and in training the gradient of each: for a 152k-token vocabulary
that is about 0.6 GB per 1,024 tokens, growing with the completion's length. Only two numbers per
token are needed: the taken token's logit and the log-sum-exp over the vocabulary. So
:func:`chunked_token_logprobs` runs the LM head over ``chunk_tokens`` tokens at a time, keeps those
two numbers, and lets the chunk's logits go; its backward pass computes each chunk's logits again
(one more matrix product per chunk) to form the gradient, so the ``[chunk, vocabulary]`` logits
live one chunk at a time in forward and backward alike.

Per token ``t`` with hidden state ``h_t``, taken token ``y_t`` and temperature ``T``::

    z_t  = (W h_t + b) / T                     (float32, or float64 for float64 states)
    lp_t = z_t[y_t] - logsumexp(z_t)
    d lp_t / d z_t = onehot(y_t) - softmax(z_t)

The logits are computed in the hidden states' dtype (as the model's own head does) and the
softmax in float32, float64 for float64 states (as the dense scoring path does), so values equal
the dense path's.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_BYTES = 64 * 2**20  # float32 logits of one chunk


def default_chunk_tokens(vocab_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk so that a chunk's float32 logits take about ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab_size))


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Log-probs ``[N]`` of ``targets`` ``[N]`` under ``softmax((hidden @ weight.T + bias) / temperature)``,
    in float32 (float64 for float64 ``hidden``).

    Args:
        hidden: ``[N, H]`` final hidden states (after the model's last norm).
        weight: ``[V, H]`` the LM head's weight (the input embedding when tied).
        bias: ``[V]`` or None.
        targets: ``[N]`` token ids in ``[0, V)``.
        temperature: divides the logits (> 0).
        chunk_tokens: tokens per chunk (default: :func:`default_chunk_tokens` of ``V``).

    Gradients flow to ``hidden``, ``weight`` and ``bias`` as through the dense computation.
    """
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [N, H] and weight [V, H] expected, got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk = chunk_tokens if chunk_tokens is not None else default_chunk_tokens(weight.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk}")
    return _ChunkedTokenLogprobs.apply(hidden, weight, bias, targets, float(temperature), int(chunk))


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where log-softmax is computed for logits of ``dtype``: float32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float):
    """A chunk's tempered logits, in a fresh tensor the caller may overwrite (no autograd)."""
    logits = torch.nn.functional.linear(hidden, weight, bias).to(softmax_dtype(hidden.dtype))
    return logits.div_(temperature)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk):
        out = torch.empty(hidden.shape[0], dtype=softmax_dtype(hidden.dtype), device=hidden.device)
        lse = torch.empty_like(out)
        with torch.no_grad():
            for start in range(0, hidden.shape[0], chunk):
                stop = min(start + chunk, hidden.shape[0])
                logits = _chunk_logits(hidden[start:stop], weight, bias, temperature)
                lse[start:stop] = torch.logsumexp(logits, dim=-1)
                out[start:stop] = logits.gather(-1, targets[start:stop, None]).squeeze(-1) - lse[start:stop]
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        acc = torch.promote_types(weight.dtype, torch.float32)  # bf16 weights accumulate in float32
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_bias and bias is not None else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            stop = min(start + ctx.chunk, hidden.shape[0])
            with torch.no_grad():
                logits = _chunk_logits(hidden[start:stop], weight, bias, ctx.temperature)
                # d lp / d logits = onehot - softmax, times the incoming gradient and 1/T; in
                # place: one [chunk, vocabulary] buffer
                grad_logits = logits.sub_(lse[start:stop, None]).exp_().neg_()
                grad_logits.scatter_add_(-1, targets[start:stop, None], torch.ones_like(grad_logits[:, :1]))
                grad_logits.mul_(grad_out[start:stop, None].to(grad_logits.dtype) / ctx.temperature)
                if grad_hidden is not None:
                    grad_hidden[start:stop] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight.addmm_(grad_logits.t().to(acc), hidden[start:stop].to(acc))
                if grad_bias is not None:
                    grad_bias += grad_logits.sum(dim=0).to(acc)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None
