"""The learner's step: a transformers model, AdamW and :class:`~rlpost.objectives.GRPOLoss`.

:class:`Learner` (plain class) trains on completed GRPO groups, publishes versioned weights and
writes checkpoints; :class:`~rlpost.actors.learner.actor.LearnerActor` adds a process's set-up,
metrics and the weight bus.

One learner step, ``train_step(groups)``::

    micro_batches = collate(slice) for grad_accumulation contiguous slices of the samples,
                    each packed to the token budget (trainer.max_tokens_per_microbatch, auto)
    D = sum(loss_normaliser(micro) for micro in micro_batches)    # the whole batch's denominator
    repeat epochs_per_batch times:                                # PPO epochs over the same batch
        for micro in micro_batches:
            loss_fn.loss_terms(micro, normaliser=D).loss.backward()
        clip_grad_norm_(grad_clip); optimizer.step(); scheduler.step(); zero_grad()
        version += 1

Micro-batch scaling. Every loss term is ``numerator(masked terms) / D``, ``D`` set by the
aggregation (:func:`rlpost.algo.loss_normaliser`: loss tokens for ``token_mean``, rows with a
loss token for ``sequence_mean``, rows x ``max_tokens`` for ``sequence_sum_norm``), so the
accumulated gradient equals the whole batch's exactly, for any split and aggregation (averaging
micro-batch losses would not, unless their denominators were equal).

The loss (``loss.type``): GRPOLoss over :func:`rlpost.algo.grpo_loss` (``grpo``),
:class:`~rlpost.objectives.DAPO` (``dapo``), :class:`~rlpost.objectives.CISPOLoss` (``cispo``),
GRPOLoss over :func:`rlpost.algo.sft_loss` (``sft``: expert iteration on the kept samples), or
``loss.custom_fn`` called with grpo_loss's arguments. ``loss.distillation.coef`` makes the
advantages per token first (:meth:`Learner._with_distillation`).

Versions. ``version`` = optimizer steps since the initial weights (version 0, the engines'
start); a step with ``epochs_per_batch = k`` adds k. Staleness = version at the step's start -
``sample.policy_version``.

Precision. Master weights and optimizer state are float32. On CUDA with ``model.dtype:
bfloat16`` the forward runs under ``torch.autocast(bfloat16)`` (log-softmax and loss stay
float32); float16 is not autocast (it would need loss scaling) and trains in float32; CPU is
float32. Weights are published in ``model.dtype``; checkpoints hold the float32 masters.
Dropout is off (``model.eval()``) for good: the learner's scores must match the engine's.

Memory. ``trainer.gradient_checkpointing`` and ``trainer.max_tokens_per_microbatch``
(:attr:`Learner.token_budget`) change neither the step's loss nor its gradient. LoRA
(``model.lora``): only the adapter trains (AdamW holds state for it alone); syncs send the
adapter or the merged weights (:meth:`Learner.choose_sync_mode`).

Sharded (``Learner(..., sharded=True)`` in each rank of a learner group,
:mod:`rlpost.actors.sharding`): FSDP2 over the group; each rank builds the model empty and loads
only its shards. Every rank gets the whole step's groups and trains on its share (rank r takes
groups r, r + N, ...); ``D`` is summed over the ranks, so the summed gradient is the one-process
gradient. The ranks run the same number of forward/backward passes (FSDP gathers each layer in
every rank's forward): a rank with fewer micro-batches adds zero-gradient passes. Scoring and
publishing are collectives too; rank 0 alone sends. With bfloat16 on CUDA the gathered
parameters are bfloat16 and reductions float32 (FSDP's mixed precision replaces autocast).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from tensordict import TensorDict

from rlpost.actors import sharding
from rlpost.actors.batch import batch_rows, collate_samples, loss_tokens, split_rows, split_to_budget
from rlpost.actors.learner import lora_sync
from rlpost.actors.learner.checkpoint import Checkpointer
from rlpost.actors.learner.memory import enable_activation_checkpointing, own_trainable_weights
from rlpost.actors.learner.settings import LearnerSettings
from rlpost.actors.learner.step_metrics import batch_metrics, combine_micro_metrics, mean_dicts
from rlpost.actors.token_budget import TokenBudget, auto_token_budget
from rlpost.algo import distillation_advantages, load_loss_function, loss_normaliser, sft_loss
from rlpost.data.samples import Group, Sample
from rlpost.objectives import DAPO, CISPOLoss, GRPOLoss
from rlpost.objectives.grpo import ATTENTION_MASK, LOG_PROBS_FULL, REF_LOG_PROBS_FULL, TOKENS_FULL
from rlpost.policies import TransformersWrapper, lora
from rlpost.runtime.liveness import progress, working
from rlpost.transport.bucketing import StreamedTensors

# loss.type -> the loss module and the function its terms come from (None: rlpost.algo.grpo_loss);
# expert iteration is SFT through the same module, on the samples the env pools kept
LOSS_TYPES = {"grpo": (GRPOLoss, None), "dapo": (DAPO, None), "cispo": (CISPOLoss, None), "sft": (GRPOLoss, sft_loss)}
log = logging.getLogger("rlpost")


def _warmup_factor(step: int, warmup_steps: int) -> float:
    """LR multiplier: linear warm-up over ``warmup_steps`` optimizer steps (1/W, 2/W, ..., 1), then 1."""
    return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)


# ------------------------------------------------------------------------------------ learner


class Learner:
    """Trains the policy with GRPO on groups of samples; see the module docstring.

    ``publisher``: what ``publish()`` sends through (a :class:`~rlpost.collect.vLLMUpdater` on
    the inference workers, or any :class:`~rlpost.transport.weight_bus.WeightPublisher`; may be
    set later; sharded: only rank 0's is used). ``sharded``: this process is one rank of a learner
    group it has joined (:func:`rlpost.actors.sharding.join_group`).
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
        self.sync_mode = "full" if cfg.model.lora is None else lora_sync.lora_route(cfg)
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
            kl_to_ref_coeff=cfg.reference.kl_coef if cfg.reference.kl_goes_to == "loss" else 0.0,
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
        """One learner step (``epochs_per_batch`` optimizer steps; progress at every micro-batch)."""
        with working("train_step"):
            return self._train_step(groups)

    def _train_step(self, groups: Sequence[Group]) -> dict[str, float]:
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
        metrics = mean_dicts(passes)
        metrics.update(batch_metrics(rows, version_at_start))
        metrics.update(policy_version=float(self._version), step_time_s=time.perf_counter() - start)
        metrics["micro_batches"] = float(passes_needed)
        if self.token_budget is not None:
            metrics["token_budget"] = float(self.token_budget.tokens)
        return metrics

    def _with_distillation(self, batch: TensorDict) -> TensorDict:
        """With ``loss.distillation.coef``, per-token advantages from the reference actor's
        (teacher's) log-probs (:func:`rlpost.algo.distillation_advantages`)."""
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
        """The tokens a micro-batch's forward may hold (padded or packed rows); ``auto`` is set at
        the first step, when the node's engines and their caches already hold their memory."""
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
        """``optimizer.grad_accumulation`` contiguous slices, each split to the token budget; a row
        longer than the budget fails the step here, before any pass."""
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
        """Accumulate, clip, step; returns this pass's metrics. ``idle``: zero-gradient passes, so
        every rank of a sharded group runs as many (module docstring)."""
        parts = []
        for batch in micro_batches:
            with self._autocast(), lora_sync.adapter_dropout(self.model, self.cfg.model.lora):
                terms = self.loss_fn.loss_terms(batch, normaliser=normaliser)
            terms.loss.backward()
            parts.append((terms.metrics(), int(loss_tokens(batch).sum())))
            progress()
        for _ in range(idle):
            self._idle_pass()
            progress()
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
        metrics = combine_micro_metrics(parts)
        metrics.update(grad_norm=float(grad_norm), lr=float(lr))
        return metrics

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
        with self._autocast(), working("score"):
            logprobs_bt = self.loss_fn.score(tokens_bt, attention_bt)
        return [logprobs_bt[i, : len(ids)].float().tolist() for i, ids in enumerate(rows)]

    def choose_sync_mode(self, workers_serve_lora: Sequence[bool]) -> str:
        """With LoRA, the mode a sync sends (:func:`~rlpost.actors.learner.lora_sync.choose_sync_mode`)."""
        self.sync_mode = lora_sync.choose_sync_mode(self.cfg, self.sync_mode, workers_serve_lora)
        return self.sync_mode

    def named_parameters_for_sync(self, device: str | torch.device = "cpu") -> Iterable[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs for the engines, lazily, in ``model.dtype``
        (:func:`~rlpost.actors.learner.lora_sync.named_parameters_for_sync`). Sharded: each is
        gathered in turn, a collective every rank iterates in the same order."""
        return lora_sync.named_parameters_for_sync(self.model, self.sync_mode, self.cfg.model.dtype, device)

    def weights_for_sync(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> StreamedTensors:
        """``tensors`` as :class:`~rlpost.transport.bucketing.StreamedTensors`: each is made only
        when the bus fills its bucket, so the whole model is never copied at once."""
        return lora_sync.weights_for_sync(self.model, self.sync_mode, self.cfg.model.dtype, tensors)

    def publish(self, wait: bool = True) -> dict[str, float]:
        """Publish the current weights at the current version; returns timing and size metrics
        (with a vLLMUpdater also ``weight_load_s``, the slowest worker's reload). Sharded: every
        rank calls it; rank 0 sends. ``wait=False`` (a publisher with ``confirm``): return once
        sent, so the next train step overlaps the reload; the next publish or
        :meth:`confirm_publish` waits for it (``weight_load_s`` then reports the update before).
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
        """Wait until the workers serve what ``publish(wait=False)`` sent (no-op when nothing is
        pending, and on ranks other than 0)."""
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
        """Write ``run_dir/checkpoints/step_<step>`` atomically
        (:meth:`Checkpointer.save <rlpost.actors.learner.checkpoint.Checkpointer.save>`)."""
        with working("save_checkpoint"):
            return self._checkpointer().save(run_dir, step, rollout_state, version=self._version)

    def load_checkpoint(self, path: str | Path) -> dict:
        """Restore a ``step_<N>`` folder in place (:meth:`Checkpointer.load
        <rlpost.actors.learner.checkpoint.Checkpointer.load>`)."""
        with working("load_checkpoint"):
            restored = self._checkpointer().load(path)
        self._version, self._step = restored["version"], restored["step"]
        return restored

    def _checkpointer(self) -> Checkpointer:
        cfg = self.cfg
        return Checkpointer(
            self.model, self.tokenizer, self.optimizer, self.scheduler, lora_config=cfg.model.lora,
            keep=cfg.trainer.keep_checkpoints, trust_remote_code=cfg.model.trust_remote_code,
            sharded=self.sharded, rank=self.rank, architecture=self._architecture,
        )  # fmt: skip
