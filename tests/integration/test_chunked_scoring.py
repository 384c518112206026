"""TransformersWrapper's chunked scoring on the real tiny model (tied embedding) equals the dense
path: the log-probs it returns and the gradients they give the model, with a temperature, a
score-from offset, LoRA adapters, and through the TorchRL-compatible outputs."""

import pytest
import torch

from rlpost.policies import TransformersWrapper
from rlpost.policies.transformers_wrapper import _plain_head

pytestmark = pytest.mark.integration

ROWS = [[1, 5, 7, 9, 11, 3, 40, 41], [2, 4, 6], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]


def load(path, dtype, lora=False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if lora:
        from rlpost.config import LoraConfig
        from rlpost.lora import apply_lora

        model = apply_lora(model, LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():  # adapters away from zero, so that they change the scores
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return model


def scores_and_grads(model, tokenizer, chunked, score_from, temperature=0.8):
    wrapper = TransformersWrapper(model, tokenizer=tokenizer, generate=False, chunked_scoring=chunked,
                                  score_chunk_tokens=4, generate_kwargs={"temperature": temperature})  # fmt: skip
    model.zero_grad()
    rows = wrapper._score_ids(ROWS, score_from)
    sum((row * (i + 1)).sum() for i, row in enumerate(rows)).backward()
    return rows, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-6), (torch.float32, 1e-5)])
@pytest.mark.parametrize("lora", [False, True])
def test_chunked_scores_and_gradients_equal_the_dense_path(tiny_model_path, tiny_tokenizer, dtype, tol, lora):
    model = load(tiny_model_path, dtype, lora)
    assert _plain_head(model) is not None  # the chunked path is the one taken
    if not lora:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    for score_from in (0, 4):
        dense, dense_grads = scores_and_grads(model, tiny_tokenizer, False, score_from)
        chunked, chunked_grads = scores_and_grads(model, tiny_tokenizer, True, score_from)
        assert [r.dtype for r in chunked] == [torch.float32] * len(ROWS)
        for got, want in zip(chunked, dense, strict=True):
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            assert (got[: max(score_from, 1)] == 0).all() and (got[max(score_from, 1) :] < 0).all()
        assert chunked_grads.keys() == dense_grads.keys() and dense_grads
        for name, want in dense_grads.items():
            scale = want.abs().max().clamp_min(1e-12)
            assert float((chunked_grads[name] - want).abs().max() / scale) < tol, name


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
    assert _plain_head(model) is None


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
