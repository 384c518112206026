"""LoRA (``model.lora``) on the real tiny model: the learner trains only the adapter, publishes
it (or the merged weights), checkpoints it with an optional merged export, and a real vLLM engine
serves each published adapter with the learner's log-probs. A model vLLM cannot serve LoRA on
(GPT-2) gets the merged weights instead."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rlpost.actors.learner import Learner, LearnerSettings
from rlpost.config import JobConfig
from rlpost.data.samples import Group, Sample
from rlpost.envs.arithmetic import ARITHMETIC_SYSTEM_PROMPT
from rlpost.policies import lora
from rlpost.transport.weight_bus import LocalWeightBus

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REPLIES = ["<answer>7</answer><|im_end|>", "<answer>5</answer><|im_end|>"]


def settings(model_path, lora_section: dict | None = None, **model) -> LearnerSettings:
    """The learner's settings for a rank-8 adapter, sent as an adapter unless ``lora_section``
    says otherwise (``auto`` would send merged weights to engines on CPUs)."""
    raw = {
        "model": {
            "name_or_path": str(model_path),
            "lora": {"rank": 8, "sync": "adapter", **(lora_section or {})},
            **model,
        },  # fmt: skip
        "rollout": {"temperature": 0.9},
        "optimizer": {"lr": 3e-3},
    }
    return LearnerSettings.from_job(JobConfig.model_validate(raw))


def prompt_ids(tokenizer, question: str) -> list[int]:
    messages = [{"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT}, {"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def on_policy_group(learner: Learner, tokenizer) -> list[Group]:
    """One group: the right answer (reward 1) and a wrong one (0), scored by the learner itself."""
    prompt = prompt_ids(tokenizer, "What is 3 + 4?")
    replies = [tokenizer.encode(text, add_special_tokens=False) for text in REPLIES]
    scores = learner.score([prompt + r for r in replies])
    samples = [
        Sample(
            prompt_id=0,
            token_ids=prompt + reply,
            logprobs=[0.0] * len(prompt) + score[len(prompt) :],
            loss_mask=[False] * len(prompt) + [True] * len(reply),
            prompt_len=len(prompt),
            reward=reward,
            policy_version=learner.version,
            finished=True,
        )  # fmt: skip
        for reply, score, reward in zip(replies, scores, [1.0, 0.0])
    ]
    return [Group(prompt_id=0, samples=samples, advantages=[1.0, -1.0], policy_version=learner.version)]


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_a_lora_learner_trains_the_adapter_alone_and_publishes_it(tiny_model_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    learner = Learner(settings(tiny_model_path))
    trainable = [name for name, p in learner.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert sum(len(g["params"]) for g in learner.optimizer.param_groups) == len(trainable)
    base_before = {name: t.clone() for name, t in lora.merged_tensors(learner.model, merge=False)}
    prompt = prompt_ids(tiny_tokenizer, "What is 3 + 4?")
    right, wrong = (prompt + tiny_tokenizer.encode(text, add_special_tokens=False) for text in REPLIES)

    def preference() -> float:  # log p(right answer) - log p(wrong answer)
        scores = learner.score([right, wrong])
        return sum(scores[0][len(prompt) :]) - sum(scores[1][len(prompt) :])

    before = preference()
    for _ in range(3):
        learner.train_step(on_policy_group(learner, tiny_tokenizer))
    assert preference() > before + 1.0, (before, preference())  # GRPO's objective: the gap widens
    for name, tensor in lora.merged_tensors(learner.model, merge=False):
        assert torch.equal(tensor, base_before[name]), name  # the base weights did not move
    # the merged weights in a plain transformers model compute what the peft model does
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    plain.load_state_dict(lora.merged_state_dict(learner.model))
    assert torch.allclose(logits(plain, right), logits(learner.model, right), atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert not torch.allclose(logits(plain, right), logits(base, right), atol=1e-3)  # and the adapter did something

    bus = LocalWeightBus(timeout_s=5)
    receiver = bus.receiver()
    learner.publisher = bus
    stats = learner.publish()
    version, tensors = receiver.receive(timeout_s=1)
    assert version == 3 and set(tensors) == {name for name, _ in lora.adapter_tensors(learner.model)}
    assert all(name.endswith((".lora_A.weight", ".lora_B.weight")) for name in tensors)
    full_bytes = sum(p.numel() * 4 for p in learner.model.parameters())
    assert stats["bytes"] < 0.1 * full_bytes  # rank 8 on every projection of the tiny model: 7.9%
    learner.sync_mode = "merged"  # what an engine without LoRA gets: the base names, merged
    learner.publish()
    _, merged = receiver.receive(timeout_s=1)
    with safe_open(tiny_model_path / "model.safetensors", "pt") as f:
        checkpoint = set(f.keys())
    # every projection (adapted: merged; their biases as they are), but not the frozen
    # embeddings, norms and tied output head, which the engine loaded from the same checkpoint
    left_out = {name for name in checkpoint if "embed_tokens" in name or "norm" in name}
    assert left_out and set(merged) == checkpoint - left_out
    assert {name.rsplit(".", 2)[-2] for name in merged} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"}  # fmt: skip
    want = lora.merged_state_dict(learner.model)
    assert all(torch.equal(merged[name], want[name]) for name in merged)


def test_lora_checkpoints_hold_the_adapter_resume_it_and_export_the_merged_model(tiny_model_path, tiny_tokenizer,
                                                                                 tmp_path):  # fmt: skip
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = settings(tiny_model_path, {"save_merged": True})
    learner = Learner(cfg)
    for _ in range(2):
        learner.train_step(on_policy_group(learner, tiny_tokenizer))
    path = learner.save_checkpoint(tmp_path, 2)
    names = {p.name for p in path.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt", "merged"} <= names
    assert "model.safetensors" not in names  # the adapter, not a copy of the base model
    ids = prompt_ids(tiny_tokenizer, "What is 2 + 2?") + [40, 41, 42]
    want = logits(learner.model, ids)
    exported = AutoModelForCausalLM.from_pretrained(path / "merged")
    assert torch.allclose(logits(exported, ids), want, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert torch.allclose(logits(PeftModel.from_pretrained(base, path), ids), want, atol=1e-5)
    # without merged/, the evaluator's merged model is built from the base and the adapter
    bare = tmp_path / "bare"
    shutil.copytree(path, bare, ignore=shutil.ignore_patterns("merged"))
    built = lora.merged_model_for(bare, str(tiny_model_path), tmp_path / "built")
    assert built == tmp_path / "built" and torch.allclose(logits(AutoModelForCausalLM.from_pretrained(built), ids),
                                                          want, atol=1e-5)  # fmt: skip

    saved_adam = [s["exp_avg"].clone() for s in learner.optimizer.state_dict()["state"].values()]
    fresh = Learner(cfg)
    assert fresh.load_checkpoint(path)["version"] == 2
    assert torch.allclose(logits(fresh.model, ids), want, atol=1e-6)
    restored_adam = [s["exp_avg"] for s in fresh.optimizer.state_dict()["state"].values()]
    assert len(restored_adam) == len(saved_adam) and all(torch.equal(a, b) for a, b in zip(restored_adam, saved_adam))

    full = Learner(
        LearnerSettings.from_job(JobConfig.model_validate({"model": {"name_or_path": str(tiny_model_path)}}))
    )
    with pytest.raises(ValueError, match="holds a LoRA adapter"):
        full.load_checkpoint(path)
    full_checkpoint = full.save_checkpoint(tmp_path / "full", 1)
    with pytest.raises(ValueError, match="holds a whole model"):
        fresh.load_checkpoint(full_checkpoint)
    with pytest.raises(ValueError, match="does not fit model.lora"):
        Learner(settings(tiny_model_path, {"rank": 16})).load_checkpoint(path)


def test_an_engine_serves_each_published_adapter(tiny_model_path, tiny_tokenizer):
    from rlpost.actors.vllm_workers import make_vllm_worker
    from rlpost.collect.weight_update import vLLMUpdater

    cfg = settings(tiny_model_path)
    learner = Learner(cfg)
    worker = make_vllm_worker(str(tiny_model_path), make_ray_worker=False, engine_config=JobConfig().rollout.engine,
                              lora=cfg.model.lora)  # fmt: skip
    updater = vLLMUpdater([worker], timeout_s=60)
    try:
        updater.init()
        learner.publisher = updater
        assert learner.choose_sync_mode(updater.workers_serve_lora()) == "adapter"
        prompt = prompt_ids(tiny_tokenizer, "What is 3 + 4?")
        probe = [prompt + tiny_tokenizer.encode(text, add_special_tokens=False) for text in REPLIES]

        def gap() -> float:
            ours, theirs = learner.score(probe), worker.score(probe, 0.9)
            return max(abs(a - b) for r, s in zip(ours, theirs) for a, b in zip(r[1:], s[1:]))

        assert gap() < 1e-4  # version 0: the base model on both sides (a fresh adapter is a no-op)
        for step in (1, 2):
            learner.train_step(on_policy_group(learner, tiny_tokenizer))
            stats = learner.publish()
            assert worker.version == step and stats["policy_version"] == step
            assert gap() < 1e-4  # measured 4e-6: the engine applies the adapter the learner trains
        completions, version = worker.generate([prompt], {"n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 0})
        assert version == 2 and len(completions[0]) == 2
        assert [p.name for p in Path(worker._adapter_root).iterdir()] == ["load-2"]  # older adapters removed
    finally:
        updater.close()
        worker.shutdown()


def test_merged_syncs_leave_the_frozen_layers_out_and_the_engine_computes_what_the_learner_does(
    tiny_model_path, tiny_tokenizer
):
    """The merged sync sends only the projections; a real engine without LoRA, loading them
    straight into its CPU kernels, then scores as the learner's peft model does, step after step
    (its embeddings, norms and output head stay the base checkpoint's, as the learner's do)."""
    from rlpost.actors.vllm_workers import make_vllm_worker
    from rlpost.collect.weight_update import vLLMUpdater

    cfg = settings(tiny_model_path, {"sync": "merged"})
    learner = Learner(cfg)
    assert learner.sync_mode == "merged"
    worker = make_vllm_worker(str(tiny_model_path), make_ray_worker=False, engine_config=JobConfig().rollout.engine)
    updater = vLLMUpdater([worker], timeout_s=60)
    try:
        updater.init()
        learner.publisher = updater
        assert worker.reload_path() == "direct"
        prompt = prompt_ids(tiny_tokenizer, "What is 3 + 4?")
        probe = [prompt + tiny_tokenizer.encode(text, add_special_tokens=False) for text in REPLIES]

        def gap() -> float:
            ours, theirs = learner.score(probe), worker.score(probe, 0.9)
            return max(abs(a - b) for r, s in zip(ours, theirs) for a, b in zip(r[1:], s[1:]))

        full_bytes = sum(t.numel() * 4 for _, t in lora.merged_tensors(learner.model, merge=False))
        for step in (1, 2):
            learner.train_step(on_policy_group(learner, tiny_tokenizer))
            assert gap() > 1e-3  # the adapter moved the learner away from what the engine serves
            stats = learner.publish()
            assert worker.version == step and stats["policy_version"] == step
            assert stats["bytes"] < 0.8 * full_bytes  # tiny model: the embedding is 0.06M of 0.45M
            assert gap() < 1e-4  # measured ~1e-6
    finally:
        updater.close()
        worker.shutdown()


def test_a_model_vllm_serves_no_lora_on_gets_merged_weights(tmp_path, tiny_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlpost.actors.vllm_workers import make_vllm_worker
    from rlpost.collect.weight_update import vLLMUpdater

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tiny_tokenizer), n_embd=64, n_layer=2, n_head=2, n_positions=512,
                                      eos_token_id=tiny_tokenizer.eos_token_id))  # fmt: skip
    gpt2.save_pretrained(tmp_path / "gpt2")
    tiny_tokenizer.save_pretrained(tmp_path / "gpt2")
    assert not lora.engine_supports_lora(str(tmp_path / "gpt2"))
    # auto as on GPU engines, which take the adapter route unless an engine cannot serve LoRA
    cfg = dataclasses.replace(settings(tmp_path / "gpt2", {"target_modules": ["c_attn", "c_proj", "c_fc"],
                                                           "sync": "auto"}), lora_sync="adapter")  # fmt: skip
    learner = Learner(cfg)
    worker = make_vllm_worker(str(tmp_path / "gpt2"), make_ray_worker=False, engine_config=JobConfig().rollout.engine,
                              lora=cfg.model.lora)  # fmt: skip
    updater = vLLMUpdater([worker], timeout_s=60)
    try:
        updater.init()
        learner.publisher = updater
        assert updater.workers_serve_lora() == [False]
        with pytest.raises(RuntimeError, match="cannot serve a LoRA adapter"):
            Learner(settings(tmp_path / "gpt2", {"target_modules": ["c_attn"], "sync": "adapter"})).choose_sync_mode(
                [False]
            )
        assert learner.choose_sync_mode(updater.workers_serve_lora()) == "merged"
        learner.train_step(on_policy_group(learner, tiny_tokenizer))
        stats = learner.publish()
        assert stats["policy_version"] == 1 and worker.version == 1
        probe = [prompt_ids(tiny_tokenizer, "What is 3 + 4?") + [40, 41, 42]]
        ours, theirs = learner.score(probe)[0], worker.score(probe, 0.9)[0]
        assert max(abs(a - b) for a, b in zip(ours[1:], theirs[1:])) < 1e-4
    finally:
        updater.close()
        worker.shutdown()
