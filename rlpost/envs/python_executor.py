"""A shared Python executor: many envs' code blocks run on one bounded set of sandboxes.

:class:`PythonExecutorService` is TorchRL's service of that name: ``execute(code)`` runs one block
and returns TorchRL's result dict (``success``, ``stdout``, ``stderr``, ``returncode``). Pass it
to ``PythonInterpreter(services=executor)``, or run it as a named Ray actor that
``PythonInterpreter(services="ray", service_name=..., namespace=...)`` finds::

    executor = ray.remote(PythonExecutorService).options(
        name="python_executor", max_concurrency=32).remote(pool_size=32, timeout=10.0)

The result dict is the one type that crosses the process boundary (:func:`execution_dict` makes
it, :func:`result_from_execution` reads it back), so a block renders the same locally or remotely.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Protocol

from rlpost.envs.sandbox import check_sandbox
from rlpost.envs.tools import PythonResult, run_python


def check_run_options(owner: str, run_kwargs: dict[str, Any]) -> None:
    """Fail now, not at the first block: ``ValueError`` for options ``run_python`` does not take
    or bad values, :class:`~rlpost.envs.sandbox.SandboxUnavailable` for a bwrap sandbox that
    cannot run here."""
    try:
        inspect.signature(run_python).bind("", **run_kwargs)
    except TypeError as exc:
        raise ValueError(f"{owner}: bad run_python options {sorted(run_kwargs)}: {exc}") from exc
    check_sandbox(run_kwargs.get("sandbox", "bwrap"))


class PythonExecutor(Protocol):
    """What ``PythonInterpreter(services=...)`` calls: one block in, TorchRL's result dict out."""

    def execute(self, code: str) -> dict[str, Any]: ...


def execution_dict(result: PythonResult) -> dict[str, Any]:
    """TorchRL's result dict for ``result``: ``stdout`` is the block's output (stdout and stderr
    interleaved, as the sandbox captures them), ``stderr`` the one-line failure reason ("" when
    it succeeded); ``duration_s`` is added."""
    return {
        "success": result.ok,
        "stdout": result.output,
        "stderr": result.error or "",
        "returncode": result.returncode,
        "duration_s": result.duration_s,
    }


def result_from_execution(execution: dict[str, Any]) -> PythonResult:
    """The :class:`PythonResult` back from :func:`execution_dict` (or from any TorchRL-style dict:
    ``duration_s`` defaults to 0 and an empty ``stderr`` of a failure becomes "failed")."""
    ok = bool(execution["success"])
    error = None if ok else (execution.get("stderr") or "failed")
    return PythonResult(ok, execution.get("stdout", ""), error, execution.get("returncode"),
                        float(execution.get("duration_s", 0.0)))  # fmt: skip


class PythonExecutorService:
    """Run code blocks from many envs in the sandbox, at most ``pool_size`` at a time.

    ``execute(code)`` is thread-safe: a Ray actor with ``max_concurrency`` up to ``pool_size``
    runs that many blocks at once (``timeout`` seconds of wall clock each), further calls wait.

    Deliberate deviations from TorchRL, whose service keeps ``pool_size`` persistent host
    interpreters and hands blocks to them round-robin: (1) every block runs in a fresh
    sandboxed interpreter, because a shared persistent one lets one episode read (or poison)
    the names another episode defined, and which interpreter a block lands on depends on
    scheduling, so a block's result would not be a function of its episode; ``pool_size``
    bounds how many run at once instead. (2) Code runs in rlpost's sandbox, not as a plain
    host process. (3) ``run_kwargs`` (``memory_mb``, ``max_output_bytes``, ``sandbox``, ... as
    ``run_python`` takes them) set the sandbox's other limits; ``sandbox="bwrap"`` raises
    :class:`~rlpost.envs.sandbox.SandboxUnavailable` here when namespaces do not work.
    """

    def __init__(self, pool_size: int = 32, timeout: float = 10.0, **run_kwargs: Any) -> None:
        if pool_size < 1:
            raise ValueError(f"PythonExecutorService pool_size must be >= 1, got {pool_size}")
        if "timeout_s" in run_kwargs:
            raise ValueError("PythonExecutorService takes the time limit as timeout=, not timeout_s=")
        self.pool_size, self.timeout = pool_size, timeout
        self.run_kwargs = {**run_kwargs, "timeout_s": timeout}
        check_run_options(type(self).__name__, self.run_kwargs)
        self._slots = threading.BoundedSemaphore(pool_size)
        self.num_executed = 0
        self._count_lock = threading.Lock()

    def execute(self, code: str) -> dict[str, Any]:
        """Run one block (waiting for a free slot) and return :func:`execution_dict`."""
        with self._slots:
            result = run_python(code, **self.run_kwargs)
        with self._count_lock:
            self.num_executed += 1
        return execution_dict(result)

    def cleanup(self) -> None:
        """TorchRL's teardown; nothing to do: no interpreter outlives its block."""

    def __repr__(self) -> str:
        return f"PythonExecutorService(pool_size={self.pool_size}, timeout={self.timeout})"


class RayExecutorHandle:
    """The :class:`PythonExecutorService` Ray actor ``name``, called like a local one; a call
    waits at most ``timeout_s`` (the block's own limit plus its wait for a free slot)."""

    def __init__(self, name: str, namespace: str | None = None, timeout_s: float = 120.0) -> None:
        import ray

        try:
            self.actor = ray.get_actor(name, namespace=namespace)
        except ValueError as exc:
            raise RuntimeError(
                f"PythonInterpreter(services='ray'): no Ray actor named {name!r} in namespace {namespace!r}; "
                f"start one first, e.g. ray.remote(PythonExecutorService).options(name={name!r}, "
                f"namespace={namespace!r}, max_concurrency=32).remote(pool_size=32)"
            ) from exc
        self.name, self.namespace, self.timeout_s = name, namespace, timeout_s

    def execute(self, code: str) -> dict[str, Any]:
        import ray

        ref = self.actor.execute.remote(code)
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except TimeoutError:  # Ray's GetTimeoutError is one
            ray.cancel(ref)
            raise TimeoutError(
                f"the Python executor actor {self.name!r} did not answer execute() within {self.timeout_s} s"
            ) from None

    def __repr__(self) -> str:
        return f"RayExecutorHandle(name={self.name!r}, namespace={self.namespace!r})"
