"""Graceful stop of ``rlpost train`` on SIGTERM and SIGINT, from a terminal or a scheduler.

Schedulers, ``ray job stop``, ``kill``, ``timeout`` and Ctrl-C all stop a run with a signal; by
Python's defaults SIGTERM kills the driver where it stands (no final checkpoint, actors left
running). Two things stand in the way of a clean stop:

**The signal lands at a safe point.** Inside ``with stop_on_signals():`` (main thread only; a
no-op elsewhere) the first SIGINT or SIGTERM prints one line and records the stop; the training
loop's safe points (before each part of a step, each poll while it waits, between steps) call
:func:`raise_if_stopping`, which raises :class:`StopRequested` (a BaseException: ``except
Exception`` lets it through) once; the cleanup stops every actor and, with the learner alive,
writes a final checkpoint. Trap: a handler raising at any line would land inside C calls (a
``ray.get``, a constructor), which then fail with ``SystemError: ... returned a result with an
exception set``. A call in flight is let finish (every one is bounded); the start's waits
(``stoppable``, :mod:`rlpost.actors.calls`) ask every half second, so a start ends at once,
killing what it started. A later signal exits at once with ``os._exit(130)`` (the way out of a
hung cleanup), skipping cleanup, ``finally`` blocks, atexit and buffered output.

**The local Ray cluster does not get the signal.** Trap: Ctrl-C, ``timeout``, systemd and
container runtimes signal a whole process group, and the Ray processes ``ray.init`` starts would
stop under the driver before it could checkpoint. So :func:`run_in_own_session` runs the driver
as a child in a session of its own; the parent passes SIGINT / SIGTERM (SIGHUP as SIGTERM) on,
ends whatever the driver left in its group (Ray's agents outlive an immediate exit by up to
minutes) and exits with its status. Should the parent die, the driver gets SIGTERM (Linux).
:func:`exit_code` gives 128 + the signal number, so a supervisor sees a stop, not a failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
FORCED_EXIT_CODE = 130  # the second signal: exit at once, as an interrupted process
# set in the driver's environment by run_in_own_session: it runs in its own session already
DRIVER_SESSION_ENV = "RLPOST_DRIVER_SESSION"


class StopRequested(BaseException):
    """Raised by :func:`raise_if_stopping` after the first SIGINT or SIGTERM inside
    :func:`stop_on_signals` (a BaseException); ``signal_name`` is ``"SIGINT"`` or ``"SIGTERM"``."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


def exit_code(stop: StopRequested) -> int:
    """The exit status for a run ended by ``stop``: 128 + the signal number (SIGINT 130, SIGTERM 143)."""
    return 128 + int(signal.Signals[stop.signal_name])


class _StopHandler:
    """The signal handler: records the first signal, exits at once on the next one."""

    def __init__(self) -> None:
        self.signal_name: str | None = None  # the first signal's name, once one came
        self.raised = False  # StopRequested was raised for it

    def __call__(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            _say(f"rlpost: {name} received again: exiting at once, without waiting for the cleanup")
            os._exit(FORCED_EXIT_CODE)
        self.signal_name = name
        _say(
            f"rlpost: {name} received: stopping every actor and writing a final checkpoint once the call "
            "in flight returns; send it again to exit at once"
        )


_handler: _StopHandler | None = None  # the handler of the innermost stop_on_signals block


def raise_if_stopping() -> None:
    """Raise :class:`StopRequested` if a stop signal came inside :func:`stop_on_signals` and was
    not raised yet (it is raised once: the cleanup that follows may call this again)."""
    handler = _handler
    if handler is not None and handler.signal_name is not None and not handler.raised:
        handler.raised = True
        raise StopRequested(handler.signal_name)


def _say(line: str) -> None:
    """Write ``line`` to stderr with one ``os.write``: from a signal handler, writing to the
    buffered ``sys.stderr`` can fail with "reentrant call" and logging can block on its lock."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:  # stderr closed: the stop itself matters more than the message
        pass


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Record SIGINT and SIGTERM inside the block for :func:`raise_if_stopping` (the previous
    handlers are restored on leaving). Put the cleanup inside, so a second signal during it exits
    at once rather than meeting the restored handlers::

        with stop_on_signals():
            try:
                train()  # calls raise_if_stopping() at its safe points
            except StopRequested as stop:
                cleanup()
                return exit_code(stop)

    A signal that comes after the loop's last safe point does not undo a finished run.
    """
    global _handler
    handler = _StopHandler()
    previous = _install(handler)
    if previous is None:  # not the main thread: signal handlers cannot be set here
        yield
        return
    outer, _handler = _handler, handler
    try:
        yield
    finally:
        _handler = outer
        _restore(previous)


def _install(handler: _StopHandler) -> dict[int, object] | None:
    """Install ``handler`` for STOP_SIGNALS; returns the previous handlers, or None where Python
    refuses (any thread but the main thread of the main interpreter)."""
    try:
        return {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    except ValueError:
        return None


def _restore(previous: dict[int, object]) -> None:
    """Put back the handlers ``_install`` replaced. None means a handler installed by C code,
    which Python cannot put back: SIG_DFL is used instead."""
    for signum, handler in previous.items():
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)


# ----------------------------------------------------------------------------- the driver's session


def in_own_session() -> bool:
    """True in a driver that :func:`run_in_own_session` started (or that should not start one)."""
    return os.environ.get(DRIVER_SESSION_ENV) == "1"


def run_in_own_session(argv: Sequence[str]) -> int:
    """Run ``python -m rlpost.ops.cli ARGV`` in a session of its own and return its exit status,
    passing SIGINT and SIGTERM on (SIGHUP as SIGTERM). The child shares stdio and the environment,
    plus ``RLPOST_DRIVER_SESSION=1``."""
    env = {**os.environ, DRIVER_SESSION_ENV: "1"}
    child = subprocess.Popen(
        [sys.executable, "-m", "rlpost.ops.cli", *argv], env=env, start_new_session=True, preexec_fn=die_with_parent
    )

    def pass_on(signum: int, frame) -> None:
        try:
            child.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)
        except ProcessLookupError:  # it has just ended
            pass

    for signum in (*STOP_SIGNALS, signal.SIGHUP):
        signal.signal(signum, pass_on)
    status = child.wait()
    # Ray's agents may outlive a second signal's immediate exit by minutes; the group is the
    # driver's own (it leads its session), so nothing else is in it.
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is empty: nothing left
        pass
    return 128 - status if status < 0 else status  # killed by a signal N: 128 + N, as a shell says


def die_with_parent() -> None:
    """In the child before it runs: receive SIGTERM when the parent dies (Linux; elsewhere the
    child outlives a killed parent and is stopped like any process)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
