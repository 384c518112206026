"""Sandboxed Python execution for tool-using LLMs, and the rendering of its results.

``run_python(code)`` runs one code block in a fresh interpreter process and returns a
:class:`PythonResult`; it never raises for anything the code does. The ``PythonInterpreter``
transform runs the ```` ```python ```` blocks of the last assistant message through it
(:func:`extract_python_blocks`) and appends :func:`format_tool_response` as a tool message, which
renders as in seed 000::

    <tool_response>
    Code block 1 executed successfully:
    testing the square function with input 2: 4

    </tool_response>

What the sandbox does, in layers, and how far each one reaches:

- Kernel limits, set in the child before the code runs: CPU time (``RLIMIT_CPU``), address space
  (``RLIMIT_AS``, so a large allocation is a ``MemoryError``), file size (``RLIMIT_FSIZE``), no
  core dumps, and ``RLIMIT_NPROC`` (only enforced for non-root users; it counts every task of the
  uid, so it is set to the uid's current count plus ``max_procs``).
- Its own session and process group, a fresh empty working directory (removed afterwards), a
  minimal environment (``PATH``, ``LANG``; ``HOME``/``TMPDIR`` point at the working directory),
  ``python -I`` (no ``PYTHON*`` variables, no user site). The parent enforces a wall-clock timeout,
  reads at most ``max_output_bytes`` of output, and on exit, timeout or overflow kills the whole
  process group and every other member of the session. While the code runs, the parent also
  counts the session's processes and kills it past ``max_procs`` (which also holds for root).
- An empty network namespace when the process may create one (root with ``CAP_SYS_ADMIN``); the
  attempt fails silently otherwise.
- A prelude, run in the child before the code: creating sockets and name lookups raise
  ``PermissionError("network disabled in rlpost sandbox ...")``; ``fork``/``exec``/``spawn``/
  ``subprocess``/``setsid``/``kill`` (except of itself) raise; opening for write, creating,
  removing, renaming or chmod-ing a path outside the working directory raises.

The prelude is a guard against accidental or naive code, not a security boundary: code that
means to escape it can (``ctypes``, re-importing a built-in module, ...). Such code still meets
the kernel limits and the process-group kill, but as root it can write anywhere the user can and
a ``setsid`` done through ``ctypes`` leaves the session. Untrusted code on a cluster should run
with the env workers inside a container (no privileges, read-only root, its own network),
which is the real isolation boundary; this module limits the damage inside it.

The child script is passed with ``-c`` and configures itself, instead of using ``preexec_fn``:
``preexec_fn`` is unsafe in a multi-threaded parent such as a Ray actor.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_TICK_S = 0.05  # how often the parent checks the child's exit and process count
_DRAIN_S = 0.5  # after the kill, how long to wait for output still in the pipe
_READ_BYTES = 65536


@dataclass(frozen=True)
class PythonResult:
    """What one sandboxed run gave. Made by :func:`run_python`, read by the tool transform.

    ``ok`` is True when the code ran to the end (or exited with status 0). ``output`` is stdout
    and stderr interleaved, cut after ``max_output_bytes`` with a marker line. ``error`` is a
    one-line reason when not ok: ``"timeout after 5.0s"``, ``"memory limit 512 MB exceeded"``,
    ``"CPU time limit"``, ``"process limit"``, ``"network disabled"``, ``"file size limit"``,
    ``"write outside working directory: PATH"``, ``"output limit N bytes exceeded"``,
    ``"exit code N"``, ``"killed by SIGNAME"``, or the last line of the exception.
    ``returncode`` is the process's (negative for a signal; None if it never started).
    """

    ok: bool
    output: str
    error: str | None
    returncode: int | None
    duration_s: float


# The child: configures limits and guards, runs the code, then writes a JSON status (exception
# type, errno, guard violation, exit code) to the status pipe for _failure_reason. It runs under
# `python -I`, so it uses only the standard library; argv: status fd, code path, limits, parent pid.
# It is kept in this file, which makes the file long, because it and the parent that reads its
# status are one protocol.
_CHILD_SCRIPT = r'''
import builtins, ctypes, io, _io, json, linecache, os, posix, resource, signal, socket, _socket
import sys, traceback, _posixsubprocess

STATUS_FD, CODE_PATH = int(sys.argv[1]), sys.argv[2]
LIMITS, PARENT_PID = json.loads(sys.argv[3]), int(sys.argv[4])
ROOT = os.path.realpath(os.getcwd())
ALLOWED_WRITES = {"/dev/null", "/dev/stdout", "/dev/stderr"}


class SandboxViolation(PermissionError):
    def __init__(self, reason, what):
        super().__init__(f"{reason} in rlpost sandbox ({what})")
        self.reason, self.what = reason, what


def kernel_guards():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the parent
        libc.unshare(0x40000000)  # CLONE_NEWNET; fails without CAP_SYS_ADMIN, which is fine
    except Exception:
        pass
    if os.getppid() != PARENT_PID:
        os._exit(1)


def uid_task_count(uid):
    count = 0
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, ValueError, KeyError):  # gone, or not a process entry
            continue
    return count


def set_limit(which, soft, hard):
    _, cur_hard = resource.getrlimit(which)
    if cur_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, cur_hard), min(hard, cur_hard)
    resource.setrlimit(which, (soft, hard))


def set_limits():
    set_limit(resource.RLIMIT_CORE, 0, 0)
    set_limit(resource.RLIMIT_CPU, LIMITS["cpu_s"], LIMITS["cpu_s"] + 1)
    set_limit(resource.RLIMIT_FSIZE, LIMITS["file_bytes"], LIMITS["file_bytes"])
    # NPROC counts every task (threads too) of the real uid and is not enforced for root.
    base = 0 if os.getuid() == 0 else uid_task_count(os.getuid())
    set_limit(resource.RLIMIT_NPROC, base + LIMITS["max_procs"], base + LIMITS["max_procs"])
    set_limit(resource.RLIMIT_AS, LIMITS["memory_bytes"], LIMITS["memory_bytes"])


def check_write(path, dir_fd=None):
    if isinstance(path, int):  # an open descriptor reaches nothing new by name
        return
    name = os.fsdecode(os.fspath(path))
    base = os.getcwd() if dir_fd is None else os.readlink(f"/proc/self/fd/{dir_fd}")
    if os.path.normpath(os.path.join(base, name)) in ALLOWED_WRITES:
        return
    full = os.path.realpath(os.path.join(base, name))  # symlinks resolved: no escape through one
    if full != ROOT and not full.startswith(ROOT + os.sep):
        raise SandboxViolation("write outside working directory", full)


def guard_files():
    real_open, real_os_open = builtins.open, os.open
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            check_write(file)
        return real_open(file, mode, *args, **kwargs)

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & write_flags:
            check_write(path, dir_fd)
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    builtins.open = io.open = _io.open = open
    os.open = posix.open = os_open
    one = [(0, "path", "dir_fd")]
    two = [(0, "src", "src_dir_fd"), (1, "dst", "dst_dir_fd")]
    paths = {"mkdir": one, "rmdir": one, "remove": one, "unlink": one, "chmod": one,
             "chown": one, "lchown": one, "truncate": one, "utime": one, "mkfifo": one,
             "mknod": one, "rename": two, "replace": two, "link": two,
             "symlink": [(1, "dst", "dir_fd")]}
    for fn_name, specs in paths.items():
        real = getattr(os, fn_name, None)
        if real is not None:
            wrapped = guard_paths(real, specs)
            setattr(os, fn_name, wrapped)
            setattr(posix, fn_name, wrapped)


def guard_paths(real, specs):
    def guarded(*args, **kwargs):
        for index, param, dir_fd_param in specs:
            path = args[index] if index < len(args) else kwargs.get(param)
            if path is not None:
                check_write(path, kwargs.get(dir_fd_param))
        return real(*args, **kwargs)
    return guarded


def guard_processes():
    def refuse(reason, name):
        def refused(*args, **kwargs):
            raise SandboxViolation(reason, name)
        return refused

    # os.exec*/spawn*/popen, subprocess and multiprocessing all end in one of these.
    creation = ["fork", "forkpty", "system", "execv", "execve", "posix_spawn", "posix_spawnp"]
    control = ["setsid", "setpgid", "setpgrp", "killpg"]  # leaving the session, signalling others
    groups = [("process creation disabled", creation), ("process control disabled", control)]
    for reason, names in groups:
        for name in names:
            for module in (os, posix):
                if hasattr(module, name):
                    setattr(module, name, refuse(reason, name))
    _posixsubprocess.fork_exec = refuse("process creation disabled", "subprocess")
    real_kill = os.kill

    def kill(pid, sig):
        if pid != os.getpid():
            raise SandboxViolation("process control disabled", f"kill({pid})")
        return real_kill(pid, sig)

    os.kill = posix.kill = kill


def guard_network():
    class NoNewSocket(socket.socket):
        # Wrapping an existing descriptor (socketpair, fromfd) is local and allowed.
        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None:
                raise SandboxViolation("network disabled", "socket")
            super().__init__(family, type, proto, fileno)

    def refuse(name):
        def refused(*args, **kwargs):
            raise SandboxViolation("network disabled", name)
        return refused

    # _socket.socket stays: socket.socket.__init__ looks it up by name.
    socket.socket = socket.SocketType = NoNewSocket
    lookups = ["getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "getnameinfo"]
    for name in lookups:
        for module in (socket, _socket):
            setattr(module, name, refuse(name))


def print_traceback(exc):
    """The traceback without this script's frames (the code is "<code>", this script "<string>")."""
    top = report = traceback.TracebackException(type(exc), exc, exc.__traceback__.tb_next)
    seen = set()
    while report is not None and id(report) not in seen:
        seen.add(id(report))
        report.stack = traceback.StackSummary.from_list(
            [frame for frame in report.stack if frame.filename != "<string>"])
        report = report.__cause__ or report.__context__
    sys.stderr.write("".join(top.format()))


def describe(exc):
    status = {"exc_type": type(exc).__name__, "errno": getattr(exc, "errno", None),
              "violation": None, "exit_code": 1,
              "error_line": traceback.format_exception_only(type(exc), exc)[-1].strip()}
    cause, seen = exc, set()
    while cause is not None and id(cause) not in seen:  # urllib & co. wrap the guard's error
        seen.add(id(cause))
        if isinstance(cause, SandboxViolation):
            status["violation"] = [cause.reason, cause.what]
            break
        cause = cause.__cause__ or cause.__context__
    return status


def main():
    kernel_guards()
    with open(CODE_PATH, encoding="utf-8") as f:
        source = f.read()
    linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")
    set_limits()
    guard_files()
    guard_processes()
    guard_network()
    reserve = bytearray(1 << 20)  # freed on failure so the traceback can be printed
    user_globals = {"__name__": "__main__", "__builtins__": builtins}
    status = {"exit_code": 0}
    try:
        exec(compile(source, "<code>", "exec"), user_globals)
    except SystemExit as exc:
        code = exc.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        status = {"exit_code": code or 0}
    except BaseException as exc:
        del reserve
        if isinstance(exc, MemoryError):
            user_globals.clear()  # what filled the memory is likely held there
        print_traceback(exc)
        status = describe(exc)
    os.write(STATUS_FD, json.dumps(status).encode())
    os.close(STATUS_FD)
    sys.exit(status["exit_code"])


main()
'''


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    cpu_s: int | None = None,
    max_output_bytes: int = 16384,
    max_file_mb: int = 16,
    max_procs: int = 64,
) -> PythonResult:
    """Run ``code`` in a sandboxed Python process (see the module docstring) and return the result.

    ``timeout_s`` is wall-clock time; ``cpu_s`` (default ``ceil(timeout_s) + 1``) is CPU time;
    ``memory_mb`` caps the address space (virtual memory, not RSS); ``max_file_mb`` caps each file
    written; ``max_procs`` caps the processes alive at once in the code's session. Output past
    ``max_output_bytes`` stops the run (``ok`` False). Nothing the code does raises here; invalid
    arguments raise ``ValueError``.
    """
    if timeout_s <= 0 or memory_mb < 32 or max_output_bytes < 1 or max_file_mb < 1 or max_procs < 1:
        raise ValueError(
            "run_python needs timeout_s > 0, memory_mb >= 32 and positive max_output_bytes, "
            f"max_file_mb, max_procs; got {timeout_s=}, {memory_mb=}, {max_output_bytes=}, "
            f"{max_file_mb=}, {max_procs=}"
        )
    if cpu_s is not None and cpu_s < 1:
        raise ValueError(f"run_python needs cpu_s >= 1, got {cpu_s}")
    limits = {
        "cpu_s": cpu_s if cpu_s is not None else math.ceil(timeout_s) + 1,
        "memory_bytes": memory_mb * 2**20,
        "file_bytes": max_file_mb * 2**20,
        "max_procs": max_procs,
    }
    start = time.monotonic()
    try:
        base = tempfile.mkdtemp(prefix="rlpost-sandbox-")
        try:
            returncode, out, status, stop = _run_child(
                code, base, limits, start + timeout_s, max_output_bytes
            )
        finally:
            _remove_tree(base)
    except OSError as exc:  # the host failed (no processes, descriptors or disk left), not the code
        error = f"sandbox error: {exc}"
        return PythonResult(False, "", error, None, time.monotonic() - start)
    output = out[:max_output_bytes].decode("utf-8", errors="replace")
    if len(out) > max_output_bytes:
        output += f"\n[output truncated: more than {max_output_bytes} bytes]"
    error = _failure_reason(stop, status, returncode, timeout_s=timeout_s, memory_mb=memory_mb,
                            max_output_bytes=max_output_bytes)
    return PythonResult(error is None, output, error, returncode, time.monotonic() - start)


def _run_child(
    code: str, base: str, limits: dict, deadline: float, cap: int
) -> tuple[int, bytes, dict | None, str | None]:
    """Start the child in ``base/work``, collect its output, kill its session; see run_python."""
    workdir = os.path.join(base, "work")
    os.mkdir(workdir)
    code_path = os.path.join(base, "code.py")
    with open(code_path, "w", encoding="utf-8", errors="replace") as f:  # lone surrogates
        f.write(code)
    env = {
        "PATH": os.environ.get("PATH", os.defpath),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOME": workdir,
        "TMPDIR": workdir,
        # Numerical libraries otherwise start a thread per core, each with its own stack.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    status_r, status_w = os.pipe()
    try:
        argv = [sys.executable, "-I", "-B", "-u", "-X", "utf8", "-c", _CHILD_SCRIPT,
                str(status_w), code_path, json.dumps(limits), str(os.getpid())]
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                pass_fds=(status_w,), start_new_session=True)
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    out_fd = proc.stdout.fileno()
    pipes = [_Pipe(out_fd, keep=cap + 1), _Pipe(status_r, keep=_READ_BYTES)]
    try:
        try:
            stop = _watch(proc.pid, pipes, deadline, limits["max_procs"])
        finally:
            _kill_session(proc.pid)
            proc.wait()
        _drain(pipes, time.monotonic() + _DRAIN_S)
    finally:
        proc.stdout.close()
        os.close(status_r)
    return proc.returncode, bytes(pipes[0].data), _parse_status(bytes(pipes[1].data)), stop


class _Pipe:
    """One pipe from the child: what was read (at most ``keep`` bytes) and whether it ended."""

    def __init__(self, fd: int, keep: int):
        self.fd, self.keep, self.data, self.ended = fd, keep, bytearray(), False

    def read(self) -> None:
        # Bytes past `keep` are read and dropped, so memory stays flat whatever the child prints.
        chunk = os.read(self.fd, _READ_BYTES)
        if not chunk:
            self.ended = True
        elif len(self.data) < self.keep:
            self.data.extend(chunk[: self.keep - len(self.data)])


def _watch(pid: int, pipes: list[_Pipe], deadline: float, max_procs: int) -> str | None:
    """Read the child's pipes until it exits. Returns why it must be stopped early, or None."""
    output = pipes[0]
    scan_session = False  # set once the child has had children: the prelude was bypassed
    next_check = idle_sleep = 0.0
    with selectors.DefaultSelector() as selector:
        for pipe in pipes:
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
            else:  # both pipes closed: the child is exiting (or closed them and runs on)
                idle_sleep = min(max(2 * idle_sleep, 0.0005), _TICK_S)
                time.sleep(min(idle_sleep, max(deadline - now, 0.0)))
            if len(output.data) >= output.keep:
                return "output"
            if _exited(pid):
                return None
            if now >= next_check:
                next_check = now + _TICK_S
                scan_session = scan_session or _has_children(pid)
                if scan_session and len(_session_members(pid)) > max_procs:
                    return "procs"


def _drain(pipes: list[_Pipe], until: float) -> None:
    """Read what is left in the pipes after the kill (bounded: an escaped writer can't hold us)."""
    with selectors.DefaultSelector() as selector:
        for pipe in pipes:
            if not pipe.ended:
                selector.register(pipe.fd, selectors.EVENT_READ, pipe)
        while selector.get_map() and time.monotonic() < until:
            for key, _ in selector.select(max(until - time.monotonic(), 0.0)):
                key.data.read()
                if key.data.ended:
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


def _session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``, from /proc."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # it exited while we looked
            continue
        state, _ppid, _pgrp, session = stat[stat.rindex(b")") + 2 :].split()[:4]
        if int(session) == sid and state not in (b"Z", b"X"):
            members.append(int(name))
    return members


def _kill_session(sid: int) -> None:
    """SIGKILL the child's process group, then any member of its session that changed group."""
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


def _parse_status(data: bytes) -> dict | None:
    """The child's last word (see _CHILD_SCRIPT), or None when it died before saying it."""
    try:
        status = json.loads(data) if data else None
    except ValueError:
        return None
    return status if isinstance(status, dict) else None


def _failure_reason(
    stop: str | None,
    status: dict | None,
    returncode: int,
    *,
    timeout_s: float,
    memory_mb: int,
    max_output_bytes: int,
) -> str | None:
    """The one-line ``error`` of a PythonResult, or None when the run succeeded."""
    if stop == "timeout":
        return f"timeout after {float(timeout_s)}s"
    if stop == "output":
        return f"output limit {max_output_bytes} bytes exceeded"
    if stop == "procs":
        return "process limit"
    if status is not None and "exc_type" in status:
        return _exception_reason(status, memory_mb)
    if status is not None:
        return None if status.get("exit_code") == 0 else f"exit code {status.get('exit_code')}"
    if returncode == -signal.SIGXCPU:
        return "CPU time limit"
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return None if returncode == 0 else f"exit code {returncode}"


def _exception_reason(status: dict, memory_mb: int) -> str:
    violation = status.get("violation")
    if violation:
        reason, what = violation
        if reason == "write outside working directory":
            return f"{reason}: {what}"
        return {"process creation disabled": "process limit"}.get(reason, reason)
    if status["exc_type"] == "MemoryError":
        return f"memory limit {memory_mb} MB exceeded"
    if status.get("errno") == errno.EFBIG:
        return "file size limit"
    return status["error_line"]


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


_BLOCK_RE = re.compile(r"```(?i:python3?|py)[ \t]*\n(.*?)```", re.DOTALL)


def extract_python_blocks(text: str) -> list[str]:
    """The code of each closed ```` ```python ```` (or ``py``) fenced block in ``text``, in order.

    A block left open at the end (a generation cut by the token limit) is not returned.
    """
    return _BLOCK_RE.findall(text)


def format_tool_response(results: list[PythonResult]) -> str:
    """The tool message for the results of one assistant message's code blocks (seed 000 format).

    Each block renders as ``Code block i executed successfully:\n<output>\n``, or when it failed
    as ``Code block i failed:\n<error>\n<output>\n``; all inside
    ``<tool_response>\n...</tool_response>``.
    """
    if not results:
        raise ValueError("format_tool_response needs at least one result (no code, no tool turn)")
    parts = []
    for i, result in enumerate(results, start=1):
        if result.ok:
            parts.append(f"Code block {i} executed successfully:\n{result.output}\n")
        else:
            parts.append(f"Code block {i} failed:\n{result.error}\n{result.output}\n")
    return "<tool_response>\n" + "".join(parts) + "</tool_response>"
