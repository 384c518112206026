"""The learner: a transformers model, AdamW and :class:`~rlpost.objectives.GRPOLoss`.

It trains on completed GRPO groups from the buffer, publishes versioned weights on the weight bus
and writes checkpoints. :class:`Learner` is a plain class (no Ray); :class:`LearnerActor` is the
thin Ray shell :func:`start_learner` starts as ``learner`` (the logic stays testable without Ray).

One learner step, ``train_step(groups)``::

    micro_batches = collate(slice) for grad_accumulation contiguous slices of the samples,
                    each packed to the token budget (trainer.max_tokens_per_microbatch, auto)
    D = sum(loss_normaliser(micro) for micro in micro_batches)    # the whole batch's denominator
    repeat epochs_per_batch times:                                # PPO epochs over the same batch
        for micro in micro_batches:
            loss_fn.loss_terms(micro, normaliser=D).loss.backward()
        clip_grad_norm_(grad_clip); optimizer.step(); scheduler.step(); zero_grad()
        version += 1

Micro-batch scaling. Every term of the loss (objective, KL, entropy, KL to inference) is
``numerator(masked terms) / D`` with a denominator ``D`` set by the aggregation
(:func:`rlpost.algo.loss_normaliser`): the number of loss tokens (``token_mean``), of rows with
at least one loss token (``sequence_mean``), or of rows times ``max_tokens``
(``sequence_sum_norm``). Each micro-batch's terms are divided by the whole batch's ``D``, so the
micro-batch losses add up to the loss over the whole batch and the accumulated gradient equals
its gradient exactly, for any split and any aggregation: unequal token counts in the
micro-batches do not tilt the step. (Averaging micro-batch losses, ``1 / grad_accumulation``
each, is only equal to it when every micro-batch has the same denominator.)

The loss (``loss.type``) is :class:`~rlpost.objectives.GRPOLoss` over
:func:`rlpost.algo.grpo_loss` (``grpo``), :class:`~rlpost.objectives.DAPO` (``dapo``: the
same with DAPO's defaults), :class:`~rlpost.objectives.CISPOLoss` (``cispo``), or GRPOLoss over
:func:`rlpost.algo.sft_loss` (``sft``: expert iteration on the samples the env pools kept); or
the function ``loss.custom_fn`` names, called with grpo_loss's arguments. With
``loss.distillation.coef`` each micro-batch's advantages become per token (the teacher's term,
:meth:`Learner._with_distillation`) before the loss.

Versions. ``version`` = the number of optimizer steps taken since the initial weights (version 0,
the weights on disk that the inference engines start from); each optimizer step adds 1, so a
step with ``epochs_per_batch = k`` adds k. Published weights carry the version they are, and
staleness is measured in it (``version at the start of the step - sample.policy_version``).

Precision. Master weights and optimizer state are always float32. On CUDA with
``model.dtype: bfloat16`` the forward runs under ``torch.autocast(bfloat16)`` (the log-softmax
and the loss math stay float32); float16 is not autocast (it would need loss scaling) and
trains in float32. On CPU everything is float32. Weights are published in ``model.dtype``, the
dtype of the inference engines; checkpoints hold the float32 masters.

Dropout is off (``model.eval()``) for good: the learner's scores must match the engine's.

Memory. ``trainer.gradient_checkpointing`` recomputes each decoder layer's activations in the
backward pass (:func:`enable_activation_checkpointing`); ``trainer.max_tokens_per_microbatch``
bounds the tokens of a micro-batch's forward (rows x the longest, or with
``model.pack_sequences`` the packed rows: :func:`rlpost.actors.batch.split_to_budget`), by default
(``auto``) from the model's shape and the device's free memory at the first step
(:mod:`rlpost.actors.token_budget`); a row longer than the budget fails its step before any
pass, naming the key. Neither changes the step's loss or gradient.

LoRA (``model.lora``): the model is wrapped by ``peft`` with an adapter on each target layer and
only the adapter trains (AdamW holds state for it alone). A sync sends the adapter's tensors,
which the inference workers serve as a vLLM LoRA adapter, or the merged weights where an engine
cannot (``sync_mode``, :meth:`choose_sync_mode`); checkpoints hold the adapter in peft's format
and, with ``model.lora.save_merged``, the merged model in ``merged/`` (:mod:`rlpost.lora`).

Sharded (``Learner(..., sharded=True)`` in each rank of a learner group,
:mod:`rlpost.actors.sharding`): the model is sharded with FSDP2 over the group; each rank builds
it empty and is sent only its shards of the weights (``sharding.load_shards``). Every rank is
given the whole step's groups and trains on its share (rank r takes groups r, r + N, ...); the
normaliser ``D`` is summed over the ranks, so the ranks' summed gradient is the one-process
gradient. The ranks run the same number of forward/backward passes (FSDP gathers each layer's
parameters in every rank's forward): a rank with fewer micro-batches adds passes that contribute
a zero gradient. Scoring and publishing are collectives too: every rank calls them; rank 0 alone
sends the gathered weights. On CUDA with ``model.dtype: bfloat16`` the gathered parameters are
bfloat16 and the reductions float32 (FSDP's mixed precision replaces autocast).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import pickle
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from rlpost import lora
from rlpost.actors import learner_name, sharding, start_actor
from rlpost.actors.batch import batch_rows, collate_samples, loss_tokens, split_rows, split_to_budget
from rlpost.actors.token_budget import TokenBudget, auto_token_budget
from rlpost.algo import distillation_advantages, load_loss_function, loss_normaliser, sft_loss
from rlpost.config import (
    LearnerResources,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
    ReferenceConfig,
    RolloutConfig,
    TrainerConfig,
)
from rlpost.objectives import DAPO, CISPOLoss, GRPOLoss
from rlpost.objectives.grpo import ATTENTION_MASK, LOG_PROBS_FULL, REF_LOG_PROBS_FULL, TOKENS_FULL
from rlpost.policies import TransformersWrapper
from rlpost.runs import latest_checkpoint, list_checkpoints
from rlpost.transport.bucketing import StreamedTensors
from rlpost.types import Group, Sample

if TYPE_CHECKING:
    from rlpost.config import JobConfig

# loss.type -> the loss module and the function its terms come from (None: rlpost.algo.grpo_loss);
# expert iteration is SFT through the same module, on the samples the env pools kept
LOSS_TYPES = {"grpo": (GRPOLoss, None), "dapo": (DAPO, None), "cispo": (CISPOLoss, None), "sft": (GRPOLoss, sft_loss)}
TRAINER_STATE = "trainer_state.pt"
TRAINER_SHARDS = "trainer_state"  # a learner group's: torch.distributed.checkpoint shards
TRAINER_META = "trainer_meta.pt"  # beside them: scheduler, step, version, RNG
ROLLOUT_STATE = "rollout_state.pkl"  # the controller's part: buffer groups, env-pool positions
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Diagnostics that are token means over the loss tokens whatever the aggregation: combined over
# micro-batches weighted by their loss tokens (exact, except for ess, which is not a mean).
_TOKEN_MEAN_METRICS = (
    "clip_fraction",
    "clip_fraction_low",
    "clip_fraction_high",
    "kl_approx",
    "ess",
    "kl_to_ref",
    "entropy",
    "kl_to_inference",
    "sampling_logp_diff_mean",
    "off_policy_fraction",
)
_LOSS_METRICS = ("loss", "loss_objective", "loss_kl", "loss_entropy")
# forming a learner group waits this long beyond the group's timeout: every rank loads the model first
_MODEL_LOAD_GRACE_S = 600.0
log = logging.getLogger("rlpost")
_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)")  # how Rust's std::io::Error shows an errno


class CheckpointWriteError(OSError):
    """A checkpoint could not be written because of an I/O error (disk full, quota, permissions).

    Raised by :meth:`Learner.save_checkpoint` once nothing of the failed write is left on disk
    and every earlier checkpoint is intact. ``errno`` is the cause's (``errno.ENOSPC`` for a full
    disk), and the message names the folder, the cause and the checkpoint to resume from.
    """


# ------------------------------------------------------------------------------------ batches


def _warmup_factor(step: int, warmup_steps: int) -> float:
    """LR multiplier: linear warm-up over ``warmup_steps`` optimizer steps (1/W, 2/W, ..., 1), then 1."""
    return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)


# ------------------------------------------------------------------------------------ learner


@dataclass(frozen=True)
class LearnerSettings:
    """The job config sections the learner reads (the YAML's sections of the same names)."""

    model: ModelConfig  # the weights to start from, their dtype, the tokenizer
    loss: LossConfig
    optimizer: OptimizerConfig
    reference: ReferenceConfig  # the KL-to-reference term: on or off, coefficient, estimator
    trainer: TrainerConfig  # epochs per batch, torch seed, checkpoints kept
    rollout: RolloutConfig  # the sampling temperature (log-probs) and max_tokens (Dr.GRPO's L_max)
    resources: LearnerResources  # ``resources.learner`` (per rank; num_workers ranks)
    run_name: str = ""  # the run whose metrics the actor reports under
    # with LoRA, what the syncs send ("adapter" or "merged", rlpost.lora.sync_route: it also
    # depends on where the engines run); None: model.lora.sync as written, with auto as adapter
    lora_sync: str | None = None

    @classmethod
    def from_job(cls, cfg: JobConfig) -> LearnerSettings:
        return cls(cfg.model, cfg.loss, cfg.optimizer, cfg.reference, cfg.trainer, cfg.rollout,
                   cfg.resources.learner, cfg.logging.run_name or "", lora.sync_route(cfg))  # fmt: skip


class Learner:
    """Trains the policy with GRPO on groups of samples; see the module docstring.

    Args:
        cfg: the learner's sections of the job config (``LearnerSettings.from_job(job_config)``).
        publisher: what ``publish()`` sends the weights through: a
            :class:`~rlpost.collect.vLLMUpdater` on the inference workers (a run's learner), or
            any :class:`~rlpost.transport.weight_bus.WeightPublisher`; may be set later
            (``learner.publisher = ...``). In a sharded group only rank 0's is used.
        sharded: this process is one rank of a learner group whose process group it has joined
            (:func:`rlpost.actors.sharding.join_group`): shard the model over it (module docstring).
    """

    def __init__(self, cfg: LearnerSettings, *, publisher=None, sharded: bool = False):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg, self.publisher, self.sharded = cfg, publisher, sharded
        if sharded and not torch.distributed.is_initialized():
            raise RuntimeError("a sharded Learner needs its learner group joined first (sharding.join_group)")
        self.rank = torch.distributed.get_rank() if sharded else 0
        self.world_size = torch.distributed.get_world_size() if sharded else 1
        torch.manual_seed(cfg.trainer.seed)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        remote = cfg.model.trust_remote_code
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path, trust_remote_code=remote)
        if sharded:  # parameters on the meta device: load_shards gives each rank its shards only
            self.model = sharding.empty_model(cfg.model.name_or_path, trust_remote_code=remote)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                cfg.model.name_or_path, dtype=torch.float32, trust_remote_code=remote
            )
        self._architecture = type(self.model).__name__  # before sharding renames the class
        if cfg.model.lora is not None:
            if sharded:
                raise ValueError("model.lora: a LoRA learner is one rank, not a sharded group")
            self.model = lora.apply_lora(self.model, cfg.model.lora)
        # what publish() sends: every weight, or with LoRA the adapter or the merged weights (an
        # adapter route turns merged where an engine serves no LoRA: LearnerActor.connect_workers)
        self.sync_mode = "full" if cfg.model.lora is None else self._lora_route()
        if not sharded:  # a sharded model's shards are allocated on the device by load_shards
            self.model.to(self.device)
            own_trainable_weights(self.model)
        self.model.eval()  # dropout off for good (module docstring)
        if cfg.trainer.gradient_checkpointing:
            enable_activation_checkpointing(self._transformers_model)
        if sharded:
            bf16 = self.device.type == "cuda" and cfg.model.dtype == "bfloat16"
            sharding.shard_model(self.model, param_dtype=torch.bfloat16 if bf16 else None)
            sharding.load_shards(self.model, cfg.model.name_or_path, self.device, trust_remote_code=remote)
        opt = cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=opt.lr,
            betas=tuple(opt.betas),
            weight_decay=opt.weight_decay,
            fused=opt.fused or None,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, functools.partial(_warmup_factor, warmup_steps=opt.warmup_steps)
        )
        self.loss_fn = self._make_loss()
        self._budget: TokenBudget | None = None  # set on first use (token_budget)
        self._version = 0
        self._step = 0  # train_step calls completed (the controller's step, saved in checkpoints)

    @property
    def _transformers_model(self) -> torch.nn.Module:
        """The transformers model (with LoRA: the one inside peft's wrapper)."""
        return self.model.get_base_model() if lora.is_lora_model(self.model) else self.model

    def _make_loss(self) -> GRPOLoss:
        cfg = self.cfg
        scorer = TransformersWrapper(
            self.model,
            tokenizer=self.tokenizer,
            input_mode="tokens",
            generate=False,
            generate_kwargs={"temperature": cfg.rollout.temperature},
            # the loss reads the assistant tokens only: no LM head or log-softmax on the prompt
            score_assistant_only=True,
            chunked_scoring=cfg.model.chunked_scoring,
            pack_sequences=cfg.model.pack_sequences,
        )
        kl_in_loss = cfg.reference.enabled and cfg.reference.kl_in == "loss"
        loss_class, loss_function = LOSS_TYPES[cfg.loss.type]
        if cfg.loss.custom_fn:
            loss_function = load_loss_function(cfg.loss.custom_fn)
        # The batch's loss tokens are the assistant mask ("rlhf"); a KL coefficient of 0.0 still
        # reports its KL (kl_to_ref when the samples carry reference log-probs).
        return loss_class(
            scorer,
            clip_epsilon=(cfg.loss.clip_eps_low, cfg.loss.clip_eps_high),
            aggregation=cfg.loss.aggregation,
            max_tokens=cfg.rollout.max_tokens,
            kl_to_ref_coeff=cfg.reference.kl_coef if kl_in_loss else 0.0,
            kl_estimator=cfg.reference.kl_estimator,
            entropy_bonus=cfg.loss.entropy_coef > 0,
            entropy_coeff=cfg.loss.entropy_coef,
            entropy_estimator=cfg.loss.entropy_estimator,
            kl_to_inference_coeff=cfg.loss.kl_to_inference_coef,
            masking_strategy="rlhf",
            loss_function=loss_function,
            off_policy_correction=cfg.loss.off_policy_correction,
            off_policy_threshold=cfg.loss.off_policy_threshold,
        )

    @property
    def version(self) -> int:
        """Optimizer steps taken since the initial weights (version 0)."""
        return self._version

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def collate(self, groups: Sequence[Group]) -> TensorDict:
        """The whole batch of ``groups`` as one right-padded TensorDict
        (:func:`rlpost.actors.batch.collate_samples`)."""
        rows = batch_rows(groups)
        return collate_samples([s for s, _ in rows], self.pad_token_id, [a for _, a in rows])

    def _autocast(self):
        if self.device.type == "cuda" and self.cfg.model.dtype == "bfloat16" and not self.sharded:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -------------------------------------------------------------------------------- training

    def train_step(self, groups: Sequence[Group]) -> dict[str, float]:
        """One learner step on ``groups``: ``epochs_per_batch`` optimizer steps; returns metrics."""
        start, version_at_start = time.perf_counter(), self._version
        rows = batch_rows(groups)
        own = (
            rows if not self.sharded else [row for g in groups[self.rank :: self.world_size] for row in batch_rows([g])]
        )
        micro_batches = [
            self._with_distillation(collate_samples([s for s, _ in chunk], self.pad_token_id, [a for _, a in chunk]))
            for chunk in self._micro_batch_rows(own)
        ] if own else []  # fmt: skip
        loss = self.cfg.loss
        normaliser = sum(loss_normaliser(loss_tokens(mb), loss.aggregation, self.cfg.rollout.max_tokens)
                         for mb in micro_batches)  # fmt: skip
        passes_needed = len(micro_batches)
        if self.sharded:  # the whole step's normaliser, and as many passes on every rank
            normaliser = sharding.all_reduce_scalar(normaliser, "sum")
            passes_needed = int(sharding.all_reduce_scalar(passes_needed, "max"))
        normaliser = max(normaliser, 1.0)  # no loss token at all: a zero loss
        idle = passes_needed - len(micro_batches)
        epochs = self.cfg.trainer.epochs_per_batch
        if epochs > 1 and loss.off_policy_correction != "none":
            self._set_proximal_log_probs(micro_batches, idle)
        passes = [self._optimizer_step(micro_batches, normaliser, idle) for _ in range(epochs)]
        self._step += 1
        metrics = _mean_dicts(passes)
        metrics.update(_batch_metrics(rows, version_at_start))
        metrics.update(policy_version=float(self._version), step_time_s=time.perf_counter() - start)
        metrics["micro_batches"] = float(passes_needed)
        if self.token_budget is not None:
            metrics["token_budget"] = float(self.token_budget.tokens)
        return metrics

    def _with_distillation(self, batch: TensorDict) -> TensorDict:
        """With ``loss.distillation.coef`` set, ``batch``'s advantages per token: the teacher's
        term (:func:`rlpost.algo.distillation_advantages`) on each generated token, plus the
        reward's advantage when ``use_reward``; the teacher's log-probs are the reference
        actor's, on the samples."""
        distill = self.cfg.loss.distillation
        if distill.coef == 0:
            return batch
        teacher = batch.get(REF_LOG_PROBS_FULL, None)
        if teacher is None:
            raise RuntimeError(
                "loss.distillation needs the teacher's log-probs on every sample, and a sample came without them: "
                "is the reference actor (the teacher) scoring the groups? (reference.enabled, reference.kl_in=loss)"
            )
        advantages = distillation_advantages(
            batch.get("advantage"), teacher, batch.get(LOG_PROBS_FULL), loss_tokens(batch),
            distill.coef, distill.use_reward,
        )  # fmt: skip
        batch.set("advantage", advantages)
        return batch

    @torch.no_grad()
    def _set_proximal_log_probs(self, micro_batches: list[TensorDict], idle: int) -> None:
        """Score each micro-batch with the weights at the start of the step, into its
        ``proximal_log_probs``: the off-policy correction's reference in every epoch (with one
        epoch the loss takes its own first scores instead). ``idle``: forward passes that keep a
        sharded group's ranks in step."""
        for batch in micro_batches:
            with self._autocast():
                scores = self.loss_fn.score(batch.get(TOKENS_FULL), batch.get(ATTENTION_MASK), loss_tokens(batch))
            batch.set(self.loss_fn.tensor_keys.proximal_log_probs, scores.float())
        for _ in range(idle):
            self.model(input_ids=torch.full((1, 1), self.pad_token_id, dtype=torch.long, device=self.device))

    @property
    def token_budget(self) -> TokenBudget | None:
        """The tokens a micro-batch's forward may hold (padded or packed, as the scorer lays rows
        out): ``trainer.max_tokens_per_microbatch``, or
        with ``auto`` set (and logged) on first use, at the first step: by then the run's other
        actors on this node, the inference engines and their caches, hold their memory."""
        if self._budget is None and self.cfg.trainer.max_tokens_per_microbatch is not None:
            self._budget = self._make_token_budget()
        return self._budget

    def _make_token_budget(self) -> TokenBudget:
        cfg = self.cfg
        chosen = cfg.trainer.max_tokens_per_microbatch
        if chosen != "auto":
            return TokenBudget(int(chosen), "trainer.max_tokens_per_microbatch")
        budget = auto_token_budget(
            self._transformers_model, self.device, gradient_checkpointing=cfg.trainer.gradient_checkpointing,
            chunked=self.loss_fn.actor_network.scores_in_chunks,
            bf16_autocast=self.device.type == "cuda" and cfg.model.dtype == "bfloat16",
            optimizer_allocated=bool(self.optimizer.state),
        )  # fmt: skip
        context = cfg.rollout.engine.max_model_len
        log.info("rlpost: learner token budget per micro-batch: %s", budget.describe())  # and in metrics.jsonl
        if budget.tokens < context:
            log.warning(
                "rlpost: the learner's token budget (%d) is below the engine's context (rollout.engine.max_model_len "
                "%d): a longer row will fail its step; set trainer.max_tokens_per_microbatch (with "
                "trainer.gradient_checkpointing on, a token costs less) or lower rollout.max_tokens",
                budget.tokens, context,
            )  # fmt: skip
        return budget

    def _micro_batch_rows(self, rows: list[tuple[Sample, float]]) -> list[list[tuple[Sample, float]]]:
        """The step's rows in micro-batches: ``optimizer.grad_accumulation`` contiguous slices,
        each split further to the token budget (:attr:`token_budget`). A row longer than the
        budget fails the step here, before any pass."""
        slices = split_rows(rows, self.cfg.optimizer.grad_accumulation)
        if self.token_budget is None:
            return slices
        budget = self.token_budget.tokens
        longest = max(len(sample.token_ids) for sample, _ in rows)
        if longest > budget:
            raise ValueError(
                f"a row of {longest} tokens is longer than the learner's token budget per micro-batch, "
                f"{self.token_budget.describe()}: raise trainer.max_tokens_per_microbatch (or turn "
                "trainer.gradient_checkpointing on, or lower rollout.max_tokens)"
            )
        packed = self.loss_fn.actor_network.packs_sequences
        return [batch for part in slices for batch in split_to_budget(part, budget, packed=packed)]

    def _optimizer_step(self, micro_batches: list[TensorDict], normaliser: float, idle: int = 0) -> dict[str, float]:
        """Accumulate the micro-batch gradients (each divided by the whole batch's
        ``normaliser``), clip, step; returns this pass's metrics. ``idle``: passes with a zero
        gradient, so that every rank of a sharded group runs as many (module docstring)."""
        parts = []
        for batch in micro_batches:
            with self._autocast(), self._adapter_dropout():
                terms = self.loss_fn.loss_terms(batch, normaliser=normaliser)
            terms.loss.backward()
            parts.append((terms.metrics(), int(loss_tokens(batch).sum())))
        for _ in range(idle):
            self._idle_pass()
        if self.sharded:  # the metrics of every rank's micro-batches
            parts = [part for rank_parts in sharding.all_gather_objects(parts) for part in rank_parts]
        grad_norm = sharding.full_tensor(
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optimizer.grad_clip)
        )
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._version += 1
        metrics = _combine_micro_metrics(parts)
        metrics.update(grad_norm=float(grad_norm), lr=float(lr))
        return metrics

    @contextlib.contextmanager
    def _adapter_dropout(self):
        """The LoRA adapters' dropout on, for one training pass (``model.lora.dropout``; the
        model stays in eval mode otherwise, so scoring never drops anything)."""
        dropouts = (
            [] if self.cfg.model.lora is None or self.cfg.model.lora.dropout == 0 else lora.adapter_dropouts(self.model)
        )
        for module in dropouts:
            module.training = True
        try:
            yield
        finally:
            for module in dropouts:
                module.training = False

    def _idle_pass(self) -> None:
        """A forward and backward that adds nothing to the gradient (one pad token, loss x 0):
        a sharded rank with fewer micro-batches than the others still joins their collectives."""
        ids = torch.full((1, 1), self.pad_token_id, dtype=torch.long, device=self.device)
        logits = self.model(input_ids=ids).logits
        (logits.float().sum() * 0.0).backward()

    # ------------------------------------------------------------------------ scoring, weights

    @torch.no_grad()
    def score(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """Log-probs ``log p(ids[t] | ids[:t])`` at the sampling temperature (0.0 at t = 0),
        computed by the loss's own scoring path (the controller's ``sync_logprob_diff`` probe)."""
        rows = [list(map(int, ids)) for ids in token_ids]
        if not rows or not all(rows):
            raise ValueError("score needs at least one non-empty token sequence")
        width = max(len(ids) for ids in rows)
        tokens_bt = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_bt = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, ids in enumerate(rows):
            tokens_bt[i, : len(ids)] = torch.tensor(ids)
            attention_bt[i, : len(ids)] = True
        with self._autocast():
            logprobs_bt = self.loss_fn.score(tokens_bt, attention_bt)
        return [logprobs_bt[i, : len(ids)].float().tolist() for i, ids in enumerate(rows)]

    def _sync_tensors(self, *, materialise: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """What a sync sends, by ``sync_mode``, before any gather or cast: the model's
        ``state_dict()`` ("full"), the LoRA adapter's tensors ("adapter") or the base weights with
        the adapter merged in ("merged"; ``materialise=False``: unmerged, for their shapes; the
        frozen embeddings, output head and norms left out, as the engines hold them already)."""
        if self.sync_mode == "adapter":
            return lora.adapter_tensors(self.model)
        if self.sync_mode == "merged":
            return lora.merged_tensors(self.model, merge=materialise, changing_only=True)
        return iter(self.model.state_dict().items())

    def choose_sync_mode(self, workers_serve_lora: Sequence[bool]) -> str:
        """With LoRA: send the adapter when every worker serves LoRA (``workers_serve_lora``, in
        worker order), otherwise the merged weights (``model.lora.sync: auto``, with a warning)
        or refuse (``sync: adapter``). Returns the mode, also kept in ``sync_mode``."""
        section = self.cfg.model.lora
        if section is None or self._lora_route() == "merged":
            return self.sync_mode
        without = [i for i, serves in enumerate(workers_serve_lora) if not serves]
        if not without:
            self.sync_mode = "adapter"
        elif section.sync == "adapter":
            raise RuntimeError(
                f"model.lora.sync=adapter, but inference workers {without} cannot serve a LoRA adapter (their "
                "log says why); set model.lora.sync=merged or auto to send merged weights instead"
            )
        else:
            log.warning("inference workers %s cannot serve a LoRA adapter: each weight sync sends the merged "
                        "model instead (model.lora.sync=auto)", without)  # fmt: skip
            self.sync_mode = "merged"
        return self.sync_mode

    def _lora_route(self) -> str:
        """The route the config chose (``LearnerSettings.lora_sync``), before any fallback."""
        return self.cfg.lora_sync or ("merged" if self.cfg.model.lora.sync == "merged" else "adapter")

    def named_parameters_for_sync(self, device: str | torch.device = "cpu") -> Iterable[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs for the inference engines, lazily.

        Names are ``model.state_dict()`` keys, i.e. the Hugging Face checkpoint names vLLM's
        ``load_weights`` / ``reload_weights`` expect; tensors are detached, contiguous copies on
        ``device`` in ``model.dtype``. With tied embeddings ``lm_head.weight`` is still sent:
        vLLM's CPU backend keeps its own (repacked) copy of the LM head, so updating only
        ``model.embed_tokens.weight`` leaves the head stale (measured: sync_logprob_diff 2e-2
        after one step without it, 3e-6 with it).

        With LoRA (``sync_mode`` "adapter") they are the adapter's tensors under peft's names
        (``...q_proj.lora_A.weight``), which the workers load as a vLLM LoRA adapter; with
        ``sync_mode`` "merged", the base model's names and the merged weights of every layer but
        the frozen embeddings, output head and norms (the engines loaded the same base).

        With a sharded model each tensor is gathered whole in turn (a collective: every rank
        iterates, in the same order).
        """
        dtype = _DTYPES[self.cfg.model.dtype]
        for name, tensor in self._sync_tensors():
            yield name, sharding.full_tensor(tensor.detach()).to(device=device, dtype=dtype).contiguous()

    def weights_for_sync(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> StreamedTensors:
        """``tensors`` (an iterator of :meth:`named_parameters_for_sync`) as
        :class:`~rlpost.transport.bucketing.StreamedTensors`: names, dtypes and shapes up front,
        each tensor made (gathered, cast) only when the bus fills its bucket, so the whole model is
        never copied at once; the caller sees how far the bus consumed it."""
        dtype = _DTYPES[self.cfg.model.dtype]
        specs = tuple((name, dtype, tuple(t.shape)) for name, t in self._sync_tensors(materialise=False))
        return StreamedTensors(specs, lambda: tensors)

    def publish(self, wait: bool = True) -> dict[str, float]:
        """Publish the current weights at the current version; returns timing and size metrics
        (with a vLLMUpdater also ``weight_load_s``, the slowest worker's reload). In a sharded
        group every rank calls it: the others gather the tensors with rank 0, which sends them.

        ``wait=False`` (a publisher with ``confirm``, such as the vLLMUpdater): return once the
        weights are sent, while the workers still reload them, so that the next train step
        overlaps their reload. The next publish, or :meth:`confirm_publish`, waits for it first;
        ``weight_load_s`` then reports the latest reload confirmed (the update before).
        """
        if self.sharded and self.rank != 0:
            start = time.perf_counter()
            for _ in self.named_parameters_for_sync("cpu"):
                pass
            return {"weight_sync_s": time.perf_counter() - start, "policy_version": float(self._version)}
        if self.publisher is None:
            raise RuntimeError("Learner.publish needs a publisher (pass publisher= or call connect_workers)")
        device = getattr(self.publisher, "device", "cpu")  # a GPU bus takes the tensors where it sends from
        start = time.perf_counter()
        defer = not wait and hasattr(self.publisher, "confirm")
        tensors = self.named_parameters_for_sync(device)
        try:
            weights = self.weights_for_sync(tensors)
            if defer:
                stats = self.publisher.publish(weights, self._version, wait=False)
            else:
                stats = self.publisher.publish(weights, self._version)
        finally:
            if self.sharded:  # a failed send: still gather every tensor, as the other ranks do
                for _ in tensors:  # (the group's next collective must be the same on every rank)
                    pass
        return {
            "weight_sync_s": time.perf_counter() - start,
            "bytes": float(stats.num_bytes),
            "policy_version": float(stats.version),
            "receivers_shm": float(stats.shm_receivers),
            "receivers_bus": float(stats.bus_receivers),
            **self._confirmed_metrics(),
        }

    def confirm_publish(self) -> dict[str, float]:
        """Wait until the workers serve what ``publish(wait=False)`` sent (no-op when nothing
        is pending, and on ranks other than 0); returns ``weight_sync_s`` (the wait) and
        ``weight_load_s``."""
        start = time.perf_counter()
        confirm = getattr(self.publisher, "confirm", None)
        if self.rank == 0 and confirm is not None:
            confirm()
        return {"weight_sync_s": time.perf_counter() - start, **self._confirmed_metrics()}

    def _confirmed_metrics(self) -> dict[str, float]:
        """``weight_load_s``: the slowest worker's reload of the latest update they confirmed."""
        infos = getattr(self.publisher, "last_worker_infos", None)
        if not infos:
            return {}
        return {"weight_load_s": max(float(info.get("load_s", 0.0)) for info in infos)}

    # ----------------------------------------------------------------------------- checkpoints

    def save_checkpoint(self, run_dir: str | Path, step: int, rollout_state: dict | None = None) -> Path:
        """Write ``run_dir/checkpoints/step_<step>`` atomically; keep the last ``keep_checkpoints``.

        The folder holds the model (float32 masters) and tokenizer in HF format,
        ``trainer_state.pt`` (optimizer, scheduler, step, version, torch RNG states) and, when
        given, ``rollout_state.pkl`` (the controller's: the groups still in the buffer and every
        env pool's position, taken together). It is written to a temporary folder beside it and
        renamed into place, so a crash never leaves a half-written ``step_<N>``.

        A failed write never costs an earlier checkpoint: older ones are pruned only after the
        new one is in place. A ``step_<N>`` saved again stays in place during the write. It is
        then renamed aside, and deleted only once the new folder has taken its name; if that
        rename fails it is renamed back. (A crash between those two renames leaves it as
        ``.old-step_<N>-*``.) When the write fails with an I/O error (disk full, quota,
        permissions; also when torch or safetensors report it as their own exception type), the
        temporary folder is removed and :class:`CheckpointWriteError` is raised. Its message names
        the folder, the cause and the latest intact checkpoint to resume from. Any other error
        also removes the temporary folder, then propagates as it is.
        """
        if self.sharded:
            return self._save_sharded_checkpoint(run_dir, step, rollout_state)
        root = Path(run_dir) / "checkpoints"
        final = root / f"step_{int(step)}"
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
        except OSError as err:
            raise _write_error(final, err) from err
        try:
            self._write_checkpoint_files(tmp, step, rollout_state)
            aside = _move_into_place(tmp, final)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            cause = _os_error_behind(err) if isinstance(err, Exception) else None
            if cause is None:
                raise
            raise _write_error(final, cause) from err
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        _prune_checkpoints(root, self.cfg.trainer.keep_checkpoints)
        return final

    def _write_checkpoint_files(self, folder: Path, step: int, rollout_state: dict | None) -> None:
        """Every file of a checkpoint, into ``folder``.

        ``trainer_state.pt`` is written through a Python file object: torch.save to a path
        writes from C++, and on a full disk it fails with a RuntimeError that has lost the
        errno. Through a file object, the OSError of the failed write stays in the
        exception's ``__context__``, where :func:`_os_error_behind` finds it.
        """
        self.model.save_pretrained(folder)  # with LoRA: the adapter (adapter_config.json, adapter_model.safetensors)
        self.tokenizer.save_pretrained(folder)
        if self.cfg.model.lora is not None and self.cfg.model.lora.save_merged:
            lora.save_merged(self.model, folder / lora.MERGED_FOLDER)
            self.tokenizer.save_pretrained(folder / lora.MERGED_FOLDER)
        with open(folder / TRAINER_STATE, "wb") as f:
            torch.save(self._trainer_state(step), f)
        if rollout_state is not None:
            # pickle: the groups are rlpost dataclasses; the file is this run's own output
            (folder / ROLLOUT_STATE).write_bytes(pickle.dumps(rollout_state))

    def _trainer_state(self, step: int) -> dict:
        return {**self._trainer_meta(step), "optimizer": self.optimizer.state_dict()}

    def _trainer_meta(self, step: int) -> dict:
        return {
            "step": int(step),
            "version": self._version,
            "scheduler": self.scheduler.state_dict(),
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }

    def _save_sharded_checkpoint(self, run_dir: str | Path, step: int, rollout_state: dict | None) -> Path:
        """:meth:`save_checkpoint` of a learner group (every rank calls it).

        The folder holds the consolidated model in HF format (what users and the inference
        engines load) and the tokenizer, written by rank 0, and the trainer state sharded with
        ``torch.distributed.checkpoint`` in ``trainer_state/`` (the model's float32 masters and
        AdamW's state: each rank writes its own shards), with ``trainer_meta.pt`` (scheduler,
        step, version, RNG). Any number of ranks, or a single learner, can load it. Every rank
        must see ``run_dir`` (one node, or a shared filesystem). The write is atomic as for a
        single learner: rank 0 moves the folder into place once every rank wrote its part.
        """
        root = Path(run_dir) / "checkpoints"
        final = root / f"step_{int(step)}"
        tmp, made = None, None
        if self.rank == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
                tmp = tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root)
            except OSError as err:
                made = err
        tmp = sharding.broadcast_from_rank0(tmp)
        if tmp is None:
            raise _write_error(final, made) if made is not None else RuntimeError(f"rank 0 could not create {final}")
        tmp, failure = Path(tmp), None
        try:
            self._write_sharded_checkpoint_files(tmp, step, rollout_state)
        except Exception as err:
            failure = err
        failed = [(rank, text) for rank, text in enumerate(sharding.all_gather_objects(failure and repr(failure)))
                  if text]  # fmt: skip
        if failed:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if failure is None:
                rank, text = failed[0]
                raise RuntimeError(f"checkpoint {final} was not written: learner rank {rank} failed: {text}")
            cause = _os_error_behind(failure)
            raise (_write_error(final, cause) if cause is not None else failure) from failure
        if self.rank == 0:
            aside = _move_into_place(tmp, final)
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)
            _prune_checkpoints(root, self.cfg.trainer.keep_checkpoints)
        sharding.all_gather_objects(None)  # every rank returns once the checkpoint is in place
        return final

    def _write_sharded_checkpoint_files(self, folder: Path, step: int, rollout_state: dict | None) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder / TRAINER_SHARDS))
        whole = {}  # gathered tensor by tensor; rank 0 keeps them for the consolidated model
        for name, tensor in self.model.state_dict().items():
            full = sharding.full_tensor(tensor.detach())
            if self.rank == 0:
                whole[name] = full.float().cpu()
        if self.rank != 0:
            return
        self.model.save_pretrained(folder, state_dict=whole)
        _name_architecture(folder, self._architecture)
        self.tokenizer.save_pretrained(folder)
        with open(folder / TRAINER_META, "wb") as f:
            torch.save(self._trainer_meta(step), f)
        if rollout_state is not None:
            (folder / ROLLOUT_STATE).write_bytes(pickle.dumps(rollout_state))

    def load_checkpoint(self, path: str | Path) -> dict:
        """Restore weights, optimizer, scheduler, version and RNG from a ``step_<N>`` folder in
        place (the optimizer keeps pointing at the same parameters); returns its ``step``,
        ``version`` and ``rollout_state`` (None when the checkpoint has none)."""
        from transformers import AutoModelForCausalLM

        path = Path(path)
        if (path / TRAINER_SHARDS).is_dir():  # written by a learner group: any number of ranks loads it
            return self._load_sharded_checkpoint(path)
        if not (path / TRAINER_STATE).is_file():
            raise FileNotFoundError(f"{path} is not a learner checkpoint (no {TRAINER_STATE} or {TRAINER_SHARDS}/)")
        if lora.is_adapter_checkpoint(path) or self.cfg.model.lora is not None:
            return self._load_adapter_checkpoint(path)
        saved = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, trust_remote_code=self.cfg.model.trust_remote_code
        )
        state = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)
        if self.sharded:  # a single learner's checkpoint, spread over this group's shards
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            set_state_dict(self.model, self.optimizer, model_state_dict=saved.state_dict(),
                           optim_state_dict=self._optimizer_state_by_name(state["optimizer"]),
                           options=StateDictOptions(full_state_dict=True))  # fmt: skip
        else:
            self.model.load_state_dict(saved.state_dict())
            self.optimizer.load_state_dict(state["optimizer"])
        return self._restore_meta(state, path)

    def _load_adapter_checkpoint(self, path: Path) -> dict:
        """:meth:`load_checkpoint` of a LoRA learner: the adapter's weights and its optimizer."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        if self.cfg.model.lora is None:
            raise ValueError(
                f"{path} holds a LoRA adapter (its run set model.lora); resume it with the same model.lora section"
            )
        if not lora.is_adapter_checkpoint(path):
            raise ValueError(f"{path} holds a whole model, not a LoRA adapter: its run did not set model.lora")
        saved = load_file(path / lora.ADAPTER_WEIGHTS)
        expected = dict(lora.adapter_tensors(self.model))
        if set(saved) != set(expected) or any(saved[k].shape != expected[k].shape for k in saved):
            raise ValueError(
                f"{path}: its adapter does not fit model.lora (rank {self.cfg.model.lora.rank}, target_modules "
                f"{self.cfg.model.lora.target_modules}); resume with the model.lora section of the run that wrote it"
            )
        set_peft_model_state_dict(self.model, saved)
        state = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        return self._restore_meta(state, path)

    def _load_sharded_checkpoint(self, path: Path) -> dict:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        with warnings.catch_warnings():  # a single learner reads the shards in one process, as meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path / TRAINER_SHARDS), no_dist=not self.sharded)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])  # fmt: skip
        return self._restore_meta(torch.load(path / TRAINER_META, map_location="cpu", weights_only=True), path)

    def _optimizer_state_by_name(self, saved: dict) -> dict:
        """A single learner's ``optimizer.state_dict()`` (parameters by index) keyed by
        parameter name instead, as ``set_state_dict`` takes a whole optimizer state."""
        names = [name for name, _ in self.model.named_parameters()]
        indices = [i for group in saved["param_groups"] for i in group["params"]]
        if len(indices) != len(names):
            raise ValueError(f"the checkpoint's optimizer has {len(indices)} parameters, the model {len(names)}")
        name_of = dict(zip(indices, names))
        return {
            "state": {name_of[i]: value for i, value in saved["state"].items()},
            "param_groups": [{**g, "params": [name_of[i] for i in g["params"]]} for g in saved["param_groups"]],
        }

    def _restore_meta(self, state: dict, path: Path) -> dict:
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng_cpu"])
        if state["rng_cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])
        self._version, self._step = int(state["version"]), int(state["step"])
        rollout = path / ROLLOUT_STATE
        rollout_state = pickle.loads(rollout.read_bytes()) if rollout.is_file() else None
        return {"step": self._step, "version": self._version, "rollout_state": rollout_state}


def _name_architecture(folder: Path, architecture: str) -> None:
    """Write the model's own class name into ``config.json``'s ``architectures`` (a sharded model
    saves under FSDP's wrapper class name, which vLLM would not know)."""
    import json

    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = [architecture]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _prune_checkpoints(root: Path, keep: int) -> None:
    for old in list_checkpoints(root.parent)[:-keep]:
        shutil.rmtree(old)


def _move_into_place(tmp: Path, final: Path) -> Path | None:
    """Rename the complete ``tmp`` to ``final``; returns the old ``final`` renamed aside (the
    caller deletes it), or None when there was none.

    ``os.replace`` cannot replace a non-empty folder, and deleting the old one first would
    leave no ``step_<N>`` at all if the rename then failed. So the old one is renamed aside
    under a name that needs no new directory, and renamed back if ``tmp`` cannot take its place.
    """
    if not final.exists():
        os.replace(tmp, final)
        return None
    aside = final.with_name(f".old-{final.name}-{os.getpid()}-{time.time_ns()}")
    os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(aside, final)
        raise
    return aside


def _os_error_behind(err: BaseException) -> OSError | None:
    """The OSError that made a checkpoint write fail, or None when ``err`` is no I/O error.

    Writers in C++ and Rust do not raise OSError themselves. torch.save into a Python file
    raises a RuntimeError ("unexpected pos ...") whose ``__context__`` is the OSError. safetensors
    (the model's weights) raises SafetensorError("... No space left on device (os error 28)").
    So this follows the exception chain, and reads an ``(os error N)`` code from a message.
    """
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError):
            return err
        match = _OS_ERROR_CODE.search(str(err))
        if match:
            code = int(match.group(1))
            return OSError(code, f"{type(err).__name__}: {err}")
        err = err.__cause__ or err.__context__
    return None


def _write_error(final: Path, cause: OSError) -> CheckpointWriteError:
    """The CheckpointWriteError for ``final``, naming the cause and the checkpoint to resume from."""
    reason = os.strerror(cause.errno).lower() if cause.errno else type(cause).__name__
    latest = latest_checkpoint(final.parent.parent)
    intact = f"the latest intact checkpoint is {latest}" if latest else "there is no earlier checkpoint"
    hint = ""
    if cause.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = f" (free space on the disk of {final.parent}: every save needs room for one more checkpoint)"
    message = (
        f"could not write checkpoint {final}: {reason}{hint}; its partial copy was removed and {intact}. Cause: {cause}"
    )
    # (errno, message): OSError keeps errno in its args, so it survives pickling (a Ray actor's error)
    return CheckpointWriteError(cause.errno, message) if cause.errno else CheckpointWriteError(message)


# ------------------------------------------------------------------------------------ metrics


def _combine_micro_metrics(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Loss terms: sum of the micro-batch losses (each over the whole batch's normaliser, so the
    sum is the full-batch loss); token-mean diagnostics: weighted by each micro-batch's loss
    tokens. A term no micro-batch reported (a custom loss's) is left out."""
    total_tokens = max(sum(n for _, n in parts), 1)
    out: dict[str, float] = {}
    for name in _LOSS_METRICS:
        if any(name in m for m, _ in parts):
            out[name] = sum(m.get(name, 0.0) for m, _ in parts)
    for name in _TOKEN_MEAN_METRICS:
        if any(name in m for m, _ in parts):
            out[name] = sum(m.get(name, 0.0) * n for m, n in parts) / total_tokens
    out.setdefault("kl_to_ref", 0.0)  # metrics.jsonl requires it; 0 without a reference
    return out


def _mean_dicts(dicts: list[dict[str, float]]) -> dict[str, float]:
    """Mean over the optimizer steps of one learner step (lr: the last one's)."""
    out = {k: sum(d[k] for d in dicts) / len(dicts) for k in dicts[0]}
    out["lr"] = dicts[-1]["lr"]
    return out


def _batch_metrics(rows: list[tuple[Sample, float]], version_at_start: int) -> dict[str, float]:
    rewards = torch.tensor([s.reward for s, _ in rows], dtype=torch.float64)
    staleness = [version_at_start - s.policy_version for s, _ in rows]
    lengths = [s.num_generated for s, _ in rows]
    metrics = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "num_samples": float(len(rows)),
        "num_tokens": float(sum(lengths)),  # loss (generated) tokens trained on
        "completion_len_mean": sum(lengths) / len(lengths),
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": float(max(staleness)),
        # the sampling policy's entropy, estimated by -log p of the tokens it generated: watched
        # for entropy collapse whether or not the loss has an entropy term
        "entropy_sampled": -sum(lp for s, _ in rows for lp, m in zip(s.logprobs, s.loss_mask) if m)
        / max(sum(lengths), 1),
    }
    # per token, where the samples say which version generated each (in-flight updates)
    labelled = [(s.policy_version, v) for s, _ in rows if s.token_versions
                for v, m in zip(s.token_versions, s.loss_mask) if m and v >= 0]  # fmt: skip
    if labelled:
        metrics["token_staleness_mean"] = sum(version_at_start - v for _, v in labelled) / len(labelled)
        metrics["inflight_token_fraction"] = sum(v > first for first, v in labelled) / len(labelled)
    return metrics


# ---------------------------------------------------------------------------------- Ray shell


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Have each decoder layer of a transformers ``model`` recompute its activations in the
    backward pass instead of keeping them from the forward.

    transformers checkpoints a layer only while that layer is in training mode, and the learner
    keeps its model in eval mode (dropout off). So the decoder layers alone are switched to
    training mode: the modules inside them (attention, MLP, dropout) stay in eval mode and
    compute exactly what they did, and the loss and gradients are unchanged. The KV cache is
    turned off too: the learner scores whole sequences and never reads it.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"trainer.gradient_checkpointing: {type(model).__name__} does not support gradient checkpointing"
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if not layers:  # e.g. remote code whose layers do not take transformers' checkpointing
        raise ValueError(
            f"trainer.gradient_checkpointing: no layer of {type(model).__name__} can be checkpointed by transformers"
        )
    for layer in layers:
        layer.training = True  # this module only, not its children (docstring)


def own_trainable_weights(model: torch.nn.Module) -> int:
    """Copy each trainable CPU parameter of ``model`` into memory of its own; returns how many.

    transformers maps a safetensors checkpoint into memory and its CPU parameters are views of
    the mapped file (private, copy-on-write pages). The first optimizer step writes every
    trainable weight, and each of its 4 KB pages is then copied by a page fault inside the step:
    measured on the Qwen2.5-0.5B-shaped model (2 CPU threads), the first AdamW step took 8.6 s
    against 3.4 s after this copy, which takes 0.6 s at load time. Frozen weights (a LoRA base
    model) keep the mapping, and the memory it saves; a parameter on an accelerator is already a
    copy. Parameter objects are kept (``.data`` is replaced), so tied weights stay tied."""
    copied = 0
    for param in model.parameters():  # each tied parameter once
        if param.requires_grad and param.device.type == "cpu":
            param.data = param.data.clone()
            copied += 1
    return copied


# glibc's mallopt parameters, and the size above which a learner's allocations get pages of their own
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_LEARNER_MMAP_THRESHOLD = 128 * 1024


def return_freed_memory_to_os() -> bool:
    """Make this process's C allocator give freed tensor memory back to the OS (glibc only;
    returns whether it applied).

    glibc serves allocations of up to 32 MB from heaps that it trims lazily, and it raises its
    mmap threshold each time a large block is freed: a training step's activations, gradients
    and gather buffers, freed at the end of the step, stay resident, and the next step's
    allocations land on top of them. With the threshold fixed at 128 KB, every tensor larger than
    that gets pages of its own that ``free`` unmaps, and pays the page faults of fresh pages on
    every allocation: measured on the Qwen2.5-0.5B-shaped model (one learner, 16 rows of 78
    tokens, 2 CPU threads) peak resident memory 12.0 -> 10.1 GB for a step of 15.3 s against
    12.1 s, on the tiny model 0.26 s against 0.14 s; each rank of a 2-rank group peaks at 6.6 GB
    against 8.7 GB (``bench learner_group``). Hence ``resources.learner.release_freed_memory``."""
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):  # no C library found, or not glibc: nothing to set
        return False
    applied = [mallopt(option, _LEARNER_MMAP_THRESHOLD) == 1 for option in (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD)]
    return all(applied)


def release_freed_memory(resources, world_size: int) -> bool:
    """Whether a learner rank gives freed memory back to the OS: ``resources.learner.
    release_freed_memory``, or by default only in a group of ranks (whose point is memory)."""
    setting = resources.release_freed_memory
    return world_size > 1 if setting is None else setting


def set_torch_threads(num_threads: int | None) -> None:
    """Give this process ``num_threads`` torch threads (None: keep Ray's OMP_NUM_THREADS, which
    Ray sets from an actor's reserved CPUs, at least 1)."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)


class LearnerActor:
    """Thin Ray shell around :class:`Learner` (start it with :func:`start_learner`, or a group of
    them with :func:`start_learner_group`).

    Alone (``world_size`` 1) it builds its learner at once. As rank ``rank`` of a group it builds
    a sharded learner in :meth:`join_group`, after rank 0's :meth:`open_rendezvous`.
    """

    def __init__(self, cfg: LearnerSettings, rank: int = 0, world_size: int = 1):
        from rlpost.metrics import RoleMetrics

        if release_freed_memory(cfg.resources, world_size):
            return_freed_memory_to_os()  # before the model's first allocation
        set_torch_threads(cfg.resources.num_threads)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self._store = None  # rank 0 of a group: the group's TCPStore, kept alive with the actor
        self.learner = Learner(cfg) if world_size == 1 else None
        self.metrics = RoleMetrics("learner", cfg.run_name, learner_name(rank))

    def open_rendezvous(self, backend: str | None = None, timeout_s: float = 300.0) -> sharding.GroupSpec:
        """Rank 0: host the group's store; returns the spec every rank joins with."""
        if self.rank != 0:
            raise RuntimeError(f"{learner_name(self.rank)}: only rank 0 opens the learner group's rendezvous")
        self._store, spec = sharding.open_rendezvous(self.world_size, backend=backend, timeout_s=timeout_s)
        return spec

    def join_group(self, spec: sharding.GroupSpec) -> int:
        """Join the learner group and build this rank's sharded learner (every rank at once:
        it returns once all joined and sharded). Returns the rank."""
        sharding.join_group(spec, self.rank, store=self._store)
        self.learner = Learner(self.cfg, sharded=True)
        return self.rank

    def memory(self) -> dict[str, float]:
        """What this rank holds: ``state_bytes`` (parameters, AdamW state and any gradients: its
        shards in a group), ``peak_rss_bytes`` (the process's peak resident memory) and, on a
        GPU, ``peak_gpu_bytes``."""
        import resource

        out = {
            "state_bytes": float(sharding.local_state_bytes(self.learner.model, self.learner.optimizer)),
            "peak_rss_bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
        }
        if torch.cuda.is_available():
            out["peak_gpu_bytes"] = float(torch.cuda.max_memory_allocated())
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's float32 weights on the CPU (a collective in a group: every rank calls it)."""
        return {
            name: sharding.full_tensor(t.detach()).float().cpu() for name, t in self.learner.model.state_dict().items()
        }

    def connect_workers(self, workers: list, host: str, backend: str, bucket_mb: float, timeout_s: float,
                        shared_memory: bool = True) -> int:  # fmt: skip
        """Form the weight bus with these inference workers (Ray actor handles): a
        :class:`~rlpost.collect.vLLMUpdater` in this process becomes the learner's publisher and
        joins every worker to its bus (``shared_memory``: ``weight_sync.shared_memory``).
        Returns the version the workers serve."""
        from rlpost.collect.weight_update import vLLMUpdater

        if self.learner.publisher is not None:
            self.learner.publisher.close()
        updater = vLLMUpdater(
            workers,
            master_address=host,
            backend=backend,
            device=self.learner.device,
            bucket_mb=bucket_mb,
            timeout_s=timeout_s,
            shared_memory=shared_memory,
        )
        updater.init()
        self.learner.publisher = updater
        if self.cfg.model.lora is not None:
            self.learner.choose_sync_mode(updater.workers_serve_lora())
        return updater.version

    def set_workers(self, workers: list) -> int:
        """After a worker was restarted: the bus's next generation with ``workers``; returns it."""
        self.learner.publisher.set_workers(workers)
        return self.learner.publisher.publisher.generation

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        metrics = self.learner.train_step(groups)
        keys = ("loss", "kl_to_ref", "clip_fraction", "step_time_s", "policy_version", "staleness_mean")
        self.metrics.record(**{k: metrics[k] for k in keys if k in metrics})
        return metrics

    def publish(self, wait: bool = True) -> dict[str, float]:
        stats = self.learner.publish(wait)
        self.metrics.record(weight_sync_s=stats["weight_sync_s"])
        return stats

    def confirm_publish(self) -> dict[str, float]:
        return self.learner.confirm_publish()

    def score(self, token_ids: list[list[int]]) -> list[list[float]]:
        return self.learner.score(token_ids)

    def save_checkpoint(self, run_dir: str, step: int, rollout_state: dict | None = None) -> str:
        return str(self.learner.save_checkpoint(run_dir, step, rollout_state))

    def load_checkpoint(self, path: str) -> dict:
        return self.learner.load_checkpoint(path)

    def version(self) -> int:
        return self.learner.version

    def num_threads(self) -> int:
        """torch threads this actor trains with (``resources.learner.num_threads``)."""
        return torch.get_num_threads()

    def close(self) -> None:
        if self.learner is not None and self.learner.publisher is not None:
            self.learner.publisher.close()
        sharding.leave_group()


def start_learner(settings: LearnerSettings, *, name: str = "learner", namespace: str | None = None, **options):
    """Start the named learner actor with the CPUs and GPUs of ``settings.resources``
    (``options`` go to ``.options()`` and win, e.g. a placement-group scheduling strategy)."""
    return start_actor(LearnerActor, settings, name=name, resources=settings.resources, namespace=namespace,
                       **options)  # fmt: skip


def start_learner_group(settings: LearnerSettings, num_workers: int, *, namespace: str | None = None,
                        timeout_s: float | None = None, backend: str | None = None,
                        options_for: Callable[[int], dict] | None = None) -> list:  # fmt: skip
    """Start ``num_workers`` learner ranks (``learner``, ``learner-1``, ...) that shard one model
    between them, and return their handles in rank order once every rank joined the group and
    sharded its model. One worker is a plain :func:`start_learner`.

    ``options_for(rank)`` gives each rank's ``.options()`` (e.g. its placement-group bundle).
    ``timeout_s`` (default ``resources.learner.timeout_s``) bounds forming the group (+ the
    model load) and every collective of the group; if forming fails, every rank started is
    killed and the error raised.
    """
    import ray

    from rlpost.actors.calls import Pending, wait_all

    options_for = options_for or (lambda rank: {})
    timeout_s = settings.resources.timeout_s if timeout_s is None else timeout_s
    if num_workers < 1:
        raise ValueError(f"resources.learner.num_workers must be >= 1, got {num_workers}")
    if num_workers == 1:
        return [start_learner(settings, namespace=namespace, **options_for(0))]
    handles = [
        start_actor(
            LearnerActor,
            settings,
            rank,
            num_workers,
            name=learner_name(rank),
            resources=settings.resources,
            namespace=namespace,
            **options_for(rank),
        )  # fmt: skip
        for rank in range(num_workers)
    ]
    try:
        spec = Pending("learner", "open_rendezvous", handles[0].open_rendezvous.remote(backend, timeout_s))
        spec = spec.result(timeout_s)
        joins = [Pending(learner_name(r), "join_group", h.join_group.remote(spec)) for r, h in enumerate(handles)]
        wait_all(joins, timeout_s + _MODEL_LOAD_GRACE_S)
    except BaseException:
        for handle in handles:
            ray.kill(handle, no_restart=True)
        raise
    return handles
