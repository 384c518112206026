"""RayReplayBuffer: a :class:`~rlpost.data.ReplayBuffer` in a Ray actor (TorchRL's).

The buffer lives in one actor; this object, in the caller's process, forwards each call to it,
and so does every copy of it sent to another actor (a :class:`~rlpost.collect.RayLLMCollector`
writing batches, a trainer sampling them). Storage, sampler and transforms are given as
constructors, built in the actor::

    rb = RayReplayBuffer(
        storage=partial(LazyStackStorage, 64),
        sampler=SamplerWithoutReplacement,
        transform_factory=partial(MCAdvantage, grpo_size=4),
        batch_size=8,
    )
    rb.extend(batch)          # runs the write hooks (MCAdvantage) in the actor
    rb.sample()               # a batch, read hooks applied
    rb.write_count            # items written so far, by every writer

A transform appended afterwards (``append_transform``) is pickled to the actor.

Every call is bounded (rlpost's addition): past ``timeout_s`` it raises TimeoutError naming the
call; a buffer actor that died raises Ray's ``RayActorError``. Copies sent to other processes
forward calls but do not own the actor: only the creator's :meth:`close` ends it.

Deviations from TorchRL: no ``transport="distributed"``, delayed initialisation or runtime lease
(the buffer's actor starts with the object and lives until :meth:`close` or Ray's shutdown);
``timeout_s``; the actor reserves no CPU unless ``remote_config`` says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rlpost.data.replay_buffers import ReplayBuffer

DEFAULT_REMOTE_CONFIG: dict[str, Any] = {"num_cpus": 0, "num_gpus": 0}


class _BufferActor:
    """The Ray actor holding the buffer: each method is one call of the buffer's API."""

    def __init__(self, replay_buffer_cls: type, kwargs: dict[str, Any]) -> None:
        self.rb = replay_buffer_cls(**kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.rb, method)(*args, **kwargs)

    def read(self, name: str) -> Any:
        return getattr(self.rb, name)

    def begin_pass(self) -> None:
        """Start iterating (``for batch in rb``): a new pass of the sampler."""
        if self.rb.batch_size is None:
            raise RuntimeError("cannot iterate over a ReplayBuffer without batch_size (pass batch_size= to it)")
        self.rb.sampler.ran_out = False

    def next_in_pass(self) -> tuple[Any, bool]:
        """The pass's next batch, and whether the sampler ended the pass with it."""
        batch = self.rb.sample()
        return batch, self.rb.sampler.ran_out


class RayReplayBuffer(ReplayBuffer):
    """A ReplayBuffer in a Ray actor; see the module docstring.

    Keyword Args:
        replay_buffer_cls: the buffer class built in the actor (default :class:`ReplayBuffer`).
        ray_init_config: ``ray.init`` arguments when Ray is not initialized yet.
        remote_config: Ray actor options (default: no CPU, no GPU).
        timeout_s: bound of each call into the actor (rlpost's).
        **kwargs: the buffer's arguments (``storage``, ``sampler`` and ``transform_factory`` as
            constructors; ``batch_size``, ``collate_fn``).
    """

    def __init__(
        self,
        *,
        replay_buffer_cls: type = ReplayBuffer,
        ray_init_config: dict[str, Any] | None = None,
        remote_config: dict[str, Any] | None = None,
        timeout_s: float = 600.0,
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
        self._rb = ray.remote(**options)(_BufferActor).remote(replay_buffer_cls, kwargs)
        self.timeout_s = timeout_s
        self._owner = True
        self._batch_size = kwargs.get("batch_size")

    # a copy in another process forwards calls to the same actor without owning it
    def __reduce__(self):
        return (_client, (self._rb, self.timeout_s, self._batch_size))

    def _get(self, what: str, ref: Any) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"RayReplayBuffer: {what} did not return within {self.timeout_s:.0f} s") from None

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._get(method, self._rb.call.remote(method, *args, **kwargs))

    # ------------------------------------------------------------------ the buffer's API

    def add(self, data: Any) -> Any:
        return self._call("add", data)

    def extend(self, data: Any) -> Any:
        return self._call("extend", data)

    def sample(self, batch_size: int | None = None, return_info: bool = False) -> Any:
        return self._call("sample", batch_size, return_info=return_info)

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
        self._get("iteration", self._rb.begin_pass.remote())
        while True:
            batch, ended = self._get("iteration", self._rb.next_in_pass.remote())
            yield batch
            if ended:
                return

    @property
    def write_count(self) -> int:
        return self._get("write_count", self._rb.read.remote("write_count"))

    @property
    def batch_size(self) -> int | None:
        return self._batch_size

    @property
    def storage(self) -> Any:
        """A copy of the actor's storage (its items as they are now)."""
        return self._get("storage", self._rb.read.remote("storage"))

    @property
    def sampler(self) -> Any:
        return self._get("sampler", self._rb.read.remote("sampler"))

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


def _client(handle: Any, timeout_s: float, batch_size: int | None) -> RayReplayBuffer:
    """A RayReplayBuffer on an existing actor that does not own it (a copy in another process)."""
    rb = RayReplayBuffer.__new__(RayReplayBuffer)
    rb._rb, rb.timeout_s, rb._owner, rb._batch_size = handle, timeout_s, False, batch_size
    return rb
