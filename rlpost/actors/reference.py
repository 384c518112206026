"""The ``reference`` actor: the frozen initial model (or ``reference.model``, a teacher), scoring
generated tokens for the KL term and for on-policy distillation.

One shared actor (``reference.enabled``), scoring with :class:`~rlpost.envs.RetrieveKL` (the
generation log-probs are the engine's), by ``reference.kl_in``: ``loss``: the loop sends each
step's groups (:meth:`Reference.annotate`) for GRPOLoss's KL term (or distillation's teacher
term); ``reward``: each env pool sends its batch before grouping (:meth:`Reference.penalize`).
Deviation: the k1 KL summed over the generated tokens is subtracted from each reward
(:class:`~rlpost.envs.KLComputation` with ``reward_per="sequence"``, RLHF style; TorchRL's form is
per-token), and advantages come from the penalised rewards. ``reference.model`` (a distillation
teacher) replaces the initial weights; its tokenizer must give the policy's token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from rlpost.actors import start_actor
from rlpost.actors.batch import collate_samples
from rlpost.config import ModelConfig, ReferenceConfig, RolloutConfig, TorchRoleResources
from rlpost.data.samples import Group, Sample
from rlpost.envs.kl import ASSISTANT_MASK, KLComputation, RetrieveKL
from rlpost.envs.kl_service import KLServiceActor
from rlpost.runtime.liveness import working
from rlpost.transport.named_actor import NamedActorClient

if TYPE_CHECKING:
    from rlpost.config import JobConfig


@dataclass(frozen=True)
class ReferenceSettings:
    """The job config sections the reference actor reads (the YAML's sections of the same names)."""

    model: ModelConfig  # the initial weights, kept frozen
    reference: ReferenceConfig  # where the KL goes (loss or reward) and its coefficient
    rollout: RolloutConfig  # the sampling temperature (log-probs of the processed distribution)
    resources: TorchRoleResources  # ``resources.reference``
    run_name: str = ""  # the run whose metrics the actor reports under

    @classmethod
    def from_job(cls, cfg: JobConfig) -> ReferenceSettings:
        return cls(cfg.model, cfg.reference, cfg.rollout, cfg.resources.reference, cfg.logging.run_name or "")


class Reference(KLServiceActor):
    """The reference model behind the KL term; as a :class:`~rlpost.envs.kl_service.KLServiceActor` it
    also serves envs that attach with ``RayRetrieveKL(actor_name="reference")`` (tokens mode,
    padded, the generation log-probs already in the data)."""

    def __init__(self, cfg: ReferenceSettings):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlpost.policies import TransformersWrapper

        self.cfg = cfg
        dtype = getattr(torch, cfg.model.dtype) if torch.cuda.is_available() else torch.float32
        source = cfg.reference.model or cfg.model.name_or_path
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).eval()
        model.requires_grad_(False)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path)
        if cfg.reference.model:  # a teacher: it must read the policy's token ids as the policy does
            check_same_vocabulary(tokenizer, AutoTokenizer.from_pretrained(cfg.reference.model), cfg.reference.model)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else tokenizer.eos_token_id)
        scorer = TransformersWrapper(
            model, tokenizer=tokenizer, input_mode="tokens", generate=False, pad_output=True, return_text=False,
            return_tokens=False, return_masks=False, log_probs_key="ref_log_probs",
            generate_kwargs={"temperature": cfg.rollout.temperature}, chunked_scoring=cfg.model.chunked_scoring,
            pack_sequences=cfg.model.pack_sequences,
        )  # fmt: skip
        # The generation log-probs are the engine's (gen_model=None); the transform only writes the
        # reference log-probs and the KL (what envs attached to this actor are served).
        self.kl = RetrieveKL(None, scorer, assistant_only=False, add_to_reward=False, estimator="k1")
        # kl_in: reward: the KL on the generated tokens, summed, taken from each sequence's reward
        self.reward_penalty = KLComputation(
            mask_key=ASSISTANT_MASK, add_to_reward=True, coeff=cfg.reference.kl_coef, reward_per="sequence",
            estimator="k1",
        )  # fmt: skip
        KLServiceActor.__init__(self, transform=self.kl)

    def annotate(self, groups: list[Group]) -> list[Group]:
        """Fill ``ref_logprobs`` on every sample (rewards and advantages left as they are)."""
        self._score([s for g in groups for s in g.samples])
        return groups

    def penalize(self, samples: list[Sample]) -> list[Sample]:
        """Fill ``ref_logprobs`` and subtract ``kl_coef`` x the summed k1 KL from each reward."""
        if self.cfg.reference.kl_goes_to != "reward":
            raise RuntimeError("penalize is the KL-shaped reward of reference.kl_in=reward; this run has kl_in=loss")
        batch = self._score(samples)
        if batch is not None:
            # the rewards as the samples hold them (float64), so the penalty is their only change
            batch.set("reward", torch.tensor([s.reward for s in samples], dtype=torch.float64))
            self.reward_penalty(batch)
            for sample, reward in zip(samples, batch.get("reward").tolist()):
                sample.reward = reward
        return samples

    def _score(self, samples: list[Sample]) -> TensorDict | None:
        """Set every sample's ``ref_logprobs`` (0 off the generated tokens); the scored batch."""
        if not samples:
            return None
        with working("score"):
            batch = self.kl(collate_samples(samples, self.pad_token_id))
        ref_bt = batch.get(("ref_log_probs", "full")).masked_fill(~batch.get(ASSISTANT_MASK), 0.0)
        for i, sample in enumerate(samples):
            sample.ref_logprobs = ref_bt[i, : len(sample.token_ids)].tolist()
        return batch


class ReferenceActor(Reference):
    """The Ray actor ``reference``: the plain class, one call at a time, reporting metrics."""

    def __init__(self, cfg: ReferenceSettings):
        from rlpost.actors.learner import set_torch_threads
        from rlpost.record.metrics import RoleMetrics

        set_torch_threads(cfg.resources.num_threads)
        super().__init__(cfg)
        self.metrics = RoleMetrics("reference", cfg.run_name, "reference")

    def annotate(self, groups: list[Group]) -> list[Group]:
        groups = super().annotate(groups)
        self.metrics.record(samples_scored=sum(len(g.samples) for g in groups))
        return groups

    def penalize(self, samples: list[Sample]) -> list[Sample]:
        samples = super().penalize(samples)
        self.metrics.record(samples_scored=len(samples))
        return samples


def start_reference(settings: ReferenceSettings, *, name: str = "reference", namespace: str | None = None,
                    **options):  # fmt: skip
    """Start the named reference actor (``options`` go to ``.options()``)."""
    return start_actor(ReferenceActor, settings, name=name, resources=settings.resources, namespace=namespace,
                       **options)  # fmt: skip


class RemoteReference(NamedActorClient):
    """The env pools' bounded client of the run's ``reference`` actor (``kl_in: reward``), by
    name: a lost actor's replacement is waited for (``reference.restart_wait_s``), a call is
    bounded by ``reference.timeout_s``."""

    def __init__(self, cfg: ReferenceConfig, actor_name: str = "reference", *, namespace: str | None = None):
        super().__init__(actor_name, namespace=namespace, timeout_s=cfg.timeout_s, restart_wait_s=cfg.restart_wait_s,
                         role="reference actor",
                         settings=("reference.timeout_s", "reference.restart_wait_s"))  # fmt: skip

    def penalize(self, samples: list[Sample]) -> list[Sample]:
        """:meth:`Reference.penalize` in the actor; the scored samples come back."""
        return self.call("penalize", samples, what=f"score {len(samples)} samples for the KL-shaped reward")


def check_same_vocabulary(policy_tokenizer, teacher_tokenizer, teacher: str) -> None:
    """Raise ValueError (naming a differing token) unless both tokenizers map every token to the
    same id: the teacher scores the policy's token ids."""
    ours, theirs = policy_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if ours == theirs:
        return
    differing = sorted(set(ours.items()) ^ set(theirs.items()))[:1]
    raise ValueError(
        f"reference.model {teacher!r} does not share the policy's tokenizer ({len(ours)} vs {len(theirs)} tokens; "
        f"e.g. {differing[0] if differing else '?'} differs): its log-probs of the policy's token ids would be "
        "meaningless. Use a teacher of the same model family (the same tokenizer)."
    )
