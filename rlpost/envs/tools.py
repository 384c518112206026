"""Running model-written Python in the sandbox, and rendering the results as tool messages.

``run_python(code)`` runs one block in a fresh sandboxed interpreter (:mod:`rlpost.envs.sandbox`:
bubblewrap namespaces, rlimits and a prelude guard); :class:`PythonSession` keeps one interpreter
across blocks (one per episode is TorchRL's ``persistent=True``). :func:`format_tool_response`
renders the results as in TorchRL's LLM tutorial::

    <tool_response>
    Code block 1 executed successfully:
    testing the square function with input 2: 4

    </tool_response>
"""

from __future__ import annotations

import errno
import inspect
import math
import re
import signal
import time
from dataclasses import dataclass

from rlpost.envs.sandbox import Limits, Outcome, SandboxProcess, check_sandbox

# A session's interpreter gets this many blocks' worth of CPU time (RLIMIT_CPU is per process).
SESSION_CPU_BLOCKS = 20


@dataclass(frozen=True)
class PythonResult:
    """What one sandboxed run gave (made by :func:`run_python` / :class:`PythonSession`).

    ``ok``: ran to the end (or exited 0). ``output``: stdout and stderr interleaved, cut after
    ``max_output_bytes`` with a marker line. ``error``, when not ok, is a one-line reason:
    ``"timeout after 5.0s"``, ``"memory limit 512 MB exceeded"``, ``"CPU time limit"``,
    ``"process limit"``, ``"network disabled"``, ``"file size limit"``, ``"write outside working
    directory: PATH"``, ``"output limit N bytes exceeded"``, ``"exit code N"``, ``"killed by
    SIGNAME"``, or the last line of the exception.
    ``returncode`` is the process's (negative for a signal; None while a session's interpreter
    lives on).
    """

    ok: bool
    output: str
    error: str | None
    returncode: int | None
    duration_s: float


@dataclass(frozen=True)
class _Options:
    """Checked ``run_python`` options, shared by the one-shot and the session paths."""

    timeout_s: float
    memory_mb: int
    max_output_bytes: int
    sandbox: str
    limits: Limits

    @classmethod
    def make(cls, timeout_s: float, memory_mb: int, cpu_s: int | None, max_output_bytes: int, max_file_mb: int,
             max_procs: int, disk_mb: int, sandbox: str, cpu_blocks: int = 1) -> _Options:  # fmt: skip
        if timeout_s <= 0 or memory_mb < 32 or max_output_bytes < 1 or max_file_mb < 1 or max_procs < 1:
            raise ValueError(
                "run_python needs timeout_s > 0, memory_mb >= 32 and positive max_output_bytes, "
                f"max_file_mb, max_procs; got {timeout_s=}, {memory_mb=}, {max_output_bytes=}, "
                f"{max_file_mb=}, {max_procs=}"
            )
        if cpu_s is not None and cpu_s < 1:
            raise ValueError(f"run_python needs cpu_s >= 1, got {cpu_s}")
        if disk_mb < max_file_mb:
            raise ValueError(f"run_python needs disk_mb >= max_file_mb, got {disk_mb=}, {max_file_mb=}")
        check_sandbox(sandbox)
        cpu_s = cpu_s if cpu_s is not None else math.ceil(timeout_s) + 1
        limits = Limits(
            cpu_s=cpu_s * cpu_blocks, memory_mb=memory_mb, max_file_mb=max_file_mb, disk_mb=disk_mb, max_procs=max_procs
        )
        return cls(float(timeout_s), memory_mb, max_output_bytes, sandbox, limits)

    def result(self, outcome: Outcome, start: float) -> PythonResult:
        out = outcome.output
        output = out[: self.max_output_bytes].decode("utf-8", errors="replace")
        if len(out) > self.max_output_bytes:
            output += f"\n[output truncated: more than {self.max_output_bytes} bytes]"
        returncode = outcome.returncode
        if self.sandbox == "bwrap" and returncode is not None and returncode > 128 and outcome.status is None:
            returncode = 128 - returncode  # bwrap reports a signal death as 128 + signal
        error = _failure_reason(
            outcome.stop,
            outcome.status,
            returncode,
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            max_output_bytes=self.max_output_bytes,
        )
        return PythonResult(error is None, output, error, returncode, time.monotonic() - start)


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    cpu_s: int | None = None,
    max_output_bytes: int = 16384,
    max_file_mb: int = 16,
    max_procs: int = 64,
    disk_mb: int = 64,
    sandbox: str = "bwrap",
) -> PythonResult:
    """Run ``code`` in a fresh sandboxed interpreter. ``timeout_s`` is wall-clock time, ``cpu_s``
    (default ``ceil(timeout_s) + 1``) CPU time; ``memory_mb`` caps the address space (virtual
    memory, not RSS), ``max_file_mb`` each file written, ``disk_mb`` the working directory,
    ``max_procs`` the processes alive at once; output past ``max_output_bytes`` stops the run.
    ``sandbox``: "bwrap" (namespaces; :class:`~rlpost.envs.sandbox.SandboxUnavailable` where they
    do not work) or "guard" (the in-process prelude only, not a security boundary). Nothing the
    code does raises here; invalid arguments raise ``ValueError``.
    """
    options = _Options.make(timeout_s, memory_mb, cpu_s, max_output_bytes, max_file_mb, max_procs, disk_mb, sandbox)
    start = time.monotonic()
    process = SandboxProcess(options.limits, sandbox)
    try:
        process.start()
        outcome = process.run(code, options.timeout_s, options.max_output_bytes)
    except OSError as exc:  # the host failed (no processes, descriptors or disk left), not the code
        return PythonResult(False, "", f"sandbox error: {exc}", None, time.monotonic() - start)
    finally:
        process.close()
    if outcome.status is not None and outcome.stop is None:
        outcome.returncode = outcome.status["exit_code"]  # it would have exited with it
    return options.result(outcome, start)


def _run_python_defaults() -> dict:
    """run_python's keyword options and their defaults (PythonSession takes the same)."""
    parameters = inspect.signature(run_python).parameters.values()
    return {p.name: p.default for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


class PythonSession:
    """One sandboxed interpreter that runs many blocks: what one block defines, the next sees.

    :func:`run_python`'s options; ``cpu_s`` is per block, the interpreter's CPU limit
    ``SESSION_CPU_BLOCKS`` times that. A block that ends the interpreter (a timeout, a limit, a
    crash, ``os._exit``) loses its state: the next ``run`` starts a new one, its output beginning
    with a note saying so. ``close()`` (or leaving the ``with`` block) kills it.
    """

    def __init__(self, **options) -> None:
        defaults = _run_python_defaults()
        unknown = sorted(set(options) - set(defaults))
        if unknown:
            raise TypeError(f"PythonSession got unexpected options {unknown}; known: {sorted(defaults)}")
        self.options = _Options.make(**{**defaults, **options}, cpu_blocks=SESSION_CPU_BLOCKS)
        self._process: SandboxProcess | None = None
        self._lost = False  # the last block ended the interpreter
        self.num_blocks = 0

    def run(self, code: str) -> PythonResult:
        start = time.monotonic()
        note = ""
        if self._process is None or not self._process.alive:
            if self._process is not None:
                self._process.close()
                note = "[interpreter restarted: names defined before are gone]\n" if self._lost else ""
            self._process = SandboxProcess(self.options.limits, self.options.sandbox)
        try:
            outcome = self._process.run(code, self.options.timeout_s, self.options.max_output_bytes)
        except OSError as exc:
            self.close()
            return PythonResult(False, note, f"sandbox error: {exc}", None, time.monotonic() - start)
        self.num_blocks += 1
        self._lost = not self._process.alive
        if outcome.status is not None and outcome.stop is None and not self._lost:
            outcome.returncode = None  # the interpreter lives on
        result = self.options.result(outcome, start)
        return PythonResult(result.ok, note + result.output, result.error, result.returncode, result.duration_s)

    def close(self) -> None:
        process, self._process = getattr(self, "_process", None), None  # None: __init__ failed
        if process is not None:
            process.close()

    def __enter__(self) -> PythonSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


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


_BLOCK_RE = re.compile(r"```(?i:python3?|py)[ \t]*\n(.*?)```", re.DOTALL)


def extract_python_blocks(text: str) -> list[str]:
    """The code of each closed ```` ```python ```` (or ``py``) fenced block in ``text``, in order
    (a block left open by a generation cut at the token limit is not returned)."""
    return _BLOCK_RE.findall(text)


def format_tool_response(results: list[PythonResult]) -> str:
    """The tool message for one assistant message's code blocks, in TorchRL's LLM tutorial's
    format (see the module docstring); a failed block renders as
    ``Code block i failed:\n<error>\n<output>\n``."""
    if not results:
        raise ValueError("format_tool_response needs at least one result (no code, no tool turn)")
    parts = []
    for i, result in enumerate(results, start=1):
        if result.ok:
            parts.append(f"Code block {i} executed successfully:\n{result.output}\n")
        else:
            parts.append(f"Code block {i} failed:\n{result.error}\n{result.output}\n")
    return "<tool_response>\n" + "".join(parts) + "</tool_response>"
