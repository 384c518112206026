"""BufferHost: the Ray actor that holds a :class:`~rlpost.data.RayReplayBuffer`'s buffer.

It lives in a module of its own that imports nothing heavy, so that a buffer's actor process
loads only the buffer class it is given (torch and tensordict only when that class needs them).
"""

from __future__ import annotations

import uuid
from typing import Any


class BufferHost:
    """The Ray actor holding the buffer: each method is one call of the buffer's API."""

    def __init__(self, replay_buffer_cls: type, kwargs: dict[str, Any]) -> None:
        self.rb = replay_buffer_cls(**kwargs)
        self.incarnation = uuid.uuid4().hex  # a new one after each restart

    # every answer is (incarnation, write count, result): the client sees a restart, and what was lost
    def call(self, method: str, *args: Any, **kwargs: Any) -> tuple[str, int, Any]:
        result = getattr(self.rb, method)(*args, **kwargs)
        return self.incarnation, self.rb.write_count, result

    def read(self, name: str) -> tuple[str, int, Any]:
        return self.incarnation, self.rb.write_count, getattr(self.rb, name)

    def begin_pass(self) -> tuple[str, int, None]:
        """Start iterating (``for batch in rb``): a new pass of the sampler."""
        if self.rb.batch_size is None:
            raise RuntimeError("cannot iterate over a ReplayBuffer without batch_size (pass batch_size= to it)")
        self.rb.sampler.ran_out = False
        return self.incarnation, self.rb.write_count, None

    def next_in_pass(self) -> tuple[str, int, tuple[Any, bool]]:
        """The pass's next batch, and whether the sampler ended the pass with it."""
        batch = self.rb.sample()
        return self.incarnation, self.rb.write_count, (batch, self.rb.sampler.ran_out)
