"""The env pool: prompts -> inference -> rewards (-> the reference's KL penalty) -> whole GRPO
groups with their advantages -> buffer.

:class:`GroupCollector` is an :class:`~rlpost.collect.LLMCollector` in its whole-episodes mode,
built from the job config: the env (its shard of the prompt order), a
:class:`~rlpost.policies.vLLMWrapper` over an engine client, and a
:class:`~rlpost.transport.group_writer.GroupWriter` as its replay buffer; a plain class and,
unchanged, the Ray actor ``env-pool-<i>`` (:func:`start_env_pool`)::

    sync:   groups = pool.collect(num_groups)            one batch with the current weights
    async:  pool.start(num_groups_total) ... pool.stop() the collector's background thread:
            reserve room -> collect -> writer.extend(groups) (ONE batched put per batch;
            backpressure blocks there) until the total, stop(), or an error

Every put carries the pool's :meth:`GroupCollector.state_dict`, kept by the buffer beside the
groups: a dead pool restarts from its last put's position, so no completed group is lost or
repeated; its higher ``epoch`` makes the buffer refuse a put the dead pool left in flight. The pool
also survives its buffer: the writer numbers its groups (``Group.seq``) and keeps them until
acknowledged; :meth:`GroupCollector.set_buffer` puts them again (the new buffer skips those it has).
"""

from __future__ import annotations

import copy
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlpost.actors import start_actor
from rlpost.actors.calls import InferenceWorkerLost
from rlpost.collect import LLMCollector, PolicyVersion, WholeEpisodes
from rlpost.data.samples import Group
from rlpost.envs import make_env
from rlpost.envs.tasks import fit_prompts
from rlpost.policies import vLLMWrapper
from rlpost.transport.group_writer import DEFAULT_PUT_TIMEOUT_S, GroupWriter

if TYPE_CHECKING:
    from rlpost.config import (
        DataConfig,
        JobConfig,
        LossConfig,
        ModelConfig,
        ReferenceConfig,
        RewardModelConfig,
        RoleResources,
        RolloutConfig,
        ToolsConfig,
        TrainerConfig,
    )


@dataclass(frozen=True)
class EnvPoolSettings:
    """The job config sections an env pool reads (the YAML's sections of the same names)."""

    model: ModelConfig  # the tokenizer and chat template
    data: DataConfig  # prompts, rewards, group size
    tools: ToolsConfig
    rollout: RolloutConfig  # sampling, turns, the number of pools (the prompt shards)
    loss: LossConfig  # advantage_scale and filter_equal_rewards (advantages are computed here, once)
    trainer: TrainerConfig  # prompts_per_step: the pools share each step's prompts
    resources: RoleResources  # ``resources.env_pool``
    run_name: str = ""  # the run whose metrics the actor reports under
    reward_model: RewardModelConfig | None = None  # scored through the run's ``reward`` actor
    reference: ReferenceConfig | None = None  # kl_in: reward: each batch penalised through the ``reference`` actor

    @classmethod
    def from_job(cls, cfg: JobConfig) -> EnvPoolSettings:
        return cls(cfg.model, cfg.data, cfg.tools, cfg.rollout, cfg.loss, cfg.trainer, cfg.resources.env_pool,
                   cfg.logging.run_name or "", cfg.reward_model, cfg.reference)  # fmt: skip

    @property
    def kl_in_reward(self) -> bool:
        """The reference actor's KL penalty goes into the rewards (``reference.kl_in: reward``)."""
        return self.reference is not None and self.reference.kl_goes_to == "reward"


class GroupCollector(LLMCollector):
    """One env pool: an LLMCollector of whole GRPO groups from its shard of the prompts (named for
    what it does; :class:`~rlpost.envs.AsyncEnvPool` is TorchRL's pool of envs).

    ``pool_index``: its shard of ``rollout.env_pool_shards()`` (prompt ids never collide across
    pools, whichever run). ``engine_client``: a :class:`~rlpost.policies.VLLMEngineClient`.
    ``buffer``: where the background run puts groups (a LocalBuffer, the run's RayBuffer, a
    RayReplayBuffer of a LocalBuffer; None: collect-only). ``input_mode``: "tokens" (exact ids
    across turns) or "history". ``epoch``: this incarnation (a restarted pool's is higher).
    ``report_metrics``: each batch's reward and counts as Ray metrics. ``reference``: with
    ``reference.kl_in: reward``, an object with :class:`~rlpost.actors.reference.Reference`'s
    ``penalize(samples)`` applied before advantages (None: ``RemoteReference``, the run's actor).
    """

    def __init__(self, cfg: EnvPoolSettings, pool_index: int, engine_client: Any, buffer: Any = None, *,
                 tokenizer: Any = None, input_mode: str = "tokens", policy_version: PolicyVersion | None = None,
                 epoch: int = 0, report_metrics: bool = False, reference: Any = None) -> None:  # fmt: skip
        num_shards = cfg.rollout.env_pool_shards()
        if not 0 <= pool_index < num_shards:
            raise ValueError(f"pool_index must be in [0, {num_shards}) (the env pools' shards), got {pool_index}")
        self.cfg, self.pool_index, self.name, self.epoch = cfg, pool_index, f"env-pool-{pool_index}", epoch
        # a batch is a pool's share of a step with the pools the run starts with (fewer pools
        # collect more batches a step, each as large)
        self.groups_per_batch = max(1, cfg.trainer.prompts_per_step // cfg.rollout.num_env_pools)
        tokenizer = with_chat_template(tokenizer if tokenizer is not None else load_tokenizer(cfg), cfg)
        group_size, rollout = cfg.data.group_size, cfg.rollout
        env = make_env(
            cfg, tokenizer, self.groups_per_batch * group_size, input_mode=input_mode,
            num_shards=num_shards, shard_index=pool_index,
        )  # fmt: skip
        if cfg.data.drop_long_prompts:  # the rows the driver's check left out (without it, it refused the run)
            fit_prompts(env, cfg)
        sampling = {"temperature": rollout.temperature, "top_p": rollout.top_p, "max_tokens": rollout.max_tokens}
        policy = vLLMWrapper(engine_client, tokenizer=tokenizer, input_mode=input_mode, generate_kwargs=sampling,
                             return_log_probs=True, return_tokens=True, pad_output=False)  # fmt: skip
        if cfg.kl_in_reward and reference is None:
            from rlpost.actors.reference import RemoteReference

            reference = RemoteReference(cfg.reference)
        self.writer = None if buffer is None else GroupWriter(buffer, self.name, epoch=epoch,
                                                              state=self.state_dict)  # fmt: skip
        super().__init__(
            env,
            policy=policy,
            dialog_turns_per_batch=self.groups_per_batch * group_size,
            replay_buffer=self.writer,
            track_policy_version=policy_version if policy_version is not None else PolicyVersion(),
            whole_episodes=WholeEpisodes(
                group_size=group_size,
                max_turns=rollout.max_turns,
                advantage_scale=cfg.loss.advantage_scale,
                filter_equal_rewards=cfg.loss.filter_equal_rewards,
                keep_top=cfg.loss.type == "sft",
                top_k=cfg.loss.top_k,
                max_prompt_tokens=rollout.engine.max_model_len - 1,
                group_info={"env_pool": pool_index},
                reward_adjustment=reference.penalize if cfg.kl_in_reward else None,
            ),
        )
        self.engine_client = engine_client
        self.num_prompts_collected = 0  # monotonic across restarts (part of the state)
        self._woken = threading.Event()  # the background run ended, or a worker was found dead
        self._worker_lost: str | None = None  # a death not yet reported by wait()
        if hasattr(engine_client, "on_worker_lost"):  # a RemoteVLLMClient: it tells us of deaths
            engine_client.on_worker_lost = self._on_worker_lost
        self.metrics = None
        if report_metrics:
            from rlpost.record.metrics import RoleMetrics

            self.metrics = RoleMetrics("env_pool", cfg.run_name, self.name)

    # ------------------------------------------------------------------ collecting

    def collect_groups(self, num_groups: int | None = None) -> list[Group]:
        """:meth:`LLMCollector.collect_groups`, counted in the pool's position and reported."""
        num_groups = num_groups or self.groups_per_batch
        groups = super().collect_groups(num_groups)
        self.num_prompts_collected += num_groups
        if self.metrics is not None:
            rewards = [r for g in groups for r in g.rewards]
            self.metrics.record(
                reward_mean=sum(rewards) / len(rewards) if rewards else None,
                groups_collected=len(groups),
                samples_collected=len(rewards),
                groups_filtered=self.episode_stats.num_filtered_groups,
            )
        return groups

    # ------------------------------------------------------------------ background (async mode)

    def start(self, num_groups_total: int | None = None) -> None:
        """Collect in the background until ``num_groups_total`` more prompts were collected (None:
        until :meth:`stop`); prompts whose groups the DAPO filter dropped count too."""
        if self.writer is None:
            raise ValueError(f"env pool {self.pool_index}: start() needs a buffer")
        if self.is_running():
            raise RuntimeError(f"env pool {self.pool_index} is already running")
        group_size = self.whole_episodes.group_size
        self.total_frames = -1 if num_groups_total is None else self._frames + num_groups_total * group_size
        self._woken.clear()
        super().start()

    def _run_in_background(self) -> None:
        try:
            super()._run_in_background()
        finally:
            self._woken.set()

    def _on_worker_lost(self, index: int, error: BaseException) -> None:
        self._worker_lost = f"inference worker {index} died under env pool {self.pool_index}'s request: {error}"
        self._woken.set()

    def wait(self, timeout_s: float | None = None, report_lost: bool = True) -> bool:
        """Wait for the background run to end; True if it ended; raises the run's error. With
        ``report_lost``, raises :class:`InferenceWorkerLost` early (once per death): the run goes
        on, and the caller can start the replacement at once."""
        if self.is_running():
            if report_lost:
                self._woken.wait(timeout_s)
            else:
                self._thread.join(timeout_s)
        self._raise_error()
        if report_lost and self._worker_lost is not None:
            lost, self._worker_lost = self._worker_lost, None
            if self.is_running():
                self._woken.clear()
            raise InferenceWorkerLost(lost)
        return not self.is_running()

    def stop(self, timeout_s: float = DEFAULT_PUT_TIMEOUT_S + 60.0) -> dict[str, Any]:
        """Stop the background run after its current batch (``TimeoutError`` past ``timeout_s``;
        the run's error if it failed); returns the stats."""
        self._stop.set()
        if not self.wait(timeout_s, report_lost=False):
            raise TimeoutError(f"env pool {self.pool_index} did not stop within {timeout_s:.0f}s")
        return self.stats()

    def _error_text(self) -> str | None:
        error = self.collection_error
        return None if error is None else "".join(traceback.format_exception(error))

    def _raise_error(self) -> None:
        if self.collection_error is not None:
            raise RuntimeError(f"env pool {self.pool_index} failed:\n{self._error_text()}") from self.collection_error

    # ------------------------------------------------------------------ state

    def stats(self) -> dict[str, Any]:
        """Running totals (samples, tokens, reward errors, filtered groups, seconds generating /
        collecting / blocked in put) and the background run's state."""
        out = self.episode_stats.as_dict()
        writer = self.writer
        out.update(
            env_pool=self.pool_index,
            policy_version=self.get_policy_version(),
            num_batches_put=writer.num_batches_put if writer is not None else 0,
            put_s=writer.put_s if writer is not None else 0.0,
            running=self.is_running(),
            error=self._error_text(),
        )
        return out

    def set_inference(self, handles: list) -> None:
        """Serve from these inference workers from now on (the controller restarted one); a
        request waiting for a worker is re-issued to them."""
        self.engine_client.set_handles(handles)

    def set_buffer(self, buffer: Any, timeout_s: float = 60.0) -> int:
        """Put into ``buffer`` (the old one's replacement) from now on, first the groups not yet
        acknowledged; returns how many groups it took."""
        if self.writer is None:
            raise ValueError(f"env pool {self.pool_index} was built without a buffer")
        return self.writer.set_buffer(buffer, timeout_s)

    def state_dict(self) -> dict[str, Any]:
        """The prompt stream's position, prompts collected, groups put, the version tracker."""
        return {
            "pool_index": self.pool_index,
            "num_shards": self.cfg.rollout.env_pool_shards(),
            "num_prompts_collected": self.num_prompts_collected,
            "num_groups_put": self.writer.num_groups_put if self.writer is not None else 0,
            "collector": super().state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # "num_env_pools": the key of checkpoints written before the shards could outnumber the pools
        saved = (state["pool_index"], state.get("num_shards", state.get("num_env_pools")))
        shards = self.cfg.rollout.env_pool_shards()
        if saved != (self.pool_index, shards):
            raise ValueError(
                f"env pool state of shard {saved[0]} of {saved[1]} cannot resume shard {self.pool_index} of {shards} "
                "(rollout.num_env_pools / max_env_pools changed? the prompt stream's shards are fixed for a run)"
            )
        super().load_state_dict(state["collector"])
        self.num_prompts_collected = int(state.get("num_prompts_collected", 0))
        if self.writer is not None:
            self.writer.num_groups_put = int(state.get("num_groups_put", 0))
            self.writer.outbox = []  # what a restarted pool put before is in the buffer (or acknowledged)


def start_env_pool(settings: EnvPoolSettings, pool_index: int, engine_client: Any, buffer: Any, *,
                   namespace: str | None = None, max_concurrency: int = 4, epoch: int = 0, **options: Any):  # fmt: skip
    """Start :class:`GroupCollector` as the actor ``env-pool-<pool_index>``, threaded so ``stop``
    and ``stats`` answer during the background collection; ``options`` go to ``.options()``."""
    if max_concurrency < 2:
        raise ValueError("the env pool actor must be threaded (max_concurrency >= 2) so stop() can reach it")
    return start_actor(
        GroupCollector, settings, pool_index, engine_client, buffer, name=f"env-pool-{pool_index}",
        resources=settings.resources, namespace=namespace, max_concurrency=max_concurrency,
        init_kwargs={"epoch": epoch, "report_metrics": True}, **options,
    )  # fmt: skip


def load_tokenizer(cfg: JobConfig | EnvPoolSettings) -> Any:
    """The tokenizer of ``cfg.model``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.model.tokenizer_path, trust_remote_code=cfg.model.trust_remote_code)


def with_chat_template(tokenizer: Any, cfg: JobConfig | EnvPoolSettings) -> Any:
    """``tokenizer`` with ``model.chat_template`` (inline Jinja or a file path) when set, as a
    shallow copy (the caller's is left as it is)."""
    template = cfg.model.chat_template
    if not template:
        return tokenizer
    path = Path(template)
    if "{" not in template and path.is_file():
        template = path.read_text()
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer
