"""Grading model-written Python functions against a dataset's unit tests (HumanEval's row format).

:func:`grade_code` scores the model's code against one row (:mod:`rlpost.envs.code`) in a
:class:`~rlpost.envs.function_pool.FunctionPool` worker with a wall-clock limit, never in the env
pool's own process.

Two sides, two trust levels::

    test side (this process: trusted)              sandbox (SandboxProcess: untrusted)
    the row's prompt helpers, the test module      the program: the model's code (with the
    check(candidate)'s statements, one by one      prompt's imports and helpers), exec'd once
    candidate(*args)  --encoded literals-->        call entry_point(*args) in the same session
                      <--encoded result---         print the encoded result between markers

- The dataset's tests are trusted like the user's own reward function: they run here.
- The model's code runs only in a :class:`~rlpost.envs.sandbox.SandboxProcess` ("bwrap" by
  default: namespaces, CPU/memory/process limits, no network, no host files).
- Only plain literal values cross (``None``, ``bool``, ``int``, ``float`` with inf and nan,
  ``str``, ``bytes``, ``list``, ``tuple``, ``dict``, ``set``, ``frozenset``), in a small tagged
  JSON encoding (:func:`encode_value` / :func:`decode_value`; exact types, so no subclass
  crosses); anything else is refused and that test fails. Replies are parsed as JSON,
  size-bounded, and rebuilt from the tags only (never ``eval``, never ``pickle``). So whatever
  the code does in the sandbox (redefining ``check``, patching builtins or ``AssertionError``,
  an always-equal ``__eq__``, printing fake results) changes nothing here: the asserts run here,
  on values built here. Forging a reply is no better than returning that value.

The tests of a row (parsed with :mod:`ast`): the ``test`` module's top-level statements run
first, here, after the prompt's own helpers (HumanEval/32's test calls the prompt's ``poly``).
Each top-level statement of ``check`` that holds an ``assert`` and uses the candidate (its
parameter, or the entry point's name, as HumanEval/33's test calls ``sort_third`` itself) is one
test (a ``for`` loop of asserts is one); the others are setup, run in order. ``assert True``
lines are setup too, so code that defines nothing earns nothing. A test passes when its
statement raises nothing.

The program sent to the sandbox: the prompt without its ``entry_point`` function (imports and
helpers) then the code when the code defines ``entry_point``, else the prompt then the code
(HumanEval's body-continuation form). It is exec'd once; each call runs in the same session, so
module state persists as in a normal run.

Limits: each call (and the program's own run) has ``call_timeout_s``; the whole grading
``timeout_s``. A call past its limit, the session dying (a fork bomb killed past its process
limit, ``os._exit``, a crash) or the deadline ends grading: the tests not yet passed count as
failed. The program failing to run (a syntax error, an exception, a memory error, a non-zero
exit) scores 0. The session is always closed: nothing it started is left.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import json
import math
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlpost.envs.sandbox import Limits, Outcome, SandboxProcess

REQUIRED_COLUMNS = ("prompt", "test", "entry_point")
MAX_REPLY_BYTES = 1 << 20  # what one call (or the program's run) may print, the encoded result included
MAX_PROCS = 16  # live processes in the sandbox (the code needs one; more is a fork bomb)
DISK_MB = 64  # the sandbox's private working directory
MAX_FILE_MB = 16
_MAX_DEPTH = 64  # nesting of an encoded value
_SANDBOX_NAMESPACE = "__rlpost_grader__"  # the sandbox global holding the call helper


class CandidateError(Exception):
    """A call of the candidate failed: the function raised in the sandbox, its result cannot cross,
    or the reply was malformed. The test that made the call fails; grading goes on."""


class _GradingStopped(BaseException):
    """The sandbox session ended (timeout, death, a limit): no further call can be made.
    A BaseException, so that a test's ``except Exception`` cannot swallow it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class CodeGrade:
    """``passed`` of ``total`` tests passed. ``error`` is None when every test ran (passing or
    not), else why grading stopped or never started: "no code", "syntax error", "exception at
    import", "memory limit", "exit at import", "timeout", "process limit", "output limit", "sandbox
    died" (the interpreter ended, or broke the status line it reports each block with)."""

    passed: int
    total: int
    error: str | None = None

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


# ------------------------------------------------------------------------------ the encoding
# encode_value and decode_value also run inside the sandbox: their source is sent there
# (_sandbox_helper_source), so they use nothing but builtins and the _MAX_DEPTH constant.


def encode_value(value: Any, depth: int = 0) -> list:
    """``value`` as a JSON-ready tagged list: ``["none"]``, ``["int", 3]``, ``["float", "inf"]``,
    ``["bytes", "00ff"]``, ``["tuple", [...]]``, ``["dict", [[key, value], ...]]``, ...

    Only exact built-in types cross (a subclass of ``str`` or ``int`` is refused: it could carry
    its own ``__eq__``); ``TypeError`` for any other value, ``ValueError`` past ``_MAX_DEPTH``
    levels of nesting."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"value nested deeper than {_MAX_DEPTH} levels")
    kind = type(value)
    if value is None:
        return ["none"]
    if kind is bool or kind is int or kind is str:
        return [kind.__name__, value]
    if kind is float:
        return ["float", repr(value)]  # repr round-trips exactly, and writes inf and nan
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind is list or kind is tuple or kind is set or kind is frozenset:
        return [kind.__name__, [encode_value(item, depth + 1) for item in value]]
    if kind is dict:
        return ["dict", [[encode_value(k, depth + 1), encode_value(v, depth + 1)] for k, v in value.items()]]
    raise TypeError(
        f"a {kind.__name__} value cannot cross the sandbox boundary (only None, bool, int, float, str, bytes, list, "
        "tuple, dict, set and frozenset)"
    )


def decode_value(data: Any, depth: int = 0) -> Any:
    """The value :func:`encode_value` encoded (``data`` as ``json.loads`` returns it). Strict:
    ``ValueError`` (or ``TypeError``, e.g. a list as a set element) for anything malformed."""
    if depth > _MAX_DEPTH:
        raise ValueError(f"value nested deeper than {_MAX_DEPTH} levels")
    if type(data) is not list or not data or type(data[0]) is not str:
        raise ValueError("malformed encoded value")
    tag = data[0]
    if tag == "none" and len(data) == 1:
        return None
    if len(data) != 2:
        raise ValueError(f"malformed encoded value of tag {tag!r}")
    payload = data[1]
    if (tag == "bool" and type(payload) is bool) or (tag == "int" and type(payload) is int):
        return payload
    if tag == "str" and type(payload) is str:
        return payload
    if tag == "float" and type(payload) is str:
        return float(payload)
    if tag == "bytes" and type(payload) is str:
        return bytes.fromhex(payload)
    if tag in ("list", "tuple", "set", "frozenset") and type(payload) is list:
        items = [decode_value(item, depth + 1) for item in payload]
        if tag == "list":
            return items
        return tuple(items) if tag == "tuple" else (set(items) if tag == "set" else frozenset(items))
    if tag == "dict" and type(payload) is list:
        result = {}
        for pair in payload:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("malformed encoded dict item")
            result[decode_value(pair[0], depth + 1)] = decode_value(pair[1], depth + 1)
        return result
    raise ValueError(f"malformed encoded value of tag {tag!r}")


# The call helper, run inside the sandbox: decode the arguments, call the function, print the
# encoded result (or the exception's type and message) between two copies of a per-call marker.
_SANDBOX_CALL = """
def call(user_globals, name, marker, payload):
    import json, sys
    try:
        args = [decode_value(item) for item in json.loads(payload)]
        text = json.dumps(["ok", encode_value(user_globals[name](*args))])
    except BaseException as exc:  # SystemExit and MemoryError too: the call failed, the session goes on
        try:
            text = json.dumps(["error", (type(exc).__name__ + ": " + str(exc))[:300]])
        except BaseException:
            text = '["error", "unprintable exception"]'
    sys.stdout.write("\\n" + marker + "\\n" + text + "\\n" + marker + "\\n")
    sys.stdout.flush()
"""


def _sandbox_helper_source() -> str:
    """The block that defines the call helper in the sandbox, in a namespace of its own."""
    helper = "\n".join([
        "from __future__ import annotations",
        f"_MAX_DEPTH = {_MAX_DEPTH}",
        inspect.getsource(encode_value),
        inspect.getsource(decode_value),
        _SANDBOX_CALL,
    ])  # fmt: skip
    return f"{_SANDBOX_NAMESPACE} = {{}}\nexec(compile({helper!r}, '<rlpost grader>', 'exec'), {_SANDBOX_NAMESPACE})\n"


def parse_reply(output: bytes, marker: str) -> Any:
    """The value the call helper printed between the last two ``marker`` lines of ``output``;
    ``CandidateError`` when the function raised or the reply is missing or malformed."""
    text = output.decode("utf-8", errors="replace")
    parts = text.split("\n" + marker + "\n")
    if len(parts) < 3:
        raise CandidateError("the sandbox sent no reply")
    try:
        kind, value = json.loads(parts[-2])
        if kind == "ok":
            return decode_value(value)
    except (ValueError, TypeError, RecursionError) as exc:
        raise CandidateError(f"malformed reply from the sandbox ({type(exc).__name__})") from None
    raise CandidateError(f"the function raised {str(value)[:300]}")


# ------------------------------------------------------------------------------ the tests


@dataclass(frozen=True)
class SplitTests:
    """A row's ``test`` source, split: ``module`` holds its module-level statements but
    ``check``; ``statements`` the statements of ``check``'s body in order, each with whether it
    is a test; ``parameter`` is ``check``'s candidate parameter."""

    module: ast.Module
    parameter: str
    statements: tuple[tuple[ast.stmt, bool], ...]
    filename: str

    @property
    def total(self) -> int:
        return sum(is_test for _, is_test in self.statements)


def row_name(row: Mapping[str, Any]) -> str:
    """How error messages name a row: its ``task_id`` when it has one."""
    task_id = row.get("task_id")
    return f"row {task_id!r}" if task_id is not None else "row"


def check_row(row: Mapping[str, Any]) -> None:
    """``ValueError`` naming the row and the column when a required column is missing or not a string."""
    for column in REQUIRED_COLUMNS:
        if not isinstance(row.get(column), str):
            found = "missing" if column not in row else f"a {type(row[column]).__name__}"
            raise ValueError(
                f"{row_name(row)}: column {column!r} is {found}; a code row needs strings in {REQUIRED_COLUMNS}"
            )


def split_tests(test_source: str, entry_point: str, *, name: str = "row") -> SplitTests:
    """Split a row's ``test`` source (see the module docstring). ``ValueError`` naming ``name``
    when it does not parse, has no ``check`` function or no test in it."""
    filename = f"<tests of {name}>"
    try:
        module = ast.parse(test_source, filename=filename)
    except SyntaxError as exc:
        raise ValueError(f"{name}: the test source does not parse ({exc})") from None
    checks = [node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == "check"]
    if not checks:
        raise ValueError(f"{name}: the test source has no `def check(candidate)` function")
    check = checks[-1]  # a redefinition wins, as when the module runs
    arguments = check.args.posonlyargs + check.args.args
    if not arguments:
        raise ValueError(f"{name}: `check` takes no parameter (it should be check(candidate))")
    parameter = arguments[0].arg
    statements = tuple((node, _is_test(node, (parameter, entry_point))) for node in check.body)
    if not any(is_test for _, is_test in statements):
        raise ValueError(f"{name}: `check` has no assert that uses the candidate ({parameter!r} or {entry_point!r})")
    others = [node for node in module.body if node is not check]
    return SplitTests(ast.Module(body=others, type_ignores=[]), parameter, statements, filename)


def _is_test(node: ast.stmt, names: tuple[str, ...]) -> bool:
    """Whether a statement of ``check`` is a test: it holds an assert and uses the candidate."""
    has_assert = any(isinstance(child, ast.Assert) for child in ast.walk(node))
    uses = any(isinstance(child, ast.Name) and child.id in names for child in ast.walk(node))
    return has_assert and uses


# ------------------------------------------------------------------------------ the program


def prompt_without_entry_point(prompt: str, entry_point: str) -> str:
    """The prompt's source without its ``entry_point`` function; a prompt that does not parse on
    its own gives its top-level import lines."""
    try:
        module = ast.parse(prompt)
    except (SyntaxError, ValueError):
        return "".join(line for line in prompt.splitlines(True) if line.startswith(("import ", "from ")))
    lines = prompt.splitlines(True)
    for node in reversed(module.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry_point:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            del lines[first - 1 : node.end_lineno]
    return "".join(lines)


def defines(code: str, name: str) -> bool:
    """Whether ``code`` parses on its own and binds ``name`` at its top level (a def, a class,
    an assignment or an import)."""
    try:
        module = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names):
                return True
    return False


def build_program(code: str, row: Mapping[str, Any]) -> str:
    """The source the sandbox execs (see the module docstring); ``SyntaxError`` when it does not
    parse."""
    prompt, entry_point = row["prompt"], row["entry_point"]
    if defines(code, entry_point):
        head = prompt_without_entry_point(prompt, entry_point)
    else:
        head = prompt
    if head and not head.endswith("\n"):
        head += "\n"
    program = head + code
    try:  # compiled, not run: also catches what ast.parse lets through (a `return` outside a function)
        compile(program, "<code>", "exec", dont_inherit=True)
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes, absurd nesting
        raise SyntaxError(f"the code cannot be compiled ({type(exc).__name__})") from None
    return program


# ------------------------------------------------------------------------------ grading


class _Session:
    """The sandboxed interpreter of one grading and the deadline it runs under."""

    def __init__(self, process: SandboxProcess, entry_point: str, deadline: float, call_timeout_s: float) -> None:
        self.process, self.entry_point = process, entry_point
        self.deadline, self.call_timeout_s = deadline, call_timeout_s
        self.stopped: str | None = None  # why the session ended

    def run(self, code: str, limit_s: float | None = None) -> Outcome:
        """Run one block within ``limit_s`` (default ``call_timeout_s``) and the deadline;
        ``_GradingStopped`` once the deadline passed or the session ended."""
        if self.stopped is None and time.monotonic() >= self.deadline:
            self.stopped = "timeout"
        if self.stopped is not None:
            raise _GradingStopped(self.stopped)
        limit_s = self.call_timeout_s if limit_s is None else limit_s
        outcome = self.process.run(code, min(limit_s, self.deadline - time.monotonic()), MAX_REPLY_BYTES)
        if outcome.stop is not None:
            self.stopped = {"timeout": "timeout", "output": "output limit", "procs": "process limit"}[outcome.stop]
        elif outcome.status is None or not self.process.alive:
            self.stopped = "sandbox died"
        if self.stopped is not None:
            raise _GradingStopped(self.stopped)
        return outcome

    def call(self, args: tuple) -> Any:
        payload = json.dumps([encode_value(arg) for arg in args])  # TypeError: this test fails
        marker = f"<<rlpost-reply-{secrets.token_hex(8)}>>"
        block = f"{_SANDBOX_NAMESPACE}['call'](globals(), {self.entry_point!r}, {marker!r}, {payload!r})\n"
        return parse_reply(self.run(block).output, marker)


class _Candidate:
    """What the tests call in place of the model's function: each call runs in the sandbox."""

    def __init__(self, session: _Session) -> None:
        self._session = session
        self.__name__ = session.entry_point

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise CandidateError("keyword arguments cannot cross the sandbox boundary")
        return self._session.call(args)

    def __repr__(self) -> str:
        return f"<sandboxed function {self.__name__}>"


def grade_code(
    code: str | None,
    row: Mapping[str, Any],
    *,
    timeout_s: float = 10.0,
    call_timeout_s: float = 3.0,
    memory_mb: int = 512,
    sandbox: str = "bwrap",
) -> CodeGrade:
    """Run ``row``'s tests against the model's ``code`` (module docstring). ``memory_mb``: the
    sandbox's address space; its CPU time is ``ceil(timeout_s) + 1`` s; ``sandbox``: "bwrap" or
    "guard" (:mod:`rlpost.envs.sandbox`). ``ValueError`` for a malformed row (a missing column,
    no ``check``, no test); what the code does never raises here.
    """
    if timeout_s <= 0 or call_timeout_s <= 0:
        raise ValueError(f"grade_code needs timeout_s > 0 and call_timeout_s > 0, got {timeout_s=}, {call_timeout_s=}")
    check_row(row)
    deadline = time.monotonic() + timeout_s
    tests = split_tests(row["test"], row["entry_point"], name=row_name(row))
    if code is None or not code.strip():
        return CodeGrade(0, tests.total, "no code")
    try:
        program = build_program(code, row)
    except SyntaxError:
        return CodeGrade(0, tests.total, "syntax error")
    limits = Limits(
        cpu_s=math.ceil(timeout_s) + 1, memory_mb=memory_mb, max_file_mb=MAX_FILE_MB, disk_mb=DISK_MB,
        max_procs=MAX_PROCS,
    )  # fmt: skip
    process = SandboxProcess(limits, sandbox)
    session = _Session(process, row["entry_point"], deadline, call_timeout_s)
    passed = 0
    try:
        # the first block starts the interpreter: it gets the whole deadline, so that a slow start
        # on a loaded machine does not count against the code
        session.run(_sandbox_helper_source(), limit_s=timeout_s)
        outcome = session.run(program)
        failure = _program_failure(outcome.status)
        if failure is not None:
            return CodeGrade(0, tests.total, failure)
        for is_test, ok in _run_tests(tests, row, _Candidate(session), deadline):
            passed += is_test and ok
    except _GradingStopped as stopped:
        return CodeGrade(passed, tests.total, stopped.reason)
    finally:
        process.close()
    return CodeGrade(passed, tests.total, None)


def _program_failure(status: dict) -> str | None:
    """Why the program's run failed (its status line from the sandbox), or None when it ran."""
    if status.get("exc_type") == "MemoryError":
        return "memory limit"
    if "exc_type" in status:
        return "exception at import"
    if status.get("exit_code") != 0:  # sys.exit(0) ends the module early; its definitions stand
        return "exit at import"
    return None


def _run_tests(tests: SplitTests, row: Mapping[str, Any], candidate: _Candidate, deadline: float):
    """Run the trusted test code here; yield ``(is_test, passed)`` for each statement of
    ``check``. ``_GradingStopped`` ends it (the deadline, or the sandbox session ended)."""
    entry_point = row["entry_point"]
    namespace: dict[str, Any] = {"__name__": "__rlpost_tests__", "__builtins__": builtins}
    helpers = prompt_without_entry_point(row["prompt"], entry_point)
    exec(compile(helpers, f"<prompt of {row_name(row)}>", "exec"), namespace)
    namespace[entry_point] = candidate
    exec(compile(tests.module, tests.filename, "exec"), namespace)
    scope = dict(namespace)  # check's own names, kept apart from the module's globals
    scope[tests.parameter] = candidate
    for node, is_test in tests.statements:
        if time.monotonic() >= deadline:
            raise _GradingStopped("timeout")
        statement = compile(ast.Module(body=[node], type_ignores=[]), tests.filename, "exec")
        try:
            exec(statement, scope)
        except Exception:  # a failed assert, a failed call, a wrong value: this test fails
            yield is_test, False
        else:
            yield is_test, True
