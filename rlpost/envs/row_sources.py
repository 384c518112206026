"""Where a :class:`~rlpost.envs.datasets.DataLoadingPrimer`'s prompts come from: a *rows source*
(a hub name, a local file or dataset folder, a list of row dicts or a ``datasets.Dataset``) or,
as TorchRL's primer takes, a *batch iterable* (a DataLoader or any iterable of batches).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import is_tensor_collection

# local file extensions and the ``datasets`` builder that reads them (gzip-compressed JSON included)
_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".json.gz": "json", ".jsonl.gz": "json", ".parquet": "parquet"}


class RowList:
    """An in-memory list of row dicts with the parts of ``datasets.Dataset`` the primer reads
    (``len``, ``[i]``, ``column_names``: the columns every row has)."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], description: str = "in-memory rows") -> None:
        if not all(isinstance(row, Mapping) for row in rows):
            raise ValueError(f"{description}: every row must be a mapping (a dict of columns)")
        self.rows = [dict(row) for row in rows]
        self.description = description
        common = set(self.rows[0]) if self.rows else set()
        for row in self.rows[1:]:
            common &= set(row)
        self.column_names = [name for name in (self.rows[0] if self.rows else ()) if name in common]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]


def load_rows(source: Any, *, name: str | None = None, split: str | None = "train") -> tuple[Any, str]:
    """The rows of ``source`` and a description of it for error messages. ``source``: a local
    ``.json``/``.jsonl`` (plain or ``.gz``) or ``.parquet`` file (one split, ``"train"``), a local
    dataset folder or hub name (``name`` the subset; ``split`` None takes ``"train"``), a list of
    row dicts, or a ``datasets.Dataset``."""
    if isinstance(source, (list, tuple)):
        return RowList(source), f"in-memory rows ({len(source)} rows)"
    if not isinstance(source, (str, os.PathLike)):
        if hasattr(source, "column_names") and hasattr(source, "__getitem__"):
            return source, f"dataset object {type(source).__name__}"
        raise ValueError(
            f"dataset must be a path, a hub name, a list of rows or a datasets.Dataset, got {type(source).__name__}"
        )
    import datasets  # lazily: importing it costs ~1 s and most modules here never need it

    path = Path(source)
    if path.is_file():
        return _load_local_file(datasets, path, name=name, split=split)
    described = _describe_source(str(source), name, split)
    loaded = datasets.load_dataset(str(source), name, split=split)
    if isinstance(loaded, Mapping):  # split=None gave a DatasetDict
        if "train" not in loaded:
            raise ValueError(f"dataset {described} has splits {sorted(loaded)}; choose one with split=")
        loaded = loaded["train"]
    return loaded, described


def _load_local_file(datasets, path: Path, *, name: str | None, split: str | None) -> tuple[Any, str]:
    extension = "".join(path.suffixes[-2:]).lower() if path.suffix.lower() == ".gz" else path.suffix.lower()
    builder = _LOCAL_BUILDERS.get(extension)
    if builder is None:
        raise ValueError(
            f"dataset file {path}: unsupported extension {extension!r} (use .json, .jsonl, .json.gz, .jsonl.gz or "
            ".parquet)"
        )
    if split not in (None, "train"):
        raise ValueError(f"dataset file {path} has a single split 'train'; got split={split!r}")
    if name is not None:
        raise ValueError(f"dataset file {path} has no subsets; got subset/name={name!r}")
    return datasets.load_dataset(builder, data_files=str(path), split="train"), f"file {path}"


def _describe_source(source: str, name: str | None, split: str | None) -> str:
    parts = [repr(source)] + [f"{key}={value!r}" for key, value in (("subset", name), ("split", split)) if value]
    return " ".join(parts)


def default_collate_fn(batch: Any) -> Any:
    """TorchRL's default collate for chat datasets (row dicts or a dict of columns, returned
    alike): a ``"text"`` column becomes ``"query"``, as it would clash with the ``"text"`` container."""
    if isinstance(batch, Mapping):
        batch = dict(batch)
        if "text" in batch:
            batch["query"] = batch.pop("text")
        return batch
    return [default_collate_fn(row) for row in batch]


def is_batch_iterable(source: Any) -> bool:
    """A DataLoader or other iterable of batches (not a rows source)."""
    if isinstance(source, (str, os.PathLike, list, tuple)) or hasattr(source, "column_names"):
        return False
    return hasattr(source, "__iter__") or hasattr(source, "__next__")


def batch_rows(batch: Any, data_key: str, description: str) -> list[dict[str, Any]]:
    """A loaded batch as a list of row dicts: from a TensorDict of batch ``[n]``, a dict of
    columns, a list of dicts, or bare strings / token-id tensors (read as the ``data_key``
    column)."""
    if isinstance(batch, str):
        return [{data_key: batch}]
    if is_tensor_collection(batch):  # a TensorDict of batch [n] (TorchRL's collate functions build one)
        rows = batch.unbind(0) if batch.batch_dims else [batch]
        return [row.to_dict() for row in rows]
    if isinstance(batch, Mapping):
        columns = {key: _column_values(value) for key, value in batch.items()}
        lengths = {len(values) for values in columns.values()}
        if len(lengths) != 1:
            raise ValueError(f"{description}: a batch's columns have different lengths {sorted(lengths)}")
        size = lengths.pop()
        return [{key: values[i] for key, values in columns.items()} for i in range(size)]
    if isinstance(batch, (list, tuple)) and all(isinstance(row, Mapping) for row in batch):
        return [dict(row) for row in batch]
    if isinstance(batch, (list, tuple)) and all(isinstance(row, (str, torch.Tensor)) for row in batch):
        return [{data_key: row} for row in batch]
    if isinstance(batch, torch.Tensor):  # token ids: [L] (one row) or [n, L] (n rows)
        return [{data_key: row} for row in (batch.unbind(0) if batch.ndim > 1 else [batch])]
    raise TypeError(
        f"{description} yielded a {type(batch).__name__}; a batch must be a dict of columns, a list of row dicts, "
        "strings or token-id tensors (write a collate_fn that returns one of these)"
    )


def _column_values(value: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return list(value.unbind(0)) if value.ndim else [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]
