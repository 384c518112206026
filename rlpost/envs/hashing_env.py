"""TorchRL's ``LLMHashingEnv``: token sequences identified by a running hash, on the loop of
:mod:`rlpost.envs.llm_env_loop`::

    reset: observation (ids) -> hashing, text
    step:  next observation = cat(observation, action), next hashing = hash(cat(hashing, action))
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from rlpost.data.specs import Composite, NonTensor, Unbounded
from rlpost.envs.common import FLAGS, EnvBase
from rlpost.envs.errors import EnvInputError
from rlpost.envs.llm_env_loop import LLMEnvLoop, merge_rows
from rlpost.envs.td_rows import NestedKey, as_key, has_key


def hash_rows(rows: torch.Tensor) -> torch.Tensor:
    """One int64 per row of a ``[N, F]`` tensor: the first 8 bytes of the BLAKE2b digest of the
    row's bytes (the same in every process)."""
    data = rows.detach().cpu().contiguous()
    values = [
        int.from_bytes(hashlib.blake2b(row.numpy().tobytes(), digest_size=8).digest(), "little", signed=True)
        for row in data
    ]
    return torch.tensor(values, dtype=torch.int64)


class LLMHashingEnv(LLMEnvLoop, EnvBase):
    """Token sequences identified by a running hash (TorchRL's ``LLMHashingEnv``).

    A reset reads ids under ``observation_key`` (``[L]`` or ``[B, L]``) and writes their hash
    (int64 ``[*B, 1]``) under ``"hashing"`` and, with ``text_output``, the decoded text; a step
    reads one token per row under ``"action"`` (see the module docstring), so equal token chains
    get equal hashes. ``hashing_module``: ``[N, F]`` int64 -> ``[N]`` int64 (default
    :func:`hash_rows`). The env takes the batch of its last reset input (TorchRL's is not
    batch-locked).

    Deliberate deviations from TorchRL: the default hash is BLAKE2b-based and the same in every
    process (TorchRL's ``SipHash`` uses Python's ``hash``, which changes with
    ``PYTHONHASHSEED``); a step also writes ``truncated`` (False); the specs are unbounded.
    """

    def __init__(
        self,
        vocab_size: int | None = None,
        *,
        hashing_module: Callable[[torch.Tensor], torch.Tensor] | None = None,
        observation_key: NestedKey = "observation",
        text_output: bool = True,
        tokenizer: Any = None,
        text_key: NestedKey | None = "text",
    ) -> None:
        if vocab_size is None:
            if tokenizer is None:
                raise TypeError("You must provide a vocab_size integer if tokenizer is `None`.")
            vocab_size = tokenizer.vocab_size
        if text_output and tokenizer is None:
            raise ValueError(
                "LLMHashingEnv(text_output=True) decodes observations: pass a tokenizer (or text_output=False)"
            )
        self.vocab_size = vocab_size
        self._hashing_module = hashing_module if hashing_module is not None else hash_rows
        self._tokenizer = tokenizer
        self.observation_key = as_key(observation_key)
        self.text_output = text_output
        self.text_key = as_key(text_key if text_key is not None else "text") if text_output else None
        self.batch_size = torch.Size([])
        self.device = None

    # ------------------------------------------------------------------ what the loop reads

    @property
    def base_env(self) -> LLMHashingEnv:
        return self

    @property
    def input_mode(self) -> NestedKey:
        return self.observation_key

    @property
    def data_key(self) -> NestedKey:
        return self.observation_key

    @property
    def base_state_keys(self) -> tuple:
        return ("hashing",) + ((self.text_key,) if self.text_output else ())

    def _action_keys(self) -> list:
        return ["action"]

    def _reward_keys(self) -> list:
        return []

    def _done_keys(self) -> list:
        return list(FLAGS)

    def _observation_spec(self) -> Composite:
        spec = Composite(shape=self.batch_size)
        spec[self.observation_key] = Unbounded(shape=(*self.batch_size, -1), dtype=torch.int64)
        spec["hashing"] = Unbounded(shape=(*self.batch_size, 1), dtype=torch.int64)
        if self.text_output:
            spec[self.text_key] = NonTensor(example_data="a string", shape=self.batch_size)
        return spec

    def _action_spec(self) -> Composite:
        return Composite({"action": Unbounded(shape=(*self.batch_size, 1), dtype=torch.int64)}, shape=self.batch_size)

    def _state_spec(self) -> Composite:
        return Composite(shape=self.batch_size)

    def _reward_spec(self) -> Composite:
        return Composite(shape=self.batch_size)

    def _done_spec(self) -> Composite:
        flags = {flag: Unbounded(shape=(*self.batch_size, 1), dtype=torch.bool) for flag in FLAGS}
        return Composite(flags, shape=self.batch_size)

    # ------------------------------------------------------------------ reset and step

    def make_tensordict(self, input: str | list[str]) -> TensorDictBase:
        """Tokenize a string (batch ``[]``) or a list of strings (batch ``[B]``) and reset on it."""
        if self._tokenizer is None:
            raise ValueError("LLMHashingEnv.make_tensordict tokenizes its input: the env needs a tokenizer")
        ids = self._tokenizer(input)
        if hasattr(ids, "keys") and "input_ids" in ids.keys():
            ids = ids["input_ids"]
        if isinstance(ids, torch.Tensor):
            ids = ids.to(torch.int64)
        elif isinstance(input, list):
            lengths = sorted({len(row) for row in ids})
            if len(lengths) > 1:
                raise ValueError(
                    f"make_tensordict: the strings tokenize to different lengths {lengths}; reset on padded ids"
                )
            ids = torch.tensor([list(row) for row in ids], dtype=torch.int64)
        else:
            ids = torch.tensor(list(ids), dtype=torch.int64)
        batch = [len(input)] if isinstance(input, list) else []
        return self.reset(TensorDict({self.observation_key: ids}, batch_size=batch))

    def _reset_input(self, td: TensorDictBase | None) -> TensorDictBase:
        if td is None:
            return TensorDict(batch_size=self.batch_size)
        if not isinstance(td, TensorDictBase):
            raise EnvInputError(f"LLMHashingEnv.reset expects a TensorDict, got {type(td).__name__}")
        if td.batch_dims > 1:
            raise EnvInputError(
                f"LLMHashingEnv.reset expects a TensorDict of batch [] or [B], got {tuple(td.batch_size)}"
            )
        self.batch_size = td.batch_size
        return td

    def _reset(self, td: TensorDictBase, *, given: bool = True) -> TensorDictBase:
        if not has_key(td, self.observation_key):
            raise EnvInputError(
                f"Resetting the LLMHashingEnv environment requires a prompt: token ids under {self.observation_key!r}; "
                f"the reset input has keys {sorted(map(str, td.keys(include_nested=True)))}"
            )
        obs = td.get(self.observation_key)
        if not isinstance(obs, torch.Tensor) or obs.is_floating_point():
            raise EnvInputError(f"LLMHashingEnv needs integer token ids under {self.observation_key!r}")
        out = td.exclude("next").clone(recurse=False)
        out.set("hashing", self._hash(obs))
        if self.text_output:
            out.set(self.text_key, self._decode(obs, td))
        for flag in FLAGS:
            out.set(flag, torch.zeros(*td.batch_size, 1, dtype=torch.bool))
        return out

    def _step(self, td: TensorDictBase) -> TensorDictBase:
        for key in (self.observation_key, "hashing", "action"):
            if not has_key(td, key):
                raise EnvInputError(
                    f"LLMHashingEnv.step needs {key!r} (the policy writes 'action', one token id per row); the step "
                    f"input has keys {sorted(map(str, td.keys(include_nested=True)))}"
                )
        action = td.get("action")
        obs = torch.cat([td.get(self.observation_key), action.to(torch.int64)], -1)
        next_td = TensorDict(batch_size=td.batch_size)
        next_td.set(self.observation_key, obs)
        next_td.set("hashing", self._hash(torch.cat([td.get("hashing"), action.to(torch.int64)], -1)))
        if self.text_output:
            next_td.set(self.text_key, self._decode(obs, td))
        for flag in FLAGS:
            next_td.set(flag, torch.zeros(*td.batch_size, 1, dtype=torch.bool))
        return next_td

    def _hash(self, values: torch.Tensor) -> torch.Tensor:
        if values.ndim > 1:
            return self._hashing_module(values).reshape(-1, 1)
        return self._hashing_module(values.unsqueeze(0)).reshape(1)

    def _decode(self, obs: torch.Tensor, td: TensorDictBase) -> Any:
        if obs.ndim > 1:
            texts = self._tokenizer.batch_decode(obs.tolist())
            return NonTensorStack(*[NonTensorData(t) for t in texts], batch_size=td.batch_size)
        return NonTensorData(self._tokenizer.decode(obs.tolist()))

    def _merge_rows(self, kept: TensorDictBase, fresh: TensorDictBase, fresh_idx: list[int]) -> TensorDictBase:
        self.batch_size = kept.batch_size  # a partial reset does not change the env's batch
        return merge_rows(kept, fresh, fresh_idx)

    def __repr__(self) -> str:
        return f"LLMHashingEnv(vocab_size={self.vocab_size}, observation_key={self.observation_key!r})"


__all__ = ["LLMHashingEnv", "hash_rows"]
