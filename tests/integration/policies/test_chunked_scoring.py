"""TransformersWrapper's chunked scoring on the real tiny model (tied embedding) equals the dense
path: the log-probs it returns and the gradients they give the model, with a temperature, a
score-from offset, LoRA adapters, and through the TorchRL-compatible outputs; so do the exact
entropies, and rows packed end to end equal rows padded to the longest."""

import pytest
import torch

from rlpost.policies import TransformersWrapper
from rlpost.policies.transformers_wrapper import plain_head

pytestmark = pytest.mark.integration

ROWS = [[1, 5, 7, 9, 11, 3, 40, 41], [2, 4, 6], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]


def load(path, dtype, lora=False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if lora:
        from rlpost.config import LoraConfig
        from rlpost.policies.lora import apply_lora

        model = apply_lora(model, LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():  # adapters away from zero, so that they change the scores
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model


def scores_and_grads(model, tokenizer, chunked, score_from, temperature=0.8, packed=True, rows=ROWS):
    wrapper = TransformersWrapper(model, tokenizer=tokenizer, generate=False, chunked_scoring=chunked,
                                  score_chunk_tokens=4, generate_kwargs={"temperature": temperature},
                                  pack_sequences=packed)  # fmt: skip
    model.zero_grad()
    scores = wrapper._score_ids(rows, score_from)
    sum((row * (i + 1)).sum() for i, row in enumerate(scores)).backward()
    return scores, grads_of(model)


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(got: dict, want: dict, tol: float) -> None:
    assert got.keys() == want.keys() and want
    for name, w in want.items():
        scale = w.abs().max().clamp_min(1e-12)
        assert float((got[name] - w).abs().max() / scale) < tol, name


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-6), (torch.float32, 1e-5)])
@pytest.mark.parametrize("lora", [False, True])
def test_chunked_scores_and_gradients_equal_the_dense_path(tiny_model_path, tiny_tokenizer, dtype, tol, lora):
    model = load(tiny_model_path, dtype, lora)
    assert plain_head(model) is not None  # the chunked path is the one taken
    if not lora:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    for score_from in (0, 4):
        dense, dense_grads = scores_and_grads(model, tiny_tokenizer, False, score_from)
        chunked, chunked_grads = scores_and_grads(model, tiny_tokenizer, True, score_from)
        assert [r.dtype for r in chunked] == [torch.float32] * len(ROWS)
        for got, want in zip(chunked, dense, strict=True):
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            assert (got[: max(score_from, 1)] == 0).all() and (got[max(score_from, 1) :] < 0).all()
        assert_same_grads(chunked_grads, dense_grads, tol)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-6), (torch.float32, 1e-5)])
def test_packed_rows_equal_padded_rows(tiny_model_path, tiny_tokenizer, dtype, tol):
    """Skewed lengths (one long row, short ones) packed end to end: fewer model rows, and the
    same log-probs and gradients as padding every row to the longest."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (40, 5, 9, 1, 12, 38, 2)]
    model = load(tiny_model_path, dtype)
    packer = TransformersWrapper(model, tokenizer=tiny_tokenizer, generate=False)
    assert packer.packs_sequences
    layout = packer._packed_inputs(rows)
    assert layout.input_ids.shape == (3, 40)  # [40], [38, 2], [5, 9, 1, 12] instead of 7 rows
    # each row's positions from 0, in the rows' order; the free tail is a segment of its own
    assert layout.position_ids[2].tolist() == [*range(5), *range(9), 0, *range(12), *range(13)]
    for score_from in (0, 7):
        padded, padded_grads = scores_and_grads(model, tiny_tokenizer, True, score_from, packed=False, rows=rows)
        packed, packed_grads = scores_and_grads(model, tiny_tokenizer, True, score_from, packed=True, rows=rows)
        for got, want in zip(packed, padded, strict=True):
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert_same_grads(packed_grads, padded_grads, tol)
    model.config._attn_implementation = "some_kernel"  # one that may not keep packed rows apart
    assert not packer.packs_sequences and packer.scores_in_chunks


def test_exact_entropies_equal_the_distributions(tiny_model_path, tiny_tokenizer):
    """log_probs_and_entropy (chunked and packed, or dense) equals get_dist's distribution, in
    values and in the gradients of a loss on both; GRPOLoss's exact entropy bonus reads it."""
    from tensordict import TensorDict

    from rlpost.objectives import GRPOLoss

    model = load(tiny_model_path, torch.float64)
    kwargs = dict(tokenizer=tiny_tokenizer, generate=False, input_mode="tokens", score_chunk_tokens=4,
                  generate_kwargs={"temperature": 0.7})  # fmt: skip
    results = {}
    for chunked in (True, False):
        wrapper = TransformersWrapper(model, chunked_scoring=chunked, **kwargs)
        model.zero_grad()
        logprobs, entropies = wrapper.log_probs_and_entropy(ROWS)
        # 0.25 and whole weights are exact in float32, the rows' dtype: the two losses' gradients then
        # differ only by the model's float64 arithmetic, not by a weight rounded in one of them
        sum((lp * 0.25 - h * (i + 1)).sum() for i, (lp, h) in enumerate(zip(logprobs, entropies))).backward()
        results[chunked] = logprobs, entropies, grads_of(model)
    width = max(map(len, ROWS))
    tokens = torch.tensor([ids + [0] * (width - len(ids)) for ids in ROWS])
    attention = torch.tensor([[True] * len(ids) + [False] * (width - len(ids)) for ids in ROWS])
    td = TensorDict({("tokens", "full"): tokens, ("masks", "all_attention_mask"): attention}, batch_size=[3])
    model.zero_grad()
    dist = wrapper.get_dist(td)  # the dense wrapper's distribution, right-padded like the rows
    ids = torch.where(attention, tokens, 0)
    lp_dist = torch.where(dist.mask, dist.log_prob(ids), 0.0)
    h_dist = torch.where(dist.mask, dist.entropy(), 0.0)
    weights = torch.arange(1, 4, dtype=torch.float64)[:, None]
    (lp_dist * 0.25 - h_dist * weights).sum().backward()
    want_grads = grads_of(model)
    for logprobs, entropies, grads in results.values():
        for i, ids_i in enumerate(ROWS):
            torch.testing.assert_close(logprobs[i], lp_dist[i, : len(ids_i)].float(), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(entropies[i], h_dist[i, : len(ids_i)].float(), rtol=1e-6, atol=1e-6)
            assert entropies[i][0] == 0 and (entropies[i][1:] > 0).all()
        assert_same_grads(grads, want_grads, 1e-9)  # the weights are exact: ~4e-15 measured

    loss_fn = GRPOLoss(TransformersWrapper(model, **kwargs), entropy_coeff=0.1, masking_strategy="generic")
    batch = td.clone()
    batch.set(("log_probs", "full"), torch.zeros(tokens.shape))
    batch.set("advantage", torch.ones(3, 1))
    out = loss_fn(batch)
    counted = attention.clone()
    counted[:, 0] = False
    torch.testing.assert_close(out.entropy.double(), h_dist[counted].mean(), rtol=1e-5, atol=1e-5)


def test_the_public_outputs_are_the_same_and_other_models_score_densely(tiny_model_path, tiny_tokenizer):
    from tensordict import TensorDict

    from rlpost.data import ChatHistory, History

    model = load(tiny_model_path, torch.float32)
    chats = [[{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "5, as 2 + 3 = 5"}],
             [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"}]]  # fmt: skip
    history = History.from_chats(chats)
    outs = []
    for chunked in (False, True):
        wrapper = TransformersWrapper(model, tokenizer=tiny_tokenizer, generate=False, chunked_scoring=chunked,
                                      input_mode="history", score_chunk_tokens=3)  # fmt: skip
        td = TensorDict(history=ChatHistory(full=history, batch_size=[2]), batch_size=[2])
        with torch.no_grad():
            outs.append(wrapper(td).get(("log_probs", "full"), as_list=True))
    for got, want in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    model.config.model_type = "gemma2"  # soft-capped logits: not lm_head(hidden) alone
    assert plain_head(model) is None


@pytest.mark.parametrize("chunked", [True, False])
def test_the_learner_and_the_reference_follow_model_chunked_scoring(tiny_model_path, chunked):
    from rlpost.actors.learner import Learner, LearnerSettings
    from rlpost.actors.reference import Reference, ReferenceSettings
    from rlpost.config import JobConfig

    cfg = JobConfig.model_validate({"model": {"name_or_path": str(tiny_model_path), "chunked_scoring": chunked},
                                    "reference": {"enabled": True}})  # fmt: skip
    learner = Learner(LearnerSettings.from_job(cfg))
    reference = Reference(ReferenceSettings.from_job(cfg))
    assert learner.loss_fn.actor_network.chunked_scoring is chunked
    assert reference.kl.ref_model.chunked_scoring is chunked
    row = [1, 5, 7, 9, 11, 3]
    dense = TransformersWrapper(learner.model, tokenizer=learner.tokenizer, generate=False, chunked_scoring=False,
                                generate_kwargs={"temperature": cfg.rollout.temperature})  # fmt: skip
    with torch.no_grad():
        want = dense._score_ids([row])[0]
    torch.testing.assert_close(torch.tensor(learner.score([row])[0]), want, rtol=1e-5, atol=1e-5)
