"""Clients of the run's actors: the only place the driver waits on a Ray call.

The controller and the supervisor never call ``ray.get`` themselves; they hold one client per
actor (the buffer's is :class:`~rlpost.transport.buffer.RayBuffer`). A client call waits a
bounded time and turns Ray's ways of failing into the errors the supervisor recovers from:

    the called actor died or was killed                     -> ActorLost(name)
    the call failed because another actor it used died
    (an env pool whose inference worker or buffer died;
    an env pool's wait that reports a worker found dead)    -> ActorLost(None)
    a weight sync failed (a bus peer died or went silent)   -> BusFailure
    no answer within the call's timeout                     -> CallTimeout(name)

Any other error (a bug, a bad input, a checkpoint that cannot be written) propagates as the
actor raised it, the remote traceback chained: retrying would only fail again. The bounded call
and the errors are :mod:`rlpost.actors.calls`; the clients add each role's methods. ``alive()``
asks Ray's control store (:func:`actor_state`), never the actor, whose queue may be busy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlpost.actors.calls import GroupPending, Pending
from rlpost.runtime.actors import alive, kill

STARTED_POLL_S = 0.5  # wait_started looks at the new actor's bundle this often


class ActorClient:
    """A named actor behind bounded calls; subclasses give each role its methods."""

    def __init__(self, name: str, handle: Any):
        self.name, self.handle = name, handle

    def submit(self, method: str, *args: Any) -> Pending:
        return Pending(self.name, method, getattr(self.handle, method).remote(*args))

    def call(self, method: str, *args: Any, timeout_s: float) -> Any:
        return self.submit(method, *args).result(timeout_s)

    def submit_ready(self) -> Pending:
        """A call that answers once the actor's constructor ran (a start watched in the background)."""
        return Pending(self.name, "__ray_ready__", self.handle.__ray_ready__.remote())

    @property
    def names(self) -> list[str]:
        """The actors this client stands for (one, except for a learner group)."""
        return [self.name]

    def alive(self) -> bool:
        return alive(self.name, self.handle)

    def unreachable(self, timeout_s: float) -> bool:
        """Whether the actor is dead or its node stopped answering, although Ray's record may still
        say ALIVE (a lost node is declared dead after ~15 s of health checks). Only a refused
        connection or a death counts: a busy actor silent for ``timeout_s`` is not unreachable."""
        import ray

        try:
            ray.get(self.handle.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            return False
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
            return True
        return False

    def wait_started(self, timeout_s: float, placed: Callable[[], bool]) -> bool:
        """Wait until a just-started actor is up (its constructor ran); False as soon as
        ``placed()`` says its bundle has no node any more. A node's loss is declared seconds
        after its actors are found dead, so a replacement may be sent to the bundle's old node
        and then wait for a node that is gone; this lets the caller leave the slot vacant
        instead. Raises CallTimeout after ``timeout_s``, or the actor's (mapped) failure."""
        import ray

        ready = Pending(self.name, "__ray_ready__", self.handle.__ray_ready__.remote())
        deadline = time.monotonic() + timeout_s
        while not ray.wait([ready.ref], timeout=min(STARTED_POLL_S, max(0.0, deadline - time.monotonic())))[0]:
            if not placed():
                return False
            if time.monotonic() >= deadline:
                break
        ready.result(0.0)  # raises the actor's failure, or CallTimeout if it is still not up
        return True

    def kill(self) -> None:
        kill(self.handle)


class InferenceClient(ActorClient):
    """``inference-<i>``: a vLLM engine; the learner's vLLMUpdater drives its weight updates."""

    def wait_ready(self, timeout_s: float) -> int:
        return self.call("get_version", timeout_s=timeout_s)

    def submit_ready(self) -> Pending:
        """A call that answers once the worker's engine is up (a start watched in the background)."""
        return self.submit("get_version")

    def score(self, token_ids: list[list[int]], temperature: float, timeout_s: float) -> list[list[float]]:
        return self.call("score", token_ids, temperature, timeout_s=timeout_s)

    def ask_busy_s(self) -> Pending:
        """Seconds its engine has spent generating and scoring since it started, answered later
        (the supervisor asks every worker at once)."""
        return self.submit("busy_s")

    def drain(self, timeout_s: float) -> bool:
        """Whether the worker finished every generate and score call it had, within ``timeout_s``."""
        return self.call("drain", timeout_s, timeout_s=timeout_s + 30.0)

    def shutdown(self, timeout_s: float) -> None:
        self.call("shutdown", timeout_s=timeout_s)


class EnvPoolClient(ActorClient):
    """``env-pool-<i>``: collects groups in a background thread and puts them in the buffer."""

    def start(self, num_groups_total: int | None, timeout_s: float = 60.0) -> None:
        self.call("start", num_groups_total, timeout_s=timeout_s)

    def wait(self, wait_s: float) -> bool:
        """True once the background run ended; raises (mapped) its error."""
        return self.call("wait", wait_s, timeout_s=wait_s + 60.0)

    def stop(self, timeout_s: float) -> None:
        self.call("stop", timeout_s, timeout_s=timeout_s + 30.0)

    def set_inference(self, handles: list, timeout_s: float = 60.0) -> None:
        self.call("set_inference", handles, timeout_s=timeout_s)

    def set_buffer(self, buffer: Any, timeout_s: float) -> int:
        """Point the pool at a new buffer (sent as a copy that does not own the actor); returns the
        groups it put again."""
        return self.call("set_buffer", buffer, timeout_s=timeout_s)

    def load_state_dict(self, state: dict, timeout_s: float = 60.0) -> None:
        self.call("load_state_dict", state, timeout_s=timeout_s)


class ControlClient(ActorClient):
    """``control``: the run's mailbox for operators' requests (:mod:`rlpost.service.mailbox`)."""

    def exchange(self, sizes: dict[str, int], timeout_s: float) -> dict[str, int]:
        """Report the fleet's sizes; returns what an operator asked for (empty: nothing)."""
        return self.call("exchange", sizes, timeout_s=timeout_s)


class ReferenceClient(ActorClient):
    """``reference``: the frozen initial model; stateless."""

    def annotate(self, groups: list, timeout_s: float) -> list:
        return self.call("annotate", groups, timeout_s=timeout_s)


class LearnerClient(ActorClient):
    """``learner``: trains, publishes on the bus, scores the probe, writes checkpoints.

    With ``resources.learner.num_workers`` > 1 it stands for the group: rank 0 (``name``,
    ``handle``) and the ``others`` (``learner-<r>``). Training, publishing, scoring and
    checkpoints are collectives: they go to every rank and return rank 0's answer
    (:class:`GroupPending`); the weight bus is rank 0's alone. Alive while every rank is.
    """

    def __init__(self, name: str, handle: Any, others: list[tuple[str, Any]] | None = None):
        super().__init__(name, handle)
        self.members = [(name, handle), *(others or [])]

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.members]

    def alive(self) -> bool:
        return all(alive(name, handle) for name, handle in self.members)

    def kill(self) -> None:
        for _, handle in self.members:
            kill(handle)

    def _on_every_rank(self, method: str, *args: Any) -> GroupPending | Pending:
        if len(self.members) == 1:
            return self.submit(method, *args)
        import ray

        refs = [ray.put(arg) for arg in args]  # one copy in the object store, not one per rank
        return GroupPending([Pending(name, method, getattr(h, method).remote(*refs)) for name, h in self.members])

    def train_step(self, groups: list, timeout_s: float) -> dict:
        return self._on_every_rank("train_step", groups).result(timeout_s)

    def publish(self, wait: bool = True) -> GroupPending | Pending:
        """Every rank publishes (a collective); ``wait=False`` returns once the weights are
        sent, before the workers confirmed them (the next publish waits for that first)."""
        return self._on_every_rank("publish", wait)

    def score(self, token_ids: list[list[int]], timeout_s: float) -> list[list[float]]:
        return self._on_every_rank("score", token_ids).result(timeout_s)

    def version(self, timeout_s: float) -> int:
        """The learner's weights version (after any call it is still running)."""
        return self.call("policy_version", timeout_s=timeout_s)

    def connect_workers(self, workers: list, host: str, backend: str, bucket_mb: float, bus_timeout_s: float,
                        timeout_s: float, shared_memory: bool = True) -> int:  # fmt: skip
        """Form the weight bus between the learner and ``workers``; the learner drives the workers'
        side of every later sync. A stop signal ends the wait (it may still load its model)."""
        pending = self.submit("connect_workers", workers, host, backend, bucket_mb, bus_timeout_s, shared_memory)
        return pending.result(timeout_s, stoppable=True)

    def set_workers(self, workers: list, timeout_s: float) -> int:
        """The bus's next generation with ``workers`` (after a restart); returns the generation."""
        return self.call("set_workers", workers, timeout_s=timeout_s)

    def save_checkpoint(self, run_dir: str, step: int, rollout_state: dict, timeout_s: float) -> Path:
        """Every rank writes its part; returns the checkpoint's folder."""
        return self._on_every_rank("save_checkpoint", run_dir, step, rollout_state).result(timeout_s)

    def load_checkpoint(self, path: str, timeout_s: float) -> dict:
        return self._on_every_rank("load_checkpoint", path).result(timeout_s)
