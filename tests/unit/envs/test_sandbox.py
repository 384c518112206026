"""The Python sandbox (rlpost.envs.tools.run_python) against hostile code, and the tool rendering.

Every hostile case must come back as a result with a clear one-line error, quickly, leaving no
process, file or directory behind.
"""

from __future__ import annotations

import functools
import os
import socket
import tempfile
import textwrap
import time
import tracemalloc
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlpost.envs.tools import PythonResult, extract_python_blocks, format_tool_response, run_python

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[3]
SEED_CODE = "def square(x):\n    return x * x\nprint('testing the square function with input 2:', square(2))\n"


@pytest.fixture
def sandbox_parent(tmp_path, monkeypatch) -> Path:
    """A private parent for the sandbox directories, so a test can see what is left in it and find
    its own sandbox processes (their command line names the sandbox directory)."""
    parent = tmp_path / "sandboxes"
    parent.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(parent))
    return parent


@pytest.fixture(params=["bwrap", "guard"])
def py(request):
    """``run_python`` in one sandbox mode: every case holds behind the namespace boundary and
    behind the prelude alone."""
    return functools.partial(run_python, sandbox=request.param)


def live_processes_naming(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text`` (zombies have none)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmdline:
            found.append(int(name))
    return found


def assert_nothing_left(parent: Path) -> None:
    assert live_processes_naming(str(parent)) == []
    assert list(parent.iterdir()) == []


def test_normal_block_prints_its_output(py, sandbox_parent):
    result = py(SEED_CODE)
    expected = "testing the square function with input 2: 4\n"
    assert result == PythonResult(True, expected, None, 0, result.duration_s)
    assert 0 < result.duration_s < 30
    assert_nothing_left(sandbox_parent)


def test_stdout_and_stderr_are_interleaved_in_order(py, sandbox_parent):
    result = py("import sys\nprint('a')\nprint('b', file=sys.stderr)\nprint('c')")
    assert result.ok and result.output == "a\nb\nc\n"


def test_exception_gives_its_last_line_and_a_traceback_of_the_code_only(py, sandbox_parent):
    result = py("x = 1\nprint('before')\nx / 0\n")
    assert not result.ok
    assert result.error == "ZeroDivisionError: division by zero"
    assert result.returncode == 1
    assert result.output.startswith("before\nTraceback (most recent call last):\n")
    assert 'File "<code>", line 3, in <module>' in result.output
    assert "<string>" not in result.output  # the sandbox's own frames are hidden


def test_syntax_error_and_exit_codes(py, sandbox_parent):
    assert py("def f(\n").error == "SyntaxError: '(' was never closed"
    assert py("import sys; sys.exit(3)").error == "exit code 3"
    assert py("import sys; sys.exit(0)").ok
    assert py("import os; os._exit(4)").error == "exit code 4"


def test_infinite_loop_times_out(py, sandbox_parent):
    result = py("print('started')\nwhile True:\n    pass\n", timeout_s=1.0)
    assert not result.ok
    assert result.error == "timeout after 1.0s"
    assert result.output == "started\n"  # output before the kill is kept (unbuffered child)
    assert 1.0 <= result.duration_s < 30.0  # killed at the timeout, not hung (generous: CI machines are busy)
    assert_nothing_left(sandbox_parent)


def test_cpu_time_limit(py, sandbox_parent):
    # a wall-clock timeout far beyond the CPU limit: on a loaded machine one CPU second can take
    # many wall seconds, and the error must still be the CPU limit's
    result = py("while True:\n    pass\n", timeout_s=120.0, cpu_s=1)
    assert result.error == "CPU time limit"


def test_os_fork_bomb_is_refused(py, sandbox_parent):
    result = py("import os\nwhile True:\n    os.fork()\n")
    assert not result.ok and result.error == "process limit"
    assert "process creation disabled in rlpost sandbox (fork)" in result.output
    assert_nothing_left(sandbox_parent)


def test_subprocess_and_signalling_others_are_refused(py, sandbox_parent):
    result = py("import subprocess\nsubprocess.run(['ls', '/'])\n")
    assert result.error == "process limit"
    assert py("import os\nos.system('echo hi')").error == "process limit"
    assert py("import os\nos.kill(1, 9)").error == "process control disabled"
    assert py("import os\nos.setsid()").error == "process control disabled"
    assert py("import signal, os\nos.kill(os.getpid(), signal.SIGTERM)").error == ("killed by SIGTERM")


def test_fork_bomb_bypassing_the_prelude_is_killed_without_strays(py, sandbox_parent):
    # ctypes reaches libc's fork directly; the parent's process count and session kill end it
    # (RLIMIT_NPROC alone would not: it is not enforced for root, which runs CI).
    bomb = "import ctypes\nlibc = ctypes.CDLL(None)\nwhile True:\n    libc.fork()\n"
    result = py(bomb, timeout_s=10.0, max_procs=16)
    assert not result.ok and result.error == "process limit"  # not "timeout after 10.0s"
    assert_nothing_left(sandbox_parent)


def test_background_processes_die_with_the_code(py, sandbox_parent):
    # Children that left the process group (but not the session) must not outlive the run.
    code = textwrap.dedent(
        """
        import ctypes, time
        libc = ctypes.CDLL(None)
        for _ in range(3):
            if libc.fork() == 0:
                libc.setpgid(0, 0)
                time.sleep(60)
        print('parent done')
        """
    )
    result = py(code)
    assert result.ok and result.output == "parent done\n"
    assert result.duration_s < 30.0  # did not wait for the children's 60 s sleep
    assert_nothing_left(sandbox_parent)


def test_ten_gigabyte_allocation_is_a_memory_error(py, sandbox_parent):
    result = py("x = bytearray(10 * 1024**3)\n", memory_mb=256)
    assert not result.ok
    assert result.error == "memory limit 256 MB exceeded"
    assert result.output.rstrip().endswith("MemoryError")


def test_growing_memory_is_a_memory_error_with_a_traceback(py, sandbox_parent):
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(2**20))\n"
    result = py(code, memory_mb=128, timeout_s=60.0)
    assert result.error == "memory limit 128 MB exceeded"
    assert "Traceback" in result.output


def test_file_size_limit(py, sandbox_parent):
    code = "with open('big.bin', 'wb') as f:\n    f.write(b'x' * 2 * 2**20)\n"
    result = py(code, max_file_mb=1)
    assert result.error == "file size limit"


def test_writes_outside_the_working_directory_are_refused(py, sandbox_parent, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    keep = outside / "keep.txt"
    keep.write_text("precious")
    repo_escape = REPO_ROOT / f"escape-{uuid.uuid4().hex}.txt"
    result = py(f"open({str(outside / 'escape.txt')!r}, 'w').write('x')")
    assert result.error == f"write outside working directory: {outside / 'escape.txt'}"
    attempts = {
        "relative": "open('../escape.txt', 'w')",
        "repo root": f"open({str(repo_escape)!r}, 'a')",
        "os.open": f"os.open({str(outside / 'a.txt')!r}, os.O_WRONLY | os.O_CREAT)",
        "pathlib": f"pathlib.Path({str(outside / 'b.txt')!r}).write_text('x')",
        "remove": f"os.remove({str(keep)!r})",
        "rename": f"os.rename({str(keep)!r}, 'stolen.txt')",
        "mkdir": f"os.makedirs({str(outside / 'd' / 'e')!r})",
        "symlink": f"os.symlink({str(keep)!r}, 'link'); open('link', 'w')",
        "chdir": "os.chdir('/'); open('escape.txt', 'w')",
    }
    allowed = "open('/dev/null', 'w').write('x'); open('/dev/stdout', 'w').write('')"
    lines = ["import os, pathlib", "results = {}"]
    for name, attempt in attempts.items():
        lines += [
            "try:",
            f"    {attempt}",
            f"    results[{name!r}] = 'written'",
            "except PermissionError as exc:",
            f"    results[{name!r}] = 'refused'",
        ]
    lines += [
        allowed,
        "os.chdir(os.environ['HOME'])",
        "open('inside.txt', 'w').write('fine')",
        "os.makedirs('sub/dir'); os.rename('inside.txt', 'sub/dir/moved.txt')",
        "print(sorted(results.items()), open('sub/dir/moved.txt').read())",
    ]
    result = py("\n".join(lines))
    assert result.ok, result.output
    assert result.output == f"{sorted((name, 'refused') for name in attempts)} fine\n"
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert keep.read_text() == "precious"
    assert not repo_escape.exists()
    assert not (sandbox_parent.parent / "escape.txt").exists()
    assert_nothing_left(sandbox_parent)


def test_socket_to_localhost_is_refused(py, sandbox_parent):
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        result = py(code)
        assert not result.ok and result.error == "network disabled"
        assert "network disabled in rlpost sandbox" in result.output
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing connected
        code = f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/')\n"
        url = py(code)
        assert url.error == "network disabled"  # found through URLError's context


def test_network_namespace_stops_code_that_bypasses_the_prelude(py, sandbox_parent):
    probe = py("import os\nprint(os.readlink('/proc/self/ns/net'))")
    if probe.output.strip() == os.readlink("/proc/self/ns/net"):
        assert py.keywords["sandbox"] == "guard", "the bwrap sandbox always has its own network namespace"
        pytest.skip("guard mode: no network namespace for the sandbox here (needs CAP_SYS_ADMIN)")
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        port = server.getsockname()[1]
        code = "import _socket\ns = _socket.socket()\ns.settimeout(2)\n"
        code += f"s.connect(('127.0.0.1', {port}))\n"
        result = py(code)
        # its own namespace: unreachable, or a loopback of its own where nothing listens
        assert not result.ok
        assert result.error.split(":")[0] in ("OSError", "ConnectionRefusedError"), result.error
        with pytest.raises(BlockingIOError):
            server.accept()


def test_printing_100_megabytes_is_cut_fast_with_flat_memory(py, sandbox_parent):
    tracemalloc.start()
    try:
        start = time.monotonic()
        result = py("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)\n")
        elapsed = time.monotonic() - start
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not result.ok and result.error == "output limit 16384 bytes exceeded"
    assert result.output == "x" * 16384 + "\n[output truncated: more than 16384 bytes]"
    assert elapsed < 3.0
    assert peak_bytes < 2 * 2**20
    assert_nothing_left(sandbox_parent)


def test_working_directory_is_fresh_empty_and_removed(py, sandbox_parent, monkeypatch):
    monkeypatch.setenv("RLPOST_SECRET_TOKEN", "hunter2")
    code = "import os\nprint(os.getcwd())\nprint(os.listdir('.'))\nprint(sorted(os.environ))\n"
    code += "open('f', 'w').write('x')\n"
    result = py(code)
    cwd, listing, env_keys = result.output.splitlines()
    assert listing == "[]"
    if py.keywords["sandbox"] == "guard":
        assert Path(cwd).parent.parent == sandbox_parent
        assert not Path(cwd).exists()
    else:
        assert cwd == "/sandbox"  # a tmpfs of its own, gone with its mount namespace
    assert "RLPOST_SECRET_TOKEN" not in env_keys
    allowed = {"PATH", "LANG", "HOME", "TMPDIR", "LC_CTYPE", "PWD"}
    allowed |= {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}
    assert set(eval(env_keys)) <= allowed
    # also after a timeout
    py("open('f', 'w').write('x')\nwhile True:\n    pass\n", timeout_s=0.5)
    assert_nothing_left(sandbox_parent)


def test_concurrent_calls_from_threads_are_independent(py, sandbox_parent):
    # An env-pool actor may run the tool for several samples at once.
    codes = [f"print({i} * {i})" if i % 2 else f"import time\ntime.sleep(0.2)\nprint({i})" for i in range(6)]
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(py, codes))
    assert [r.output for r in results] == [f"{i * i if i % 2 else i}\n" for i in range(6)]
    assert all(r.ok for r in results)
    assert_nothing_left(sandbox_parent)


def test_crash_by_signal_is_reported(py, sandbox_parent):
    result = py("import ctypes\nctypes.string_at(0)\n")
    assert result.returncode == -11 and result.error == "killed by SIGSEGV"


def test_invalid_limits_are_value_errors():
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("pass", timeout_s=0)
    with pytest.raises(ValueError, match="cpu_s"):
        run_python("pass", cpu_s=0)


SEED_ACTION = """Here is a block of code to be executed in python:
```python
def square(x):
    return x * x
print('testing the square function with input 2:', square(2))
```
<|im_end|>
"""

SEED_TOOL_RESPONSE = (
    "<tool_response>\n"
    "Code block 1 executed successfully:\n"
    "testing the square function with input 2: 4\n"
    "\n"
    "</tool_response>"
)


def test_seed_000_tool_turn_renders_exactly(py, sandbox_parent):
    blocks = extract_python_blocks(SEED_ACTION)
    assert blocks == [SEED_CODE]
    assert format_tool_response([py(block) for block in blocks]) == SEED_TOOL_RESPONSE


def test_extract_python_blocks():
    text = "a\n```python\nprint(1)\n```\nb ```py\nprint(2)```\n```bash\nls\n```\n"
    text += "```Python3 \nx = 3\n```\n```python\ncut"
    assert extract_python_blocks(text) == ["print(1)\n", "print(2)", "x = 3\n"]
    assert extract_python_blocks("no code here") == []


def test_format_tool_response_with_a_failed_block():
    results = [
        PythonResult(True, "1\n", None, 0, 0.1),
        PythonResult(False, "partial\n", "timeout after 5.0s", -9, 5.0),
        PythonResult(True, "", None, 0, 0.1),
    ]
    assert format_tool_response(results) == (
        "<tool_response>\n"
        "Code block 1 executed successfully:\n1\n\n"
        "Code block 2 failed:\ntimeout after 5.0s\npartial\n\n"
        "Code block 3 executed successfully:\n\n"
        "</tool_response>"
    )
    with pytest.raises(ValueError, match="at least one"):
        format_tool_response([])
