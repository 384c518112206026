r"""RayReplayBuffer: a :class:`~rlpost.data.ReplayBuffer` in a Ray actor (TorchRL's).

The buffer lives in one actor; this object, and every copy of it sent to another actor (a
:class:`~rlpost.collect.RayLLMCollector` writing, a trainer sampling), forwards each call to it.
Storage, sampler and transforms are given as constructors, built in the actor::

    rb = RayReplayBuffer(
        storage=partial(LazyStackStorage, 64),
        sampler=SamplerWithoutReplacement,
        transform_factory=partial(MCAdvantage, grpo_size=4),
        batch_size=8,
    )
    rb.extend(batch)          # runs the write hooks (MCAdvantage) in the actor
    rb.sample()               # a batch, read hooks applied
    rb.write_count            # items written so far, by every writer

Any other public method of the buffer class runs in the actor too (as in TorchRL);
:meth:`RayReplayBuffer.call` does so with its own bound. :meth:`RayReplayBuffer.client` is a copy
that does not own the actor: only the creator's :meth:`close` ends it.

A dead buffer actor is restarted by Ray (``max_restarts``, 3 by default) empty, with the
constructors' storage, sampler and transforms (not those appended later); a call made meanwhile
waits for it (within ``timeout_s``). The loss is never silent: each answer carries the actor's
incarnation, and the first call to see a new one logs a warning and counts it in
:attr:`restarts`. Once restarts are spent calls raise Ray's ``RayActorError``. (rlpost's service
rebuilds its buffer from what the producers kept instead: :class:`~rlpost.transport.buffer.RayBuffer`.)

Deviations from TorchRL: every call is bounded (TimeoutError naming it past ``timeout_s``); the
restarts; no ``transport="distributed"``, delayed initialisation or runtime lease (the actor lives
until :meth:`close` or Ray's shutdown); the actor reserves no CPU unless ``remote_config`` says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from rlpost.data.buffer_host import BufferHost
from rlpost.data.replay_buffers import ReplayBuffer
from rlpost.runtime.liveness import remote_class
from rlpost.runtime.placement import PLACEMENT_TIMEOUT_S, asks_of, wait_until_placed

log = logging.getLogger("rlpost")

DEFAULT_REMOTE_CONFIG: dict[str, Any] = {"num_cpus": 0, "num_gpus": 0, "max_restarts": 3}


class RayReplayBuffer(ReplayBuffer):
    """A ReplayBuffer in a Ray actor; see the module docstring.

    Keyword Args:
        replay_buffer_cls: the buffer class built in the actor (default :class:`ReplayBuffer`).
        ray_init_config: ``ray.init`` arguments when Ray is not initialized yet.
        remote_config: Ray actor options (default: no CPU, no GPU).
        timeout_s, placement_timeout_s: rlpost's bounds of each call and of the actor's
            placement (:mod:`rlpost.runtime.placement`).
        **kwargs: the buffer's arguments (``storage``, ``sampler``, ``transform_factory`` as
            constructors).
    """

    def __init__(
        self,
        *,
        replay_buffer_cls: type = ReplayBuffer,
        ray_init_config: dict[str, Any] | None = None,
        remote_config: dict[str, Any] | None = None,
        timeout_s: float = 600.0,
        placement_timeout_s: float = PLACEMENT_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        import ray

        if "transform" in kwargs and kwargs["transform"] is not None:
            raise TypeError(
                "RayReplayBuffer builds its transforms in the actor: pass transform_factory=, not transform="
            )
        if not ray.is_initialized():
            ray.init(**(ray_init_config or {}))
        options = dict(DEFAULT_REMOTE_CONFIG if remote_config is None else remote_config)
        handle = remote_class(BufferHost).options(**options).remote(replay_buffer_cls, kwargs)
        try:
            wait_until_placed({"its buffer actor": (handle, asks_of(options))}, placement_timeout_s, "RayReplayBuffer")
        except BaseException:
            ray.kill(handle)
            raise
        self._setup(handle, timeout_s, kwargs.get("batch_size"), owner=True, restarts=options.get("max_restarts", 0))

    def _setup(self, handle: Any, timeout_s: float, batch_size: int | None, owner: bool, restarts: int) -> None:
        self._rb, self.timeout_s, self._batch_size, self._owner = handle, timeout_s, batch_size, owner
        self._max_restarts = restarts  # Ray's, for the actor: 0 means a dead actor stays dead
        self._incarnation: str | None = None  # the actor's, as last seen
        self._writes_seen = 0  # its write count, as its last answer said
        self.restarts = 0  # restarts of the actor this object has seen

    # a copy in another process forwards calls to the same actor without owning it
    def __reduce__(self):
        return (_client, (self._rb, self.timeout_s, self._batch_size, self._max_restarts))

    def client(self) -> RayReplayBuffer:
        """A copy that forwards calls to the same actor but does not own it (its :meth:`close`
        only lets go); what a pickled copy is too."""
        if self._rb is None:
            raise RuntimeError("RayReplayBuffer is closed")
        return _client(self._rb, self.timeout_s, self._batch_size, self._max_restarts)

    def _ask(self, what: str, method: str, *args: Any, timeout_s: float | None = None,
             kwargs: dict[str, Any] | None = None) -> Any:  # fmt: skip
        """``actor.method(*args, **kwargs)`` bounded by ``timeout_s``, retried while Ray restarts
        the actor; notes a new incarnation."""
        import ray

        if self._rb is None:
            raise RuntimeError(f"RayReplayBuffer: {what} on a closed buffer")
        bound = self.timeout_s if timeout_s is None else timeout_s
        deadline, deaths = time.monotonic() + bound, 0
        while True:
            try:
                ref = getattr(self._rb, method).remote(*args, **(kwargs or {}))
                incarnation, writes, result = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
                break
            except ray.exceptions.ActorUnavailableError:  # restarting: the call did not run
                deaths = 0
            except ray.exceptions.RayActorError:
                # the call died with the actor (its state with it: running it again writes nothing
                # twice); the actor is restarting unless its restarts are spent, which a few
                # calls in a row meeting a dead actor say
                deaths += 1
                if self._max_restarts == 0 or deaths > 3:
                    raise
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"RayReplayBuffer: {what} did not return within {bound:.0f} s") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"RayReplayBuffer: {what}: the buffer's actor did not come back within "
                                   f"{bound:.0f} s")  # fmt: skip
            time.sleep(0.5)
        if self._incarnation is not None and incarnation != self._incarnation:
            self.restarts += 1
            log.warning("RayReplayBuffer: the buffer's actor was restarted; it starts empty: what it held of the "
                        "%d items written before (as of this process's last call) is lost", self._writes_seen)  # fmt: skip
        self._incarnation, self._writes_seen = incarnation, writes
        return result

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # the method's own keywords (LocalBuffer.put's timeout_s among them) go to it, not to the bound
        return self._ask(method, "call", method, *args, kwargs=kwargs)

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """``buffer.method(*args, **kwargs)`` in the actor, bounded by ``timeout_s`` (default: the
        buffer's) instead of the buffer's own bound (rlpost's)."""
        return self._ask(method, "call", method, *args, timeout_s=timeout_s, kwargs=kwargs)

    def __getattr__(self, name: str) -> Any:
        """Any other public method of the buffer class, called in the actor (TorchRL's)."""
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self._call(name, *args, **kwargs)

    def _read(self, name: str) -> Any:
        return self._ask(name, "read", name)

    # ------------------------------------------------------------------ the buffer's API

    def add(self, data: Any) -> Any:
        return self._call("add", data)

    def extend(self, data: Any) -> Any:
        return self._call("extend", data)

    def sample(self, batch_size: int | None = None, **kwargs: Any) -> Any:
        """A batch sampled in the actor (``kwargs`` such as ``return_info`` go to the buffer's
        ``sample``)."""
        return self._call("sample", batch_size, **kwargs)

    def empty(self, empty_write_count: bool = True) -> None:
        self._call("empty", empty_write_count)

    def append_transform(self, transform: Any, *, invert: bool = False) -> RayReplayBuffer:
        self._call("append_transform", transform, invert=invert)
        return self

    def insert_transform(self, index: int, transform: Any, *, invert: bool = False) -> RayReplayBuffer:
        self._call("insert_transform", index, transform, invert=invert)
        return self

    def __len__(self) -> int:
        return self._call("__len__")

    def __getitem__(self, index: Any) -> Any:
        return self._call("__getitem__", index)

    def __iter__(self) -> Iterator[Any]:
        """Batches of ``batch_size`` sampled in the actor until its sampler ends a pass (never,
        for a RandomSampler), as a local ReplayBuffer iterates."""
        self._ask("iteration", "begin_pass")
        while True:
            batch, ended = self._ask("iteration", "next_in_pass")
            yield batch
            if ended:
                return

    @property
    def write_count(self) -> int:
        return self._read("write_count")

    @property
    def batch_size(self) -> int | None:
        return self._batch_size

    @property
    def storage(self) -> Any:
        """A copy of the actor's storage (its items as they are now)."""
        return self._read("storage")

    @property
    def sampler(self) -> Any:
        return self._read("sampler")

    @property
    def actor(self) -> Any:
        """The buffer's Ray actor handle (rlpost's: for a supervisor's health checks)."""
        return self._rb

    @property
    def is_alive(self) -> bool:
        """Whether this object still has its buffer actor (False after :meth:`close`)."""
        return self._rb is not None

    def close(self) -> None:
        """End the buffer's actor (the creator's object only; a copy just lets go of it)."""
        import ray

        if self._rb is not None and self._owner:
            ray.kill(self._rb, no_restart=True)
        self._rb = None

    shutdown = close

    def __repr__(self) -> str:
        return f"RayReplayBuffer(actor={self._rb}, batch_size={self._batch_size})"


def _client(handle: Any, timeout_s: float, batch_size: int | None, restarts: int) -> RayReplayBuffer:
    """A RayReplayBuffer on an existing actor that does not own it (a copy in another process)."""
    rb = RayReplayBuffer.__new__(RayReplayBuffer)
    rb._setup(handle, timeout_s, batch_size, owner=False, restarts=restarts)
    return rb
