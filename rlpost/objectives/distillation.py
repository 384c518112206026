"""DistillationLoss and DistillationLossOutput: TorchRL's token-level distillation loss.

A student (the actor, trained) is pulled toward a frozen teacher through the log-probs both give
the same tokens: the teacher's read from the batch (``RetrieveLogProb(teacher,
log_probs_full_key=("teacher_log_probs", "full"))`` writes them), the student's from the actor.
Keys (``set_keys``)::

    history            ("history", "full")
    teacher_log_prob   ("next", "teacher_log_probs", "full")
    log_probs          ("log_probs", "full")        where the student writes its log-probs

Per token the KL is the k3 estimate (:func:`rlpost.algo.k3_kl_token_estimate`):
``kl_direction="reverse"`` (default) estimates KL(student || teacher) on tokens the student
sampled, ``"forward"`` KL(teacher || student) on tokens the teacher wrote. Each row's sum (over
its assistant tokens, or every attended one with ``assistant_only=False``) is divided by its
count when ``normalize_by_seq_length`` and reduced over rows. As in TorchRL the gradient flows
through the student's log-probs only (the pathwise gradient of k3), whose expectation is the
forward KL's in both directions.

For on-policy distillation in a training run, rlpost's learner instead puts
``teacher_lp - sampler_lp`` into each token's advantage (``loss.distillation`` in a job config,
:func:`rlpost.algo.distillation_advantages`), which descends the reverse KL with its
score-function gradient; this class keeps TorchRL's objective for code ported from it.

Deliberate deviations from TorchRL: rows are the flattened batch (``reduction="none"`` gives the
batch's shape), and a row whose student and teacher log-probs differ in length names both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from tensordict import NestedKey, TensorClass, TensorDictBase

from rlpost.algo import k3_kl_token_estimate
from rlpost.algo.sft import reduce
from rlpost.data.stacking import batch_shape, get_rows
from rlpost.objectives.sft import HistoryLoss

KL_DIRECTIONS = ("reverse", "forward")
# share of exact-zero teacher log-probs on non-assistant tokens that marks assistant-only data
_ZERO_FILLED_SHARE = 0.9


class DistillationLossOutput(TensorClass["nocast"]):
    """What :class:`DistillationLoss` returns: ``loss_distill`` (with its graph: backpropagate
    it) and ``kl_to_teacher``, the detached mean of the rows' KL estimates."""

    loss_distill: torch.Tensor
    kl_to_teacher: torch.Tensor


def _distillation_loss(summed_kl: torch.Tensor, reduction: str) -> torch.Tensor:
    """The rows' KL estimates reduced (``"mean"``, ``"sum"`` or ``"none"``)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"Invalid reduction: {reduction!r} (one of 'mean', 'sum', 'none').")
    return reduce(summed_kl, reduction)


class DistillationLoss(HistoryLoss):
    """Token-level knowledge distillation toward a teacher's log-probs (TorchRL's
    ``DistillationLoss``; module docstring). ``actor_network``: the student, scoring histories,
    or any TensorDict module writing ``("log_probs", "full")``; ``tokenizer``,
    ``tokenizer_kwargs``, ``device``: as :class:`~rlpost.objectives.SFTLoss`'s.
    ``assistant_only`` must match the one the teacher's log-probs were written with (a mismatch
    is detected and refused).
    """

    @dataclass
    class _AcceptedKeys:
        """The TensorDict keys the loss reads (see the module docstring)."""

        history: NestedKey = ("history", "full")
        teacher_log_prob: NestedKey = ("next", "teacher_log_probs", "full")
        log_probs: NestedKey = ("log_probs", "full")

    default_keys = _AcceptedKeys

    def __init__(
        self,
        actor_network,
        tokenizer=None,
        tokenizer_kwargs: dict | None = None,
        kl_direction: Literal["reverse", "forward"] = "reverse",
        reduction: Literal["mean", "sum", "none"] = "mean",
        normalize_by_seq_length: bool = True,
        assistant_only: bool = True,
        device: torch.device | None = None,
    ):
        super().__init__(actor_network, tokenizer, tokenizer_kwargs, device, reduction, normalize_by_seq_length)
        if kl_direction not in KL_DIRECTIONS:
            raise ValueError(f"kl_direction must be 'reverse' or 'forward', got {kl_direction!r}.")
        self.kl_direction = kl_direction
        self.assistant_only = assistant_only

    @property
    def in_keys(self) -> list[NestedKey]:
        return [self.tensor_keys.history, self.tensor_keys.teacher_log_prob]

    @property
    def out_keys(self) -> list[str]:
        return []

    def forward(self, tensordict: TensorDictBase) -> DistillationLossOutput:
        """The distillation loss of ``tensordict`` as a :class:`DistillationLossOutput`."""
        attention, assistant = self.masks(tensordict, need_assistant=self.assistant_only)
        masks = [a & b for a, b in zip(assistant, attention)] if self.assistant_only else attention
        if any(not bool(mask.any()) for mask in masks):
            raise ValueError(
                "Some sequences have no tokens selected for distillation: check the batch's assistant / attention "
                "masks (or build the loss with assistant_only=False)."
            )
        student = self.actor_log_probs(tensordict)
        teacher = get_rows(tensordict, self.tensor_keys.teacher_log_prob)
        if teacher is None:
            raise KeyError(
                f"Teacher log-probs not found at {self.tensor_keys.teacher_log_prob!r} (the batch has "
                f"{sorted(str(k) for k in tensordict.keys(True, True))}): write them with "
                "RetrieveLogProb(teacher, log_probs_full_key=('teacher_log_probs', 'full')), or point the "
                "teacher_log_prob key at them with set_keys()."
            )
        if len(student) != len(teacher) or any(s.shape != t.shape for s, t in zip(student, teacher)):
            raise ValueError(
                f"Student and teacher log-probs have different shapes: {[tuple(s.shape) for s in student]} vs "
                f"{[tuple(t.shape) for t in teacher]}; both models must score the same tokenized rows."
            )
        self.check_shapes("the log-probs", masks, student)
        if not self.assistant_only and assistant is not None:
            _refuse_assistant_only_teacher(teacher, attention, assistant)
        summed = []
        for lp, tlp, mask in zip(student, teacher, masks):
            mask = mask.to(lp.device)
            lp = lp.masked_fill(~mask, 0.0)
            tlp = tlp.detach().to(lp.device).masked_fill(~mask, 0.0)
            kl = k3_kl_token_estimate(tlp, lp) if self.kl_direction == "reverse" else k3_kl_token_estimate(lp, tlp)
            total = kl.sum()
            summed.append(total / mask.sum().clamp(min=1) if self.normalize_by_seq_length else total)
        summed_kl = torch.stack(summed)
        loss = _distillation_loss(summed_kl, self.reduction)
        if self.reduction == "none":
            loss = loss.reshape(batch_shape(tensordict))
        return DistillationLossOutput(loss_distill=loss, kl_to_teacher=summed_kl.detach().mean(), batch_size=[])


def _refuse_assistant_only_teacher(
    teacher: list[torch.Tensor], attention: list[torch.Tensor], assistant: list[torch.Tensor]
) -> None:
    """Teacher log-probs written with ``assistant_only=True`` hold exact zeros off the assistant
    turns; with ``assistant_only=False`` the loss would pull the student toward probability one
    on those tokens. Refused when nearly all of them are exact zeros."""
    zeros = total = 0
    for tlp, att, ast in zip(teacher, attention, assistant):
        if tlp.shape != att.shape or tlp.shape != ast.shape:
            return
        outside = att & ~ast
        total += int(outside.sum())
        zeros += int(((tlp == 0.0) & outside.to(tlp.device)).sum())
    if total and zeros > _ZERO_FILLED_SHARE * total:
        raise RuntimeError(
            f"{zeros} of the {total} attended non-assistant tokens have a teacher log-prob of exactly 0.0: the "
            "teacher's log-probs were written with RetrieveLogProb(assistant_only=True), but this loss has "
            "assistant_only=False. Build the loss with assistant_only=True, or write the teacher's log-probs with "
            "RetrieveLogProb(assistant_only=False)."
        )


__all__ = ["DistillationLoss", "DistillationLossOutput"]
