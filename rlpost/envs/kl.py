"""KL retrieval on batches (seed 004 names): RetrieveLogProb, KLComputation, RetrieveKL.

- :class:`RetrieveLogProb` scores a model (``generate=False``) on the full sequences of a batch
  and writes its log-probs, zeroed outside the assistant tokens when ``assistant_only``.
- :class:`KLComputation` turns generation and reference log-probs into a per-token KL and
  either subtracts it from the reward (RLHF style, k1: ``reward -= coeff * sum_t (lp_gen -
  lp_ref)``) or only stores it for the loss term (``add_to_reward=False``).
- :class:`RetrieveKL` chains them: generation log-probs (scored, or the ones the inference engine
  already returned when ``gen_model`` is None — what the service does) and reference log-probs.

Deliberate deviations from TorchRL: these act on batches of completed samples (the reference
actor calls them), not as env transforms; they need padded batches (``pad_output=True``); and
rewards are per sequence, so the reward-side KL is summed over the sequence's tokens instead of
being added per token.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

from rlpost.algo import kl_per_token

ASSISTANT_MASK = ("masks", "all_assistant_mask")


class RetrieveLogProb:
    """Write ``model``'s log-probs of the batch's full sequences at ``log_probs_full_key``."""

    def __init__(
        self,
        model,
        *,
        log_probs_full_key: NestedKey | None = None,
        assistant_only: bool = True,
        detach: bool = True,
    ):
        if getattr(model, "generate", True):
            raise ValueError("RetrieveLogProb needs a scoring model (generate=False)")
        if not getattr(model, "return_log_probs", True):
            raise ValueError("RetrieveLogProb needs return_log_probs=True")
        if not getattr(model, "pad_output", False):
            raise ValueError("RetrieveLogProb works on padded batches: build the model with pad_output=True")
        if assistant_only and not getattr(model, "return_masks", True):
            raise ValueError("assistant_only=True needs the model's masks: build it with return_masks=True")
        self.model = model
        self.log_probs_full_key = log_probs_full_key or (model.log_probs_key, "full")
        self.assistant_only = assistant_only
        self.detach = detach

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        with torch.set_grad_enabled(not self.detach):
            scored = self.model(batch.copy())
        logprobs_bt = scored.get((self.model.log_probs_key, "full"))
        if self.assistant_only:
            mask_bt = scored.get((self.model.masks_key, "all_assistant_mask"), None)
            if mask_bt is None:
                raise ValueError(
                    "assistant_only=True but the model returned no assistant mask; use input_mode='history' "
                    "or tokens with a prompt/full split"
                )
            logprobs_bt = torch.where(mask_bt.bool(), logprobs_bt, torch.zeros_like(logprobs_bt))
            batch.set(ASSISTANT_MASK, mask_bt.bool())
        batch.set(self.log_probs_full_key, logprobs_bt.detach() if self.detach else logprobs_bt)
        return batch


class KLComputation:
    """Per-token KL between two log-prob tensors; optionally a sequence-level reward penalty."""

    def __init__(
        self,
        gen_log_probs_full_key: NestedKey = ("log_probs", "full"),
        ref_log_probs_full_key: NestedKey = ("ref_log_probs", "full"),
        *,
        kl_key: NestedKey = "kl_penalty",
        add_to_reward: bool = True,
        coeff: float = 1.0,
        estimator: str = "k1",
        mask_key: NestedKey = ASSISTANT_MASK,
    ):
        self.gen_key, self.ref_key = gen_log_probs_full_key, ref_log_probs_full_key
        self.kl_key, self.add_to_reward, self.coeff = kl_key, add_to_reward, coeff
        self.estimator, self.mask_key = estimator, mask_key

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        gen_bt, ref_bt = batch.get(self.gen_key), batch.get(self.ref_key)
        if gen_bt.shape != ref_bt.shape:
            raise ValueError(
                f"generation log-probs {tuple(gen_bt.shape)} and reference log-probs {tuple(ref_bt.shape)} differ: "
                "both must come from the same padded layout (and keep the EOS token when pad == eos)"
            )
        mask_bt = batch.get(self.mask_key, None)
        mask_bt = mask_bt.bool() if mask_bt is not None else torch.ones_like(gen_bt, dtype=torch.bool)
        kl_bt = kl_per_token(gen_bt, torch.where(mask_bt, ref_bt, gen_bt), self.estimator)
        kl_bt = torch.where(mask_bt, kl_bt, torch.zeros_like(kl_bt))
        batch.set(self.kl_key, kl_bt)
        if self.add_to_reward:
            reward = batch.get("reward")
            batch.set("reward", reward - self.coeff * kl_bt.sum(-1).reshape(reward.shape))
        return batch


class RetrieveKL:
    """Generation and reference log-probs, then their KL (see the module docstring).

    Args:
        gen_model: scoring model of the generating policy, or None to use the log-probs already
            at ``gen_log_probs_full_key`` (the inference engine's processed log-probs).
        ref_model: scoring model of the frozen reference (``generate=False``, ``pad_output=True``).
    """

    def __init__(
        self,
        gen_model,
        ref_model,
        *,
        assistant_only: bool = True,
        gen_log_probs_full_key: NestedKey = ("log_probs", "full"),
        ref_log_probs_full_key: NestedKey = ("ref_log_probs", "full"),
        kl_key: NestedKey = "kl_penalty",
        add_to_reward: bool = True,
        coeff: float = 1.0,
        estimator: str = "k1",
        detach: bool = True,
    ):
        if gen_model is not None and getattr(gen_model, "log_probs_key", None) == getattr(ref_model, "log_probs_key", None):
            raise ValueError("gen_model and ref_model must write different log_probs_key values")
        self.gen = None
        if gen_model is not None:
            self.gen = RetrieveLogProb(
                gen_model, log_probs_full_key=gen_log_probs_full_key, assistant_only=assistant_only, detach=detach
            )
        self.ref = RetrieveLogProb(
            ref_model, log_probs_full_key=ref_log_probs_full_key, assistant_only=assistant_only, detach=detach
        )
        self.kl = KLComputation(
            gen_log_probs_full_key,
            ref_log_probs_full_key,
            kl_key=kl_key,
            add_to_reward=add_to_reward,
            coeff=coeff,
            estimator=estimator,
        )

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        if self.gen is not None:
            batch = self.gen(batch)
        return self.kl(self.ref(batch))
