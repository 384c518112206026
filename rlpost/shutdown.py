"""Graceful stop of the driver process on SIGTERM and SIGINT.

Schedulers, ``ray job stop``, ``kill`` and Ctrl-C all stop a run the same way: with a signal.
Left to Python's defaults, SIGTERM kills the driver where it stands. No checkpoint is written, so
the steps trained since the last periodic checkpoint are lost. The actors it started are left
running too. Inside ``with stop_on_signals():`` (main thread only) the driver gets this instead:

* The first SIGINT or SIGTERM prints one line to stderr and raises :class:`StopRequested` in the
  main thread. It is raised at whatever Python line the thread is running, the way Python raises
  KeyboardInterrupt. The training loop unwinds into its ``except StopRequested`` cleanup, which
  stops every actor and, when the learner is still alive, writes a final checkpoint. A resumed
  run then goes on from the step the run was stopped at.
* Later signals never raise again. A second exception raised into the cleanup would abort the
  very checkpoint it is writing. So the second signal prints a line and ends the process at once
  with ``os._exit(130)``. That is the way out when the cleanup hangs (an actor that no longer
  answers). It skips the cleanup, ``finally`` blocks, atexit handlers and buffered output: the
  last complete checkpoint on disk is what remains.
* Leaving the block restores the handlers that were installed before it.
* Outside the main thread Python does not allow signal handlers (``signal.signal`` raises
  ValueError), so there the context manager does nothing: the signals keep their handlers.

:class:`StopRequested` derives from BaseException, like KeyboardInterrupt, so the ``except
Exception`` blocks of the training loop (retries, fault handling) let it through.
:func:`exit_code` gives the status the shell convention expects from a process stopped by a
signal (128 + its number), so a supervisor sees that the run was stopped, not that it failed.

The handler runs between two Python bytecodes of the main thread. A main thread blocked inside C
code sees the signal only when that code returns or checks for signals (``ray.get`` does).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
FORCED_EXIT_CODE = 130  # the second signal: exit at once, as an interrupted process


class StopRequested(BaseException):
    """Raised in the main thread by the first SIGINT or SIGTERM inside :func:`stop_on_signals`.

    A BaseException so that ``except Exception`` does not catch it; ``signal_name`` is
    ``"SIGINT"`` or ``"SIGTERM"``.
    """

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal_name = signal_name


def exit_code(stop: StopRequested) -> int:
    """The exit status for a run ended by ``stop``: 128 + the signal number (SIGINT 130, SIGTERM 143)."""
    return 128 + int(signal.Signals[stop.signal_name])


class _StopHandler:
    """The signal handler: raises :class:`StopRequested` once, then exits at once on the next signal."""

    def __init__(self) -> None:
        self.stopping = False

    def __call__(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.stopping:
            _say(f"rlpost: {name} received again: exiting at once, without waiting for the cleanup")
            os._exit(FORCED_EXIT_CODE)
        self.stopping = True
        _say(
            f"rlpost: {name} received: stopping every actor and writing a final checkpoint; "
            "send it again to exit at once"
        )
        raise StopRequested(name)


def _say(line: str) -> None:
    """Write ``line`` to stderr with one ``os.write``.

    A signal handler can interrupt the main thread inside a write to ``sys.stderr``. Writing to
    that same buffered stream again from the handler can fail with "reentrant call", and the
    logging module can block on its own lock. A raw write to fd 2 does neither.
    """
    try:
        os.write(2, (line + "\n").encode())
    except OSError:  # stderr closed: the stop itself matters more than the message
        pass


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into :class:`StopRequested` inside the block; see the module docstring.

    Put the cleanup (stop the actors, write the final checkpoint) inside the block, so that a
    second signal during it exits at once rather than meeting the restored handlers::

        with stop_on_signals():
            try:
                train()
            except StopRequested as stop:
                cleanup()
                return exit_code(stop)
    """
    previous = _install(_StopHandler())
    if previous is None:  # not the main thread: signal handlers cannot be set here
        yield
        return
    try:
        yield
    finally:
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
