"""The engine client of inference workers that run as Ray actors: load balancing, bounds, re-issue.

Used by a :class:`~rlpost.policies.vLLMWrapper` on workers in Ray actors (``make_vllm_worker``'s,
the run's ``inference-<i>``, an ``AsyncVLLM`` fleet's replicas). :func:`is_remote_worker` and
:func:`is_local_worker` recognise workers by what they do (take weight updates), so this
package never imports the actors that define them.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any


def is_remote_worker(obj: Any) -> bool:
    """A Ray actor handle of an inference worker (what make_vllm_worker returns)."""
    return type(obj).__name__ == "ActorHandle" and hasattr(obj, "update_weights")


def is_local_worker(obj: Any) -> bool:
    """An in-process inference worker (``make_vllm_worker(..., make_ray_worker=False)``): it takes
    weight updates and generates through its engine client."""
    return not is_remote_worker(obj) and callable(getattr(obj, "update_weights", None)) and hasattr(obj, "client")


class RemoteVLLMClient:
    """Load-balancing :class:`~rlpost.policies.VLLMEngineClient` over inference actor handles.

    ``request_timeout_s`` bounds every call. A dead worker (RayActorError) is skipped and the
    request re-issued on the next; when every worker has failed the request waits up to
    ``worker_wait_s`` for :meth:`set_handles` (or, ``restartable=True``: Ray's ``max_restarts``,
    for one of the same handles to answer again), then the error propagates.
    ``on_worker_lost(index, error)`` is told of each death at once (an env pool tells the controller).
    """

    def __init__(
        self, handles: list, *, request_timeout_s: float = 600.0, worker_wait_s: float = 600.0, tokenizer=None,
        restartable: bool = False,
    ):  # fmt: skip
        if not handles:
            raise ValueError("RemoteVLLMClient needs at least one inference worker handle")
        self.request_timeout_s, self.worker_wait_s = request_timeout_s, worker_wait_s
        self.restartable = restartable
        self.last_policy_version: int | None = None
        self.num_reissued = 0
        self._tokenizer = tokenizer
        self._cond = threading.Condition()
        self._order = itertools.count()
        self._generation = 0
        self.on_worker_lost: Callable[[int, BaseException], None] | None = None
        self._set(handles)

    def _set(self, handles: list) -> None:
        self.handles = list(handles)
        self._in_flight = [0] * len(self.handles)

    def set_handles(self, handles: list) -> None:
        """Use these workers from now on; requests waiting for a worker go to them."""
        if not handles:
            raise ValueError("set_handles needs at least one inference worker handle")
        with self._cond:
            self._set(handles)
            self._generation += 1
            self._cond.notify_all()

    def get_tokenizer(self):
        return self._tokenizer

    def __getstate__(self) -> dict:
        # travels to the env-pool actor: handles and settings, not the lock or the local counters
        return {
            "handles": self.handles,
            "request_timeout_s": self.request_timeout_s,
            "worker_wait_s": self.worker_wait_s,
            "tokenizer": self._tokenizer,
            "restartable": self.restartable,
        }

    def __setstate__(self, state: dict) -> None:
        self.__init__(
            state["handles"],
            request_timeout_s=state["request_timeout_s"],
            worker_wait_s=state["worker_wait_s"],
            tokenizer=state["tokenizer"],
            restartable=state.get("restartable", False),
        )

    def generate(self, prompt_token_ids: list[list[int]], sampling: dict[str, Any]):
        completions, version = self.call("generate", prompt_token_ids, sampling)
        self.last_policy_version = version
        return completions

    def score(self, token_ids: list[list[int]], *, temperature: float) -> list[list[float]]:
        return self.call("score", token_ids, temperature)

    def call(self, method: str, *args):
        """``method(*args)`` on the least-busy worker, bounded, re-issued when a worker died."""
        import ray

        tried: set[int] = set()
        generation = self._generation
        while True:
            picked = self._pick(tried, generation)
            if picked is None:  # every worker failed: wait for the controller's replacements
                generation = self._wait_for_new_handles(generation)
                tried = set()
                continue
            i, handle, generation = picked
            try:
                return ray.get(getattr(handle, method).remote(*args), timeout=self.request_timeout_s)
            except ray.exceptions.RayActorError as exc:
                tried.add(i)
                self.num_reissued += 1
                if self.on_worker_lost is not None:
                    self.on_worker_lost(i, exc)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(
                    f"inference worker {i} did not answer {method} within {self.request_timeout_s}s"
                ) from None
            finally:
                with self._cond:
                    if generation == self._generation:
                        self._in_flight[i] -= 1

    def _pick(self, tried: set[int], generation: int) -> tuple[int, Any, int] | None:
        """The least-busy worker not yet tried (ties broken round-robin), or None when all were.
        Handles replaced since ``generation`` start a fresh round."""
        with self._cond:
            if generation != self._generation:
                tried.clear()
            start = next(self._order)
            candidates = [
                (self._in_flight[i], (i - start) % len(self.handles), i)
                for i in range(len(self.handles))
                if i not in tried
            ]
            if not candidates:
                return None
            i = min(candidates)[2]
            self._in_flight[i] += 1
            return i, self.handles[i], self._generation

    def _wait_for_new_handles(self, generation: int) -> int:
        if self.restartable:
            return self._wait_for_a_restart(generation)
        with self._cond:
            if not self._cond.wait_for(lambda: self._generation != generation, timeout=self.worker_wait_s):
                raise RuntimeError(
                    f"every inference worker failed and none was replaced within {self.worker_wait_s:.0f}s"
                )
            return self._generation

    def _wait_for_a_restart(self, generation: int) -> int:
        """Every worker failed and Ray restarts them: wait until one of them answers again (a call
        to a restarting actor waits for it; one whose restarts are spent fails at once)."""
        import ray

        deadline = time.monotonic() + self.worker_wait_s
        while (left := deadline - time.monotonic()) > 0:
            pending = [handle.get_version.remote() for handle in self.handles]
            while pending and (left := deadline - time.monotonic()) > 0:
                ready, pending = ray.wait(pending, num_returns=1, timeout=left)
                for ref in ready:
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayActorError:
                        continue
                    return self._generation
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        raise RuntimeError(f"every inference worker failed and none came back within {self.worker_wait_s:.0f}s")
