"""rlpost.shutdown: the first SIGTERM / SIGINT raises StopRequested into the main thread, a second
one exits at once, the previous handlers come back, and other threads are left alone.

The signals are real: each case runs a child Python process and signals it with os.kill.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rlpost.shutdown import StopRequested, exit_code, stop_on_signals

pytestmark = pytest.mark.unit

# The child: a training loop stand-in inside stop_on_signals; its cleanup runs inside the block.
CHILD = textwrap.dedent("""
    import sys, time
    from rlpost.shutdown import StopRequested, exit_code, stop_on_signals

    cleanup_s = float(sys.argv[1])
    with stop_on_signals():
        try:
            try:
                print("ready", flush=True)
                while True:
                    time.sleep(0.02)
            except Exception:  # what a retry loop does: it must not catch the stop
                print("swallowed by except Exception", flush=True)
        except StopRequested as stop:
            print(f"cleanup started {stop.signal_name}", flush=True)
            time.sleep(cleanup_s)
            print("cleanup finished", flush=True)
            sys.exit(exit_code(stop))
""")


def start_child(cleanup_s: float) -> subprocess.Popen:
    """The child, once it has entered stop_on_signals (it printed "ready")."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(cleanup_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdout.readline() == "ready\n", child.communicate(timeout=30)
    return child


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_first_signal_raises_stop_requested_and_the_cleanup_runs(signum, code):
    child = start_child(cleanup_s=0.0)
    child.send_signal(signum)
    out, err = child.communicate(timeout=30)
    name = signal.Signals(signum).name
    assert child.returncode == code, (out, err)
    assert out == f"cleanup started {name}\ncleanup finished\n"
    assert (
        f"rlpost: {name} received: stopping every actor and writing a final checkpoint; "
        "send it again to exit at once" in err
    )
    assert "Traceback" not in err


def test_second_signal_exits_at_once_without_finishing_the_cleanup():
    child = start_child(cleanup_s=60.0)
    child.send_signal(signal.SIGTERM)
    assert child.stdout.readline() == "cleanup started SIGTERM\n"
    sent = time.monotonic()
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=30)
    assert time.monotonic() - sent < 5.0
    assert child.returncode == 130, (out, err)
    assert "cleanup finished" not in out
    assert "rlpost: SIGINT received again: exiting at once" in err
    assert "Traceback" not in err  # the second signal did not raise into the cleanup


def test_exit_code_is_128_plus_the_signal_number():
    assert exit_code(StopRequested("SIGINT")) == 130
    assert exit_code(StopRequested("SIGTERM")) == 143
    assert not issubclass(StopRequested, Exception)


def test_previous_handlers_come_back_after_the_block():
    def mine(signum, frame):
        pass

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, mine)
    try:
        with stop_on_signals():
            inside = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        assert inside[signal.SIGINT] not in (before[signal.SIGINT], signal.SIG_DFL)
        assert inside[signal.SIGTERM] is inside[signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
        assert signal.getsignal(signal.SIGTERM) is mine
        with pytest.raises(StopRequested):  # restored on the way out of a stop too
            with stop_on_signals():
                signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before[signal.SIGTERM])


def test_outside_the_main_thread_it_does_nothing():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    seen: dict[str, object] = {}

    def body():
        try:
            with stop_on_signals():
                seen["inside"] = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            seen["error"] = exc

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(timeout=10)
    assert "error" not in seen, seen.get("error")
    assert seen["inside"] == before
    assert {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} == before
