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

One field differs from the docstring, as it does in TorchRL at the reference commit (ae9719f):
the third batch's ``text``. The docstring shows the 10-letter prompt the data loader gave; TorchRL's
code gives that prompt followed by the first two responses. Its ``LLMEnv`` is done only when
an action holds ``eos_token_id`` (or a transform says so), and the example passes none (the env
warns); its ``LLMCollector`` (``reset_at_each_iter=False``) carries the env's next observation
from one batch to the next. So the three batches are three turns of one dialog, each step's
observation the last one followed by the action (the printed output dates from the collector's
first version, April 2025, and was not made again since). rlpost's LLMEnv and LLMCollector do what
TorchRL's code does; the test asserts that, and that with ``reset_at_each_iter=True`` each batch
starts from a new prompt of the loader and the third batch's ``text`` is the 10-letter prompt
the docstring prints.
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
    """TorchRL's test dataloader: random 10-letter strings under "text", ``batch_size`` a batch
    (here each string it gave is also kept, in ``given``)."""

    def __init__(self, batch_size=0):
        self.batch_size = batch_size
        self.given: list[str] = []

    def __iter__(self):
        return self

    def __next__(self):
        def word():
            self.given.append("".join(random.choice(string.ascii_lowercase) for _ in range(10)))
            return self.given[-1]

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
    assert data["collector", "traj_ids"].shape == (1, 1)
    assert data["done"].shape == (1, 1, 1) and data["next", "done"].shape == (1, 1, 1)
    assert isinstance(data[0, 0]["text_response"], str)
    assert data["tokens_response"].shape[:2] == (1, 1)
    # the text of each batch: the loader's prompt, then the same dialog on (see the docstring):
    # the third batch's is the prompt and the first two responses, as TorchRL's code gives it
    responses = [batch[0, 0]["text_response"] for batch in batches]
    prompt = batches[0][0, 0]["text"]
    assert prompt in dataloader.given and len(prompt) == 10
    texts = [batch[0, 0]["text"] for batch in batches]
    assert texts == [prompt, prompt + responses[0], prompt + responses[0] + responses[1]]
    assert not any(batch["next", "done"].any() for batch in batches)  # no eos_token_id: never done
    assert data[0, 0]["next", "text"] == data[0, 0]["text"] + responses[2]  # the observation grows

    # reset at each batch: the third batch's text is the loader's third prompt, as the docstring prints
    dataloader = DummyStrDataLoader(1)
    env = LLMEnv.from_dataloader(dataloader=dataloader, tokenizer=tokenizer, from_text=True, batch_size=1,
                                 group_repeats=True)  # fmt: skip
    collector = LLMCollector(env=env, policy_factory=lambda: policy, dialog_turns_per_batch=env.batch_size[0],
                             total_dialog_turns=3, reset_at_each_iter=True)  # fmt: skip
    texts = [batch[0, 0]["text"] for batch in collector]
    assert len(texts) == 3 and all(text in dataloader.given and len(text) == 10 for text in texts)
    assert dataloader.given.index(texts[0]) < dataloader.given.index(texts[1]) < dataloader.given.index(texts[2])
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
