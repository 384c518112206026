"""TorchRL's TRL-interop tests that compose a replay buffer with the HF bridges
(``test/llm/test_wrapper.py::TestTRLInterop``): the buffer's samples through
``TorchRLBufferDataset`` into ``HFRewardModelWrapper``, and TRL's ``GRPOTrainer`` reading prompts
from the dataset. Imports are TorchRL's with ``rlpost.torchrl``; the models are built here, as in
TorchRL's tests (no hub). The GRPOTrainer test needs the ``trl`` package, which rlpost does not
depend on; the dev extra installs it (``make test``), and elsewhere the test is skipped.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rlpost.torchrl.data import ListStorage, ReplayBuffer
from rlpost.torchrl.modules.llm import HFRewardModelWrapper, TorchRLBufferDataset

pytestmark = pytest.mark.compat


def make_rb(n: int = 10, seq_len: int = 8) -> ReplayBuffer:
    """TorchRL's ``_make_rb``: a small in-memory buffer of prompts with token TensorDicts."""
    rb = ReplayBuffer(storage=ListStorage(max_size=100))
    for i in range(n):
        rb.add(
            TensorDict(
                {
                    "prompt": f"Question {i}",
                    "input_ids": torch.randint(0, 100, (seq_len,)),
                    "attention_mask": torch.ones(seq_len, dtype=torch.long),
                    "reward": torch.tensor(float(torch.randn(1).item())),
                },
                batch_size=[],
            )
        )
    return rb


class DummyRewardModel(torch.nn.Module):
    """TorchRL's ``_make_dummy_reward_model``: an output with ``.logits`` of ``[B, *shape]``."""

    def __init__(self, logits_shape: tuple = (1,)):
        super().__init__()
        self.logits_shape = logits_shape

    def forward(self, input_ids, attention_mask=None):
        class Out:
            logits = torch.randn(input_ids.shape[0], *self.logits_shape)

        return Out()


def test_round_trip_buffer_to_reward_wrapper():
    """TorchRL's ``test_round_trip_buffer_to_reward_wrapper``: a buffer of rollout-like items,
    sampled through ``TorchRLBufferDataset(keys=[("tokens", "full"), ("masks",
    "all_attention_mask")])``, re-batched and scored by ``HFRewardModelWrapper``."""
    rb = ReplayBuffer(storage=ListStorage(max_size=100), batch_size=8)
    seq_len = 16
    for _ in range(20):
        rb.add(
            TensorDict(
                {
                    "tokens": TensorDict({"full": torch.randint(0, 1000, (seq_len,))}, batch_size=[]),
                    "masks": TensorDict({"all_attention_mask": torch.ones(seq_len, dtype=torch.long)}, batch_size=[]),
                },
                batch_size=[],
            )
        )

    dataset = TorchRLBufferDataset(rb, batch_size=8, keys=[("tokens", "full"), ("masks", "all_attention_mask")])
    samples = list(dataset)
    assert len(samples) == 8

    batch_ids = torch.stack([s["tokens.full"] for s in samples])
    batch_mask = torch.stack([s["masks.all_attention_mask"] for s in samples])
    assert batch_ids.shape == (8, 16) and batch_mask.shape == (8, 16)
    td_batch = TensorDict(
        {
            "tokens": TensorDict({"full": batch_ids}, batch_size=[8]),
            "masks": TensorDict({"all_attention_mask": batch_mask}, batch_size=[8]),
        },
        batch_size=[8],
    )

    wrapper = HFRewardModelWrapper(DummyRewardModel(logits_shape=(1,)), inference_mode=True)
    result = wrapper(td_batch)
    assert "reward" in result
    assert result["reward"].shape == torch.Size([8])
    assert result["reward"].dtype == torch.float32


def test_torchrl_buffer_dataset_grpo_trainer(tmp_path):
    """TorchRL's ``test_torchrl_buffer_dataset_grpo_trainer``: a real GRPOTrainer (a one-layer
    GPT-2 and a word-level tokenizer built here) reads prompts from the buffer's stream."""
    pytest.importorskip("trl", reason="TRL's GRPOTrainer: trl is in the dev extra, not a dependency of rlpost")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    raw_tokenizer = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, "Question": 3}, unk_token="[UNK]"))
    raw_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw_tokenizer, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]"
    )
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=4, n_embd=16, n_layer=1, n_head=2, bos_token_id=2, eos_token_id=2, pad_token_id=0)
    )
    dataset = TorchRLBufferDataset(make_rb(), batch_size=4, keys=["prompt"], num_batches=None).as_hf_dataset()
    args = GRPOConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=2,
        use_cpu=True,
        report_to="none",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    batch = next(iter(trainer.get_train_dataloader()))
    assert len(batch) == 2
    assert all(isinstance(sample["prompt"], str) for sample in batch)
