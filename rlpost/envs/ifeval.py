"""IFEval (Zhou et al. 2023, "Instruction-Following Evaluation for Large Language Models") as a
chat env and a reward transform, with TorchRL's API: :class:`IFEvalEnv`, :class:`IfEvalScorer`,
:class:`IFEvalScoreData` and the row record :class:`IFEvalData`.

Scoring (strict and loose checks, the punkt data some checkers need, and the scorer's own
deviations from TorchRL) is in :mod:`rlpost.envs.ifeval_scorer`.

Deliberate deviations from TorchRL (each tested):

- :class:`IFEvalData`'s spec has no ``feature_dims`` (rlpost's ``NonTensor`` spec has none), and
  :class:`IFEvalEnv` does not restrict its columns to it unless ``primers=`` is passed (TorchRL's
  env always does, so a dataset without a ``key`` column fails there).
- :class:`IFEvalEnv` defaults to ``"google/IFEval"`` (TorchRL spells it ``"google/IFeval"``; the
  hub resolves both), and with ``compute_reward`` checks every row when it is built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorClass, TensorDictBase
from tensordict.utils import is_non_tensor

from rlpost.data import specs
from rlpost.envs.chat import ChatEnv, DatasetChatEnv, as_list
from rlpost.envs.ifeval_scorer import (
    PUNKT_INSTRUCTIONS,
    IFEvalScoreData,
    IfEvalScorer,
    build_checker,
    require_punkt,
)
from rlpost.envs.transforms import Transform

__all__ = [
    "IFEVAL_SYSTEM_PROMPT", "PUNKT_INSTRUCTIONS", "IFEvalColumns", "IFEvalData", "IFEvalEnv", "IFEvalScoreData",
    "IfEvalScorer", "PromptAsQuery", "require_punkt",
]  # fmt: skip

IFEVAL_SYSTEM_PROMPT = (
    "You are an assistant that follows instructions to the letter.\n\n"
    "Answer every request in two parts:\n"
    "1. Reason about the request step by step between <think> and </think>.\n"
    "2. Write your final response between <answer> and </answer>.\n\n"
    "Only the text inside <answer> </answer> is graded, so it must be complete on its own and "
    "must satisfy every requirement of the request: length, format, capitalisation, "
    "punctuation, required or forbidden words, placeholders such as [name], and so on. Use "
    "exactly these two tags, each once."
)

# IFEval's columns and the keys the scorer reads them from (TorchRL's names for both)
IFEVAL_COLUMNS = {"key": "key", "instruction_id_list": "instruction_id_list", "kwargs": "kwargs"}


class IFEvalData(TensorClass["nocast"]):
    """An IFEval row as :class:`IFEvalEnv` writes it at reset (TorchRL's ``IFEvalData``); the
    optional fields (None until set) are what the policy and the scorer add. ``key`` is int64
    ``[*batch]``; ``kwargs`` holds one dict of checker arguments per instruction.

    :meth:`default_spec` describes the first four; as ``primers=`` of an :class:`IFEvalEnv` (what
    TorchRL's env passes itself) it makes the env write only those columns of each row.
    """

    key: torch.Tensor
    instruction_id_list: list[str]
    kwargs: list[dict]
    query: str
    response: str | None = None
    tokens: torch.Tensor | None = None
    tokens_response: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    reward: torch.Tensor | None = None

    @classmethod
    def default_spec(cls, shape=(), device: torch.device | str | None = None) -> specs.Composite:
        """The spec of rows of batch ``shape`` (non-tensor fields with an example from IFEval)."""
        shape = tuple(shape)
        examples = {
            "instruction_id_list": ["punctuation:no_comma"],
            "kwargs": [{"num_highlights": None, "relation": None, "num_placeholders": None}],
            "query": "Write a short note to a neighbour about a missing cat. Do not use any commas.",
        }
        entries: dict[str, specs.TensorSpec] = {"key": specs.Unbounded(shape, dtype=torch.int64, device=device)}
        entries |= {name: specs.NonTensor(shape, device=device, example_data=value) for name, value in examples.items()}
        return specs.Composite(entries, shape=shape, device=device, data_cls=cls, step_mdp_static=True)


# ---------------------------------------------------------------------------- the env


class IFEvalColumns(Transform):
    """Put IFEval's columns of each drawn row at top level of the reset output (TorchRL's layout,
    where :class:`IfEvalScorer` reads them) and carry them from step to step.

    ``columns`` maps a key to its column (default: IFEval's three, same names). Values come from
    the reset input when it has the key, else from the row the
    :class:`~rlpost.envs.datasets.DataLoadingPrimer` wrote under ``row_key``. An integer column
    becomes an int64 tensor, any other a non-tensor stack.
    """

    def __init__(self, columns: Mapping[str, str] | None = None, *, row_key: str = "row") -> None:
        super().__init__()
        self.columns = dict(IFEVAL_COLUMNS if columns is None else columns)
        self.row_key = row_key
        self.state_keys = tuple(self.columns)

    def reset_preprocess(self, td: TensorDictBase) -> TensorDictBase:
        num_envs = td.batch_size[0]
        rows = as_list(td.get(self.row_key), num_envs) if self.row_key in td.keys() else None
        for key, column in self.columns.items():
            if key in td.keys():
                value = td.get(key)
                if not is_non_tensor(value):
                    continue
                values = as_list(value, num_envs)
            elif rows is not None:
                missing = [i for i, row in enumerate(rows) if column not in row]
                if missing:
                    row = rows[missing[0]]
                    raise ValueError(f"IFEval row {missing[0]} has no column {column!r}; its columns are {sorted(row)}")
                values = [row[column] for row in rows]
            else:
                continue
            if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                td.set(key, torch.tensor(values, dtype=torch.int64, device=td.device))
            else:
                td.set(key, NonTensorStack(*[NonTensorData(v) for v in values], batch_size=[num_envs]))
        return td

    def __repr__(self) -> str:
        return f"IFEvalColumns({self.columns})"


class PromptAsQuery:
    """IFEval's collate function (TorchRL's): each row's ``prompt`` becomes the query key
    (``data_key``); a row with neither raises ``ValueError``. Rows or a dict of columns."""

    def __init__(self, data_key: str = "query") -> None:
        self.data_key = data_key

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            return self._rename(dict(batch))
        return [self._rename(dict(row)) for row in batch]

    def _rename(self, row: dict[str, Any]) -> dict[str, Any]:
        if "prompt" in row:
            row[self.data_key] = row.pop("prompt")
        elif self.data_key not in row:
            raise ValueError(f"IFEval rows need a 'prompt' column; this row has the columns {sorted(row)}")
        return row


class IFEvalEnv(DatasetChatEnv):
    """IFEval as a chat env (TorchRL's ``IFEvalEnv``): ``google/IFEval`` by default.

    As in TorchRL, ``prompt`` becomes the query (:class:`PromptAsQuery`) and each reset writes
    the row's ``key``, ``instruction_id_list`` and ``kwargs`` at top level
    (:class:`IFEvalColumns`); with ``compute_reward`` an :class:`IfEvalScorer` (``scorer_kwargs``)
    checks the ``<answer>`` block the system prompt asks for; ``max_steps`` defaults to 1.
    Other keywords are :class:`~rlpost.envs.chat.DatasetChatEnv`'s (``ray_backend``'s actor:
    ``"ifeval_dataloader"``). Offline, pass a local jsonl/parquet file with IFEval's columns.

    Construction fails with ``ValueError`` naming a missing ``instruction_id_list``/``kwargs``
    column; with ``compute_reward`` every row is also checked (known ids, one kwargs dict per
    instruction that its checker accepts, punkt data), so a bad dataset fails here, not mid-run.
    """

    SYSTEM_PROMPT = IFEVAL_SYSTEM_PROMPT

    def __init__(
        self, *, dataset: Any = "google/IFEval", compute_reward: bool = True, max_steps: int | None = 1,
        collate_fn: Callable[[Any], Any] | None = None, prompt_column: str | None = None,
        answer_column: str | None = None, scorer_kwargs: dict[str, Any] | None = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        if collate_fn is None and prompt_column is None:
            collate_fn = PromptAsQuery(kwargs.get("data_key") or ChatEnv.data_key)
        if kwargs.get("ray_backend") and kwargs.get("dataloader_actor_name") is None:
            kwargs["dataloader_actor_name"] = "ifeval_dataloader"  # TorchRL's name
        super().__init__(
            dataset=dataset, max_steps=max_steps, collate_fn=collate_fn, prompt_column=prompt_column,
            answer_column=answer_column, **kwargs,
        )  # fmt: skip
        rows = getattr(self.primer, "rows", None)  # None for a DataLoader source
        if rows is not None:
            columns = list(rows.column_names)
        else:
            columns = list(getattr(self.primer, "columns", ()))
        for column in ("instruction_id_list", "kwargs"):
            if column not in columns:
                raise ValueError(
                    f"IFEvalEnv: column {column!r} not found in dataset {self.primer.description}; "
                    f"its columns are {columns} (IFEval's are key, prompt, instruction_id_list, kwargs)"
                )
        self.append_transform(IFEvalColumns({key: col for key, col in IFEVAL_COLUMNS.items() if col in columns}))
        self.scorer: IfEvalScorer | None = None
        if compute_reward:
            self.scorer = IfEvalScorer(**(scorer_kwargs or {}))
            if rows is not None:
                self._check_rows(rows, columns)
            self.append_transform(self.scorer)

    def _check_rows(self, rows: Any, columns: list[str]) -> None:
        ids = _column_values(rows, "instruction_id_list")
        kwargs = _column_values(rows, "kwargs")
        keys = _column_values(rows, "key") if "key" in columns else [None] * len(ids)
        for index, (row_ids, row_kwargs, key) in enumerate(zip(ids, kwargs, keys)):
            where = f"IFEvalEnv: row {index}" + (f" (key={key!r})" if key is not None else "")
            where += f" of dataset {self.primer.description}"
            ids_, kwargs_ = self.scorer.check_instructions(row_ids, row_kwargs, where=where)
            for instruction_id, arguments in zip(ids_, kwargs_):  # argument names and values
                build_checker(self.scorer.registry, instruction_id, arguments, "", where)


def _column_values(rows: Any, column: str) -> list:
    """One column of the primer's rows, as a list (an in-memory row list or a ``datasets.Dataset``)."""
    if hasattr(rows, "rows"):
        return [row[column] for row in rows.rows]
    return list(rows[column])
