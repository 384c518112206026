"""SFTLoss and SFTLossOutput: TorchRL's supervised fine-tuning loss (``torchrl.objectives.llm``).

The loss reads chat histories, scores them with the actor (the model being trained, with its
graph) and imitates their assistant tokens. Its input, with TorchRL's key names (``set_keys``)::

    history        ("history", "full")                 the chats (a History per row)
    ref_log_prob   ("next", "ref_log_probs", "full")   the reference's log-probs (KL / MinorSFT only)
    log_probs      ("log_probs", "full")               where the actor writes its log-probs

The tokens that count are the assistant tokens: the masks ``("masks", "all_assistant_mask")``
and ``("masks", "all_attention_mask")`` when the batch has them, else the history re-rendered
with the tokenizer (``return_assistant_tokens_mask``). The math is :mod:`rlpost.algo.sft`'s; the
service's expert iteration trains with the same NLL through its learner
(:func:`rlpost.algo.sft_loss`).

Deliberate deviations from TorchRL, each tested in tests/unit/algo/test_sft_distillation_losses.py:

- The KL to the reference (``kl_to_ref``, and ``loss_kl_to_ref`` with its coefficient) is the k3
  mean over the assistant tokens; TorchRL averages it over every position of the rows, so the
  prompt (where both log-probs are 0) dilutes it by the prompt's share.
- MinorSFT's reference log-likelihood sums the reference log-probs over the same assistant
  tokens as the model's (TorchRL sums every position, which is the same only when the reference
  log-probs were written with ``assistant_only=True``).
- The reference log-probs are also read at ``("ref_log_probs", "full")`` when the default key is
  absent (where :class:`rlpost.envs.RetrieveLogProb` writes on data without ``"next"``).
- Rows are the flattened batch (any number of batch dims); ``reduction="none"`` gives one loss
  per row in the batch's shape.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from tensordict import NestedKey, TensorClass, TensorDictBase

from rlpost.algo import k3_kl_token_estimate
from rlpost.algo.sft import minor_sft_loss, reduce, sequence_log_likelihood
from rlpost.data.stacking import batch_shape, get_rows, same_key
from rlpost.objectives.loss_inputs import set_accepted_keys

ASSISTANT_MASK = ("masks", "all_assistant_mask")
ATTENTION_MASK = ("masks", "all_attention_mask")


class SFTLossOutput(TensorClass["nocast"]):
    """What :class:`SFTLoss` returns: ``loss_sft`` (with its graph), and with a KL coefficient
    ``loss_kl_to_ref`` (with its graph) and ``kl_to_ref`` (detached). ``out.sum(reduce=True)``
    is the total loss (the diagnostic ``kl_to_ref`` has no gradient)."""

    loss_sft: torch.Tensor
    loss_kl_to_ref: torch.Tensor | None = None
    kl_to_ref: torch.Tensor | None = None


class HistoryLoss(torch.nn.Module):
    """What SFTLoss and :class:`~rlpost.objectives.DistillationLoss` share: keys set with
    :meth:`set_keys`, the tokenizer settings, the per-row masks of a batch of histories, and the
    actor's per-row log-probs of them."""

    @dataclass
    class _AcceptedKeys:
        history: NestedKey = ("history", "full")
        log_probs: NestedKey = ("log_probs", "full")

    default_keys = _AcceptedKeys

    def __init__(self, actor_network, tokenizer, tokenizer_kwargs: dict | None, device, reduction: str,
                 normalize_by_seq_length: bool):  # fmt: skip
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.reduction, self.normalize_by_seq_length = reduction, normalize_by_seq_length
        self.actor_network = actor_network
        self.tokenizer = tokenizer if tokenizer is not None else getattr(actor_network, "tokenizer", None)
        kwargs = dict(tokenizer_kwargs or {})
        for name, value in (
            ("return_assistant_tokens_mask", True),
            ("tokenize", True),
            ("return_tensors", "pt"),
            ("padding", False),
            ("add_generation_prompt", False),
        ):
            kwargs.setdefault(name, value)
        self.tokenizer_kwargs = kwargs
        self.device = device
        self._tensor_keys = self._AcceptedKeys()

    @property
    def tensor_keys(self):
        """The keys the loss reads (:meth:`set_keys`)."""
        return self._tensor_keys

    def set_keys(self, **kwargs) -> None:
        """Set the keys the loss reads (None restores a default; ``ValueError`` for another name)."""
        set_accepted_keys(self, **kwargs)

    def _device(self):
        return torch.device(self.device) if self.device is not None else contextlib.nullcontext()

    def masks(self, td: TensorDictBase, need_assistant: bool) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per row: the attention mask and (None when not found and not ``need_assistant``) the
        assistant mask, from the batch's masks or by rendering its histories."""
        attention, assistant = get_rows(td, ATTENTION_MASK), get_rows(td, ASSISTANT_MASK)
        if attention is None or (assistant is None and need_assistant):
            if self.tokenizer is None:
                raise ValueError(
                    "A tokenizer is needed to recover the token masks: the batch has no ('masks', ...) entries. "
                    "Pass tokenizer= to the loss, or give the batch its masks."
                )
            history = td.get(self.tensor_keys.history, None)
            if history is None:
                raise KeyError(
                    f"no chat history at {self.tensor_keys.history!r} (the batch has "
                    f"{sorted(str(k) for k in td.keys(True, True))}); point the history key at it with set_keys()"
                )
            with self._device():
                rendered = history.apply_chat_template(tokenizer=self.tokenizer, **self.tokenizer_kwargs)
            if assistant is None:
                assistant = get_rows(rendered, "assistant_masks")
            if assistant is None and need_assistant:
                raise ValueError(
                    "the rendered histories have no assistant mask: the chat template must mark assistant turns "
                    "({% generation %}); rlpost's registered templates do"
                )
            if attention is None:
                attention = get_rows(rendered, "attention_mask")
        attention = [mask.bool() for mask in attention]
        return attention, None if assistant is None else [mask.bool() for mask in assistant]

    def actor_log_probs(self, td: TensorDictBase) -> list[torch.Tensor]:
        """The actor's log-probs of each row's tokens, with their graph."""
        if self.actor_network is None:
            raise RuntimeError(f"{type(self).__name__} was built with actor_network=None: it has nothing to train")
        with self._device():
            out = self.actor_network(td.select(self.tensor_keys.history))
        found = get_rows(out, self.tensor_keys.log_probs)
        if found is None:
            raise KeyError(
                f"the actor wrote no log-probs at {self.tensor_keys.log_probs!r}: build it with generate=False "
                "(a TransformersWrapper scoring the histories)"
            )
        return found

    @staticmethod
    def check_shapes(what: str, masks: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        if len(masks) != len(values) or any(m.shape != v.shape for m, v in zip(masks, values)):
            raise ValueError(
                f"the token masks and {what} have different shapes: {[tuple(m.shape) for m in masks]} vs "
                f"{[tuple(v.shape) for v in values]}; both must cover the same tokenized rows"
            )


class SFTLoss(HistoryLoss):
    """Supervised fine-tuning on chat histories (TorchRL's ``SFTLoss``; module docstring).

    Per row, ``LL`` = the summed log-probs of its assistant tokens (divided by their count when
    ``normalize_by_seq_length``): ``loss_function="sft"`` minimises ``-LL``;
    ``"minor_sft"`` minimises ``-log sigmoid(beta * (LL - LL_ref))`` (MinorSFT), with ``LL_ref``
    the reference's. Both are reduced over rows with ``reduction``.

    Args:
        actor_network: the model to train, scoring histories: e.g. ``TransformersWrapper(model,
            generate=False, input_mode="history", pad_output=False)``.
        tokenizer: renders the histories when the batch has no masks; default the actor's.
        tokenizer_kwargs: for ``History.apply_chat_template`` (e.g. ``{"chat_template_name":
            "qwen"}``); default: the full chat with its assistant mask, unpadded.
        kl_to_ref_coeff: with ``"sft"``, the weight of the k3 KL to the reference log-probs
            (``loss_kl_to_ref``); None: no KL. With ``"minor_sft"`` it is set to 0.0 with a
            warning (the reference is already in the loss) and the KL is reported only.
        device: where the histories are rendered and scored.
    """

    @dataclass
    class _AcceptedKeys:
        """The TensorDict keys the loss reads (see the module docstring)."""

        history: NestedKey = ("history", "full")
        ref_log_prob: NestedKey = ("next", "ref_log_probs", "full")
        log_probs: NestedKey = ("log_probs", "full")

    default_keys = _AcceptedKeys

    def __init__(
        self,
        actor_network,
        tokenizer=None,
        tokenizer_kwargs: dict | None = None,
        reduction: Literal["mean", "sum", "none"] = "mean",
        normalize_by_seq_length: bool = True,
        kl_to_ref_coeff: float | None = None,
        loss_function: Literal["sft", "minor_sft"] = "sft",
        beta: float = 0.1,
        device: torch.device | None = None,
    ):
        super().__init__(actor_network, tokenizer, tokenizer_kwargs, device, reduction, normalize_by_seq_length)
        if self.tokenizer is None:
            raise ValueError("SFTLoss needs a tokenizer: pass tokenizer= or an actor that has one")
        if loss_function not in ("sft", "minor_sft"):
            raise ValueError(f"loss_function must be 'sft' or 'minor_sft', got {loss_function!r}")
        if loss_function == "minor_sft" and kl_to_ref_coeff:
            warnings.warn(
                "kl_to_ref_coeff is not used with minor_sft (its loss already holds the reference): set to 0.0",
                stacklevel=2,
            )
            kl_to_ref_coeff = 0.0
        self.kl_to_ref_coeff = kl_to_ref_coeff
        self.loss_function = loss_function
        self.beta = beta

    @property
    def in_keys(self) -> list[NestedKey]:
        keys = [self.tensor_keys.history]
        if self.kl_to_ref_coeff is not None or self.loss_function == "minor_sft":
            keys.append(self.tensor_keys.ref_log_prob)
        return keys

    @property
    def out_keys(self) -> list[str]:
        return []

    def forward(self, tensordict: TensorDictBase) -> SFTLossOutput:
        """The loss of ``tensordict``'s histories as an :class:`SFTLossOutput`."""
        attention, assistant = self.masks(tensordict, need_assistant=True)
        masks = [a & b for a, b in zip(assistant, attention)]
        if not any(bool(mask.any()) for mask in masks):
            raise ValueError("Some inputs have no valid assistant masks: no row has an assistant token to train on.")
        log_probs = self.actor_log_probs(tensordict)
        self.check_shapes("the actor's log-probs", masks, log_probs)
        ll = _per_row(sequence_log_likelihood, log_probs, masks, self.normalize_by_seq_length)
        need_ref = self.kl_to_ref_coeff is not None or self.loss_function == "minor_sft"
        ref = self._ref_log_probs(tensordict, masks) if need_ref else None
        if self.loss_function == "sft":
            loss = reduce(-ll, self.reduction)
        else:
            ref_ll = _per_row(sequence_log_likelihood, ref, masks, self.normalize_by_seq_length).to(ll.device)
            loss = minor_sft_loss(ll, ref_ll, self.beta, self.reduction)
        loss = loss.reshape(batch_shape(tensordict)) if self.reduction == "none" else loss
        if self.kl_to_ref_coeff is None:
            return SFTLossOutput(loss_sft=loss, batch_size=[])
        with torch.no_grad() if self.loss_function == "minor_sft" else contextlib.nullcontext():
            kl = _masked_mean(
                [k3_kl_token_estimate(r.detach().to(lp.device), lp) for lp, r in zip(log_probs, ref)], masks
            )
        return SFTLossOutput(
            loss_sft=loss, loss_kl_to_ref=self.kl_to_ref_coeff * kl, kl_to_ref=kl.detach(), batch_size=[]
        )

    def _ref_log_probs(self, td: TensorDictBase, masks: list[torch.Tensor]) -> list[torch.Tensor]:
        key = self.tensor_keys.ref_log_prob
        found = get_rows(td, key)
        if found is None and same_key(key, self.default_keys.ref_log_prob):
            found = get_rows(td, ("ref_log_probs", "full"))
        if found is None:
            raise ValueError(
                f"Reference log probs not found in tensordict at key {key!r}, needed by "
                f"{'minor_sft' if self.loss_function == 'minor_sft' else 'kl_to_ref_coeff'}; "
                f"the batch has {sorted(str(k) for k in td.keys(True, True))}. Write them with RetrieveLogProb."
            )
        self.check_shapes("the reference log-probs", masks, found)
        return found


# ------------------------------------------------------------------------------------ helpers


def _per_row(fn, values: list[torch.Tensor], masks: list[torch.Tensor], *args) -> torch.Tensor:
    """``fn`` of each row (``[T]`` tensors) stacked into ``[N]``."""
    return torch.stack([fn(v[None], m.to(v.device)[None], *args)[0] for v, m in zip(values, masks)])


def _masked_mean(values: list[torch.Tensor], masks: list[torch.Tensor]) -> torch.Tensor:
    total = sum(torch.where(m.to(v.device), v, 0.0).sum() for v, m in zip(values, masks))
    count = sum(int(m.sum()) for m in masks)
    return total / max(count, 1)


__all__ = ["SFTLoss", "SFTLossOutput"]
