"""The env pool: prompts -> inference -> rewards -> whole GRPO groups -> buffer.

:class:`EnvPool` is a plain class (no Ray needed): the env of its settings (its shard of the
prompt order), a :class:`~rlpost.policies.vLLMWrapper` over an engine client (an in-process
``LocalVLLMClient`` or the inference workers' remote client), and an
:class:`~rlpost.collect.LLMCollector` in its whole-episodes mode (each batch's episodes start
together and end inside it; whole GRPO groups come out). The controller drives it in one of
two ways::

    sync:   groups = pool.collect(num_groups)            one batch with the current weights
    async:  pool.start(num_groups_total) ... pool.stop() a background thread runs
            run(): collect -> buffer.put(groups) (ONE batched put per collect; backpressure
            blocks there) until the total, stop(), or an error

Every put carries the pool's :meth:`EnvPool.state_dict` (its position in the prompt stream and
the number of prompts collected so far), which the buffer keeps beside the groups: a pool that
dies is restarted from the position its last put ended at, so no completed group is lost or
repeated (the prompts it was generating are generated again). A restarted pool has a higher
``epoch``; the buffer refuses puts of older epochs once it is replaced (a put the dead pool left
in flight cannot land after it).

The pool also survives its buffer: it numbers the groups it puts (``Group.seq``) and keeps them in
its outbox until the learner's side acknowledges them (each put's receipt says how far). When
the buffer actor dies, a call to it waits for :meth:`EnvPool.set_buffer` (the supervisor starting
a new one), which puts the outbox again; groups the new buffer already has are skipped.

:class:`EnvPoolActor` is the thin Ray shell (actor name ``env-pool-<i>``), threaded so that
``stop()`` and ``stats()`` answer while the background thread collects.
"""

from __future__ import annotations

import copy
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlpost.actors import start_actor
from rlpost.actors.calls import InferenceWorkerLost
from rlpost.collect import LLMCollector, PolicyVersion, WholeEpisodes
from rlpost.envs import make_env
from rlpost.policies import vLLMWrapper
from rlpost.transport.buffer import BufferLost, BufferTimeout
from rlpost.types import Group

if TYPE_CHECKING:
    from rlpost.config import (
        DataConfig,
        JobConfig,
        LossConfig,
        ModelConfig,
        RoleResources,
        RolloutConfig,
        ToolsConfig,
        TrainerConfig,
    )

DEFAULT_PUT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class EnvPoolSettings:
    """The job config sections an env pool reads (the YAML's sections of the same names)."""

    model: ModelConfig  # the tokenizer and chat template
    data: DataConfig  # prompts, rewards, group size
    tools: ToolsConfig
    rollout: RolloutConfig  # sampling, turns, the number of pools (the prompt shards)
    loss: LossConfig  # advantage_scale and filter_equal_rewards (advantages are computed here)
    trainer: TrainerConfig  # prompts_per_step: the pools share each step's prompts
    resources: RoleResources  # ``resources.env_pool``
    run_name: str = ""  # the run whose metrics the actor reports under

    @classmethod
    def from_job(cls, cfg: JobConfig) -> EnvPoolSettings:
        return cls(cfg.model, cfg.data, cfg.tools, cfg.rollout, cfg.loss, cfg.trainer, cfg.resources.env_pool,
                   cfg.logging.run_name or "")  # fmt: skip


class EnvPool:
    """One env pool: collects whole groups from its shard of the prompts.

    Args:
        cfg: the env pool's sections of the job config (``EnvPoolSettings.from_job(job_config)``).
        pool_index: this pool's index; it takes shard ``pool_index`` of
            ``rollout.num_env_pools``, so prompt ids never collide across pools.
        engine_client: a :class:`~rlpost.policies.VLLMEngineClient` (may expose
            ``last_policy_version``).
        buffer: where ``run`` puts groups (``put(groups, timeout_s, producer, producer_state)``);
            None for collect-only.

    Keyword Args:
        tokenizer: the model's tokenizer; loaded from ``cfg.model`` when None.
        input_mode: "tokens" (default: exact ids across turns) or "history".
        policy_version: a shared :class:`PolicyVersion` (e.g. set by the owner after a local
            weight load); a new one when None.
        epoch: this pool's incarnation (0 first; the supervisor gives a restarted pool a
            higher one, and the buffer then refuses puts of older epochs).
    """

    def __init__(
        self,
        cfg: EnvPoolSettings,
        pool_index: int,
        engine_client: Any,
        buffer: Any = None,
        *,
        tokenizer: Any = None,
        input_mode: str = "tokens",
        policy_version: PolicyVersion | None = None,
        epoch: int = 0,
    ) -> None:
        num_pools = cfg.rollout.num_env_pools
        if not 0 <= pool_index < num_pools:
            raise ValueError(f"pool_index must be in [0, rollout.num_env_pools={num_pools}), got {pool_index}")
        self.cfg, self.pool_index, self.buffer = cfg, pool_index, buffer
        self.groups_per_batch = max(1, cfg.trainer.prompts_per_step // num_pools)
        tokenizer = with_chat_template(tokenizer if tokenizer is not None else load_tokenizer(cfg), cfg)
        group_size = cfg.data.group_size
        self.env = make_env(
            cfg, tokenizer, self.groups_per_batch * group_size, input_mode=input_mode,
            num_shards=num_pools, shard_index=pool_index,
        )  # fmt: skip
        rollout = cfg.rollout
        self.policy = vLLMWrapper(
            engine_client,
            tokenizer=tokenizer,
            input_mode=input_mode,
            generate_kwargs={
                "temperature": rollout.temperature,
                "top_p": rollout.top_p,
                "max_tokens": rollout.max_tokens,
            },  # fmt: skip
            return_log_probs=True,
            return_tokens=True,
            pad_output=False,
        )
        self.collector = LLMCollector(
            self.env,
            policy=self.policy,
            dialog_turns_per_batch=self.groups_per_batch * group_size,
            track_policy_version=policy_version if policy_version is not None else PolicyVersion(),
            whole_episodes=WholeEpisodes(
                group_size=group_size,
                max_turns=rollout.max_turns,
                advantage_scale=cfg.loss.advantage_scale,
                filter_equal_rewards=cfg.loss.filter_equal_rewards,
                max_prompt_tokens=rollout.engine.max_model_len - 1,
                group_info={"env_pool": pool_index},
            ),
        )
        self.name = f"env-pool-{pool_index}"
        self.engine_client = engine_client
        self.num_batches_put = 0
        self.num_prompts_collected = 0  # monotonic across restarts (part of the state)
        self.num_groups_put = 0  # the last group's seq (part of the state)
        self.epoch = epoch
        self.outbox: list[Group] = []  # groups put and not yet acknowledged by the learner's side
        self._buffer_changed = threading.Condition()  # guards buffer, outbox and the numbering
        self._buffer_generation = 0
        self.put_s = 0.0  # seconds blocked in buffer.put (backpressure)
        self.buffer_wait_s = DEFAULT_PUT_TIMEOUT_S  # how long a call waits for a new buffer
        self._thread: threading.Thread | None = None
        self.on_batch: Callable[[list[Group]], None] | None = None  # e.g. the actor's metrics
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._error_text: str | None = None
        self._woken = threading.Event()  # the background run ended, or a worker was found dead
        self._worker_lost: str | None = None  # a death not yet reported by wait()
        if hasattr(engine_client, "on_worker_lost"):  # a RemoteVLLMClient: it tells us of deaths
            engine_client.on_worker_lost = self._on_worker_lost

    # ------------------------------------------------------------------ collecting

    def collect(self, num_groups: int | None = None) -> list[Group]:
        """One batch of ``num_groups`` prompts (default: this pool's share of a learner step);
        fewer groups come back when the DAPO filter drops some."""
        if self.running:
            raise RuntimeError(
                f"env pool {self.pool_index} is collecting in the background (start()); stop() it before collect()"
            )
        return self._collect(num_groups or self.groups_per_batch)

    def _collect(self, num_groups: int) -> list[Group]:
        groups = self.collector.collect_groups(num_groups)
        self.num_prompts_collected += num_groups
        if self.on_batch is not None:
            self.on_batch(groups)
        return groups

    def run(
        self,
        num_groups_total: int | None = None,
        stop: threading.Event | None = None,
        put_timeout_s: float = DEFAULT_PUT_TIMEOUT_S,
    ) -> None:
        """Collect and put into the buffer until ``num_groups_total`` prompts were collected
        (None: until ``stop`` is set). Each collect's groups go in with one batched put, which
        blocks while the buffer is full (a :class:`~rlpost.transport.buffer.BufferTimeout`
        after ``put_timeout_s`` propagates: a partial put cannot be retried without duplicates).
        Prompts whose groups the DAPO filter dropped count towards the total."""
        if self.buffer is None:
            raise ValueError(f"env pool {self.pool_index}: run() needs a buffer")
        collected = 0
        while num_groups_total is None or collected < num_groups_total:
            if stop is not None and stop.is_set():
                return
            num_groups = self.groups_per_batch
            if num_groups_total is not None:
                num_groups = min(num_groups, num_groups_total - collected)
            if not self._wait_for_room(num_groups, stop, put_timeout_s):
                return
            groups = self._collect(num_groups)
            collected += num_groups
            # even an empty put (the DAPO filter dropped every group) records the new position
            start = time.perf_counter()
            self._put(groups, put_timeout_s)
            self.put_s += time.perf_counter() - start
            self.num_batches_put += 1

    def _put(self, groups: list[Group], timeout_s: float) -> None:
        """Number ``groups``, keep them in the outbox and put them with the pool's new state."""
        with self._buffer_changed:
            for group in groups:
                self.num_groups_put += 1
                group.producer, group.seq = self.name, self.num_groups_put
            self.outbox.extend(groups)
            state = self.state_dict()
        receipt = self._buffer_call(
            "put", groups, timeout_s=timeout_s, producer=self.name, producer_state=state, epoch=self.epoch
        )
        self._after_put(receipt)

    def _after_put(self, receipt: Any) -> None:
        if not receipt.accepted:
            raise RuntimeError(f"{self.name} (epoch {self.epoch}) was replaced: the buffer refuses its puts")
        with self._buffer_changed:
            self.outbox = [g for g in self.outbox if g.seq > receipt.acknowledged]

    def _buffer_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call the buffer; when its actor died, wait for :meth:`set_buffer` and call the new one
        (its replay already holds this pool's outbox, so a put again only skips duplicates)."""
        while True:
            with self._buffer_changed:
                buffer, generation = self.buffer, self._buffer_generation
            try:
                return getattr(buffer, method)(*args, **kwargs)
            except BufferLost:
                self._wait_for_new_buffer(generation)

    def _wait_for_new_buffer(self, generation: int) -> None:
        with self._buffer_changed:
            if not self._buffer_changed.wait_for(
                lambda: self._buffer_generation != generation, timeout=self.buffer_wait_s
            ):
                raise BufferLost(f"{self.name}: the buffer died and no new one came within {self.buffer_wait_s:.0f}s")

    def set_buffer(self, buffer: Any, timeout_s: float = 60.0) -> int:
        """Use ``buffer`` from now on (the supervisor started it after the old one died): put
        the outbox into it (beyond its capacity if need be: the old buffer held these groups)
        with the pool's state. Returns how many groups the new buffer took (those the learner's
        side had not received)."""
        with self._buffer_changed:
            self.buffer = buffer
            self._buffer_generation += 1
            replay, state = list(self.outbox), self.state_dict()
            self._buffer_changed.notify_all()
        receipt = buffer.put(
            replay, timeout_s=timeout_s, producer=self.name, producer_state=state, epoch=self.epoch, force=True
        )
        self._after_put(receipt)
        return sum(g.seq > receipt.acknowledged for g in replay)

    def _wait_for_room(self, num_groups: int, stop: threading.Event | None, timeout_s: float) -> bool:
        """Block until the buffer holds room for the next batch for this pool (a reservation
        its put releases); False when ``stop`` was set.

        Generating only when the batch can go straight in keeps the pipeline one batch deep:
        a batch generated while an older one waits for room would age past the staleness cap
        and be dropped (measured: 30-44% of the async demo's groups before this wait; 18% with
        2 pools before it reserved, as both saw the same room).
        """
        if not hasattr(self.buffer, "reserve"):
            return True
        start = time.perf_counter()
        while not self._buffer_call("reserve", num_groups, 1.0, self.name):
            if stop is not None and stop.is_set():
                return False
            if time.perf_counter() - start > timeout_s:
                raise BufferTimeout(f"env pool {self.pool_index}: no room in the buffer for {timeout_s:.0f}s")
        self.put_s += time.perf_counter() - start
        return True

    # ------------------------------------------------------------------ background (async mode)

    def start(self, num_groups_total: int | None = None, put_timeout_s: float = DEFAULT_PUT_TIMEOUT_S) -> None:
        """Run :meth:`run` in a background thread; :meth:`stop` ends it."""
        if self.running:
            raise RuntimeError(f"env pool {self.pool_index} is already running")
        self._stop.clear()
        self._woken.clear()
        self._error = self._error_text = None
        self._thread = threading.Thread(
            target=self._run_guarded, args=(num_groups_total, put_timeout_s),
            name=f"env-pool-{self.pool_index}", daemon=True,
        )  # fmt: skip
        self._thread.start()

    def _run_guarded(self, num_groups_total: int | None, put_timeout_s: float) -> None:
        try:
            self.run(num_groups_total, self._stop, put_timeout_s)
        except BaseException as exc:  # kept and re-raised by stop()/wait(); shown by stats()
            self._error = exc
            self._error_text = "".join(traceback.format_exception(exc))
        finally:
            self._woken.set()

    def _on_worker_lost(self, index: int, error: BaseException) -> None:
        self._worker_lost = f"inference worker {index} died under env pool {self.pool_index}'s request: {error}"
        self._woken.set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout_s: float | None = None, report_lost: bool = True) -> bool:
        """Wait for the background run to end; True if it ended. Raises the run's error. With
        ``report_lost``, returns early by raising :class:`InferenceWorkerLost` (once per death)
        when the engine client found an inference worker dead: the run goes on, waiting for the
        worker's replacement, and the caller can start that replacement without delay."""
        if self.running:
            if report_lost:
                self._woken.wait(timeout_s)
            else:
                self._thread.join(timeout_s)
        self._raise_error()
        if report_lost and self._worker_lost is not None:
            lost, self._worker_lost = self._worker_lost, None
            if self.running:
                self._woken.clear()
            raise InferenceWorkerLost(lost)
        return not self.running

    def stop(self, timeout_s: float = DEFAULT_PUT_TIMEOUT_S + 60.0) -> dict[str, Any]:
        """Ask the background run to stop after its current collect/put; wait up to
        ``timeout_s``. Returns the stats; raises the run's error if it failed, or
        ``TimeoutError`` if it did not stop in time."""
        self._stop.set()
        if not self.wait(timeout_s, report_lost=False):
            raise TimeoutError(f"env pool {self.pool_index} did not stop within {timeout_s:.0f}s")
        return self.stats()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"env pool {self.pool_index} failed:\n{self._error_text}") from self._error

    # ------------------------------------------------------------------ state

    @property
    def policy_version(self) -> PolicyVersion:
        return self.collector.policy_version_tracker

    def set_policy_version(self, version: int) -> None:
        """Tell the pool the weights version its engine now serves (clients without
        ``last_policy_version``, e.g. an in-process engine after a local weight load)."""
        self.collector.policy_version_tracker.set_version(version)

    def stats(self) -> dict[str, Any]:
        """Running totals: samples, generated tokens, reward errors, filtered groups, seconds
        generating / collecting / blocked in put, and the background run's state."""
        out = self.collector.stats.as_dict()
        out.update(
            env_pool=self.pool_index,
            policy_version=self.collector.get_policy_version(),
            num_batches_put=self.num_batches_put,
            put_s=self.put_s,
            running=self.running,
            error=self._error_text,
        )
        return out

    def set_inference(self, handles: list) -> None:
        """Serve from these inference workers from now on (the controller restarted one); a
        request waiting for a worker is re-issued to them."""
        self.engine_client.set_handles(handles)

    def state_dict(self) -> dict[str, Any]:
        """The prompt stream's position, the prompts collected so far and the version tracker."""
        return {
            "pool_index": self.pool_index,
            "num_env_pools": self.cfg.rollout.num_env_pools,
            "num_prompts_collected": self.num_prompts_collected,
            "num_groups_put": self.num_groups_put,
            "collector": self.collector.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = (state["pool_index"], state["num_env_pools"])
        if saved != (self.pool_index, self.cfg.rollout.num_env_pools):
            raise ValueError(
                f"env pool state of pool {saved[0]} of {saved[1]} cannot resume pool {self.pool_index} "
                f"of {self.cfg.rollout.num_env_pools} (rollout.num_env_pools changed?)"
            )
        self.collector.load_state_dict(state["collector"])
        self.num_prompts_collected = int(state.get("num_prompts_collected", 0))
        self.num_groups_put = int(state.get("num_groups_put", 0))
        self.outbox = []  # what a restarted pool put before is in the buffer (or acknowledged)


class EnvPoolActor:
    """Ray shell around :class:`EnvPool` (named ``env-pool-<i>``); forwards every call.

    Start it with :func:`start_env_pool` (threaded: ``max_concurrency`` >= 2, so ``stop`` and
    ``stats`` run while the background collection does).
    """

    def __init__(self, cfg: EnvPoolSettings, pool_index: int, engine_client: Any, buffer: Any, epoch: int = 0):
        from rlpost.metrics import RoleMetrics

        self.pool = EnvPool(cfg, pool_index, engine_client, buffer, epoch=epoch)
        self.metrics = RoleMetrics("env_pool", cfg.run_name, f"env-pool-{pool_index}")
        self.pool.on_batch = self._report

    def _report(self, groups: list[Group]) -> None:
        rewards = [r for g in groups for r in g.rewards]
        self.metrics.record(
            reward_mean=sum(rewards) / len(rewards) if rewards else None,
            groups_collected=len(groups),
            samples_collected=len(rewards),
        )

    def collect(self, num_groups: int | None = None) -> list[Group]:
        return self.pool.collect(num_groups)

    def start(self, num_groups_total: int | None = None, put_timeout_s: float = DEFAULT_PUT_TIMEOUT_S) -> None:
        self.pool.start(num_groups_total, put_timeout_s)

    def stop(self, timeout_s: float = DEFAULT_PUT_TIMEOUT_S + 60.0) -> dict[str, Any]:
        return self.pool.stop(timeout_s)

    def wait(self, timeout_s: float | None = None) -> bool:
        return self.pool.wait(timeout_s)

    def set_policy_version(self, version: int) -> None:
        self.pool.set_policy_version(version)

    def stats(self) -> dict[str, Any]:
        return self.pool.stats()

    def set_inference(self, handles: list) -> None:
        self.pool.set_inference(handles)

    def set_buffer(self, rb: Any, timeout_s: float = 60.0) -> int:
        """Use the buffer ``rb`` (a RayReplayBuffer holding the service's LocalBuffer)."""
        from rlpost.transport.buffer import RayBuffer

        return self.pool.set_buffer(RayBuffer(rb), timeout_s)

    def state_dict(self) -> dict[str, Any]:
        return self.pool.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pool.load_state_dict(state)


def start_env_pool(
    settings: EnvPoolSettings,
    pool_index: int,
    engine_client: Any,
    buffer: Any,
    *,
    namespace: str | None = None,
    max_concurrency: int = 4,
    epoch: int = 0,
    **options: Any,
):
    """Start the actor ``env-pool-<pool_index>`` with the CPUs and GPUs of ``settings.resources``
    and return its handle. ``epoch``: the pool's incarnation (see :class:`EnvPool`); ``options``
    go to ``.options()`` and win (e.g. a placement-group scheduling strategy)."""
    if max_concurrency < 2:
        raise ValueError("the env pool actor must be threaded (max_concurrency >= 2) so stop() can reach it")
    return start_actor(
        EnvPoolActor, settings, pool_index, engine_client, buffer, epoch, name=f"env-pool-{pool_index}",
        resources=settings.resources, namespace=namespace, max_concurrency=max_concurrency, **options,
    )  # fmt: skip


# ---------------------------------------------------------------------------- helpers


def load_tokenizer(cfg: JobConfig | EnvPoolSettings) -> Any:
    """The tokenizer of ``cfg.model``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.model.tokenizer_path, trust_remote_code=cfg.model.trust_remote_code)


def with_chat_template(tokenizer: Any, cfg: JobConfig | EnvPoolSettings) -> Any:
    """``tokenizer`` with ``model.chat_template`` (inline Jinja or a file path) when set; a
    shallow copy, so the caller's tokenizer is left as it is."""
    template = cfg.model.chat_template
    if not template:
        return tokenizer
    path = Path(template)
    if "{" not in template and path.is_file():
        template = path.read_text()
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer
