"""GRPOLoss, DAPO and CISPOLoss, and their outputs: TorchRL's policy losses of ``torchrl.objectives.llm``.

The module scores a TensorDict batch's tokens with the actor (the current policy, with its graph)
and applies :func:`rlpost.algo.grpo_loss`; the math lives in :mod:`rlpost.algo`, so a new loss
never needs a copy of this module. Its input, with TorchRL's key names (``set_keys``)::

    action            ("tokens", "full")         prompt + response ids
    sample_log_prob   ("log_probs", "full")      the inference engine's log-probs (0 on the prompt)
    advantage         "advantage"                [B], [B, 1] or [B, 1, 1]: one per sequence;
                                                 [B, T] or [B, T, 1]: one per token
    ref_log_probs     ("next", "ref_log_probs", "full")   the reference model's (KL-to-ref only)

and, at the actor's keys, the masks ``("masks", "all_attention_mask")`` (True on real tokens),
``("masks", "all_assistant_mask")`` and the prompt ids ``("tokens", "prompt")``. A batch is a
dense ``[B, T]`` TensorDict in any padding layout (every per-token entry in the same one), or a
lazy stack of rows of different lengths (read left-padded, as TorchRL reads them); leading batch
dims beyond one are flattened.

``masking_strategy`` picks the tokens that count (as TorchRL's wrappers' ``_get_sft_dist``,
``_get_rlhf_dist`` and ``_get_generic_dist`` do):

- ``"sft"`` (default): the response, i.e. each row's real tokens after its prompt
  (``("tokens", "prompt")``; in the padded layout the prompt fills the first ``P`` columns);
  without prompt ids, the assistant mask (TorchRL's fallback).
- ``"rlhf"``: the assistant mask (every assistant turn of a multi-turn chat).
- ``"generic"``: every real token (the attention mask).

The output is a :class:`GRPOLossOutput` tensorclass, so TorchRL's ways to make the scalar work:
summing the ``loss_*`` fields, or ``out.mean(reduce=True)`` (every field's mean, as TorchRL's GRPO
scripts do; its gradient is the loss terms' over the number of fields).

Deliberate deviations from TorchRL, each tested in tests/unit/objectives/test_grpo_loss.py:

- Diagnostics (``clip_fraction``, ``kl_approx``, ``entropy``, ``kl_to_ref``,
  ``kl_to_inference``) are means over the counted tokens; TorchRL's average over every position
  of the padded batch, so padding and prompt dilute them. ``clip_fraction`` is the share of
  counted tokens where the clip is active (the ratio is past a bound in the advantage's
  direction, so the token's gradient is cut); TorchRL counts every ratio outside the range.
- The KL terms (``loss_kl_to_ref``, ``loss_kl_to_inference``) are reduced like the objective,
  with ``aggregation`` over the counted tokens; TorchRL averages them over every position and
  never per token. With ``aggregation="none"`` every ``loss_*`` field is per token ``[B, T, 1]``.
- ``aggregation="prompt_mean"`` leaves a row with no counted token out of the mean (TorchRL counts
  it as 0, so padding rows dilute the loss).
- ``kl_to_ref_coeff=0.0`` reports ``kl_to_ref`` (with a zero ``loss_kl_to_ref``) when the batch
  has reference log-probs, as TorchRL's ``kl_to_inference_coeff=0.0`` does for its KL; TorchRL
  reports nothing below a positive coefficient. A negative ``kl_to_ref_coeff`` is an error
  (TorchRL ignores it silently).
- Reference log-probs: with the default key, a batch without ``("next", "ref_log_probs",
  "full")`` is read at ``("ref_log_probs", "full")``, where :class:`rlpost.envs.RetrieveKL`
  writes on data without a ``"next"`` entry and where rlpost's learner batches hold them.
- The first token of each row never counts (it has no context, hence no log-prob), whatever
  the strategy.
- An empty mask gives zero losses and ``ESS`` 1 (TorchRL: NaN).
- Entropy: ``entropy_estimator="exact"`` (default) is TorchRL's, the entropy of the whole
  next-token distribution, with the log-probs from the same forward pass: from rlpost's
  TransformersWrapper's chunked ``log_probs_and_entropy`` (no ``[B, T, vocab]`` tensor), or from
  another actor's logits (``get_dist``). ``"sampled"`` uses ``-log p(token)`` of the sampled tokens,
  an unbiased Monte-Carlo estimate on on-policy samples that needs no ``[B, T, vocab]`` tensor.
- rlpost's additions: ``aggregation`` ``"sequence_mean"`` (the same as ``"prompt_mean"``) and
  ``"sequence_sum_norm"`` with ``max_tokens`` (Dr.GRPO), ``kl_estimator`` for the KL to the
  reference, :meth:`GRPOLoss.loss_terms` (the algo's terms: total loss, clip fraction split by
  side; ``normaliser=`` for a batch split into pieces), :meth:`GRPOLoss.score`, and
  ``loss_function=``: a function with :func:`rlpost.algo.grpo_loss`'s signature that replaces
  it (what the service's ``loss.custom_fn`` names).
- Checked arguments: ``reduction`` is None, ``"mean"`` or ``"none"`` (TorchRL ignores the
  others); ``gamma`` and ``clip_value`` (GRPO has no value network) must be None; an unknown
  keyword is a TypeError (TorchRL swallows it); a generating actor (``generate=True``) is refused
  when the loss is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from tensordict import NestedKey, TensorDictBase
from torch.nn.utils.rnn import pad_sequence

from rlpost.algo import OFF_POLICY_CORRECTIONS, GRPOLossTerms, LossFunction, grpo_loss, trust_region_mask
from rlpost.data.stacking import same_key
from rlpost.objectives.loss_inputs import (
    actor_input,
    advantage_bt,
    check_number,
    clip_bounds,
    describe,
    key_list,
    lazy_rows,
    per_token_bt,
    read_padded,
    score_and_entropy,
    scoring_twin,
    set_accepted_keys,
)
from rlpost.objectives.loss_output import GRPOLossOutput, LLMLossOutput

TOKENS_FULL = ("tokens", "full")
ATTENTION_MASK = ("masks", "all_attention_mask")
ASSISTANT_MASK = ("masks", "all_assistant_mask")
LOG_PROBS_FULL = ("log_probs", "full")
REF_LOG_PROBS_FULL = ("ref_log_probs", "full")
# TorchRL's default: the reference transform writes under "next" during an env step
NEXT_REF_LOG_PROBS_FULL = ("next", "ref_log_probs", "full")

MASKING_STRATEGIES = ("sft", "rlhf", "generic")
ENTROPY_ESTIMATORS = ("exact", "sampled")
# TorchRL's names, then rlpost's (see rlpost.algo.grpo): the algo's name for each
_AGGREGATIONS = {
    "token_mean": "token_mean",
    "prompt_mean": "sequence_mean",
    "none": "none",
    "sequence_mean": "sequence_mean",
    "sequence_sum_norm": "sequence_sum_norm",
}


class GRPOLoss(torch.nn.Module):
    """GRPO / DAPO / Dr.GRPO loss over a TensorDict batch; see the module docstring.

    Per counted token, with ``ratio = exp(log p - sample_log_prob)`` and its advantage ``A``::

        loss = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)

    Args:
        actor_network: the policy, an rlpost LLM wrapper built with ``generate=False`` (e.g.
            ``policy.get_new_version(generate=False)``); its temperature must be the sampling
            one, so that its scores match the engine's. Any input mode: the loss scores the token
            ids, through a twin (same model) that returns log-probs only. None builds a loss that
            cannot run (as in TorchRL, for its helpers).
        clip_epsilon: ``x`` for ``[1 - x, 1 + x]``, or ``(eps_low, eps_high)`` (DAPO's
            clip-higher: ``(0.2, 0.28)``); non-negative, ``eps_low < 1``; kept as the buffers
            ``clip_epsilon_low`` / ``clip_epsilon_high`` on ``device`` (default: the actor's).
        kl_mask_threshold: tokens with ``0.5 * (log p - sample_log_prob)**2`` above it are left
            out of every term (TorchRL's KL-Mask trust region).
        aggregation: ``"token_mean"`` (over every counted token), ``"prompt_mean"`` (per-row
            mean, then over rows), ``"none"`` (per token ``[B, T, 1]``), or rlpost's
            ``"sequence_mean"`` / ``"sequence_sum_norm"`` (divides by ``max_tokens``).
        entropy_bonus: add ``loss_entropy = -entropy_coeff * entropy``.
        samples_mc_entropy: TorchRL's Monte-Carlo sample count; a categorical has a closed-form
            entropy, so it is unused (as in TorchRL).
        reduction: None or ``"mean"`` (use ``aggregation``), or ``"none"`` (per token).
        kl_to_ref_coeff: weight of the KL (``kl_estimator``, TorchRL's k3 by default) to the
            reference log-probs; None for none, 0.0 to report ``kl_to_ref`` only.
        kl_to_inference_coeff: weight of the k3 KL between the policy and ``sample_log_prob``;
            None for none, 0.0 to report ``kl_to_inference`` only.
        gamma, clip_value: TorchRL's PPO arguments; GRPO has no value network, only None.
        off_policy_correction: rlpost's ``"tis"`` or ``"mis"``: :func:`rlpost.algo.grpo_loss`'s
            importance-weight correction for tokens the policy did not sample exactly, capped at
            ``off_policy_threshold`` (> 1); the PPO ratio is then taken against the learner's
            log-probs at the start of the step (``proximal_log_probs`` when the batch has it,
            else the current ones, detached).
        loss_function: rlpost's: a function with :func:`rlpost.algo.grpo_loss`'s signature (and
            result, at least ``loss`` set) that replaces it.

    ``ValueError`` names a bad argument with its value; ``TypeError``: an unknown keyword, or an
    actor that is no rlpost LLM wrapper.
    """

    @dataclass
    class _AcceptedKeys:
        """The keys the loss reads (module docstring; :meth:`GRPOLoss.set_keys`). rlpost's
        ``proximal_log_probs``: the learner's log-probs at the start of the step, read by an
        off-policy correction when present."""

        advantage: NestedKey = "advantage"
        action: NestedKey = TOKENS_FULL
        sample_log_prob: NestedKey = LOG_PROBS_FULL
        ref_log_probs: NestedKey = NEXT_REF_LOG_PROBS_FULL
        proximal_log_probs: NestedKey = "proximal_log_probs"

    default_keys = _AcceptedKeys
    output_type: type[LLMLossOutput] = GRPOLossOutput
    # the per-token objective of rlpost.algo.grpo_loss: "ppo" (the clipped surrogate) or "cispo"
    objective: str = "ppo"

    def __init__(
        self,
        actor_network=None,
        *,
        clip_epsilon: float | tuple[float, float] = 0.2,
        kl_mask_threshold: float | None = None,
        aggregation: str | None = "token_mean",
        entropy_bonus: bool = True,
        samples_mc_entropy: int = 1,
        entropy_coeff: float = 0.01,
        gamma: float | None = None,
        reduction: str | None = None,
        clip_value: bool | float | None = None,
        kl_to_ref_coeff: float | None = None,
        kl_to_inference_coeff: float | None = None,
        device: torch.device | str | None = None,
        masking_strategy: Literal["sft", "rlhf", "generic"] = "sft",
        max_tokens: int | None = None,
        kl_estimator: Literal["k1", "k2", "k3"] = "k3",
        entropy_estimator: Literal["exact", "sampled"] = "exact",
        loss_function: LossFunction | None = None,
        off_policy_correction: Literal["none", "tis", "mis"] = "none",
        off_policy_threshold: float = 2.0,
    ):
        super().__init__()
        for name, value in (("gamma", gamma), ("clip_value", clip_value)):
            if value is not None:
                raise ValueError(f"GRPOLoss has no value network: {name} must be None, got {value!r}")
        aggregation = "token_mean" if aggregation is None else aggregation
        if aggregation not in _AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {tuple(_AGGREGATIONS)}, got {aggregation!r}")
        if aggregation == "sequence_sum_norm" and not (isinstance(max_tokens, int) and max_tokens > 0):
            raise ValueError(f"aggregation 'sequence_sum_norm' needs max_tokens > 0, got max_tokens={max_tokens!r}")
        if reduction not in (None, "mean", "none"):
            raise ValueError(f"reduction must be None, 'mean' or 'none', got {reduction!r}")
        if masking_strategy not in MASKING_STRATEGIES:
            raise ValueError(f"masking_strategy must be one of {MASKING_STRATEGIES}, got {masking_strategy!r}")
        if entropy_estimator not in ENTROPY_ESTIMATORS:
            raise ValueError(f"entropy_estimator must be one of {ENTROPY_ESTIMATORS}, got {entropy_estimator!r}")
        if off_policy_correction not in OFF_POLICY_CORRECTIONS:
            raise ValueError(
                f"off_policy_correction must be one of {OFF_POLICY_CORRECTIONS}, got {off_policy_correction!r}"
            )
        if not (isinstance(off_policy_threshold, (int, float)) and off_policy_threshold > 1):
            raise ValueError(f"off_policy_threshold must be a number > 1, got {off_policy_threshold!r}")
        if kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"kl_estimator must be one of ('k1', 'k2', 'k3'), got {kl_estimator!r}")
        check_number("entropy_coeff", entropy_coeff)
        for name, value in (
            ("kl_to_ref_coeff", kl_to_ref_coeff),
            ("kl_to_inference_coeff", kl_to_inference_coeff),
            ("kl_mask_threshold", kl_mask_threshold),
        ):
            if value is not None:
                check_number(name, value)
        if kl_to_ref_coeff is not None and kl_to_ref_coeff < 0:
            raise ValueError(f"kl_to_ref_coeff must be >= 0 (or None), got {kl_to_ref_coeff!r}")

        self.actor_network = scoring_twin(actor_network)
        self.entropy_bonus = bool(entropy_bonus)
        self.entropy_coeff = float(entropy_coeff)
        self.entropy_estimator = entropy_estimator
        self.samples_mc_entropy = samples_mc_entropy
        self.kl_mask_threshold = kl_mask_threshold
        self.aggregation = aggregation
        self.reduction = "mean" if reduction is None else reduction
        self.max_tokens = max_tokens
        self.kl_to_ref_coeff = kl_to_ref_coeff
        self.kl_estimator = kl_estimator
        self.kl_to_inference_coeff = kl_to_inference_coeff
        self.masking_strategy = masking_strategy
        self.loss_function = grpo_loss if loss_function is None else loss_function
        self.off_policy_correction = off_policy_correction
        self.off_policy_threshold = float(off_policy_threshold)

        if device is None:
            param = next(self.parameters(), None)
            device = param.device if param is not None else torch.get_default_device()
        eps_low, eps_high = clip_bounds(clip_epsilon)
        self.register_buffer("clip_epsilon_low", torch.tensor(eps_low, device=device))
        self.register_buffer("clip_epsilon_high", torch.tensor(eps_high, device=device))
        self._tensor_keys = self._AcceptedKeys()

    # -------------------------------------------------------------------------------- keys

    @property
    def tensor_keys(self) -> _AcceptedKeys:
        """The keys the loss reads (:class:`GRPOLoss._AcceptedKeys`)."""
        return self._tensor_keys

    def set_keys(self, **kwargs) -> None:
        """Set the keys the loss reads, e.g. ``loss.set_keys(advantage="adv")``; None restores a
        key's default; ``ValueError`` for a name not in :class:`GRPOLoss._AcceptedKeys`."""
        set_accepted_keys(self, **kwargs)

    @property
    def in_keys(self) -> list[NestedKey]:
        """The actor's input key, then the action, sample log-prob, advantage and reference
        log-prob keys (TorchRL's order)."""
        keys = list(getattr(self.actor_network, "in_keys", None) or [])
        keys += [
            self.tensor_keys.action,
            self.tensor_keys.sample_log_prob,
            self.tensor_keys.advantage,
            self.tensor_keys.ref_log_probs,
        ]
        return list(dict.fromkeys(keys))

    @property
    def out_keys(self) -> list[str]:
        """The output fields the loss can set (TorchRL's list)."""
        keys = ["loss_objective", "clip_fraction", "ESS", "kl_approx"]
        if self.entropy_bonus:
            keys += ["entropy", "loss_entropy"]
        return keys + ["loss_kl_to_ref", "kl_to_ref", "loss_kl_to_inference", "kl_to_inference"]

    # ------------------------------------------------------------------------------ forward

    def forward(self, tensordict: TensorDictBase) -> GRPOLossOutput:
        """The loss terms and diagnostics of ``tensordict`` as a :class:`GRPOLossOutput`."""
        terms = self.loss_terms(tensordict)
        per_token = self._algo_aggregation == "none"

        def loss_field(value: torch.Tensor | None) -> torch.Tensor | None:
            if not per_token or value is None:
                return value
            # a term with coefficient 0 is a 0-d zero: per token it is zeros like the objective
            return value.expand_as(terms.loss_objective).unsqueeze(-1)

        # a custom loss_function may set ``loss`` only: it is then the objective
        objective = terms.loss if terms.loss_objective is None else terms.loss_objective
        out = {
            "loss_objective": loss_field(objective),
            "clip_fraction": terms.clip_fraction,
            "kl_approx": terms.kl_approx,
            "ESS": terms.ess,
        }
        if self.entropy_bonus:
            out.update(entropy=terms.entropy, loss_entropy=loss_field(terms.loss_entropy))
        if terms.kl_to_ref is not None:
            out.update(loss_kl_to_ref=loss_field(terms.loss_kl), kl_to_ref=terms.kl_to_ref)
        if terms.kl_to_inference is not None:
            out.update(
                loss_kl_to_inference=loss_field(terms.loss_kl_to_inference), kl_to_inference=terms.kl_to_inference
            )
        return self.output_type(**out, batch_size=[])

    def loss_terms(self, tensordict: TensorDictBase, normaliser: float | None = None) -> GRPOLossTerms:
        """rlpost's: the terms :func:`rlpost.algo.grpo_loss` (or ``loss_function``) computes.

        Beyond :meth:`forward`'s output: ``loss = loss_objective + loss_kl + loss_entropy +
        loss_kl_to_inference`` (in that order), ``clip_fraction_low`` / ``_high`` and
        ``metrics()``; terms not computed are 0 (``loss_kl``, ``loss_entropy``) or None.
        ``normaliser``: the denominator when ``tensordict`` is a piece of a larger batch (that
        batch's :func:`rlpost.algo.loss_normaliser`); None: its own.
        """
        if self.actor_network is None:
            raise RuntimeError("GRPOLoss was built with actor_network=None: it has no policy to score the tokens with")
        td = tensordict if tensordict.batch_dims == 1 else tensordict.reshape(-1)
        keys = self.tensor_keys
        tokens_bt = read_padded(td, keys.action, 0)
        if tokens_bt is None:
            raise ValueError(f"Action key {keys.action} not in tensordict.")
        if not isinstance(tokens_bt, torch.Tensor) or tokens_bt.ndim != 2:
            raise ValueError(f"{keys.action!r} must hold token ids of shape [B, T], got {describe(tokens_bt)}")
        advantage = read_padded(td, keys.advantage, 0.0)
        if advantage is None:
            raise ValueError(f"Advantage key {keys.advantage} not in tensordict.")
        old_bt = read_padded(td, keys.sample_log_prob, 0.0)
        if old_bt is None:
            raise KeyError(f"Couldn't find the log-prob {keys.sample_log_prob} in the input data.")
        if old_bt.requires_grad:
            raise RuntimeError(f"tensordict stored {keys.sample_log_prob} requires grad.")
        old_bt = per_token_bt(old_bt, keys.sample_log_prob, tokens_bt)
        advantage = advantage_bt(advantage, keys.advantage, tokens_bt)
        ref_bt = self._ref_log_probs(td, tokens_bt)
        attention_bt = self._attention(td, tokens_bt)
        mask_bt = self._loss_mask(td, tokens_bt, attention_bt)

        want_entropy = self.entropy_bonus
        if want_entropy and self.entropy_estimator == "exact":
            logprobs_bt, entropy_bt = score_and_entropy(self.actor_network, tokens_bt, attention_bt)
        else:
            logprobs_bt = self.score(tokens_bt, attention_bt, mask_bt)
            entropy_bt = -logprobs_bt if want_entropy else None
        if self.kl_mask_threshold is not None:
            mask_bt = mask_bt & trust_region_mask(logprobs_bt, old_bt, self.kl_mask_threshold).to(mask_bt.device)
        # passed only when used, so a custom loss_function without them still works
        correction = {} if self.objective == "ppo" else {"objective": self.objective}
        if self.off_policy_correction != "none":
            prox_bt = read_padded(td, keys.proximal_log_probs, 0.0)
            correction.update(
                off_policy_correction=self.off_policy_correction,
                off_policy_threshold=self.off_policy_threshold,
                proximal_logprobs=None
                if prox_bt is None
                else per_token_bt(prox_bt, keys.proximal_log_probs, tokens_bt).to(logprobs_bt.device),
            )
        return self.loss_function(
            logprobs_bt,
            old_bt.to(logprobs_bt.device),
            advantage.to(logprobs_bt.device),
            mask_bt.to(logprobs_bt.device),
            clip_eps=(float(self.clip_epsilon_low), float(self.clip_epsilon_high)),
            aggregation=self._algo_aggregation,
            max_tokens=self.max_tokens,
            ref_logprobs=None if ref_bt is None else ref_bt.to(logprobs_bt.device),
            kl_coef=self.kl_to_ref_coeff or 0.0,
            kl_estimator=self.kl_estimator,
            entropy=entropy_bt,
            entropy_coef=self.entropy_coeff if want_entropy else 0.0,
            kl_to_inference_coef=self.kl_to_inference_coeff,
            normaliser=normaliser,
            **correction,
        )

    @property
    def _algo_aggregation(self) -> str:
        return "none" if self.reduction == "none" else _AGGREGATIONS[self.aggregation]

    # -------------------------------------------------------------------------------- scoring

    def score(
        self, tokens_bt: torch.Tensor, attention_bt: torch.Tensor, needed_bt: torch.Tensor | None = None
    ) -> torch.Tensor:
        """rlpost's: current log-probs ``[B, T]`` of ``tokens_bt`` in its layout (0 on padding and
        each row's first token), with their graph. ``needed_bt``: the positions the caller reads,
        handed to the actor as its assistant mask (an actor with ``score_assistant_only=True``
        may leave the positions before the first at 0); None: every position."""
        if self.actor_network is None:
            raise RuntimeError("GRPOLoss was built with actor_network=None: it has no policy to score the tokens with")
        actor = self.actor_network
        td = actor_input(actor, tokens_bt, attention_bt)
        if needed_bt is not None:
            td.set((actor.masks_key, "all_assistant_mask"), needed_bt.bool())
        rows = actor(td).get((actor.log_probs_key, "full"), as_list=True)
        logprobs_bt = torch.zeros(tokens_bt.shape, dtype=rows[0].dtype if rows else torch.float32)
        # boolean-mask assignment fills row by row, left to right: the order rows were read in
        return logprobs_bt.index_put((attention_bt.cpu(),), torch.cat(list(rows)).cpu())

    # --------------------------------------------------------------------------- reading

    def _attention(self, td: TensorDictBase, tokens_bt: torch.Tensor) -> torch.Tensor:
        """The attention mask (True on real tokens); all True for dense ids without one, the
        rows' lengths for a lazy stack without one."""
        key = self._actor_key("attention_mask_key", ATTENTION_MASK)
        attention = read_padded(td, key, False)
        if attention is None:
            rows = lazy_rows(td, self.tensor_keys.action)
            if rows is None:
                return torch.ones(tokens_bt.shape, dtype=torch.bool, device=tokens_bt.device)
            rows = [torch.ones(row.shape[-1], dtype=torch.bool) for row in rows]
            attention = pad_sequence(rows, batch_first=True, padding_value=False, padding_side="left")
        return per_token_bt(attention, key, tokens_bt).bool()

    def _loss_mask(self, td: TensorDictBase, tokens_bt: torch.Tensor, attention_bt: torch.Tensor) -> torch.Tensor:
        """The tokens that count under ``masking_strategy``, less each row's first token."""
        mask_bt = attention_bt
        if self.masking_strategy != "generic":
            response_bt = self._response_mask(td, tokens_bt) if self.masking_strategy == "sft" else None
            if response_bt is None:
                key = (self._actor_key("masks_key", "masks"), "all_assistant_mask")
                assistant = read_padded(td, key, False)
                if assistant is None:
                    raise ValueError(
                        f"masking_strategy={self.masking_strategy!r} needs the assistant mask at {key!r}"
                        + (" or the prompt ids" if self.masking_strategy == "sft" else "")
                        + f"; the batch has {key_list(td)}. "
                        "masking_strategy='generic' counts every real token."
                    )
                response_bt = per_token_bt(assistant, key, tokens_bt).bool()
            mask_bt = mask_bt & response_bt
        first_bt = attention_bt & (attention_bt.long().cumsum(dim=1) == 1)
        return mask_bt & ~first_bt

    def _response_mask(self, td: TensorDictBase, tokens_bt: torch.Tensor) -> torch.Tensor | None:
        """False on each row's prompt positions (None without prompt ids). A dense batch's
        prompt fills the first ``P`` columns (``P`` the prompt ids' width, TorchRL's rule); a
        lazy stack's row ``i`` is right-aligned (read left-padded) and its prompt is its first
        ``p_i`` tokens."""
        key = (self._actor_key("tokens_key", "tokens"), "prompt")
        prompt = read_padded(td, key, 0)
        if prompt is None:
            return None
        num_rows, width = tokens_bt.shape
        prompt_rows, token_rows = lazy_rows(td, key), lazy_rows(td, self.tensor_keys.action)
        if prompt_rows is None:
            prompt_lengths = torch.full((num_rows,), prompt.shape[-1])
        else:
            prompt_lengths = torch.tensor([row.shape[-1] for row in prompt_rows])
        if token_rows is None:
            row_lengths = torch.full((num_rows,), width)
        else:
            row_lengths = torch.tensor([row.shape[-1] for row in token_rows])
        start = width - row_lengths
        position = torch.arange(width)[None, :]
        in_prompt = (position >= start[:, None]) & (position < (start + prompt_lengths)[:, None])
        return ~in_prompt.to(tokens_bt.device)

    def _ref_log_probs(self, td: TensorDictBase, tokens_bt: torch.Tensor) -> torch.Tensor | None:
        if self.kl_to_ref_coeff is None:
            return None
        key = self.tensor_keys.ref_log_probs
        ref = read_padded(td, key, 0.0)
        if ref is None and same_key(key, NEXT_REF_LOG_PROBS_FULL):
            key = REF_LOG_PROBS_FULL
            ref = read_padded(td, key, 0.0)
        if ref is None:
            if self.kl_to_ref_coeff > 0:
                raise KeyError(
                    f"Couldn't find the ref log-prob {self.tensor_keys.ref_log_probs} in the input data "
                    f"(keys: {key_list(td)})."
                )
            return None
        return per_token_bt(ref, key, tokens_bt)

    def _actor_key(self, attribute: str, default: NestedKey) -> NestedKey:
        return getattr(self.actor_network, attribute, default)


__all__ = ["GRPOLoss"]
