"""Saved weights under the service's storage folder, each run owned by one tenant.

A client's model is a training run (its id the model id); what it saves is addressed as
``tinker://<run id>/weights/<name>`` (adapter and optimizer state, for resuming) or
``tinker://<run id>/sampler_weights/<name>`` (the adapter, for sampling). On disk::

    <root>/runs/<run id>/run.json                    owner (tenant), base model, LoRA settings
    <root>/runs/<run id>/<weights|sampler_weights>/<name>/   the files the trainer wrote

A path resolves only for the tenant that owns its run: another tenant's path is answered as
unknown, exactly as a path that never existed (nothing says it exists). Everything is on disk,
so a restarted server lists and loads what an earlier one saved.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlpost.serve.futures import RequestError

SCHEME = "tinker://"
KINDS = ("weights", "sampler_weights")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_RUN = re.compile(r"[A-Za-z0-9][A-Za-z0-9:._-]{0,200}")


@dataclass(frozen=True)
class WeightsPath:
    """A parsed ``tinker://<run>/<kind>/<name>``."""

    run_id: str
    kind: str
    name: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.run_id}/{self.kind}/{self.name}"

    @classmethod
    def parse(cls, value: str, field: str = "path") -> WeightsPath:
        if not isinstance(value, str) or not value.startswith(SCHEME):
            raise RequestError(f"{field}: {value!r} is not a tinker:// path")
        parts = value[len(SCHEME) :].split("/")
        if len(parts) != 3 or parts[1] not in KINDS or not _RUN.fullmatch(parts[0]) or not _NAME.fullmatch(parts[2]):
            raise RequestError(f"{field}: {value!r} is not tinker://<run>/weights|sampler_weights/<name>")
        return cls(*parts)


def check_name(name: Any, field: str = "path") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RequestError(f"{field}: {name!r} must be 1-128 letters, digits, '.', '_' or '-', not starting with '.'")
    return name


class Storage:
    """The storage folder; see the module docstring."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        (self.root / "runs").mkdir(parents=True, exist_ok=True)

    def _run_dir(self, run_id: str) -> Path:
        if not _RUN.fullmatch(run_id):
            raise RequestError(f"run: {run_id!r} is not a run id")
        return self.root / "runs" / run_id

    def create_run(self, run_id: str, tenant: str, base_model: str, lora: dict[str, Any]) -> None:
        folder = self._run_dir(run_id)
        folder.mkdir(parents=True, exist_ok=True)
        record = {"run_id": run_id, "tenant": tenant, "base_model": base_model, "lora": lora, "created": time.time()}
        (folder / "run.json").write_text(json.dumps(record, indent=1))

    def run(self, run_id: str, tenant: str) -> dict[str, Any]:
        """The run's record, when ``tenant`` owns it; unknown otherwise."""
        record_file = self._run_dir(run_id) / "run.json"
        record = json.loads(record_file.read_text()) if record_file.is_file() else None
        if record is None or record["tenant"] != tenant:
            raise RequestError(f"run: no run {run_id!r}")
        return record

    def runs(self, tenant: str) -> list[dict[str, Any]]:
        records = (json.loads(p.read_text()) for p in sorted((self.root / "runs").glob("*/run.json")))
        return [r for r in records if r["tenant"] == tenant]

    def save(self, path: WeightsPath, tenant: str, files: dict[str, bytes], *, overwrite: bool = True) -> None:
        self.run(path.run_id, tenant)
        folder = self._run_dir(path.run_id) / path.kind / path.name
        if folder.exists() and not overwrite:
            raise RequestError(f"path: {path} exists (overwrite=false)")
        staging = folder.with_name(f".{path.name}.{time.monotonic_ns()}")
        staging.mkdir(parents=True)
        for name, content in files.items():
            (staging / Path(name).name).write_bytes(content)
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)  # a reader never sees half a checkpoint

    def load(self, path: WeightsPath, tenant: str) -> dict[str, bytes]:
        self.run(path.run_id, tenant)
        folder = self._run_dir(path.run_id) / path.kind / path.name
        if not folder.is_dir():
            raise RequestError(f"path: no weights at {path}")
        return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}

    def checkpoints(self, run_id: str, tenant: str) -> list[dict[str, Any]]:
        """The run's saved weights as the REST API lists them."""
        self.run(run_id, tenant)
        found = []
        for kind, label in (("weights", "training"), ("sampler_weights", "sampler")):
            for folder in sorted((self._run_dir(run_id) / kind).glob("[!.]*")):
                stat = folder.stat()
                size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
                found.append({
                    "checkpoint_id": f"{kind}/{folder.name}", "checkpoint_type": label,
                    "time": iso_time(stat.st_mtime), "tinker_path": str(WeightsPath(run_id, kind, folder.name)),
                    "size_bytes": size, "public": False,
                })  # fmt: skip
        return found


def iso_time(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
