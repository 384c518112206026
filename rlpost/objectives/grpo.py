"""GRPOLoss: the seed-named module that scores the current policy and applies :func:`rlpost.algo.grpo_loss`.

A batch is a TensorDict of B completed samples in one dense layout [B, T] (any padding side):

    ("tokens", "full")               token ids, prompt + response (the ids that were generated)
    ("masks", "all_attention_mask")  True on real tokens
    ("masks", "all_assistant_mask")  True on the tokens the loss counts (assistant / response)
    ("log_probs", "full")            behaviour log-probs from the inference engine (0 on the prompt)
    "advantage"                      [B] or [B, 1]
    ("ref_log_probs", "full")        optional, reference log-probs (RetrieveKL) for the KL term

The current log-probs come from the actor (a TransformersWrapper with ``generate=False``) and keep
their graph; everything else is a constant of the objective. The math lives in :mod:`rlpost.algo`
so that a new loss never requires copying this module.

Deliberate deviation from TorchRL: the entropy bonus uses the sampled-token estimate
``-log p(token)`` (an unbiased Monte-Carlo estimate of the entropy on on-policy samples) because
the wrapper returns the chosen tokens' log-probs, not whole distributions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from rlpost.algo import GRPOLossTerms, grpo_loss, kl_per_token, masked_aggregate
from rlpost.data import Tokens

TOKENS_FULL = ("tokens", "full")
ATTENTION_MASK = ("masks", "all_attention_mask")
ASSISTANT_MASK = ("masks", "all_assistant_mask")
LOG_PROBS_FULL = ("log_probs", "full")
REF_LOG_PROBS_FULL = ("ref_log_probs", "full")


@dataclass(frozen=True, eq=False)
class GRPOLossOutput:
    """What :class:`GRPOLoss` returns: the algo terms plus the KL to the inference policy."""

    terms: GRPOLossTerms
    loss: torch.Tensor  # terms.loss + loss_kl_to_inference, differentiable
    loss_kl_to_inference: torch.Tensor
    kl_to_inference: torch.Tensor  # detached k3 KL(learner || behaviour), token mean over the mask

    def __getattr__(self, name: str) -> Any:  # loss_objective, clip_fraction, ess, ... from the terms
        return getattr(self.terms, name)

    def metrics(self) -> dict[str, float]:
        out = self.terms.metrics()
        out.update(loss=float(self.loss.detach()), kl_to_inference=float(self.kl_to_inference))
        return out


class GRPOLoss(torch.nn.Module):
    """GRPO / DAPO / Dr.GRPO loss over a TensorDict batch (see the module docstring for the keys).

    Args:
        actor_network: a :class:`~rlpost.policies.TransformersWrapper` with ``generate=False``
            (its scoring twin; ``generator.get_new_version(generate=False)`` gives one). Its
            temperature must equal the sampling temperature so its scores match the processed
            behaviour log-probs.

    Keyword Args:
        clip_epsilon: float or (low, high) pair (DAPO clip-higher: (0.2, 0.28)).
        aggregation: "token_mean" | "sequence_mean" | "sequence_sum_norm".
        max_tokens: L_max for "sequence_sum_norm" (the completion-length cap).
        kl_to_ref_coeff, kl_estimator: KL-to-reference term (needs ``ref_log_probs``).
        entropy_coeff: entropy bonus (sampled-token estimate).
        kl_to_inference_coeff: k3 penalty between the learner and the behaviour log-probs.
    """

    def __init__(
        self,
        actor_network,
        *,
        clip_epsilon: float | tuple[float, float] = 0.2,
        aggregation: str = "token_mean",
        max_tokens: int | None = None,
        kl_to_ref_coeff: float = 0.0,
        kl_estimator: str = "k3",
        entropy_coeff: float = 0.0,
        kl_to_inference_coeff: float = 0.0,
    ):
        super().__init__()
        if getattr(actor_network, "generate", False):
            raise ValueError("GRPOLoss needs a scoring actor (generate=False); use actor.get_new_version(generate=False)")
        if getattr(actor_network, "input_mode", "tokens") != "tokens":
            actor_network = actor_network.get_new_version(input_mode="tokens")
        self.actor_network = actor_network.get_new_version(
            pad_output=False, return_text=False, return_tokens=False, return_masks=False, inplace="empty"
        )
        self.clip_epsilon = clip_epsilon
        self.aggregation = aggregation
        self.max_tokens = max_tokens
        self.kl_to_ref_coeff = kl_to_ref_coeff
        self.kl_estimator = kl_estimator
        self.entropy_coeff = entropy_coeff
        self.kl_to_inference_coeff = kl_to_inference_coeff

    def forward(self, batch: TensorDictBase) -> GRPOLossOutput:
        attention_bt = batch.get(ATTENTION_MASK).bool()
        mask_bt = batch.get(ASSISTANT_MASK).bool() & attention_bt
        logprobs_bt = self.score(batch.get(TOKENS_FULL), attention_bt)
        old_bt = batch.get(LOG_PROBS_FULL)
        advantages_b = batch.get("advantage").reshape(-1)
        ref_bt = batch.get(REF_LOG_PROBS_FULL, None)
        want_kl = self.kl_to_ref_coeff > 0 or ref_bt is not None
        terms = grpo_loss(
            logprobs_bt,
            old_bt,
            advantages_b,
            mask_bt,
            clip_eps=self.clip_epsilon,
            aggregation=self.aggregation,
            max_tokens=self.max_tokens,
            ref_logprobs=ref_bt if want_kl else None,
            kl_coef=self.kl_to_ref_coeff,
            kl_estimator=self.kl_estimator,
            entropy=-logprobs_bt if self.entropy_coeff > 0 else None,
            entropy_coef=self.entropy_coeff,
        )
        return self._with_kl_to_inference(terms, logprobs_bt, old_bt, mask_bt)

    def score(self, tokens_bt: torch.Tensor, attention_bt: torch.Tensor) -> torch.Tensor:
        """Current log-probs [B, T] in the batch's own layout (0 on padding), with their graph."""
        td = TensorDict(
            {TOKENS_FULL[0]: Tokens(full=tokens_bt, padded=True, batch_size=tokens_bt.shape[:1]), ATTENTION_MASK: attention_bt},
            batch_size=tokens_bt.shape[:1],
        )
        rows = self.actor_network(td).get(LOG_PROBS_FULL, as_list=True)
        logprobs_bt = torch.zeros(tokens_bt.shape, dtype=rows[0].dtype if rows else torch.float32)
        # boolean-mask assignment fills row by row, left to right: the order rows were read in
        return logprobs_bt.index_put((attention_bt,), torch.cat(list(rows)))

    def _with_kl_to_inference(self, terms, logprobs_bt, old_bt, mask_bt) -> GRPOLossOutput:
        kl_bt = kl_per_token(logprobs_bt, torch.where(mask_bt, old_bt, logprobs_bt).detach(), "k3")
        kl_bt = torch.where(mask_bt, kl_bt, torch.zeros_like(kl_bt))
        loss_kl_inf = torch.zeros((), dtype=terms.loss.dtype)
        if self.kl_to_inference_coeff > 0:
            loss_kl_inf = self.kl_to_inference_coeff * masked_aggregate(kl_bt, mask_bt, self.aggregation, self.max_tokens)
        kl_inf = masked_aggregate(kl_bt.detach(), mask_bt, "token_mean")
        return GRPOLossOutput(terms=terms, loss=terms.loss + loss_kl_inf, loss_kl_to_inference=loss_kl_inf, kl_to_inference=kl_inf)
