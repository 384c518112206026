"""Calls into the service's actors that outlive the actors (:class:`ActorCalls`).

Every call is bounded (``call_timeout_s``). A call whose actor is lost (dead, killed by a signal,
on a lost node) or that runs past its bound (a hung actor is as lost as a dead one) does not fail
the client's request: the actor is killed and started again in its place, and the call runs
again on the new one. At most :data:`MAX_REPLACEMENTS` replacements a call, then it fails as a
server error.

A new trainer holds no adapter; ``on_new_trainer`` (the service's) puts every model back from its
last snapshot and replays the gradients added since, before any call reaches it: calls wait while
a replacement is under way. So a step is applied exactly once: the snapshot is taken after each
``optim_step``, the ``forward_backward`` calls since are replayed, and the call that was in flight
runs again. A new inference worker holds no adapter either: the samplers' adapters are sent to it
again on their first use.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from rlpost.serve.futures import SERVER, RequestError

log = logging.getLogger("rlpost")

MAX_REPLACEMENTS = 3  # per call


class ActorLost(Exception):
    """The actor of a call is gone, or hung past the call's bound."""


class ActorCalls:
    """The trainer's and the inference workers' calls for the service; see the module docstring."""

    def __init__(self, fleet: Any, call_timeout_s: float, on_new_trainer: Callable[[], Awaitable[None]] | None = None):
        self.fleet, self.call_timeout_s, self.on_new_trainer = fleet, call_timeout_s, on_new_trainer
        self.trainer_generation = 0
        self.worker_generations: dict[int, int] = {}
        self._trainer_ready = asyncio.Event()
        self._trainer_ready.set()
        self._locks: dict[object, asyncio.Lock] = {}

    async def trainer(self, method: str, *args: Any, what: str, **kwargs: Any) -> Any:
        """``fleet.trainer.<method>(*args, **kwargs)``, its trainer replaced when lost."""
        for attempt in range(MAX_REPLACEMENTS + 1):
            await self._trainer_ready.wait()
            generation = self.trainer_generation
            try:
                return await self.wait(getattr(self.fleet.trainer, method).remote(*args, **kwargs), what)
            except ActorLost as lost:
                if attempt == MAX_REPLACEMENTS:
                    raise RequestError(f"{what}: the trainer was lost {attempt + 1} times ({lost})", SERVER) from None
                log.warning("serve: %s: %s; replacing the trainer", what, lost)
                try:
                    await self._replace_trainer(generation)
                except ActorLost as again:  # the new one was lost too: the next attempt replaces it
                    log.warning("serve: the new trainer was lost while models were put back: %s", again)
        raise AssertionError("unreachable")

    async def worker(self, index: int, method: str, *args: Any, what: str) -> Any:
        """``fleet.inference[index].<method>(*args)``, the worker replaced when lost."""
        for attempt in range(MAX_REPLACEMENTS + 1):
            generation = self.worker_generations.get(index, 0)
            try:
                return await self.wait(getattr(self.fleet.inference[index], method).remote(*args), what)
            except ActorLost as lost:
                if attempt == MAX_REPLACEMENTS:
                    raise RequestError(
                        f"{what}: inference-{index} was lost {attempt + 1} times ({lost})", SERVER
                    ) from None
                log.warning("serve: %s: %s; replacing inference-%d", what, lost, index)
                await self._replace_worker(index, generation)
        raise AssertionError("unreachable")

    async def wait(self, ref: Any, what: str) -> Any:
        """Await one actor call: its result, the client's error as raised, or :class:`ActorLost`."""
        import ray

        try:
            return await asyncio.wait_for(ref, self.call_timeout_s)
        except asyncio.TimeoutError:
            raise ActorLost(f"no answer in {self.call_timeout_s:.0f} s") from None
        except ray.exceptions.RayActorError as exc:
            raise ActorLost(str(exc).splitlines()[0]) from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, Exception) else exc
            if isinstance(cause, (ValueError, KeyError, RequestError)):
                raise cause from None
            raise RequestError(f"{what} failed: {type(cause).__name__}: {str(cause).splitlines()[0]}", SERVER) from None

    def _lock(self, key: object) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    async def _replace_trainer(self, generation: int) -> None:
        async with self._lock("trainer"):
            if self.trainer_generation != generation:  # another call replaced it meanwhile
                return
            self._trainer_ready.clear()
            try:
                await asyncio.to_thread(self.fleet.restart_trainer)
                self.trainer_generation += 1
                if self.on_new_trainer is not None:
                    await self.on_new_trainer()
            finally:
                self._trainer_ready.set()

    async def _replace_worker(self, index: int, generation: int) -> None:
        async with self._lock(("worker", index)):
            if self.worker_generations.get(index, 0) != generation:
                return
            await asyncio.to_thread(self.fleet.restart_inference, index)
            self.worker_generations[index] = generation + 1
