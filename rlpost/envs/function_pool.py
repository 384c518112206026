"""Worker processes that run the user's own Python functions with a wall-clock limit.

Reward functions (``data.reward_fn``) and tool functions (``tools.functions``) are trusted but
fallible: one that hangs would stall an env pool forever, one that crashes the interpreter would
take the env pool's actor with it. :class:`FunctionPool` runs them in worker processes::

    result = pool.call("my_pkg.rewards:score", (completion, row), timeout_s=30)
    result.ok, result.value, result.error, result.traceback

A call past ``timeout_s`` is abandoned: its worker is killed (with everything it started) and
replaced on the next call; the result says ``"timeout after 30.0s"``. An exception comes back as
its type name and traceback. Only the caller's own mistakes raise (a function that cannot be sent
to a worker, e.g. a lambda: use a module-level function or a ``"package.module:function"`` path).

Trap: workers are plain ``python -c`` processes, as ``multiprocessing``'s spawn re-runs the
parent's ``__main__`` (inside a Ray actor, Ray's worker script). They get the parent's
``sys.path``, die with the parent, and write the user's prints to stderr so the protocol on
stdout stays clean. Model-written code never runs here: that goes to :mod:`rlpost.envs.sandbox`.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_HEADER = struct.Struct("!Q")
_START_TIMEOUT_S = 120.0  # a worker's first import of the user's module may be slow


@dataclass(frozen=True)
class CallResult:
    """One call's outcome: ``value`` when ``ok``; else ``error`` (the exception's type name, or
    ``"Timeout"`` / ``"WorkerDied"``), ``message`` (one line) and the remote ``traceback``."""

    ok: bool
    value: Any = None
    error: str | None = None
    message: str = ""
    traceback: str = ""
    duration_s: float = 0.0


class FunctionPool:
    """``num_workers`` worker processes, each running one call at a time (thread-safe: callers
    wait for an idle worker). Workers start on first use."""

    def __init__(self, num_workers: int = 1) -> None:
        if num_workers < 1:
            raise ValueError(f"FunctionPool needs num_workers >= 1, got {num_workers}")
        self._idle: queue.Queue[_Worker] = queue.Queue()
        for _ in range(num_workers):
            self._idle.put(_Worker())
        self.num_workers = num_workers
        self.num_timeouts = 0

    def call(self, fn: str | Callable, args: tuple = (), kwargs: dict | None = None, *, timeout_s: float) -> CallResult:
        """``fn(*args, **kwargs)`` in a worker (``fn``: a path or a module-level callable);
        ``ValueError`` when ``fn`` or the arguments cannot be sent to a worker."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        try:
            request = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
        except Exception as exc:
            raise ValueError(
                f"cannot send {getattr(fn, '__qualname__', fn)!r} to a worker process ({exc}); use a "
                "module-level function or a 'package.module:function' path"
            ) from exc
        worker = self._idle.get()
        try:
            result = worker.call(request, timeout_s)
        finally:
            self._idle.put(worker)
        if result.error == "Timeout":
            self.num_timeouts += 1
        return result

    def close(self) -> None:
        """Kill every worker (idle ones; a pool is closed when nothing calls it)."""
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules already torn down; workers die with us
            pass


class _Worker:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def call(self, request: bytes, timeout_s: float) -> CallResult:
        start = time.monotonic()
        if self.proc is None or self.proc.poll() is not None:
            self.kill()
            self._start()
        try:
            self.proc.stdin.write(_HEADER.pack(len(request)) + request)
            self.proc.stdin.flush()
            # first frame: the function was imported (not the call's time: a module may be slow to
            # import the first time); second frame: the call's result
            started = self._read_reply(time.monotonic() + _START_TIMEOUT_S)
            call_start = time.monotonic()
            reply = self._read_reply(call_start + timeout_s) if started is not None else None
        except (BrokenPipeError, EOFError, OSError) as exc:
            self.kill()
            return CallResult(
                False,
                error="WorkerDied",
                message=f"the worker process died ({exc})",
                duration_s=time.monotonic() - start,
            )
        if reply is None:
            self.kill()
            limit = timeout_s if started is not None else _START_TIMEOUT_S
            return CallResult(
                False, error="Timeout", message=f"timeout after {float(limit)}s", duration_s=time.monotonic() - start
            )
        kind, *rest = pickle.loads(reply)
        duration = time.monotonic() - call_start
        if kind == "ok":
            return CallResult(True, value=rest[0], duration_s=duration)
        error, message, trace = rest
        return CallResult(False, error=error, message=message, traceback=trace, duration_s=duration)

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-c", _WORKER_SCRIPT, json.dumps(sys.path), str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip

    def _read_reply(self, deadline: float) -> bytes | None:
        """The next framed reply, or None at the deadline; EOFError when the worker died."""
        header = self._read_exactly(_HEADER.size, deadline)
        return None if header is None else self._read_exactly(_HEADER.unpack(header)[0], deadline)

    def _read_exactly(self, n: int, deadline: float) -> bytes | None:
        fd = self.proc.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        data = bytearray()
        while len(data) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                return None
            chunk = os.read(fd, n - len(data))
            if not chunk:
                raise EOFError("worker closed its output")
            data.extend(chunk)
        return bytes(data)

    def kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        self.proc = None


# The worker: reads framed pickled (fn, args, kwargs) from stdin, writes framed pickled replies to
# a private copy of stdout (fd 1 is pointed at stderr, so the user's prints cannot break framing).
_WORKER_SCRIPT = r"""
import importlib, json, os, pickle, struct, sys, threading, time, traceback

sys.path[:] = json.loads(sys.argv[1])
PARENT = int(sys.argv[2])


def exit_with_parent():
    # Not PR_SET_PDEATHSIG: it fires when the parent *thread* that started us exits, and callers
    # start workers from short-lived threads. Reparenting (getppid changes) means the parent died.
    while os.getppid() == PARENT:
        time.sleep(0.5)
    os._exit(1)


threading.Thread(target=exit_with_parent, daemon=True).start()
HEADER = struct.Struct("!Q")
reply_fd = os.dup(1)
os.dup2(2, 1)
cache = {}


def resolve(fn):
    if not isinstance(fn, str):
        return fn
    if fn not in cache:
        module, _, attr = fn.partition(":") if ":" in fn else fn.rpartition(".")
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        cache[fn] = obj
    return cache[fn]


def read_exactly(n):
    data = bytearray()
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            sys.exit(0)
        data.extend(chunk)
    return bytes(data)


def write(reply):
    try:
        body = pickle.dumps(reply)
    except Exception as exc:
        body = pickle.dumps(("error", "UnpicklableResult", f"the function returned {exc}", ""))
    os.write(reply_fd, HEADER.pack(len(body)) + body)


while True:
    fn, args, kwargs = pickle.loads(read_exactly(HEADER.unpack(read_exactly(HEADER.size))[0]))
    try:
        fn = resolve(fn)
    except (Exception, SystemExit) as exc:
        fn = exc
    write(("started",))
    try:
        if isinstance(fn, BaseException):
            raise fn
        reply = ("ok", fn(*args, **kwargs))
    except (Exception, SystemExit) as exc:
        line = traceback.format_exception_only(type(exc), exc)[-1].strip()
        reply = ("error", type(exc).__name__, line, traceback.format_exc())
    write(reply)
"""
