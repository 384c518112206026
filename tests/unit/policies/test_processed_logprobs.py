"""processed_logprobs (the vLLM wrapper's re-scoring of raw log-probs) equals vLLM's own sampler
processing: temperature, then top-k, then top-p, then log_softmax."""

import pytest
import torch

from rlpost.policies import processed_logprobs

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.7, 1.0, 0), (1.0, 0.9, 0), (0.5, 0.8, 20), (1.3, 1.0, 5)])
def test_matches_vllm_sampler(temperature, top_p, top_k):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    torch.manual_seed(0)
    logits = torch.randn(4, 448) * 3
    raw = torch.log_softmax(logits, dim=-1)  # what a raw-log-probs engine returns
    k = torch.full((4,), top_k) if top_k else None
    p = torch.full((4,), top_p) if top_p < 1.0 else None
    expected = torch.log_softmax(apply_top_k_top_p_pytorch(logits / temperature, k, p), dim=-1)
    for row in range(4):
        got = processed_logprobs(raw[row], temperature=temperature, top_p=top_p, top_k=top_k)
        kept = torch.isfinite(expected[row])
        assert torch.equal(torch.isfinite(got), kept)
        assert (got[kept] - expected[row][kept]).abs().max().item() < 1e-5
