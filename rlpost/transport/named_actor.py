"""Bounded calls of a run's named, stateless actor that the supervisor replaces when it dies.

An env pool calls the ``reward`` actor (a learned reward) and, with ``reference.kl_in: reward``,
the ``reference`` actor (the KL-shaped reward) by name: it holds no handle the supervisor would
have to replace. :class:`NamedActorClient` looks the name up, bounds each call, and when the
actor is dead or restarting (killed, its node lost) looks the name up again every
``RETRY_S`` until the replacement answers, for at most ``restart_wait_s``::

    call ──> ray.get_actor(name) ──> handle.method.remote(*args) ──> ray.get(timeout_s)
               │ not there yet                                       │ RayActorError: lost
               └──────── sleep RETRY_S, until restart_wait_s ────────┘
"""

from __future__ import annotations

import time
from typing import Any

RETRY_S = 1.0  # how often a call waits for a lost actor's replacement


class NamedActorClient:
    """The bounded client of the named actor ``actor_name``.

    Args:
        namespace: None: the caller's (an actor of the run looks up its run's).
        timeout_s: per call (past it: ``TimeoutError``); restart_wait_s: for a lost actor's
            replacement (past it: ``RuntimeError`` naming the actor).
        role: how errors name the actor (e.g. "reward actor"); settings: the config keys of
            ``timeout_s`` and ``restart_wait_s``, named in the errors.
    """

    def __init__(
        self,
        actor_name: str,
        *,
        namespace: str | None = None,
        timeout_s: float = 120.0,
        restart_wait_s: float = 180.0,
        role: str = "actor",
        settings: tuple[str, str] = ("timeout_s", "restart_wait_s"),
    ) -> None:
        self.actor_name, self.namespace = actor_name, namespace
        self.timeout_s, self.restart_wait_s = timeout_s, restart_wait_s
        self.role, self.settings = role, settings
        self._handle: Any = None

    def call(self, method: str, *args: Any, what: str) -> Any:
        """``actor.method(*args)``'s answer; ``what`` says what the call does in a timeout's
        message (e.g. "score 8 conversations")."""
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        deadline = time.monotonic() + self.restart_wait_s
        last_error: BaseException | None = None
        while True:
            handle = self._lookup()
            if handle is not None:
                try:
                    return ray.get(getattr(handle, method).remote(*args), timeout=self.timeout_s)
                except GetTimeoutError:
                    raise TimeoutError(
                        f"the {self.role} {self.actor_name!r} did not {what} within {self.timeout_s:.0f} s "
                        f"({self.settings[0]})"
                    ) from None
                except (RayActorError, ActorUnavailableError) as exc:  # lost: wait for its replacement
                    self._handle, last_error = None, exc
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the {self.role} {self.actor_name!r} is gone and no replacement answered within "
                    f"{self.restart_wait_s:.0f} s ({self.settings[1]}); last error: {last_error}"
                )
            time.sleep(RETRY_S)

    def _lookup(self) -> Any:
        if self._handle is None:
            import ray

            try:
                self._handle = ray.get_actor(self.actor_name, namespace=self.namespace)
            except ValueError:  # not started (yet, or again)
                return None
        return self._handle

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handle": None}  # a handle is looked up again where it is used

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.actor_name!r}, timeout_s={self.timeout_s})"
