"""What the learner trains with: ``reference`` (KL and the teacher), ``loss`` (with
``loss.distillation``), ``optimizer``, ``trainer``, and ``weight_sync``."""

from __future__ import annotations

import typing
from typing import Literal

from pydantic import Field, model_validator

from rlpost.config.base import Section


class ReferenceConfig(Section):
    """The frozen reference model and the KL penalty to it (or the teacher of loss.distillation)."""

    enabled: bool = Field(False, description="Start the reference actor and compute KL to the initial model.")
    model: str | None = Field(
        None,
        description="The reference model, a hub name or local path: the teacher of loss.distillation. It must "
        "share the policy's tokenizer (the same token ids). None: model.name_or_path, the policy's initial weights.",
    )
    kl_coef: float = Field(0.0, ge=0, description="KL coefficient (beta).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator (Schulman).")
    kl_in: Literal["loss", "reward"] = Field(
        "loss",
        description="Add KL as a loss term ('loss', GRPO) or subtract it from the reward ('reward', k1, RLHF: each "
        "env pool has its batch scored by the reference actor before it computes the group advantages).",
    )
    timeout_s: float = Field(
        300.0,
        gt=0,
        description="Bound of one env pool's call scoring a batch for the KL-shaped reward (kl_in: reward).",
    )
    restart_wait_s: float = Field(
        180.0,
        gt=0,
        description="How long an env pool waits for the supervisor to start a lost reference actor again before its "
        "collection fails (kl_in: reward).",
    )

    @property
    def kl_goes_to(self) -> Literal["loss", "reward"] | None:
        """Where the KL to the reference goes: ``None`` without a reference actor, else ``kl_in``.
        The one place this is decided: the learner puts a KL term in its loss when it says
        ``"loss"``, the env pools have each batch's rewards penalised when it says ``"reward"``,
        and the loop has each step's groups annotated only in the first case."""
        return self.kl_in if self.enabled else None


class DistillationConfig(Section):
    """On-policy distillation toward the reference actor's model (reference.model, the teacher)."""

    coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the teacher in each token's advantage: coef * (teacher log-prob - sampled "
        "log-prob), the negative per-token reverse KL to the teacher, whose policy gradient descends that KL. "
        "0: off. Needs reference.enabled with reference.kl_in=loss.",
    )
    use_reward: bool = Field(
        True,
        description="Keep the reward's group advantage beside the teacher's term; false: pure distillation "
        "(the reward is logged but not trained on).",
    )


DAPO_CLIP_EPS_HIGH = 0.28  # DAPO's clip-higher (Yu et al. 2025, Eq. 10)


class LossConfig(Section):
    """The policy loss: GRPO (with DAPO's clip-higher, Dr.GRPO's aggregation), DAPO, CISPO, or SFT on
    each group's best samples (expert iteration); on-policy distillation on top of any of them."""

    type: Literal["grpo", "dapo", "cispo", "sft"] = Field(
        "grpo",
        description="grpo: the clipped surrogate. dapo: the same with DAPO's defaults (clip_eps_high 0.28 and "
        "filter_equal_rewards true, unless set). cispo: the clipped importance weight held constant on every "
        "token's log-prob gradient (MiniMax-M1). sft: expert iteration, the negative log-likelihood of each "
        "group's samples above its median reward (at most loss.top_k).",
    )
    top_k: int | None = Field(
        None,
        ge=1,
        description="loss.type=sft: the most samples kept per group (best first, above the group's median "
        "reward); None: every sample above the median. A group whose rewards are all equal is dropped.",
    )
    distillation: DistillationConfig = Field(
        default_factory=DistillationConfig, description="On-policy distillation toward reference.model."
    )
    clip_eps_low: float = Field(0.2, gt=0, lt=1, description="Lower clip: ratio >= 1 - clip_eps_low.")
    clip_eps_high: float = Field(0.2, gt=0, description="Upper clip: ratio <= 1 + clip_eps_high (DAPO uses 0.28).")
    aggregation: Literal["token_mean", "sequence_mean", "sequence_sum_norm"] = Field(
        "token_mean", description="How per-token terms become a scalar (sequence_sum_norm = Dr.GRPO)."
    )
    advantage_scale: Literal["group", "batch", "none"] = Field(
        "group",
        description="Advantage normalisation: group std, batch std (over an env pool's batch, after the KL "
        "penalty with reference.kl_in=reward), or none (Dr.GRPO).",
    )
    filter_equal_rewards: bool = Field(
        False, description="DAPO dynamic sampling: drop groups whose rewards are all equal."
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    entropy_estimator: Literal["sampled", "exact"] = Field(
        "sampled",
        description="The entropy of the bonus: 'sampled' is -log p(token) of the sampled tokens (an "
        "unbiased estimate on on-policy samples, nothing extra to compute); 'exact' is the entropy of "
        "each token's whole next-token distribution (TorchRL's default), computed in chunks with the "
        "log-probs when model.chunked_scoring applies.",
    )
    kl_to_inference_coef: float = Field(
        0.0, ge=0, description="Penalty on the k3 KL between the learner and the behaviour (inference) log-probs."
    )
    off_policy_correction: Literal["none", "tis", "mis"] = Field(
        "none",
        description="Correct for tokens the learner's weights did not sample exactly (engine numerics, stale "
        "weights): weight each token's objective by w = p_learner / p_sampler, truncated at "
        "off_policy_threshold ('tis') or dropped above it ('mis'); the PPO ratio is then taken against the "
        "learner's own log-probs at the start of the step. 'none': the ratio against the sampler's log-probs.",
    )
    off_policy_threshold: float = Field(
        2.0, gt=1, description="The cap C on the importance weight w of loss.off_policy_correction (tis / mis)."
    )
    custom_fn: str | None = Field(
        None,
        description=(
            "A loss of your own, 'package.module:function', called instead of rlpost.algo.grpo_loss with its "
            "arguments (it returns GRPOLossTerms with at least `loss`); the module must be importable by the "
            "learner (installed, or in the job's working_dir). null: grpo_loss."
        ),
    )

    @model_validator(mode="after")
    def _type_defaults(self) -> LossConfig:
        if self.type == "dapo":  # DAPO's recipe where the config does not say otherwise
            if "clip_eps_high" not in self.model_fields_set:
                self.clip_eps_high = DAPO_CLIP_EPS_HIGH
            if "filter_equal_rewards" not in self.model_fields_set:
                self.filter_equal_rewards = True
            if self.clip_eps_high < self.clip_eps_low:
                raise ValueError(
                    f"loss.type=dapo is clip-higher: loss.clip_eps_high ({self.clip_eps_high}) must be >= "
                    f"loss.clip_eps_low ({self.clip_eps_low})"
                )
        if self.top_k is not None and self.type != "sft":
            raise ValueError(f"loss.top_k is set but loss.type is {self.type!r}: top_k selects samples for sft")
        if self.type == "sft" and self.off_policy_correction != "none":
            raise ValueError("loss.type=sft has no importance ratio: loss.off_policy_correction must be none")
        if self.type == "sft" and self.kl_to_inference_coef > 0:
            raise ValueError("loss.type=sft has no behaviour-policy term: loss.kl_to_inference_coef must be 0")
        if self.custom_fn and self.type != "grpo":
            raise ValueError(f"loss.custom_fn replaces grpo's loss; it cannot be combined with loss.type={self.type}")
        return self


class OptimizerConfig(Section):
    """AdamW and its schedule."""

    lr: float = Field(1e-5, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Max global grad norm.")
    grad_accumulation: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps, then constant.")
    fused: bool = Field(
        True,
        description="AdamW's fused kernel: one multi-threaded pass over every parameter instead of a loop of "
        "per-tensor ops (transformers' Trainer default with torch >= 2.8). On 2 CPU cores the 0.5B-shaped "
        "model's update takes 0.3 s against 1.4-2.7 s. false: torch's per-tensor AdamW.",
    )


class TrainerConfig(Section):
    """The training loop."""

    steps: int = Field(20, ge=1, description="Learner steps (one batch of prompts_per_step groups each).")
    prompts_per_step: int = Field(8, ge=1, description="Prompts (GRPO groups) per learner step.")
    epochs_per_batch: int = Field(1, ge=1, description="Passes over each batch (PPO epochs).")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: collect -> train -> publish; async: collection never stops."
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="async: drop groups more than this many policy versions old; the buffer holds this many steps.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass instead of keeping them "
        "(less learner memory for long completions; the tiny model's learner step took 16-34% longer).",
    )
    max_tokens_per_microbatch: typing.Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        "auto",
        description="Tokens per learner micro-batch as its forward holds them (rows x the longest row, packed "
        "or padded); a longer row fails its step before training, naming this key. auto: set at the first step "
        "from the model's shape and the free memory (metrics.jsonl's token_budget; docs/architecture.md); None: "
        "no budget. The step's gradient is the same for any split.",
    )
    weight_sync_interval: int = Field(1, ge=1, description="Optimizer steps between weight publications.")
    checkpoint_interval: int = Field(0, ge=0, description="Steps between checkpoints; 0 = only at the end.")
    keep_checkpoints: int = Field(2, ge=1, description="Most recent checkpoints kept.")
    auto_resume: bool = Field(False, description="Resume from the last checkpoint by itself when the learner dies.")
    seed: int = Field(0, description="Seed of the learner (torch RNG).")


class WeightSyncConfig(Section):
    """The learner -> inference weight bus (a torch.distributed group of its own)."""

    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="auto: NCCL when the roles have GPUs, else gloo."
    )
    bucket_mb: int = Field(64, ge=1, description="Size of the flattened parameter buckets sent per collective.")
    timeout_s: float = Field(60.0, gt=0, description="Timeout of every collective; a dead peer is detected after it.")
    inflight_updates: bool = Field(
        True,
        description="An update that reaches an inference worker while it generates is applied between two engine "
        "steps: running requests go on with the new weights (their KV cache kept) and every token records the "
        "version that sampled it (metrics token_staleness_mean, inflight_token_fraction). false: the update waits "
        "for the running generate call to finish. Matters in async mode, where updates meet running generation.",
    )
    train_during_reload: bool = Field(
        True,
        description="Async mode: the learner trains the next step while the workers reload the weights it sent; "
        "the loop waits for the reload at the next sync (at once before a probe, an evaluation and the last step), "
        "where a failed reload is recovered as any failed sync; weight_load_s is then the update before's. false: "
        "every sync waits. Sync mode always waits.",
    )
    probe_every: int = Field(
        1,
        ge=0,
        description="Check every N-th weight sync (and the first, and the start-up sync) by scoring a fixed probe "
        "in one inference worker and in the learner: sync_logprob_diff, their largest log-prob difference (null "
        "on unchecked syncs). 0: never. A forward pass on each side: ~0.8 s of a 13 s CPU step (0.5B shape).",
    )
    shared_memory: bool = Field(
        True,
        description="Inference workers on the learner's node read the weights from memory the learner shares "
        "(a shared-memory segment on CPU, CUDA IPC on the learner's own GPU; one whole copy of the weights, kept "
        "between updates) instead of the collectives, which other workers use. false: collectives for all.",
    )
