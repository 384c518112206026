"""Tasks of the ``reasoning-gym`` package (imported as ``reasoning_gym``) as an rlpost training task.

``reasoning_gym`` holds about a hundred procedural task generators (arithmetic, logic puzzles,
games, graphs, ...), each with a seeded generator of ``{"question", "answer", "metadata"}``
entries and its own scorer ``score_answer(answer, entry) -> float`` in [0, 1] (partial credit
possible). Nothing is downloaded (a few tasks read files shipped inside the package).

The task mapping: ``NAME -> WEIGHT`` (a positive number), or ``NAME -> {weight: W, option: value,
...}`` where ``weight`` (default 1.0) is the task's share of the mixture and every other key an
option of the task's config (e.g. ``chain_sum: {weight: 2, min_terms: 2, max_terms: 3}``);
``NAME -> None`` (a bare ``chain_sum:`` in YAML) is weight 1.0 with the defaults. ``seed`` and
``size`` are set by :func:`reasoning_gym_rows`; ``composite`` is refused (the mapping is the
mixture).

A row: ``question`` (the prompt), ``answer`` (the reference; "" for tasks whose scorer checks by
rules, e.g. graph_color, rush_hour), ``task`` (for metrics per task) and ``entry`` (the package's
full entry, which the scorer reads; picklable).

Splits: ``"test"`` (held-out evaluation) draws with other derived seeds and drops every row whose
question is among the train rows of the same ``(tasks, size, seed)``, so an evaluation never
scores a question training could have seen; it may hold fewer than ``size`` rows (raises when
none are left).

Determinism. The same ``(tasks, size, seed, split)`` gives the same rows in every process, except
for the few tasks whose generators iterate over Python sets of strings
(:data:`HASH_SEED_DEPENDENT_TASKS`): their rows also depend on ``PYTHONHASHSEED``, so processes
must share a fixed one for those rows (and the train/test separation) to agree. A run's processes
do (``resources.python_hash_seed``); elsewhere a warning says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import io
import logging
import math
import numbers
import os
import pickle
import random
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from tensordict import TensorDictBase

from rlpost.envs.chat import DatasetChatEnv, as_list
from rlpost.envs.rewards import (
    add_reward,
    count_failure,
    end_episodes,
    extract_answer,
    final_answer,
    has_answer,
    reward_value,
)
from rlpost.envs.transforms import Transform

__all__ = [
    "HASH_SEED_DEPENDENT_TASKS", "REASONING_GYM_SYSTEM_PROMPT", "ReasoningGymEnv", "ReasoningGymRewardParser",
    "reasoning_gym_rows", "reasoning_gym_task_names",
]  # fmt: skip

logger = logging.getLogger(__name__)

REASONING_GYM_SYSTEM_PROMPT = (
    "Think the problem through, then give your final answer inside <answer></answer> tags, exactly in the "
    "format the question asks for, e.g. <answer>42</answer>. Put nothing after the closing tag."
)

SPLITS = ("train", "test")

# Options that reasoning_gym_rows sets itself in every task's config.
_RESERVED_OPTIONS = frozenset({"seed", "size"})

# Tasks of reasoning_gym 0.1.19 whose generated rows change with PYTHONHASHSEED (their
# generators iterate over sets of strings), found by generating each task under two hash seeds.
HASH_SEED_DEPENDENT_TASKS = frozenset(
    {"isomorphic_strings", "knight_swap", "polynomial_multiplication", "ransom_note", "word_ladder"}
)

# Score-outside-[0, 1] error name in the reward parser's ``errors``.
SCORE_OUT_OF_RANGE = "ScoreOutOfRange"


# ---------------------------------------------------------------------------- the task mapping


def _registry() -> dict[str, tuple[type, type]]:
    """The package's registry: name -> (dataset class, config dataclass). Imported lazily: importing
    ``reasoning_gym`` takes about 1.5 s."""
    import reasoning_gym.factory

    return reasoning_gym.factory.DATASETS


def reasoning_gym_task_names() -> list[str]:
    """The names of the tasks the installed package can generate (sorted; ``composite`` left out)."""
    return sorted(name for name in _registry() if name != "composite")


@dataclasses.dataclass(frozen=True)
class _TaskSpec:
    """One task of the mapping, checked: its mixture weight and its config options."""

    name: str
    weight: float
    options: dict[str, Any]


def _parse_tasks(tasks: Mapping[str, Any]) -> list[_TaskSpec]:
    """The checked task specs of a task mapping (see the module docstring), sorted by name so that
    the rows do not depend on the mapping's order. Raises ValueError naming the bad entry."""
    if not isinstance(tasks, Mapping) or not tasks:
        raise ValueError(
            f"reasoning_gym tasks must be a non-empty mapping of task name -> weight or options, got {tasks!r}"
        )
    registry = _registry()
    specs = []
    for name in sorted(tasks, key=str):
        _check_task_name(name, registry)
        value = tasks[name]
        if value is None:
            weight, options = 1.0, {}
        elif isinstance(value, Mapping):
            options = dict(value)
            weight = options.pop("weight", 1.0)
        else:
            weight, options = value, {}
        specs.append(_TaskSpec(name, _check_weight(name, weight), _check_options(name, options, registry)))
    return specs


def _check_task_name(name: Any, registry: Mapping[str, Any]) -> None:
    """ValueError unless ``name`` is a task of the package (close names suggested); ``composite`` refused."""
    if name == "composite":
        raise ValueError(
            "reasoning_gym task 'composite' is not supported: list the tasks to mix in the tasks mapping itself, "
            "each with its weight"
        )
    if isinstance(name, str) and name in registry:
        return
    names = [n for n in registry if n != "composite"]
    close = difflib.get_close_matches(str(name), names, n=3)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(
        f"unknown reasoning_gym task {name!r}{hint} (the installed reasoning_gym has {len(names)} tasks; "
        "list them with rlpost.envs.reasoning_gym.reasoning_gym_task_names())"
    )


def _check_weight(name: str, weight: Any) -> float:
    """``weight`` as a float when it is a finite number > 0 (not a bool); else ValueError naming the task."""
    is_number = isinstance(weight, numbers.Real) and not isinstance(weight, bool)
    if not is_number or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"reasoning_gym task {name!r}: weight must be a positive number, got {weight!r}")
    return float(weight)


def _check_options(name: str, options: dict[str, Any], registry: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` when the task's config takes each of them and its validation accepts their
    values; else ValueError naming the task and the option."""
    config_cls = registry[name][1]
    accepted = sorted(f.name for f in dataclasses.fields(config_cls) if f.name not in _RESERVED_OPTIONS)
    for option in options:
        if option in _RESERVED_OPTIONS:
            raise ValueError(
                f"reasoning_gym task {name!r}: option {option!r} is set by rlpost (the size and seed of "
                "reasoning_gym_rows / ReasoningGymEnv); remove it from the task's options"
            )
        if option not in accepted:
            close = difflib.get_close_matches(str(option), accepted, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"reasoning_gym task {name!r} has no option {option!r}{hint}; its options are {accepted}")
    try:
        config = config_cls(**options)
        if callable(getattr(config, "validate", None)):
            config.validate()
    except (TypeError, ValueError, AssertionError) as exc:
        raise ValueError(f"reasoning_gym task {name!r} refuses options {options}: {_message(exc)}") from exc
    return options


def _message(exc: BaseException) -> str:
    """An exception's text, or its type name when it has none (a bare ``assert``)."""
    return str(exc) or type(exc).__name__


def _create_dataset(name: str, options: Mapping[str, Any], *, seed: int, size: int) -> Any:
    """The package's dataset object of task ``name`` with ``options``; its config errors (a
    dataset's own checks beyond its config's validation) as ValueError naming the task."""
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, **options, seed=seed, size=size)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ValueError(f"reasoning_gym task {name!r} refuses options {dict(options)}: {_message(exc)}") from exc


# ---------------------------------------------------------------------------- rows


def _derived_seed(seed: int, split: str, part: str) -> int:
    """A seed for ``part`` (a task name, or the mixture draw) of ``split``: a hash of the three,
    the same on every machine and Python version. Hashing, not ``seed + offset``: a generator
    seeds entry ``i`` with ``seed + i``, so nearby seeds would repeat each other's entries."""
    digest = hashlib.sha256(f"rlpost/reasoning_gym/{split}/{seed}/{part}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**31


def _generate(spec: _TaskSpec, count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` entries of one task from ``seed``; what generators print (``bf``'s compiler) is
    discarded."""
    dataset = _create_dataset(spec.name, spec.options, seed=seed, size=max(count, 1))
    entries: list[dict[str, Any]] = []
    with contextlib.redirect_stdout(io.StringIO()):
        iterator = iter(dataset)
        for _ in range(count):
            try:
                entries.append(next(iterator))
            except (StopIteration, IndexError) as exc:
                detail = f" ({_message(exc)})" if isinstance(exc, IndexError) else ""
                raise ValueError(
                    f"reasoning_gym task {spec.name!r} with options {spec.options} yielded only {len(entries)} of "
                    f"the {count} rows asked{detail}; ask for fewer rows or give the task a larger problem space"
                ) from exc
    if entries:
        try:
            pickle.dumps(entries[0])
        except Exception as exc:  # the rows travel between processes (Ray actors, env pools)
            raise ValueError(f"reasoning_gym task {spec.name!r} makes entries that cannot be pickled: {exc}") from exc
    return entries


def _row(name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """The row of one package entry (format in the module docstring)."""
    answer = entry.get("answer")
    return {
        "question": str(entry["question"]),
        "answer": "" if answer is None else str(answer),
        "task": name,
        "entry": entry,
    }


def _draw_rows(specs: list[_TaskSpec], size: int, seed: int, split: str) -> list[dict[str, Any]]:
    """``size`` rows: each row's task drawn by weight, then each task's entries generated in one go
    with the task's own derived seed and handed out in the drawn order."""
    mixture = random.Random(_derived_seed(seed, split, "<mixture>"))
    drawn = mixture.choices([spec.name for spec in specs], weights=[spec.weight for spec in specs], k=size)
    counts = Counter(drawn)
    queues = {}
    for spec in specs:  # every task is built, so bad options fail even when a small draw skips the task
        queues[spec.name] = iter(_generate(spec, counts[spec.name], _derived_seed(seed, split, spec.name)))
    return [_row(name, next(queues[name])) for name in drawn]


def reasoning_gym_rows(tasks: Mapping[str, Any], *, size: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """``size`` rows (module docstring) of reasoning_gym ``tasks`` for a
    :class:`~rlpost.envs.chat.DatasetChatEnv`, each row's task drawn by weight; the same
    ``(tasks, size, seed, split)`` gives the same rows, whatever the order of ``tasks``.

    ``ValueError``: an unknown task, a bad weight, an option the task does not take or a value its
    validation refuses, ``size < 1``, an unknown split, a task that cannot generate the rows
    asked, or a test split left with no row.
    """
    if split not in SPLITS:
        raise ValueError(f"reasoning_gym split must be one of {list(SPLITS)}, got {split!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"reasoning_gym size must be an integer >= 1, got {size!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"reasoning_gym seed must be an integer, got {seed!r}")
    specs = _parse_tasks(tasks)
    _warn_hash_seed_dependence(specs)
    if split == "train":
        return _draw_rows(specs, size, seed, "train")
    train_questions = {row["question"] for row in _draw_rows(specs, size, seed, "train")}
    drawn = _draw_rows(specs, size, seed, "test")
    rows = [row for row in drawn if row["question"] not in train_questions]
    if not rows:
        raise ValueError(
            f"reasoning_gym test split of {sorted(s.name for s in specs)} (size={size}, seed={seed}) is empty: "
            "every drawn question is also a train question; widen the tasks' options or lower size"
        )
    if len(rows) < len(drawn):
        dropped = len(drawn) - len(rows)
        logger.info("reasoning_gym test split: dropped %d of %d rows whose question is a train question", dropped,
                    len(drawn))  # fmt: skip
    return rows


def _warn_hash_seed_dependence(specs: list[_TaskSpec]) -> None:
    """Warn when a task of :data:`HASH_SEED_DEPENDENT_TASKS` is used without a fixed PYTHONHASHSEED."""
    affected = sorted(spec.name for spec in specs if spec.name in HASH_SEED_DEPENDENT_TASKS)
    hash_seed = os.environ.get("PYTHONHASHSEED", "random")
    if affected and not hash_seed.isdigit():
        logger.warning(
            "reasoning_gym tasks %s generate rows that depend on PYTHONHASHSEED (unset or random here): "
            "processes draw different rows for them and the test split may hold train questions; rlpost train "
            "gives every process of a run resources.python_hash_seed, elsewhere set PYTHONHASHSEED to a fixed "
            "number in every process",
            affected,
        )


# ---------------------------------------------------------------------------- the reward


class ReasoningGymRewardParser(Transform):
    """``reward += the task's own score of the latest response's answer``.

    The answer is the last ``<answer>`` tag's content (none: 0.0, the scorer is not called),
    scored by the package's ``score_answer(answer, entry)`` of the row's ``task`` (the row dict
    under ``row_key``), built once per task with its options from ``tasks`` (some scorers read
    their config, e.g. tolerances), or the defaults.

    Failures never stop the env: the sample scores 0 and the failure is counted by name in
    ``errors`` (summed in ``env.reward_errors``; the first of each logged): a scorer that raises
    (``prime_factorization`` on a non-number) or a row without ``task``/``entry``: the
    exception's type name; a non-finite score: ``TypeError``/``ValueError``/``"NonFiniteReward"``.
    A finite score outside [0, 1] is clamped into it and counted as ``"ScoreOutOfRange"``, so the
    group's advantages stay bounded.

    ``strict_format``: score 0.0 when anything but whitespace follows ``</answer>`` (rlpost's
    strict answer rule, :mod:`rlpost.envs.rewards`).
    """

    def __init__(
        self,
        *,
        tasks: Mapping[str, Any] | None = None,
        row_key: str = "row",
        set_done_if_answer: bool = True,
        strict_format: bool = False,
    ) -> None:
        super().__init__()
        self.options = {spec.name: spec.options for spec in _parse_tasks(tasks)} if tasks else {}
        self.row_key, self.set_done_if_answer, self.strict_format = row_key, set_done_if_answer, strict_format
        self.errors: Counter = Counter()
        self._scorers: dict[str, Callable[[str | None, dict[str, Any]], Any]] = {}

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        num_envs = td.batch_size[0]
        if self.row_key not in td.keys():
            raise ValueError(f"{type(self).__name__} needs the dataset row under {self.row_key!r} in the step input")
        completions = self._chat_env().last_responses(td)
        rows = as_list(td.get(self.row_key), num_envs)
        add_reward(next_td, [self.score(completion, row) for completion, row in zip(completions, rows)])
        if self.set_done_if_answer:
            end_episodes(next_td, [has_answer(c) for c in completions])
        return next_td

    def score(self, completion: str, row: Mapping[str, Any]) -> float:
        """The reward of ``completion`` for ``row`` (see the class docstring)."""
        answer = final_answer(completion) if self.strict_format else extract_answer(completion)
        if answer is None:
            return 0.0
        task = row.get("task") if isinstance(row, Mapping) else None
        try:
            value = self.scorer(row["task"])(answer, row["entry"])
        except Exception as exc:  # the package's scorers are third-party code: any failure is the sample's
            return self._failed(type(exc).__name__, f"task {task!r}: scoring raised {exc!r}")
        reward, error = reward_value(value)
        if error is not None:
            return self._failed(error, f"task {task!r}: the scorer returned {value!r}")
        if not 0.0 <= reward <= 1.0:
            self._failed(SCORE_OUT_OF_RANGE, f"task {task!r}: the scorer returned {value!r}, clamped into [0, 1]")
            reward = min(max(reward, 0.0), 1.0)
        return reward

    def scorer(self, task: str) -> Callable[[str | None, dict[str, Any]], Any]:
        """The package's ``score_answer`` of ``task`` (cached per task)."""
        if task not in self._scorers:
            if task in self.options:
                dataset = _create_dataset(task, self.options[task], seed=0, size=1)
                self._scorers[task] = dataset.score_answer
            else:
                import reasoning_gym

                self._scorers[task] = reasoning_gym.get_score_answer_fn(task)
        return self._scorers[task]

    def _failed(self, error: str, detail: str) -> float:
        message = "%s: %s; reward 0 (counted in reward_errors as %s; logged once per error type)"
        count_failure(self.errors, error, logger, message, type(self).__name__, detail, error)
        return 0.0

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(tasks={sorted(self.options)}, set_done_if_answer={self.set_done_if_answer}, "
            f"strict_format={self.strict_format})"
        )


# ---------------------------------------------------------------------------- the env


class ReasoningGymEnv(DatasetChatEnv):
    """A :class:`~rlpost.envs.chat.DatasetChatEnv` over generated reasoning_gym rows.

    The rows are :func:`reasoning_gym_rows` of ``tasks``, ``size``, ``split`` and ``row_seed``
    (default ``seed``, else 0); with ``compute_reward`` a :class:`ReasoningGymRewardParser` scores
    them. Other keywords but ``dataset`` go to :class:`~rlpost.envs.chat.DatasetChatEnv`.
    """

    SYSTEM_PROMPT = REASONING_GYM_SYSTEM_PROMPT

    def __init__(
        self,
        *,
        tasks: Mapping[str, Any],
        size: int = 1000,
        row_seed: int | None = None,
        split: str = "train",
        compute_reward: bool = True,
        max_steps: int | None = 1,
        **kwargs: Any,
    ) -> None:
        if "dataset" in kwargs:
            raise ValueError("ReasoningGymEnv generates its rows from tasks; it takes no dataset")
        row_seed = row_seed if row_seed is not None else (kwargs.get("seed") or 0)
        rows = reasoning_gym_rows(tasks, size=size, seed=row_seed, split=split)
        for column, default in (("prompt_column", "question"), ("answer_column", "answer")):
            if kwargs.get(column) is None:
                kwargs[column] = default
        super().__init__(dataset=rows, max_steps=max_steps, **kwargs)
        self.tasks, self.split = dict(tasks), split
        if compute_reward:
            self.append_transform(ReasoningGymRewardParser(tasks=tasks))
