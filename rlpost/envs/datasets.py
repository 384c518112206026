"""Prompts from a dataset: :class:`DataLoadingPrimer`, the transform that fills a chat env's reset
input (its env, :class:`~rlpost.envs.chat.DatasetChatEnv`, is in :mod:`rlpost.envs.chat` as in
TorchRL; its sources in :mod:`rlpost.envs.row_sources`, its Ray form in :mod:`rlpost.envs.ray_primer`).

Each loaded batch (``batch_size_dl`` rows of a seeded order) goes through ``collate_fn`` into a
queue, every row ``repeats`` times in a row (TorchRL's meaning: a batch ``a b`` with ``repeats=3``
queues ``a a a b b b``; a reset of ``k`` envs takes the next ``k`` items, so copies continue over
the next resets). The copies of a row, one GRPO group, carry the same ``prompt_id`` and the row
itself (for the reward). When the rows run out, the next epoch starts with a new seeded order.

What rlpost adds to TorchRL's primer, on purpose:

- A resumable position: for rows, ``(epoch, position, copies served)``, so ``state_dict()`` /
  ``load_state_dict()`` make a resumed run draw exactly the prompts the interrupted one would
  have drawn next (a DataLoader's iterator position cannot be saved: an iterable source is
  replayed and fast-forwarded instead).
- The order of epoch ``e`` is ``numpy.random.default_rng([seed, e]).permutation(num_rows)``: it
  depends only on ``(seed, e)``, never on what was drawn before.
- ``num_shards`` / ``shard_index`` split one order between several env pools (pool ``i`` takes
  positions ``i, i + num_shards, ...``); ``prompt_id = epoch * num_rows + position`` stays
  unique across the pools.
- ``group_repeats=True`` checks that every reset takes whole loaded batches with their copies
  (TorchRL sizes its primer's batch so that it does).
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from rlpost.data.specs import Composite, NonTensor
from rlpost.data.stacking import as_nested_tensor, as_padded_tensor
from rlpost.envs.row_sources import (  # noqa: F401 (RowList: its old path)
    RowList,
    batch_rows,
    default_collate_fn,
    is_batch_iterable,
    load_rows,
)
from rlpost.envs.td_rows import stack_rows
from rlpost.envs.transforms import Transform

# Keys the env loop or the primer writes itself; a dataset column of one of these names would
# clash. (A column named like an env's observation, e.g. "tokens" for a token LLMEnv, is allowed:
# it is what that env reads; a ChatEnv refuses a reset input whose container key is not its own.)
_RESERVED_KEYS = frozenset({"reward", "done", "terminated", "truncated", "next", "step_count", "prompt_id", "row"})


@dataclass
class PromptItem:
    """One emitted prompt: the (collated) dataset row, its index in the dataset (-1 for an
    iterable source) and its id, shared by the copies of one draw."""

    row: dict[str, Any]
    row_index: int
    prompt_id: int


class DataLoadingPrimer(Transform):
    """Fill the reset input of a chat env with prompts drawn from a dataset or a dataloader.

    ``dataloader`` (or ``dataset=``, rlpost's name) is rows (a local file, a hub name with
    ``name``/``split``, a ``datasets.Dataset`` or a list of row dicts: seeded, resumable exactly,
    shardable) or, as TorchRL's, a DataLoader or any iterable of batches (a dict of columns or a
    list of row dicts; a bare string or list of strings is the ``data_key`` column), iterated
    endlessly. A reset of ``k`` envs whose input lacks ``data_key`` gets, per env: every column of the
    collated row (or those of ``primers``), the prompt under ``data_key`` (from
    ``prompt_column``: default ``data_key`` itself, else ``"question"``), ``"answer"`` (from
    ``answer_column``), ``"prompt_id"`` (int64, shared by the copies of one draw) and ``"row"``
    (the row dict, for reward functions); all carried from step to step (``state_keys``).
    Missing columns raise ``ValueError`` naming the column, the dataset and its columns.
    ``data_keys``: the column name of batches that are not mappings; ``stack_method``: how tensor
    columns stack across rows (None: ``torch.stack``, or nested when lengths differ;
    ``"as_nested_tensor"``, ``"as_padded_tensor"`` or a callable); ``batch_size`` is TorchRL's
    and informative (a reset takes as many items as it has envs); ``repeats`` None or 0: one
    copy; ``seed`` None draws one, saved in ``state_dict``.
    """

    def __init__(
        self,
        dataloader: Any = None,
        *,
        dataset: Any = None,
        primers: Any = None,
        data_keys: list[str] | None = None,
        stack_method: Any = None,
        batch_size: int | tuple[int, ...] | torch.Size | None = None,
        repeats: int | None = None,
        device: torch.device | str | None = None,
        group_repeats: bool = False,
        batch_size_dl: int = 1,
        collate_fn: Callable[[Any], Any] | None = None,
        prompt_column: str | None = None,
        answer_column: str | None = None,
        data_key: str = "query",
        name: str | None = None,
        split: str | None = "train",
        shuffle: bool = True,
        seed: int | None = None,
        num_shards: int = 1,
        shard_index: int = 0,
    ) -> None:
        super().__init__()
        if (dataloader is None) == (dataset is None):
            raise ValueError("DataLoadingPrimer needs exactly one source: a dataloader (or iterable) or dataset=")
        source = dataloader if dataloader is not None else dataset
        self.repeats = max(1, int(repeats or 0))
        if repeats is not None and repeats < 0:
            raise ValueError(f"repeats must be >= 0 or None, got {repeats}")
        if batch_size_dl < 1:
            raise ValueError(f"batch_size_dl must be >= 1, got {batch_size_dl}")
        self.data_key, self.group_repeats = data_key, group_repeats
        self.data_keys = list(data_keys) if data_keys is not None else [data_key]
        if len(self.data_keys) != 1:
            raise ValueError(f"data_keys names the one column of non-mapping batches; got {self.data_keys}")
        self.collate_fn = collate_fn if collate_fn is not None else default_collate_fn
        self.stack_method = _stack_method(stack_method)
        self.device = torch.device(device) if device is not None else None
        self.shuffle, self.num_shards, self.shard_index = shuffle, num_shards, shard_index
        self.seed = secrets.randbits(63) if seed is None else int(seed)
        self._kept: np.ndarray | None = None  # keep_rows: the rows drawn (None: all)
        self.is_iterable = is_batch_iterable(source)
        if self.is_iterable:
            if num_shards != 1:
                raise ValueError("num_shards > 1 needs a rows source (a file, hub name, Dataset or list of rows)")
            self.dataloader, self.description = source, f"dataloader {type(source).__name__}"
            self.batch_size_dl = int(getattr(source, "batch_size", None) or 1)
            self.rows, self.num_rows = None, 0
        else:
            self.dataloader = None
            self.rows, self.description = load_rows(source, name=name, split=split)
            self.num_rows = len(self.rows)
            self.batch_size_dl = batch_size_dl
            if self.num_rows == 0:
                raise ValueError(f"dataset {self.description} has no rows")
            if not 0 <= shard_index < num_shards or num_shards > self.num_rows:
                raise ValueError(
                    f"need 0 <= shard_index < num_shards <= rows; got shard_index={shard_index}, "
                    f"num_shards={num_shards} for {self.num_rows} rows of dataset {self.description}"
                )
        size = batch_size if batch_size is not None else self.batch_size_dl
        size = size if isinstance(size, int) else (int(size[0]) if len(size) else 0)
        self.batch_size = torch.Size([size * (self.repeats if group_repeats else 1)]) if size else torch.Size([])
        self.reset_dataloader()
        first = self._peek_columns()
        self.prompt_column = prompt_column if prompt_column is not None else self._default_prompt_column(first)
        self.answer_column = answer_column if answer_column is not None else ("answer" if "answer" in first else None)
        self.columns = self._check_columns(first, primers)
        self.primers = primers if primers is not None else self._make_primers(first)
        extra = [data_key, "prompt_id", "row"] + (["answer"] if self.answer_column else [])
        self.state_keys = tuple(dict.fromkeys(self.columns + extra))

    # ------------------------------------------------------------------ columns

    def _default_prompt_column(self, first: dict[str, Any]) -> str | None:
        """``data_key`` when the rows have it, else ``"question"``, else None (the env reads its own
        key among the columns, e.g. a token env's ``"tokens"``)."""
        if self.data_key in first:
            return self.data_key
        return "question" if "question" in first else None

    def _peek_columns(self) -> dict[str, Any]:
        """A collated first row (not consumed), to learn the columns."""
        if self.is_iterable:
            return self._peek_item().row
        return self._collate([dict(self.rows[0])], 1)[0]

    def _check_columns(self, first: dict[str, Any], primers: Any) -> list[str]:
        columns = list(first)
        if not self.is_iterable and hasattr(self.rows, "column_names") and self.collate_fn is default_collate_fn:
            columns = [("query" if c == "text" else c) for c in self.rows.column_names]
        for role, column in (("prompt_column", self.prompt_column), ("answer_column", self.answer_column)):
            if column is not None and column not in first:
                raise ValueError(
                    f"column {column!r} ({role}) not found in dataset {self.description}; its columns are {columns}"
                )
        wanted = list(primers.keys()) if primers is not None else columns
        for column in wanted:
            if column not in first:
                raise ValueError(
                    f"primers key {column!r} is not a column of dataset {self.description}; its columns are {columns}"
                )
            if column in _RESERVED_KEYS:
                raise ValueError(
                    f"column {column!r} of dataset {self.description} clashes with a key the env writes; "
                    "rename it with collate_fn= (or select columns with primers=)"
                )
        return [c for c in wanted if c in first]

    def _make_primers(self, first: dict[str, Any]) -> Composite:
        """Specs of the written columns, each a NonTensor with the first row's value as example."""
        shape = tuple(self.batch_size)
        entries = {column: NonTensor(example_data=first[column], shape=shape) for column in self.columns}
        return Composite(entries, shape=shape)

    # ------------------------------------------------------------------ the stream

    def keep_rows(self, indices: Sequence[int]) -> DataLoadingPrimer:
        """Draw only the rows ``indices`` of a rows source (say, the prompts the engine can take):
        the order, the shards and the prompt ids are those of a dataset of just these rows, and
        each item keeps its row's index in the whole dataset. Goes back to the first prompt."""
        if self.is_iterable:
            raise ValueError(f"keep_rows needs a rows source, not {self.description}")
        kept = np.asarray(sorted(set(int(i) for i in indices)), dtype=np.int64)
        if len(kept) == 0 or kept[0] < 0 or kept[-1] >= len(self.rows):
            raise ValueError(f"keep_rows: {len(kept)} row indices, in range 0..{len(self.rows) - 1} of dataset "
                             f"{self.description}, are needed")  # fmt: skip
        if self.num_shards > len(kept):
            raise ValueError(f"{len(kept)} rows of dataset {self.description} kept, fewer than the {self.num_shards} "
                             "shards that draw from them")  # fmt: skip
        self._kept, self.num_rows = kept, len(kept)
        return self.reset_dataloader()

    def reset_dataloader(self) -> DataLoadingPrimer:
        """Go back to the first prompt of epoch 0 (TorchRL's name for it)."""
        self.epoch, self.position, self.served, self.batches = 0, self.shard_index, 0, 0
        self.served_ids = 0  # iterable source: items loaded so far (the next prompt id)
        self._queue: deque[PromptItem] = deque()
        self._order, self._order_epoch = None, -1
        self._iterator = None
        return self

    def order(self, epoch: int) -> np.ndarray:
        """Row indices in the order epoch ``epoch`` visits them (rows source)."""
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
            else:
                self._order = np.arange(self.num_rows)
            self._order_epoch = epoch
        return self._order

    def _batch_positions(self, epoch: int, position: int) -> list[int]:
        """Positions of the batch starting at ``position`` (cut at the end of the epoch)."""
        stop = min(self.num_rows, position + self.batch_size_dl * self.num_shards)
        return list(range(position, stop, self.num_shards))

    def _after(self, epoch: int, position: int) -> tuple[int, int]:
        """Start of the batch after the one at (epoch, position)."""
        position = self._batch_positions(epoch, position)[-1] + self.num_shards
        return (epoch + 1, self.shard_index) if position >= self.num_rows else (epoch, position)

    def _load_rows_batch(self) -> list[PromptItem]:
        positions = self._batch_positions(self.epoch, self.position)
        order = self.order(self.epoch)
        indices = [int(order[p]) if self._kept is None else int(self._kept[order[p]]) for p in positions]
        collated = self._collate([dict(self.rows[i]) for i in indices], len(indices))
        return [PromptItem(row, i, self.epoch * self.num_rows + p) for row, i, p in zip(collated, indices, positions)]

    def _load_iterable_batch(self) -> list[PromptItem]:
        if self._iterator is None:
            self._iterator = iter(self.dataloader)
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._iterator = iter(self.dataloader)
            try:
                batch = next(self._iterator)
            except StopIteration:
                raise ValueError(f"{self.description} yields no batches") from None
        rows = self._collate(batch_rows(batch, self.data_keys[0], self.description), None)
        start = self.served_ids
        self.served_ids += len(rows)
        return [PromptItem(row, -1, start + i) for i, row in enumerate(rows)]

    def _collate(self, rows: list[dict[str, Any]], expected: int | None) -> list[dict[str, Any]]:
        collated = batch_rows(self.collate_fn(rows), self.data_keys[0], self.description)
        if expected is not None and len(collated) != expected:
            raise ValueError(f"collate_fn turned a batch of {expected} rows into {len(collated)} rows")
        return collated

    def _fill_queue(self) -> None:
        """Load the next batch into the queue, each row ``repeats`` times in a row."""
        batch = self._load_iterable_batch() if self.is_iterable else self._load_rows_batch()
        self._queue.extend(item for item in batch for _ in range(self.repeats))
        self.served = 0

    def _peek_item(self) -> PromptItem:
        if not self._queue:
            self._fill_queue()
        return self._queue[0]

    def next_items(self, num_items: int) -> list[PromptItem]:
        """The next ``num_items`` prompts of the stream (advances the position)."""
        if self.group_repeats:
            self._check_whole_groups(num_items)
        return [self._next_item() for _ in range(num_items)]

    def _next_item(self) -> PromptItem:
        if not self._queue:
            self._fill_queue()
        item = self._queue.popleft()
        self.served += 1
        if not self._queue:  # the batch and its copies are all out: move on
            self.served = 0
            self.batches += 1
            if not self.is_iterable:
                self.epoch, self.position = self._after(self.epoch, self.position)
        return item

    def _check_whole_groups(self, num_items: int) -> None:
        """With group_repeats, a reset must start and end at the boundary of a loaded batch's
        copies."""
        aligned = self.served == 0
        if aligned and not self.is_iterable:
            epoch, position, left = self.epoch, self.position, num_items
            while left > 0:
                left -= self.repeats * len(self._batch_positions(epoch, position))
                epoch, position = self._after(epoch, position)
            aligned = left == 0
        elif aligned:
            aligned = num_items % (self.repeats * self.batch_size_dl) == 0
        if not aligned:
            raise ValueError(
                f"group_repeats=True: a reset must take whole groups of {self.repeats * self.batch_size_dl} prompts "
                f"(batch_size_dl={self.batch_size_dl} x repeats={self.repeats}), got a reset of {num_items} envs"
            )

    # ------------------------------------------------------------------ transform hooks

    def reset_preprocess(self, td: TensorDictBase) -> TensorDictBase:
        if self.data_key in td.keys():
            return td
        items = self.next_items(td.batch_size[0])
        for column in self.columns:
            td.set(column, self._stack([item.row[column] for item in items], td.batch_size, column))
        if self.prompt_column is not None:
            prompts = [self._prompt_of(item) for item in items]
            td.set(self.data_key, NonTensorStack(*[NonTensorData(p) for p in prompts], batch_size=td.batch_size))
        if self.answer_column is not None:
            answers = [item.row[self.answer_column] for item in items]
            td.set("answer", NonTensorStack(*[NonTensorData(a) for a in answers], batch_size=td.batch_size))
        td.set("prompt_id", torch.tensor([item.prompt_id for item in items], dtype=torch.int64, device=self.device))
        td.set("row", NonTensorStack(*[NonTensorData(item.row) for item in items], batch_size=td.batch_size))
        return td

    def _stack(self, values: list[Any], batch_size: torch.Size, column: str) -> Any:
        """A column's values across rows: tensors through ``stack_method`` (which, as in TorchRL,
        takes one TensorDict per row), anything else as a NonTensorStack."""
        if all(isinstance(v, torch.Tensor) for v in values):
            values = [v.to(self.device) if self.device is not None else v for v in values]
            if self.stack_method is stack_rows:
                return stack_rows(values)
            return self.stack_method([TensorDict({column: v}, batch_size=[]) for v in values]).get(column)
        return NonTensorStack(*[NonTensorData(v) for v in values], batch_size=batch_size)

    def prompts(self, start: int, stop: int) -> list[str]:
        """The prompts of rows ``start``..``stop - 1`` of a rows source, as the primer serves them
        (collated, from the prompt column), whether kept or not (:meth:`keep_rows`)."""
        rows = self._collate([dict(self.rows[i]) for i in range(start, stop)], stop - start)
        return [self._prompt_of(PromptItem(row, start + k, -1)) for k, row in enumerate(rows)]

    def _prompt_of(self, item: PromptItem) -> str:
        prompt = item.row.get(self.prompt_column)
        if not isinstance(prompt, str):
            where = f"row {item.row_index}" if item.row_index >= 0 else f"item {item.prompt_id}"
            raise ValueError(
                f"{where} of dataset {self.description}: column {self.prompt_column!r} "
                f"holds a {type(prompt).__name__}, expected a string"
            )
        return prompt

    def state_dict(self) -> dict[str, Any]:
        """The stream's position. A rows source resumes exactly; an iterable source is replayed
        from its start and fast-forwarded past the batches already loaded (exact when the
        iterable yields the same batches again, e.g. a DataLoader with a seeded generator)."""
        state = {
            "epoch": self.epoch, "position": self.position, "copies": self.served, "seed": self.seed,
            "num_rows": self.num_rows, "repeats": self.repeats, "shuffle": self.shuffle,
            "num_shards": self.num_shards, "shard_index": self.shard_index,
        }  # fmt: skip
        if self.batch_size_dl != 1:
            state["batch_size_dl"] = self.batch_size_dl
        if self.is_iterable:
            state["batches"] = self.batches
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the dataset and the settings that shape the stream must match."""
        mine = self.state_dict()
        for key in ("num_rows", "repeats", "shuffle", "num_shards", "shard_index"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"DataLoadingPrimer state was saved with {key}={state.get(key)!r} but this primer "
                    f"has {key}={mine[key]!r} (dataset {self.description}); a resume would draw other prompts"
                )
        if state.get("batch_size_dl", 1) != self.batch_size_dl:
            raise ValueError(
                f"DataLoadingPrimer state was saved with batch_size_dl={state.get('batch_size_dl', 1)} but this "
                f"primer has batch_size_dl={self.batch_size_dl}; a resume would draw other prompts"
            )
        self.reset_dataloader()
        self.seed = int(state["seed"])
        served = int(state["copies"])
        if self.is_iterable:
            for _ in range(int(state["batches"])):
                self._load_iterable_batch()
            self.batches = int(state["batches"])
        else:
            self.epoch, self.position = int(state["epoch"]), int(state["position"])
        if served:
            self._fill_queue()
            for _ in range(served):
                self._queue.popleft()
            self.served = served

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        return (
            f"DataLoadingPrimer(dataset={self.description}, rows={self.num_rows}, repeats={self.repeats}, "
            f"batch_size_dl={self.batch_size_dl}, epoch={self.epoch}, position={self.position})"
        )


def _stack_method(method: Any) -> Callable[[list[torch.Tensor]], Any]:
    if method is None:
        return stack_rows
    if method == "as_nested_tensor":
        return as_nested_tensor
    if method == "as_padded_tensor":
        return as_padded_tensor
    if callable(method):
        return method
    raise ValueError(f"stack_method must be None, 'as_nested_tensor', 'as_padded_tensor' or a callable, got {method!r}")
