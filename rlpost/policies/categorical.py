"""CategoricalSequential: the base of the LLM wrappers (TorchRL's ``torchrl.modules.llm.CategoricalSequential``).

TorchRL's probabilistic-module surface (``log_prob``, ``get_dist``, ``log_prob_key(s)``,
``dist_sample_keys``, ``register_collector``) on every wrapper; backends that return logits
implement ``_full_logits``.

Deviation from TorchRL: ``get_dist`` returns a plain ``Categorical`` over right-padded positions
and its mask (``dist.mask``, True on real tokens) instead of TorchRL's masked categorical; its
``log_prob`` and ``entropy`` are then the distribution's at every position, masked or not, which
rlpost's losses rely on. Sampling goes through ``forward`` (``generate=True``), never the
distribution. TorchRL's masked categorical for LLM logits is here too,
:class:`LLMMaskedCategorical`.
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
        """Log-probabilities of the sequences in ``data`` (scoring modules only), the response's
        (the full sequence's without a split); ``get_kwargs`` go to ``TensorDict.get``."""
        if self.generate:
            raise RuntimeError("log_prob not callable when generate=True: use get_new_version(generate=False)")
        out = self(data)
        key = (self.log_prob_key, "response")
        if out.get(key, None) is None:
            key = (self.log_prob_key, "full")
        return out.get(key, **get_kwargs)

    def get_dist(self, tensordict: TensorDictBase, **kwargs) -> torch.distributions.Categorical:
        """The next-token distribution at every position of the full sequences in ``tensordict``.

        A ``[B, T]`` right-padded Categorical; ``dist.log_prob(tokens)`` at ``t`` scores token
        ``t`` given those before, so position 0 (no context) is masked out of ``dist.mask``.
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


class LLMMaskedCategorical(torch.distributions.Distribution):
    """A categorical over the vocabulary at every position of LLM logits, with a mask
    (TorchRL's ``torchrl.modules.LLMMaskedCategorical``).

    Args:
        logits: ``[*B, T, V]`` unnormalised scores.
        mask: ``[*B, T]`` (position level: True where the position counts) or ``[*B, T, V]``
            (token level: True where the token may be chosen at that position).
        ignore_index: the token id :meth:`log_prob` reads as "no token here" (default -100, as
            ``cross_entropy``'s).

    ``log_prob(tokens)`` is ``-cross_entropy(logits, tokens)`` per position (no logits copy for
    a position-level mask): masked and ``ignore_index`` positions score 0; under a token-level
    mask a masked token scores about ``finfo.min`` (as TorchRL, not -inf). ``sample``, ``mode``
    and ``entropy`` use logits masked to ``finfo(dtype).min`` (cached; :meth:`clear_cache`), so a
    masked token is never sampled; a fully masked position samples uniformly.
    """

    arg_constraints: dict = {}

    def __init__(self, logits: torch.Tensor, mask: torch.Tensor, ignore_index: int = -100) -> None:
        if mask.shape not in (logits.shape[:-1], logits.shape):
            raise ValueError(
                f"Mask shape {tuple(mask.shape)} must be either logits batch shape {tuple(logits.shape[:-1])} "
                f"(for position-level masking) or logits shape {tuple(logits.shape)} (for token-level masking)"
            )
        self._original_logits = logits
        self._mask = mask.bool()
        self.ignore_index = ignore_index
        self._position_level_masking = mask.shape == logits.shape[:-1]
        self._masked_logits: torch.Tensor | None = None
        self._masked_dist: torch.distributions.Categorical | None = None
        super().__init__(batch_shape=logits.shape[:-1], event_shape=logits.shape[-1:], validate_args=False)

    @property
    def logits(self) -> torch.Tensor:
        """The logits as given (not normalised, not masked)."""
        return self._original_logits

    @property
    def mask(self) -> torch.Tensor:
        return self._mask

    @property
    def position_level_masking(self) -> bool:
        """True for a ``[*B, T]`` mask, False for a ``[*B, T, V]`` one."""
        return self._position_level_masking

    @property
    def probs(self) -> torch.Tensor:
        """``softmax`` of the given logits (the mask is not applied)."""
        return torch.softmax(self._original_logits, dim=-1)

    @property
    def masked_logits(self) -> torch.Tensor:
        """The logits with masked entries at ``finfo(dtype).min`` (made on first use)."""
        if self._masked_logits is None:
            mask = self._mask if not self._position_level_masking else self._mask.unsqueeze(-1)
            lowest = torch.finfo(self._original_logits.dtype).min
            self._masked_logits = self._original_logits.masked_fill(~mask, lowest)
        return self._masked_logits

    @property
    def masked_dist(self) -> torch.distributions.Categorical:
        """A ``Categorical`` on :attr:`masked_logits` (what sampling and entropy use)."""
        if self._masked_dist is None:
            logits = self.masked_logits
            if not bool(logits.isfinite().all()):  # an inf or NaN logit would break the softmax
                logits = torch.nan_to_num(logits, nan=0.0, posinf=1e4, neginf=-1e4)
            self._masked_dist = torch.distributions.Categorical(logits=logits)
        return self._masked_dist

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """``log p(value)`` per position, ``[*B, T]``; 0 where ignored (see the class docstring)."""
        if self._position_level_masking:
            logits = self._original_logits
            value = value.masked_fill(~self._mask, self.ignore_index)
        else:
            logits = self.masked_logits
        scores = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), value.reshape(-1), reduction="none", ignore_index=self.ignore_index
        )
        return -scores.reshape(value.shape)

    def sample(self, sample_shape: torch.Size | tuple = ()) -> torch.Tensor:
        return self.masked_dist.sample(torch.Size(sample_shape))

    def rsample(self, sample_shape: torch.Size | tuple = ()) -> torch.Tensor:
        """Token ids are discrete: a plain sample, as in TorchRL."""
        return self.sample(sample_shape)

    @property
    def mode(self) -> torch.Tensor:
        return self.masked_logits.argmax(dim=-1)

    def entropy(self) -> torch.Tensor:
        return self.masked_dist.entropy()

    def clear_cache(self) -> None:
        """Drop the masked logits and their distribution (memory, for a large vocabulary)."""
        self._masked_logits = None
        self._masked_dist = None
