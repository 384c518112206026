"""CategoricalSequential: the base of the LLM wrappers (TorchRL's ``torchrl.modules.llm.CategoricalSequential``).

An LLM policy is a categorical distribution over the next token, applied once per position. This
base gives every wrapper TorchRL's probabilistic-module surface, so code written against TorchRL's
base class works on rlpost's wrappers:

- ``log_prob(td)``: the log-probabilities of the sequences in ``td`` under a scoring module
  (``generate=False``), read from ``(log_prob_key, "response")``, or from ``"full"`` when the
  input gives no prompt/response split;
- ``get_dist(td)``: a ``torch.distributions.Categorical`` over the vocabulary at every position
  of the full sequences (backends that can return logits implement ``_full_logits``);
- ``log_prob_key(s)``, ``dist_sample_keys``, ``register_collector`` / ``collector``.

Deviation from TorchRL: ``get_dist`` returns a plain ``Categorical`` over right-padded positions
and its mask (``dist.mask``, True on real tokens) instead of TorchRL's masked categorical, which
rlpost does not depend on; sampling goes through ``forward`` (``generate=True``), never the
distribution.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from tensordict import NestedKey, TensorDictBase
from tensordict.nn import TensorDictModuleBase


class CategoricalSequential(TensorDictModuleBase):
    """Token-level categorical policy over a TensorDict of sequences; see the module docstring."""

    generate: bool
    log_probs_key: NestedKey = "log_probs"
    _collector: weakref.ReferenceType | None = None

    @property
    def log_prob_keys(self) -> list[NestedKey]:
        """TorchRL's name for the keys log-probabilities are written to."""
        return getattr(self, "_log_prob_keys", None) or [self.log_probs_key]

    @log_prob_keys.setter
    def log_prob_keys(self, value: list[NestedKey]) -> None:
        self._log_prob_keys = list(value)
        self.log_probs_key = self._log_prob_keys[0]

    @property
    def log_prob_key(self) -> NestedKey:
        return self.log_prob_keys[0]

    @log_prob_key.setter
    def log_prob_key(self, value: NestedKey) -> None:
        self.log_prob_keys = [value]

    @property
    def dist_sample_keys(self) -> list[NestedKey]:
        """Where sampled actions (the response tokens) are written."""
        return [(getattr(self, "tokens_key", "tokens"), "response")]

    @property
    def dist_params_keys(self) -> list[NestedKey]:
        raise NotImplementedError(f"{type(self).__name__} has no distribution parameters in the TensorDict")

    def register_collector(self, collector: Any) -> None:
        """Keep a weak reference to the collector driving this policy (set by LLMCollector)."""
        self._collector = weakref.ref(collector)

    @property
    def collector(self) -> Any:
        """The collector that registered this policy, if it is still alive."""
        return self._collector() if self._collector is not None else None

    def log_prob(self, data: TensorDictBase, **get_kwargs) -> torch.Tensor | list[torch.Tensor]:
        """Log-probabilities of the sequences in ``data`` (scoring modules only).

        ``get_kwargs`` go to ``TensorDict.get`` (e.g. ``as_list=True`` or
        ``as_padded_tensor=True`` for ragged outputs).
        """
        if self.generate:
            raise RuntimeError("log_prob not callable when generate=True: use get_new_version(generate=False)")
        out = self(data)
        key = (self.log_prob_key, "response")
        if out.get(key, None) is None:
            key = (self.log_prob_key, "full")
        return out.get(key, **get_kwargs)

    def get_dist(self, tensordict: TensorDictBase, **kwargs) -> torch.distributions.Categorical:
        """The next-token distribution at every position of the full sequences in ``tensordict``.

        Returns a ``Categorical`` with batch shape ``[B, T]`` (right-padded) whose ``mask``
        attribute is True on real positions; ``dist.log_prob(tokens)`` at position ``t`` scores
        token ``t`` given the tokens before it, so position 0 (no context) is masked out.
        """
        if self.generate:
            raise NotImplementedError(
                "get_dist is not implemented for generate=True. "
                "Create a scoring twin with get_new_version(generate=False)."
            )
        logits, mask = self._full_logits(tensordict)
        dist = torch.distributions.Categorical(logits=logits)
        dist.mask = mask
        return dist

    def _full_logits(self, tensordict: TensorDictBase) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [B, T, V] aligned so that logits[:, t] predicts token t, mask [B, T])``."""
        raise NotImplementedError(f"{type(self).__name__} cannot return logits; get_dist needs a backend that can")
