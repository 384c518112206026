"""The offline tiny model: real transformers, the real vLLM CPU engine, determinism, start reward."""

import hashlib
import json

import pytest
import torch

from rlpost.envs.arithmetic import ARITHMETIC_SYSTEM_PROMPT, make_arithmetic_rows
from rlpost.envs.rewards import answer_reward
from rlpost.tiny_model import build_tiny_model

pytestmark = pytest.mark.integration


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def chat(question):
    return [{"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT}, {"role": "user", "content": question}]


def test_same_seed_gives_identical_files(tiny_model_path, tmp_path):
    build_tiny_model(tmp_path / "again", log=lambda _: None)
    assert digest(tmp_path / "again") == digest(tiny_model_path)


def test_tokenizer_has_chatml_and_assistant_masks(tiny_tokenizer):
    tok = tiny_tokenizer
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    messages = chat("What is 3 + 4?") + [{"role": "assistant", "content": "<answer>7</answer>"}]
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assistant_ids = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(assistant_ids) == "<answer>7</answer><|im_end|>"
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n<answer>7</answer><|im_end|>\n")
    assert tok.decode(tok(text)["input_ids"]) == text


def test_transformers_loads_and_start_reward_is_in_band(tiny_model_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from rlpost.tiny_model import evaluate_reward

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert model.config.hidden_size // model.config.num_attention_heads == 64
    meta = json.loads((tiny_model_path / "rlpost_tiny_model.json").read_text())
    assert 0.1 <= meta["start_reward_estimate"] <= 0.5
    # fresh prompts (another seed than the build's evaluation set), 200 samples
    reward = evaluate_reward(model, tiny_tokenizer, make_arithmetic_rows(200, seed=123), seed=1)
    assert 0.1 <= reward <= 0.5


def test_vllm_cpu_engine_loads_and_generates(tiny_model_path, tiny_tokenizer, monkeypatch):
    from vllm import LLM, SamplingParams

    # Without a fixed KV-cache size the CPU backend reserves gpu_memory_utilization (0.92 by
    # default) of the machine's memory and refuses to start when other processes use some.
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(model=str(tiny_model_path), dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
    try:
        rows = make_arithmetic_rows(16, seed=5)
        prompts = [tiny_tokenizer.apply_chat_template(chat(r["question"]), tokenize=False, add_generation_prompt=True)
                   for r in rows]
        outs = llm.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=0), use_tqdm=False)
        completions = [(o.text, r["answer"]) for out, r in zip(outs, rows) for o in out.outputs]
        assert len(completions) == 64
        rewards = [answer_reward(text, answer) for text, answer in completions]
        # the warm start taught the format: nearly every sample answers in tags
        assert sum(r > 0 for r in rewards) / len(rewards) > 0.8
        assert 0.05 <= sum(rewards) / len(rewards) <= 0.6
        assert all(o.finish_reason == "stop" for out in outs for o in out.outputs)
    finally:
        llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine, "engine_core") else None
        del llm
