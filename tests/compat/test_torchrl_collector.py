"""TorchRL's LLMCollector (``torchrl.collectors.llm.LLMCollector``) run against rlpost: its
docstring example with the tiny model on a real vLLM engine, and a TransformersWrapper policy.

The docstring example runs as written, with the tiny model's ``vllm.LLM``: its policy,
``vLLMWrapper(llm_model)``, is a current wrapper (no ``input_mode``), and its env,
``LLMEnv.from_dataloader(from_text=True)``, TorchRL 0.9's text env, which holds bare strings
under ``"text"`` and reads its action from ``"text_response"``. TorchRL's own wrapper, in its
default history mode, cannot read that env; rlpost's, built without ``input_mode``, answers such
an input in 0.9's layout (``text_response``, ``tokens_response``), the batch the docstring
prints. The assertions are what it prints: ``[1, 1]`` batches (one env, one turn) with the
prompt, the response, its tokens and ``collector.traj_ids``.
"""

from __future__ import annotations

import random
import string

import pytest
import torch

from rlpost.collect import LLMCollector
from rlpost.envs import LLMEnv
from rlpost.policies import TransformersWrapper, vLLMWrapper

pytestmark = pytest.mark.compat


class DummyStrDataLoader:
    """TorchRL's test dataloader: random 10-letter strings under "text", ``batch_size`` a batch."""

    def __init__(self, batch_size=0):
        self.batch_size = batch_size

    def __iter__(self):
        return self

    def __next__(self):
        def word():
            return "".join(random.choice(string.ascii_lowercase) for _ in range(10))

        return {"text": word()} if self.batch_size == 0 else {"text": [word() for _ in range(self.batch_size)]}


def test_llm_collector_docstring_example(plain_llm):
    llm_model = plain_llm
    tokenizer = llm_model.get_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    policy = vLLMWrapper(llm_model)
    dataloader = DummyStrDataLoader(1)
    env = LLMEnv.from_dataloader(
        dataloader=dataloader,
        tokenizer=tokenizer,
        from_text=True,
        batch_size=1,
        group_repeats=True,
    )
    collector = LLMCollector(
        env=env,
        policy_factory=lambda: policy,
        dialog_turns_per_batch=env.batch_size[0],
        total_dialog_turns=3,
    )
    batches = []
    for i, data in enumerate(collector):
        batches.append(data)
        if i == 2:
            print(data)
            break
    del collector
    assert len(batches) == 3 and all(b.batch_size == (1, 1) for b in batches)
    data = batches[2]
    prompt = data[0, 0]["text"]
    assert isinstance(prompt, str) and len(prompt) >= 10
    assert data["collector", "traj_ids"].shape == (1, 1)
    assert data["done"].shape == (1, 1, 1) and data["next", "done"].shape == (1, 1, 1)
    assert isinstance(data[0, 0]["text_response"], str)
    assert data["tokens_response"].shape[:2] == (1, 1)
    assert data[0, 0]["next", "text"] == prompt + data[0, 0]["text_response"]  # the observation grows
    # a wrapper given its input mode reads that mode only: history mode finds no history here
    with pytest.raises(ValueError, match="Expected .*history.* key for history input mode"):
        vLLMWrapper(llm_model, input_mode="history")(env.reset())


def test_llm_collector_with_a_transformers_policy_on_a_chat_env(tiny_model_path, tiny_tokenizer):
    """TorchRL's collector takes either wrapper; here a TransformersWrapper generating with the
    tiny model on a history-mode DatasetChatEnv, two turns per batch, tracked versions."""
    from transformers import AutoModelForCausalLM

    from rlpost.envs import DatasetChatEnv

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    policy = TransformersWrapper(model, tokenizer=tiny_tokenizer, input_mode="history", generate=True,
                                 generate_kwargs={"max_new_tokens": 6, "do_sample": False})  # fmt: skip
    env = DatasetChatEnv(dataset=[{"query": "What is 1 + 2?"}, {"query": "What is 3 + 4?"}], shuffle=False,
                         num_envs=2, max_steps=1, tokenizer=tiny_tokenizer)  # fmt: skip
    collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=4, total_dialog_turns=4,
                             track_policy_version=True)  # fmt: skip
    (batch,) = list(collector)
    assert batch.batch_size == (2, 2) and collector.policy_version == 0
    full = batch[:, 0]["history"].full
    assert [c[-1]["role"] for c in full.to_chats()] == ["assistant", "assistant"]
    assert batch["collector", "traj_ids"].tolist() == [[0, 2], [1, 3]]
    assert batch["next", "policy_version"].flatten().tolist() == [0, 0, 0, 0]
    assert policy.collector is collector
