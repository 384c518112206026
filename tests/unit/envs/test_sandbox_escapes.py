"""Deliberate escapes from the namespace sandbox: each one gets past the in-process prelude (so
the prelude alone would fail it), and each test asserts that the host is untouched.

Plus the persistent interpreter (PythonSession) and the refusal where namespaces do not work.
"""

from __future__ import annotations

import os
import socket
import textwrap
import uuid
from pathlib import Path

import pytest

from rlpost.envs import sandbox
from rlpost.envs.sandbox import SandboxUnavailable, check_sandbox, namespace_problem
from rlpost.envs.tools import PythonSession, run_python

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[3]
LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"


def test_namespaces_work_on_this_host():
    # The escapes below are only meaningful behind the boundary; a host without user namespaces
    # must fail here loudly rather than skip the file.
    assert namespace_problem() is None


def run(code: str, **kwargs):
    return run_python(textwrap.dedent(code), sandbox="bwrap", **kwargs)


@pytest.fixture
def target(tmp_path) -> Path:
    """A host file the code tries to create: a path that exists on the host (its folder) but is
    not mounted in the sandbox."""
    return tmp_path / f"escape-{uuid.uuid4().hex}.txt"


def test_libc_open_and_write_through_ctypes(target):
    code = (
        LIBC
        + f"""
fd = libc.open({str(target).encode()!r}, os.O_WRONLY | os.O_CREAT, 0o644)
print("fd", fd, "errno", ctypes.get_errno())
if fd >= 0:
    libc.write(fd, b"pwned", 5)
"""
    )
    result = run(code)
    assert result.output.startswith("fd -1 errno 2"), result.output  # ENOENT: no such folder in there
    assert not target.exists()


def test_reimported_posix_module(target):
    code = f"""
    import sys, importlib
    del sys.modules["posix"]
    posix = importlib.import_module("posix")   # a fresh copy: the prelude's patches are gone
    fd = posix.open({str(target)!r}, posix.O_WRONLY | posix.O_CREAT)
    posix.write(fd, b"pwned")
    """
    result = run(code)
    assert not result.ok and "FileNotFoundError" in result.error, result.output
    assert not target.exists()


def test_io_fileio_bypassing_open(target):
    result = run(f"import _io\n_io.FileIO({str(target)!r}, 'w').write(b'pwned')\n")
    assert not result.ok and "FileNotFoundError" in result.error, result.output
    assert not target.exists()


def test_writing_into_the_checkout(target):
    escape = REPO_ROOT / target.name
    code = LIBC + f"fd = libc.open({str(escape).encode()!r}, os.O_WRONLY | os.O_CREAT, 0o644)\nprint(fd)\n"
    code += (
        f"import _io\ntry:\n    _io.FileIO({str(escape)!r}, 'w')\nexcept OSError as e:\n    print(type(e).__name__)\n"
    )
    result = run(code)
    assert result.output == "-1\nFileNotFoundError\n"  # the checkout is not in the sandbox at all
    assert not escape.exists()


@pytest.fixture
def listener():
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.5)
        yield server


def assert_no_connection(server: socket.socket) -> None:
    with pytest.raises(TimeoutError):
        server.accept()


def test_reimported_socket_module(listener):
    port = listener.getsockname()[1]
    code = f"""
    import sys, importlib
    del sys.modules["_socket"]
    _socket = importlib.import_module("_socket")
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect(("127.0.0.1", {port}))
    """
    result = run(code)
    assert not result.ok and result.error.startswith("ConnectionRefusedError"), result.output
    assert_no_connection(listener)


def test_libc_socket_and_connect(listener):
    port = listener.getsockname()[1]
    code = (
        LIBC
        + f"""
import struct
fd = libc.socket(2, 1, 0)  # AF_INET, SOCK_STREAM
addr = struct.pack("!HH4s8x", 2, {port}, bytes([127, 0, 0, 1]))
addr = struct.pack("=H", 2) + addr[2:]  # sa_family is host-endian
rc = libc.connect(fd, addr, len(addr))
print("socket", fd >= 0, "connect", rc, "errno", ctypes.get_errno())
"""
    )
    result = run(code)
    assert result.output == "socket True connect -1 errno 111\n", result.output  # ECONNREFUSED in its own netns
    assert_no_connection(listener)


def test_libc_fork_and_exec_of_a_shell(target):
    code = (
        LIBC
        + f"""
import time
pid = libc.fork()
if pid == 0:
    argv = (ctypes.c_char_p * 4)(b"/bin/sh", b"-c", b"echo pwned > {target}", None)
    libc.execv(b"/bin/sh", argv)
    libc._exit(127)  # exec failed: no shell in the sandbox
status = ctypes.c_int()
libc.waitpid(pid, ctypes.byref(status), 0)
print("child exit", (status.value >> 8) & 0xFF)
"""
    )
    result = run(code)
    assert result.output == "child exit 127\n", result.output
    assert not target.exists()


def test_host_files_are_not_readable():
    host_name = Path("/etc/hostname").read_text() if Path("/etc/hostname").exists() else None
    code = """
    import os, socket
    for path in ["/etc/hostname", "/etc/passwd", "/root", "/home", "/tmp"]:
        print(path, os.path.exists(path))
    print(socket.gethostname.__name__)
    """
    result = run(code)
    assert result.ok, result.output
    lines = result.output.splitlines()
    assert lines[:5] == ["/etc/hostname False", "/etc/passwd False", "/root False", "/home False", "/tmp False"] or (
        # the interpreter may live under /root (pyenv): then /root exists, with only that inside
        lines[2] == "/root True"
        and lines[:2] + lines[3:5] == ["/etc/hostname False", "/etc/passwd False", "/home False", "/tmp False"]
    )
    if host_name:
        assert host_name.strip() not in result.output


def test_proc_shows_only_the_sandbox(monkeypatch):
    # The parent's environment holds a secret; the sandbox's /proc is its own PID namespace.
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("RLPOST_TEST_SECRET", secret)
    code = f"""
    import os
    print(sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
    print(open("/proc/1/environ", "rb").read().replace(b"\\0", b" ").decode())
    print(os.path.exists("/proc/{os.getpid()}/environ"))
    """
    result = run(code)
    assert result.ok, result.output
    pids, environ, parent_visible = result.output.splitlines()
    assert eval(pids) == [1, 2]  # the sandbox's init and the interpreter, nothing of the host
    assert secret not in result.output and "RLPOST_TEST_SECRET" not in environ
    assert parent_visible == "False" or os.getpid() in (1, 2)


def test_setsid_escapee_dies_with_the_sandbox(tmp_path):
    # A grandchild that leaves the session and the process group through libc still dies: it is
    # in the sandbox's PID namespace, which dies with the sandbox's init.
    code = (
        LIBC
        + """
import time
if libc.fork() == 0:
    libc.setsid()
    if libc.fork() == 0:
        time.sleep(120)
    libc._exit(0)
time.sleep(0.3)
print("parent done")
"""
    )
    marker = uuid.uuid4().hex
    result = run(code.replace("time.sleep(120)", f"time.sleep(120)  # {marker}"))
    assert result.ok and result.output == "parent done\n"
    assert not [
        p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, "rlpost-sandbox") and _cmdline_has(p, marker)
    ]
    assert _sandboxed_processes() == []


def _cmdline_has(pid: str, text: str) -> bool:
    try:
        return text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _sandboxed_processes() -> list[int]:
    """Live descendants of this process in a PID namespace other than ours whose command line runs
    the child script (only ours: another pytest worker may be running a sandbox of its own)."""
    ours = os.readlink("/proc/self/ns/pid")
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") != ours and b"STATUS_FD" in Path(f"/proc/{pid}/cmdline").read_bytes():
                if _descends_from_us(int(pid)):
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _descends_from_us(pid: int) -> bool:
    while pid > 1:
        if pid == os.getpid():
            return True
        try:  # the parent is the 4th field of /proc/<pid>/stat, after the ")" that ends the name
            pid = int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def test_libc_fork_bomb_dies_with_its_namespace():
    bomb = LIBC + "while True:\n    libc.fork()\n"
    result = run(bomb, timeout_s=10.0, max_procs=16)
    assert not result.ok and result.error == "process limit"
    assert _sandboxed_processes() == []


# ------------------------------------------------------------------------------ PythonSession


def test_session_keeps_names_between_blocks():
    with PythonSession(timeout_s=5.0) as session:
        first = session.run("x = 21\ndef double(v):\n    return 2 * v\nprint('defined')")
        second = session.run("print(double(x))")
        assert (first.ok, first.output, first.returncode) == (True, "defined\n", None)
        assert (second.ok, second.output) == (True, "42\n")
        failed = session.run("undefined_name")
        assert failed.error == "NameError: name 'undefined_name' is not defined"
        assert session.run("print(x)").output == "21\n"  # an exception keeps the interpreter
        assert session.num_blocks == 4


def test_session_restarts_after_a_timeout_and_says_state_is_lost():
    with PythonSession(timeout_s=1.0) as session:
        session.run("x = 1")
        assert session.run("while True:\n    pass").error == "timeout after 1.0s"
        after = session.run("print('x' in globals())")
        assert after.ok
        assert after.output == "[interpreter restarted: names defined before are gone]\nFalse\n"


def test_session_close_kills_its_interpreter():
    session = PythonSession()
    session.run("print(1)")
    pid = session._process.proc.pid
    session.close()
    assert not Path(f"/proc/{pid}").exists() or b"Z" in Path(f"/proc/{pid}/stat").read_bytes().split(b")")[1][:3]
    assert _sandboxed_processes() == []


def test_unknown_session_option_is_a_type_error():
    with pytest.raises(TypeError, match="timeout"):
        PythonSession(timeout=3)


# ------------------------------------------------------------------------------ refusal


def test_refuses_without_namespaces_unless_guard_is_asked_for(monkeypatch):
    monkeypatch.setenv("RLPOST_BWRAP", "/bin/false")  # a bwrap that cannot make namespaces
    with pytest.raises(SandboxUnavailable, match="tools.sandbox: guard"):
        check_sandbox("bwrap")
    with pytest.raises(SandboxUnavailable):
        run_python("print(1)")
    assert run_python("print(1)", sandbox="guard").output == "1\n"
    with pytest.raises(ValueError, match="sandbox must be one of"):
        check_sandbox("docker")
    assert "/bin/false failed" in sandbox.namespace_problem()
