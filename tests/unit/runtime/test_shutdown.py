"""rlpost.runtime.shutdown: the first SIGTERM / SIGINT is raised as StopRequested at the loop's next safe
point (never inside the call in flight), a second one exits at once, the previous handlers come
back, and other threads are left alone.

The signals are real: each case runs a child Python process and signals it with os.kill (the
terminal's and the process group's signals are tests/e2e/test_terminal_stop.py's).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rlpost.runtime.shutdown import StopRequested, exit_code, raise_if_stopping, stop_on_signals

pytestmark = pytest.mark.unit

# The child: a training loop stand-in inside stop_on_signals; its cleanup runs inside the block.
CHILD = textwrap.dedent("""
    import sys, time
    from rlpost.runtime.shutdown import StopRequested, exit_code, raise_if_stopping, stop_on_signals

    cleanup_s, call_s = float(sys.argv[1]), float(sys.argv[2])
    with stop_on_signals():
        try:
            try:
                print("ready", flush=True)
                while True:
                    time.sleep(call_s)  # a call in flight: the signal does not cut it short
                    print("call returned", flush=True)
                    raise_if_stopping()  # the loop's safe point
            except Exception:  # what a retry loop does: it must not catch the stop
                print("swallowed by except Exception", flush=True)
        except StopRequested as stop:
            print(f"cleanup started {stop.signal_name}", flush=True)
            time.sleep(cleanup_s)
            print("cleanup finished", flush=True)
            sys.exit(exit_code(stop))
""")


def start_child(cleanup_s: float, call_s: float = 0.02) -> subprocess.Popen:
    """The child, once it has entered stop_on_signals (it printed "ready")."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(cleanup_s), str(call_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline() == "ready\n", child.communicate(timeout=30)
    return child


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_first_signal_stops_at_the_next_safe_point_after_the_call_in_flight(signum, code):
    child = start_child(cleanup_s=0.0, call_s=1.0)
    child.send_signal(signum)
    out, err = child.communicate(timeout=30)
    name = signal.Signals(signum).name
    assert child.returncode == code, (out, err)
    assert out == f"call returned\ncleanup started {name}\ncleanup finished\n"  # the call ran to its end
    assert (
        f"rlpost: {name} received: stopping every actor and writing a final checkpoint once the call in flight "
        "returns; send it again to exit at once" in err
    )
    assert "Traceback" not in err


def test_second_signal_exits_at_once_without_finishing_the_cleanup():
    child = start_child(cleanup_s=60.0)
    child.send_signal(signal.SIGTERM)
    assert child.stdout.readline() == "call returned\n"
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
                signal.raise_signal(signal.SIGTERM)  # recorded, not raised here
                raise_if_stopping()
        raise_if_stopping()  # outside the block: nothing to raise
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


def test_only_a_shell_train_that_starts_a_local_cluster_gets_a_session_of_its_own(monkeypatch):
    from rlpost.ops.cli import _shield_local_cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RLPOST_DRIVER_SESSION", raising=False)
    assert _shield_local_cluster(["train", "configs/tiny-cpu.yaml"])
    assert _shield_local_cluster(["serve", "configs/serve-tiny-cpu.yaml"])
    assert not _shield_local_cluster(["train", "c.yaml", "--address", "10.0.0.1:6379"])
    assert not _shield_local_cluster(["train", "c.yaml", "--address=10.0.0.1:6379"])
    assert not _shield_local_cluster(["eval", "c.yaml"]) and not _shield_local_cluster([])
    monkeypatch.setenv("RLPOST_DRIVER_SESSION", "1")  # the driver itself
    assert not _shield_local_cluster(["train", "configs/tiny-cpu.yaml"])
    monkeypatch.delenv("RLPOST_DRIVER_SESSION")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert not _shield_local_cluster(["train", "configs/tiny-cpu.yaml"])


def test_the_driver_runs_in_a_session_of_its_own_and_its_status_comes_back(tmp_path, capfd):
    """The child is `python -m rlpost.ops.cli ARGV`: a config error's status (2) and message come
    through the parent."""
    from rlpost.runtime.shutdown import run_in_own_session

    assert run_in_own_session(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capfd.readouterr().err
