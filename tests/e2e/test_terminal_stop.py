"""Stopping `rlpost train` from a terminal: Ctrl-C in a real pseudo-terminal, and SIGTERM to the
whole process group (what `timeout`, systemd and container runtimes send).

Each run is the CLI, started in a pty of its own (the pty is its controlling terminal, so a
Ctrl-C typed into it is the kernel's SIGINT to the foreground process group, as in a shell). The
local Ray processes the run starts must be out of that group's reach: the run ends with a final
checkpoint of its last metrics line, exits 130 (SIGINT) or 143 (SIGTERM), and leaves none of its
processes behind; a run stopped so resumes from that checkpoint. A second Ctrl-C exits at once.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
CTRL_C = b"\x03"
STEPS = 60  # more than any stop below lets a run take


@dataclass
class Stopped:
    code: int  # the exit status, as a shell reports it
    output: str  # everything the terminal showed
    lines: int  # metrics lines when the stop was sent
    shielded: bool  # every process of the run's session was outside the terminal's process group
    left: list[str]  # processes of the run still there 30 s after it ended
    exit_s: float  # from the stop sent to the run's exit


def _stat(pid: int) -> tuple[int, int, int]:
    """(parent, process group, session) of ``pid``, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[2]), int(fields[3])


def _all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _group_of(pid: int) -> int | None:
    try:
        return _stat(pid)[1]
    except (OSError, IndexError, ValueError):  # ended while we looked
        return None


def _session_members(session: int) -> list[int]:
    members = []
    for pid in _all_pids():
        try:
            if _stat(pid)[2] == session:
                members.append(pid)
        except (OSError, IndexError, ValueError):
            pass
    return members


def _driver_of(front: int) -> int | None:
    """The driver: the front's child that leads a session of its own."""
    for pid in _all_pids():
        try:
            parent, _, session = _stat(pid)
        except (OSError, IndexError, ValueError):
            continue
        if parent == front and session == pid:
            return pid
    return None


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:120]
    except OSError:
        return "?"


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def stop_in_terminal(run_dir: Path, tiny_model_path, *, after_lines: int | None, delay_s: float, how: str,
                     resume_steps: int | None = None) -> Stopped:  # fmt: skip
    """Run the tiny job in a pty (``resume_steps``: resume ``run_dir`` to that many steps instead);
    once metrics.jsonl has ``after_lines`` lines (None: once the run said where its Ray cluster is,
    and its actors start), wait ``delay_s`` and stop it ``how``: "ctrl-c", "ctrl-c twice" or
    "SIGTERM to the group"."""
    args = [
        sys.executable, "-m", "rlpost.ops.cli", "train", "configs/tiny-cpu.yaml",
        f"model.name_or_path={tiny_model_path}", "trainer.prompts_per_step=4", f"trainer.steps={STEPS}",
        "logging.dashboard=false", "--run-dir", str(run_dir),
    ]  # fmt: skip
    if resume_steps is not None:
        args = [sys.executable, "-m", "rlpost.ops.cli", "train", "--resume", str(run_dir), f"trainer.steps={resume_steps}"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    front, fd = pty.fork()  # the child leads a new session whose controlling terminal is the pty
    if front == 0:
        os.chdir(REPO)
        os.execve(sys.executable, args, env)
    output, metrics = b"", run_dir / "metrics.jsonl"
    sent_at, lines, shielded, members = None, 0, False, []
    deadline = time.monotonic() + 400
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.05)
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # the terminal's last process ended
                    break
                if not chunk:
                    break
                output += chunk
            if sent_at is None and (
                b"(namespace rlpost-" in output
                if after_lines is None
                else metrics.is_file() and len(metrics.read_text().splitlines()) >= after_lines
            ):
                time.sleep(delay_s)
                lines = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
                driver = _driver_of(front)
                members = _session_members(driver) if driver else []  # the driver and its Ray processes
                group = os.getpgid(front)  # the terminal's foreground process group
                in_group = [p for p in _all_pids() if _group_of(p) == group]
                shielded = len(members) >= 3 and in_group == [front]
                if how == "SIGTERM to the group":
                    os.killpg(group, signal.SIGTERM)
                else:
                    os.write(fd, CTRL_C)
                    if how == "ctrl-c twice":
                        time.sleep(0.3)
                        os.write(fd, CTRL_C)
                sent_at = time.monotonic()
        else:
            os.kill(front, signal.SIGKILL)
            pytest.fail(f"the run did not end within 400 s:\n{output.decode(errors='replace')[-3000:]}")
    finally:
        _, status = os.waitpid(front, 0)
        ended = time.monotonic()
        os.close(fd)
    end = time.monotonic() + 30  # the Ray processes end with the driver (the agents within seconds)
    while [p for p in members if _running(p)] and time.monotonic() < end:
        time.sleep(0.2)
    left = [f"{p}: {_command(p)}" for p in members if _running(p)]
    exit_s = ended - sent_at if sent_at is not None else float("nan")
    return Stopped(os.waitstatus_to_exitcode(status), output.decode(errors="replace"), lines, shielded, left, exit_s)


def _checkpoints(run_dir: Path) -> list[str]:
    folder = run_dir / "checkpoints"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def _assert_stopped_cleanly(stopped: Stopped, run_dir: Path, code: int, name: str, steps_asked: int = STEPS) -> int:
    """The checks of a graceful stop; returns the last step trained."""
    assert stopped.code == code, stopped.output[-3000:]
    assert stopped.shielded, "the run's Ray processes were in the terminal's process group"
    assert "Traceback" not in stopped.output and "rlpost: failed" not in stopped.output, stopped.output[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and stopped.lines <= last < steps_asked
    assert f"rlpost: stopped by {name}" in stopped.output and f"stopped after step {last}" in stopped.output
    assert (run_dir / "checkpoints" / f"step_{last}" / "trainer_state.pt").is_file()
    assert not stopped.left, f"processes of the run left running: {stopped.left}"
    return last


# The tiny job's step takes ~0.5 s: a stop sent right after a metrics line lands in the next
# step's collection, 0.25 s after it in the train call, 0.35 s after it in the weight sync.


@pytest.mark.long  # ~25 s
def test_ctrl_c_while_the_engines_load_stops_the_start_within_seconds(tmp_path, tiny_model_path):
    """Ctrl-C 3 s after the run's cluster started: its actors are starting, the inference
    worker's engine loading (~15 s here). The start ends at once, every actor it started is
    killed, the run exits 130 with no checkpoint (nothing was trained) and no process left."""
    run_dir = tmp_path / "loading"
    stopped = stop_in_terminal(run_dir, tiny_model_path, after_lines=None, delay_s=3.0, how="ctrl-c")
    assert stopped.code == 130, stopped.output[-3000:]
    assert stopped.shielded, "the run's Ray processes were in the terminal's process group"
    assert stopped.lines == 0 and not (run_dir / "metrics.jsonl").exists()
    assert "rlpost: stopped by SIGINT" in stopped.output and "Traceback" not in stopped.output, stopped.output[-3000:]
    assert stopped.exit_s < 10.0, (stopped.exit_s, stopped.output[-3000:])
    assert not stopped.left, f"processes of the run left running: {stopped.left}"


@pytest.mark.long  # three runs, each resuming the one before: 261 s beside another test (make test keeps shutdown's units)
def test_each_stop_writes_the_final_checkpoint_and_the_next_run_resumes_from_it(tmp_path, tiny_model_path):
    """One run folder, three runs: Ctrl-C early in a step (its collection) exits 130; the run
    resumed from that final checkpoint (to 80 steps: an override on resume) is stopped by Ctrl-C
    late in a step (its weight sync), the next by SIGTERM to the whole group in its train call
    (exit 143, as `timeout`, systemd and container runtimes stop a process). Each stop writes the
    final checkpoint of its last step and the next run goes on from it: the steps and the policy
    versions run on without a gap, and nothing is trained twice."""
    run_dir = tmp_path / "stopped"
    stopped = stop_in_terminal(run_dir, tiny_model_path, after_lines=2, delay_s=0.0, how="ctrl-c")
    last = _assert_stopped_cleanly(stopped, run_dir, 130, "SIGINT")
    stopped = stop_in_terminal(run_dir, tiny_model_path, after_lines=last + 2, delay_s=0.35, how="ctrl-c",
                               resume_steps=80)  # fmt: skip
    assert re.search(rf"resumed from \S*step_{last}: step {last},", stopped.output), stopped.output[-3000:]
    last = _assert_stopped_cleanly(stopped, run_dir, 130, "SIGINT", steps_asked=80)
    assert "steps: 80" in (run_dir / "config.yaml").read_text()  # the folder records the new length
    stopped = stop_in_terminal(run_dir, tiny_model_path, after_lines=last + 2, delay_s=0.25,
                               how="SIGTERM to the group", resume_steps=80)  # fmt: skip
    last = _assert_stopped_cleanly(stopped, run_dir, 143, "SIGTERM", steps_asked=80)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, last + 1)) and last >= 6
    assert [r["policy_version"] for r in rows] == list(range(1, last + 1))
    assert not (run_dir / "metrics.superseded.jsonl").exists()  # nothing trained twice


@pytest.mark.long
def test_a_second_ctrl_c_exits_at_once_and_leaves_no_process(tmp_path, tiny_model_path):
    run_dir = tmp_path / "twice"
    stopped = stop_in_terminal(run_dir, tiny_model_path, after_lines=2, delay_s=0.0, how="ctrl-c twice")
    assert stopped.code == 130, stopped.output[-3000:]
    assert "SIGINT received again: exiting at once" in stopped.output
    assert not stopped.left, f"processes of the run left running: {stopped.left}"
