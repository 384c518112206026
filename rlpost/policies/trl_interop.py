"""Adapters between rlpost and Hugging Face's TRL (TorchRL's ``torchrl.modules.llm.trl_interop``).

:class:`TorchRLBufferDataset` reads a replay buffer as an iterable dataset (for TRL's
``GRPOTrainer``); :class:`HFRewardModelWrapper` makes a reward model a TensorDict module.
Neither ``trl`` nor ``datasets`` is imported here; ``datasets`` only by ``as_hf_dataset``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from tensordict import NestedKey, NonTensorData, NonTensorStack, TensorDictBase
from tensordict.nn import TensorDictModuleBase

from rlpost.data.replay_buffers import ReplayBuffer

log = logging.getLogger("rlpost")


class TorchRLBufferDataset(torch.utils.data.IterableDataset):
    """Items sampled from a replay buffer, as an iterable dataset of flat dicts.

    Each item is a dict of its leaf keys joined with dots (``"tokens.full"``), strings as plain
    values. ``keys``: those to yield (a key a batch lacks is skipped with a warning);
    ``num_batches``: batches of ``batch_size`` per iterator (None: an unbounded stream).
    """

    def __init__(
        self,
        replay_buffer: ReplayBuffer,
        batch_size: int,
        *,
        keys: list[NestedKey] | None = None,
        device: torch.device | str | None = None,
        num_batches: int | None = 1,
    ) -> None:
        if not isinstance(replay_buffer, ReplayBuffer):
            raise TypeError(f"replay_buffer must be a ReplayBuffer instance, got {type(replay_buffer).__name__}.")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
        if num_batches is not None and (isinstance(num_batches, bool) or not isinstance(num_batches, int)
                                        or num_batches <= 0):  # fmt: skip
            raise ValueError(f"num_batches must be a positive integer or None, got {num_batches!r}.")
        self._replay_buffer = replay_buffer
        self._batch_size = batch_size
        self._keys = list(keys) if keys is not None else None
        self._device = torch.device(device) if device is not None else None
        self._num_batches = num_batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        drawn = 0
        while self._num_batches is None or drawn < self._num_batches:
            batch = self._replay_buffer.sample(self._batch_size)
            keys = self._batch_keys(batch)
            for i in range(batch.batch_size[0]):
                yield self._item(batch[i], keys)
            drawn += 1

    def _batch_keys(self, batch: TensorDictBase) -> list[NestedKey]:
        """The leaf keys of ``batch`` to yield: ``keys`` where given (those the batch has)."""
        leaves = [
            key
            for key in batch.keys(include_nested=True)
            if not isinstance(value := batch.get(key), TensorDictBase) or isinstance(value, NonTensorStack)
        ]
        if self._keys is None:
            return leaves
        present = {_flat_name(key) for key in leaves}
        missing = [key for key in self._keys if _flat_name(key) not in present]
        for key in missing:
            log.warning("TorchRLBufferDataset: key %r not found in the sampled TensorDict: skipped", key)
        return [key for key in self._keys if _flat_name(key) in present]

    def _item(self, item: TensorDictBase, keys: list[NestedKey]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in keys:
            value = item.get(key, None)
            if value is None:
                continue
            if isinstance(value, NonTensorData):
                value = value.data
            elif self._device is not None and isinstance(value, torch.Tensor):
                value = value.to(self._device)
            out[_flat_name(key)] = value
        return out

    def as_hf_dataset(self):
        """A ``datasets.IterableDataset`` yielding the same items (needs ``datasets``)."""
        try:
            from datasets import IterableDataset
        except ImportError as err:
            raise ImportError(
                "TorchRLBufferDataset.as_hf_dataset needs the optional 'datasets' package (pip install datasets)"
            ) from err
        return IterableDataset.from_generator(self.__iter__)

    def __repr__(self) -> str:
        keys = self._keys if self._keys is not None else "<all>"
        return (
            f"{type(self).__name__}(replay_buffer={self._replay_buffer!r}, batch_size={self._batch_size}, "
            f"keys={keys}, device={self._device}, num_batches={self._num_batches})"
        )


def _flat_name(key: NestedKey) -> str:
    if isinstance(key, str):
        return key
    return ".".join(str(part) for part in key)


class HFRewardModelWrapper(TensorDictModuleBase):
    """A Hugging Face reward model as a TensorDict module: one scalar reward per sequence.

    ``model``: a one-label sequence classifier (e.g. TRL's ``RewardTrainer``'s) or any module
    taking ``input_ids`` and ``attention_mask``; its ``logits`` (or ``rewards``, or the output
    tensor) of ``[*B]`` or ``[*B, 1]`` are written in place as float32 ``[*B]`` at
    ``reward_key``. ``attention_mask_key`` None calls it without a mask. ``inference_mode``:
    ``torch.no_grad`` (the reward is then an ordinary tensor). A multi-value output is a
    RuntimeError.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        token_key: NestedKey = ("tokens", "full"),
        attention_mask_key: NestedKey | None = ("masks", "all_attention_mask"),
        reward_key: NestedKey = "reward",
        inference_mode: bool = False,
    ) -> None:
        super().__init__()
        self.in_keys = [token_key] + ([attention_mask_key] if attention_mask_key is not None else [])
        self.out_keys = [reward_key]
        self._token_key, self._attention_mask_key, self._reward_key = token_key, attention_mask_key, reward_key
        self._inference_mode = bool(inference_mode)
        self._model = model

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        input_ids = tensordict.get(self._token_key, None)
        if input_ids is None:
            raise KeyError(f"HFRewardModelWrapper: token_key {self._token_key!r} not found in the input TensorDict.")
        inputs = {"input_ids": input_ids}
        if self._attention_mask_key is not None:
            mask = tensordict.get(self._attention_mask_key, None)
            if mask is None:
                raise KeyError(
                    f"HFRewardModelWrapper: attention_mask_key {self._attention_mask_key!r} not found in the "
                    "input TensorDict."
                )
            inputs["attention_mask"] = mask
        with torch.no_grad() if self._inference_mode else contextlib.nullcontext():
            output = self._model(**inputs)
        tensordict.set(self._reward_key, _scalar_rewards(output, input_ids.shape[:-1]))
        return tensordict


def _scalar_rewards(output: Any, batch_shape: torch.Size) -> torch.Tensor:
    """The ``[*B]`` float32 rewards in a reward model's output."""
    if isinstance(output, torch.Tensor):
        rewards = output
    elif getattr(output, "logits", None) is not None:
        rewards = output.logits
    elif getattr(output, "rewards", None) is not None:
        rewards = output.rewards
    else:
        raise RuntimeError(
            f"HFRewardModelWrapper: could not extract reward from model output of type {type(output).__name__}: "
            "expected a tensor, or an output with 'logits' or 'rewards'"
        )
    if rewards.shape == (*batch_shape, 1):
        rewards = rewards.squeeze(-1)
    elif rewards.shape != batch_shape:
        raise RuntimeError(
            f"HFRewardModelWrapper: expected one scalar reward per input, of shape {tuple(batch_shape)} or "
            f"{(*batch_shape, 1)}; got {tuple(rewards.shape)} (a head with several labels?)"
        )
    return rewards.float()
