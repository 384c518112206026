"""The offline tiny model: real transformers, the real vLLM CPU engine, determinism, start reward;
and its tool_arithmetic variant: tokenizer, stored spec, start reward and tool-call rate."""

import hashlib
import json

import pytest
import torch

from rlpost.envs.arithmetic import ARITHMETIC_SYSTEM_PROMPT, make_arithmetic_rows, make_tool_arithmetic_rows
from rlpost.envs.rewards import answer_reward
from rlpost.tiny.model import (
    TOOL_SPEC,
    TinyModelSpec,
    build_tiny_model,
    built_spec,
    ensure_tiny_model,
    spec_dict,
    tool_episode,
    tool_message_for,
)

pytestmark = pytest.mark.integration


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def chat(question):
    return [{"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT}, {"role": "user", "content": question}]


@pytest.mark.long  # a whole build again: ~36 s
def test_a_rebuild_gives_the_shipped_tokenizer_and_config(tiny_model_path, tmp_path):
    """The shipped model rebuilt here: the tokenizer, the config and the stored spec are the same
    bytes on any CPU; the weights are the same tensors by name and shape, but their values are
    identical only on the kind of CPU that built the shipped ones (models/README.md says why)."""
    from safetensors import safe_open

    build_tiny_model(tmp_path / "again", log=lambda _: None)
    again, shipped = digest(tmp_path / "again"), digest(tiny_model_path)
    assert sorted(again) == sorted(shipped)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
    ):
        assert again[name] == shipped[name], name
    assert built_spec(tmp_path / "again") == built_spec(tiny_model_path)

    def shapes(folder):
        with safe_open(folder / "model.safetensors", "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}

    assert shapes(tmp_path / "again") == shapes(tiny_model_path)


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

    from rlpost.tiny.model import evaluate_reward

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert model.config.hidden_size // model.config.num_attention_heads == 64
    meta = json.loads((tiny_model_path / "rlpost_tiny_model.json").read_text())
    assert 0.1 <= meta["start_reward_estimate"] <= 0.5
    # fresh prompts (another seed than the build's evaluation set), 200 samples
    reward = evaluate_reward(model, tiny_tokenizer, make_arithmetic_rows(200, seed=123), seed=1)
    assert 0.1 <= reward <= 0.5


def test_vllm_cpu_engine_loads_and_generates(plain_llm, tiny_tokenizer):
    """The tiny model on a plain ``vllm.LLM`` (the suite's shared one, tests/conftest.py)."""
    from vllm import SamplingParams

    rows = make_arithmetic_rows(16, seed=5)
    prompts = [
        tiny_tokenizer.apply_chat_template(chat(r["question"]), tokenize=False, add_generation_prompt=True)
        for r in rows
    ]
    outs = plain_llm.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=0), use_tqdm=False)
    completions = [(o.text, r["answer"]) for out, r in zip(outs, rows) for o in out.outputs]
    assert len(completions) == 64
    rewards = [answer_reward(text, answer) for text, answer in completions]
    # the warm start taught the format: nearly every sample answers in tags
    assert sum(r > 0 for r in rewards) / len(rewards) > 0.8
    assert 0.05 <= sum(rewards) / len(rewards) <= 0.6
    assert all(o.finish_reason == "stop" for out in outs for o in out.outputs)


# The stored spec of the default model as it was before the tool variant existed: adding fields
# for the tool task must not change it, or every cached default model would be rebuilt (and the
# demo's figures would no longer describe it).
DEFAULT_SPEC = {
    "seed": 0, "vocab_size": 512, "hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
    "intermediate_size": 384, "max_position_embeddings": 512, "sft_rows": 4000, "batch_size": 64, "lr": 0.001,
    "max_sft_steps": 2000, "eval_every": 25, "eval_prompts": 128, "target_reward": [0.35, 0.5], "num_threads": 2,
}  # fmt: skip


def test_default_spec_is_unchanged(tiny_model_path):
    assert spec_dict(TinyModelSpec()) == DEFAULT_SPEC
    assert TinyModelSpec.for_task("arithmetic") == TinyModelSpec()
    assert built_spec(tiny_model_path) == DEFAULT_SPEC
    assert not ensure_tiny_model(tiny_model_path, log=lambda _: None)  # the cached build is up to date


@pytest.fixture(scope="module")
def tool_tokenizer(tiny_tool_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tool_model_path)


def test_tool_spec_is_stored_with_its_task(tiny_tool_model_path):
    meta = json.loads((tiny_tool_model_path / "rlpost_tiny_model.json").read_text())
    assert meta["spec"]["task"] == "tool_arithmetic"
    assert meta["spec"] == spec_dict(TOOL_SPEC)
    assert meta["system_prompt"].startswith("Compute with a ```python block")
    low, high = TOOL_SPEC.target_reward
    assert low <= meta["start_reward_estimate"] <= high
    low, high = TOOL_SPEC.target_tool_rate
    assert low <= meta["start_tool_call_rate"] <= high


def test_tool_tokenizer_round_trips_a_tool_episode(tool_tokenizer):
    from rlpost.envs.tools import PythonResult, format_tool_response

    tok = tool_tokenizer
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    messages = tool_episode("What is 4821 * 937?")
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assistant_ids = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    # both assistant turns are trained: the code block and the answer after the tool
    assert tok.decode(assistant_ids) == "```python\nprint(4821 * 937)\n```<|im_end|><answer>4517277</answer><|im_end|>"
    text = tok.apply_chat_template(messages, tokenize=False)
    tool_turn = format_tool_response([PythonResult(True, "4517277\n", None, 0, 0.0)])
    assert f"<|im_start|>user\n{tool_turn}<|im_end|>\n" in text  # what the PythonInterpreter transform sends
    assert tok.decode(tok(text)["input_ids"]) == text
    # the tool episode's text was in the tokenizer's corpus, so it has merges for it
    for piece, most in [
        ("```python", 2),
        ("print(", 2),
        ("<tool_response>", 5),
        ("Code block 1 executed successfully:", 7),
    ]:
        assert len(tok(piece, add_special_tokens=False)["input_ids"]) <= most, piece


def test_tool_message_for_accepts_only_a_product_of_literals():
    assert tool_message_for("```python\nprint(4821 * 937)\n```") == "Code block 1 executed successfully:\n4517277\n"
    assert tool_message_for("ok\n```python\nprint(12*3)\n```") == "Code block 1 executed successfully:\n36\n"
    for completion in [
        "<answer>7</answer>",
        "```python\nimport os\n```",
        "```python\nprint(012 * 3)\n```",
        "```python\nprint(4821 * 937)\nprint(1)\n```",
        "```python\nprint(4821 + 937)\n```",
    ]:
        assert tool_message_for(completion) is None, completion


def test_tool_model_calls_the_tool_sometimes_and_is_in_band(tiny_tool_model_path, tool_tokenizer):
    from transformers import AutoModelForCausalLM

    from rlpost.tiny.model import evaluate_tool_episodes

    model = AutoModelForCausalLM.from_pretrained(tiny_tool_model_path, dtype=torch.float32)
    assert model.config.hidden_size // model.config.num_attention_heads == 64
    # fresh prompts (another seed than the build's evaluation set), 200 episodes
    result = evaluate_tool_episodes(model, tool_tokenizer, make_tool_arithmetic_rows(200, seed=123), seed=1)
    assert 0.2 <= result.reward <= 0.6
    assert 0.25 <= result.tool_call_rate <= 0.75
    # the tool calls are mostly well formed: print(<int> * <int>), then a second turn
    calls = [chat for chat, _ in result.episodes if "```python" in chat[2]["content"]]
    assert sum(len(chat) == 5 for chat in calls) >= 0.8 * len(calls)
