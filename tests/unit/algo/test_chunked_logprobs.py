"""Chunked scoring through the LM head equals the dense path, in values and gradients."""

import pytest
import torch

from rlpost.algo.chunked import chunked_logprobs_and_entropy, chunked_token_logprobs, default_chunk_tokens

pytestmark = pytest.mark.unit


def dense(hidden, weight, bias, targets, temperature):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def inputs(dtype, with_bias, n=37, h=16, v=53, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=dtype).requires_grad_()
    weight = torch.randn(v, h, generator=gen, dtype=dtype).requires_grad_()
    bias = torch.randn(v, generator=gen, dtype=dtype).requires_grad_() if with_bias else None
    targets = torch.randint(0, v, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen)  # a loss's gradient on each log-prob
    return hidden, weight, bias, targets, upstream


def grads(fn, hidden, weight, bias, targets, upstream, temperature):
    params = [p for p in (hidden, weight, bias) if p is not None]
    out = fn(hidden, weight, bias, targets, temperature)
    return out.detach(), torch.autograd.grad((out * upstream).sum(), params)


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, 1e-6), (torch.float32, 1e-5)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, 37, 1000])
def test_values_and_gradients_equal_the_dense_path(dtype, rtol, with_bias, chunk):
    hidden, weight, bias, targets, upstream = inputs(dtype, with_bias)
    for temperature in (1.0, 0.7):
        want, want_grads = grads(dense, hidden, weight, bias, targets, upstream, temperature)
        got, got_grads = grads(
            lambda *a: chunked_token_logprobs(*a[:4], temperature=a[4], chunk_tokens=chunk),
            hidden, weight, bias, targets, upstream, temperature,
        )  # fmt: skip
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol)
        for g, w in zip(got_grads, want_grads, strict=True):
            assert g.dtype == w.dtype
            torch.testing.assert_close(g, w, rtol=rtol, atol=rtol)


def dense_with_entropy(hidden, weight, bias, targets, temperature):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    dist = torch.distributions.Categorical(logits=logits)
    return dist.log_prob(targets), dist.entropy()


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, 1e-6), (torch.float32, 1e-5)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 6, 1000])
def test_entropy_values_and_gradients_equal_the_dense_distribution(dtype, rtol, with_bias, chunk):
    """The exact entropy (as TorchRL's loss takes it from the actor's distribution) and the
    log-probs from the same chunks; a loss reading both, either, or the entropy alone."""
    hidden, weight, bias, targets, upstream = inputs(dtype, with_bias)
    upstream_h = torch.randn(upstream.shape, generator=torch.Generator().manual_seed(3))
    params = [p for p in (hidden, weight, bias) if p is not None]
    for temperature in (1.0, 0.6):
        want_lp, want_h = dense_with_entropy(hidden, weight, bias, targets, temperature)
        got_lp, got_h = chunked_logprobs_and_entropy(
            hidden, weight, bias, targets, temperature=temperature, chunk_tokens=chunk
        )
        assert got_lp.dtype == got_h.dtype == dtype
        torch.testing.assert_close(got_lp, want_lp, rtol=rtol, atol=rtol)
        torch.testing.assert_close(got_h, want_h, rtol=rtol, atol=rtol)
        assert (got_h > 0).all()
        for weights in ((upstream, upstream_h), (upstream, None), (None, upstream_h)):

            def loss(lp, h, weights=weights):
                return sum((x * w).sum() for x, w in zip((lp, h), weights) if w is not None)

            want = torch.autograd.grad(loss(want_lp, want_h), params, retain_graph=True)
            got = torch.autograd.grad(loss(got_lp, got_h), params, retain_graph=True)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=rtol, atol=rtol)


def test_a_tied_head_gets_both_gradients():
    """The weight is also the input embedding: its gradient sums both uses, as dense autograd does."""
    hidden_in, weight, _, targets, upstream = inputs(torch.float64, False)
    ids = torch.randint(0, weight.shape[0], (hidden_in.shape[0],), generator=torch.Generator().manual_seed(1))

    def run(fn):
        hidden = torch.tanh(weight[ids] + hidden_in)  # the "model" reads the embedding
        out = fn(hidden, weight, None, targets, 0.9)
        return torch.autograd.grad((out * upstream).sum(), [weight, hidden_in])

    want = run(dense)
    got = run(lambda *a: chunked_token_logprobs(*a[:4], temperature=a[4], chunk_tokens=4))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_only_the_needed_gradients_and_bad_input():
    hidden, weight, _, targets, _ = inputs(torch.float32, False)
    frozen = weight.detach()
    out = chunked_token_logprobs(hidden, frozen, None, targets, chunk_tokens=8)
    (g,) = torch.autograd.grad(out.sum(), [hidden])
    assert g.shape == hidden.shape
    with pytest.raises(ValueError, match="targets must be"):
        chunked_token_logprobs(hidden, weight, None, targets[:-1])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        chunked_token_logprobs(hidden, weight, None, targets, temperature=0)
    assert default_chunk_tokens(151_936) == 110 and default_chunk_tokens(10) == 1677721
    assert default_chunk_tokens(151_936, "cuda") == 883  # a GPU keeps busy on bigger products


def test_under_autocast_forward_and_backward_multiply_in_its_dtype(monkeypatch):
    """bf16 autocast (the learner's GPU setting, here on the CPU): the head's products run in
    bf16 in the forward and in the recomputing backward alike (a backward pass does not run
    under the forward's autocast), and the results match the dense head under autocast."""
    from rlpost.algo import chunked

    hidden, weight, bias, targets, upstream = inputs(torch.float32, True, n=40, h=32, v=97)
    seen = []
    original = chunked._chunk_logits
    monkeypatch.setattr(
        chunked, "_chunk_logits", lambda h, w, b, t: seen.append((h.dtype, w.dtype)) or original(h, w, b, t)
    )
    params = [hidden, weight, bias]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_lp, got_h = chunked_logprobs_and_entropy(hidden, weight, bias, targets, temperature=0.9, chunk_tokens=7)
        want_lp, want_h = dense_with_entropy(hidden, weight, bias, targets, 0.9)
    assert got_lp.dtype == torch.float32
    got = torch.autograd.grad((got_lp * upstream).sum() + got_h.sum(), params)
    want = torch.autograd.grad((want_lp * upstream).sum() + want_h.sum(), params)
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)} and len(seen) == 2 * 6  # 6 chunks, twice
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got_h, want_h, rtol=1e-3, atol=1e-3)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == torch.float32
        assert float((g - w).abs().max() / w.abs().max()) < 2e-2  # bf16 products on both sides
