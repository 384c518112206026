"""Experiment trackers: every metrics.jsonl record also goes to TensorBoard, wandb and/or MLflow.

``logging.trackers`` names them (default ``["tensorboard"]``). Each adapter has ``log(metrics,
step)`` and ``close()``; :class:`rlpost.record.metrics.MetricsWriter` calls them after each
metrics.jsonl line, with its numeric values (:func:`numeric_values`).

- ``tensorboard``: event files in ``RUN_DIR/tensorboard/`` (``tensorboard --logdir RUN_DIR``).
- ``wandb`` (``pip install 'rlpost[wandb]'``): mode by :func:`wandb_mode` (offline files under
  ``RUN_DIR/wandb/``, upload later with ``wandb sync``); project ``WANDB_PROJECT`` or ``rlpost``.
- ``mlflow`` (``pip install 'rlpost[mlflow]'``): store by :func:`mlflow_tracking_uri` (view a
  local one with ``mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlruns/mlflow.db``);
  experiment ``MLFLOW_EXPERIMENT_NAME`` or ``rlpost``.

A resumed run continues the same runs: the wandb and MLflow run ids are kept in
``RUN_DIR/trackers.json``. Importing this module imports none of the tracker libraries.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from rlpost.config import LoggingConfig

log = logging.getLogger("rlpost")

TENSORBOARD_DIR = "tensorboard"
IDS_FILE = "trackers.json"


class Tracker(Protocol):
    """What :class:`rlpost.record.metrics.MetricsWriter` needs from a tracker."""

    name: str

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` (name -> number) at learner step ``step``."""

    def close(self) -> None:
        """Flush and release the tracker; no ``log`` follows."""


def numeric_values(record: Mapping[str, object]) -> dict[str, float]:
    """The values of a metrics record that a tracker can chart, as floats under the same names:
    bools as 0/1, finite numbers (0-d tensors and numpy scalars unwrapped); the rest left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if hasattr(value, "item") and not isinstance(value, (int, float)):
            try:
                value = value.item()
            except (TypeError, ValueError, RuntimeError):  # not a scalar (a tensor or array of several)
                continue
        if isinstance(value, bool):
            out[key] = float(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = float(value)
    return out


def make_trackers(cfg: LoggingConfig, run_dir: str | Path, run_name: str, first_step: int = 1) -> list[Tracker]:
    """The trackers ``cfg.trackers`` names, in order. ``first_step`` above 1 is a resume
    (TensorBoard purges what was logged from it on). One that fails to start is left out with a
    warning."""
    run_dir = Path(run_dir)
    trackers: list[Tracker] = []
    for name in cfg.trackers:
        try:
            if name == "tensorboard":
                purge_step = first_step if first_step > 1 else None
                trackers.append(TensorBoardTracker(run_dir / TENSORBOARD_DIR, purge_step=purge_step))
            elif name == "wandb":
                trackers.append(WandbTracker(run_dir, run_name))
            elif name == "mlflow":
                trackers.append(MlflowTracker(run_dir, run_name))
            else:
                raise ValueError(f"unknown tracker {name!r}")
        except Exception as exc:
            log.warning(
                "tracker %s could not start (%s: %s); the run goes on without it", name, type(exc).__name__, exc
            )
    return trackers


class TensorBoardTracker:
    """Scalars in TensorBoard event files under ``logdir``; every ``log`` flushes. ``purge_step``
    (a resumed run's first step): TensorBoard drops the earlier files' events from that step on
    (what a crashed run logged after its last checkpoint)."""

    name = "tensorboard"

    def __init__(self, logdir: str | Path, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = Path(logdir)
        self.writer = SummaryWriter(log_dir=str(self.logdir), purge_step=purge_step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def wandb_mode(environ: Mapping[str, str]) -> str:
    """The wandb mode: ``WANDB_MODE`` when set, else online with ``WANDB_API_KEY``, else offline."""
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    return "online" if environ.get("WANDB_API_KEY") else "offline"


class WandbTracker:
    """A Weights & Biases run, its files in ``RUN_DIR/wandb/``; a resume continues it. Trap: the
    record's ``step`` is logged as a value and declared every metric's x-axis, since wandb's own
    step refuses a step lower than one seen, which a resume from a checkpoint logs."""

    name = "wandb"

    def __init__(self, run_dir: str | Path, run_name: str, *, project: str | None = None, mode: str | None = None,
                 **init_kwargs):  # fmt: skip
        """``project`` default ``WANDB_PROJECT``, else "rlpost"; ``mode`` default
        :func:`wandb_mode`; ``init_kwargs`` (entity, group, tags, ...) go to ``wandb.init``."""
        import wandb

        run_dir = Path(run_dir)
        run_id = remembered_id(run_dir, "wandb", lambda: uuid.uuid4().hex[:12])
        self.run = wandb.init(project=project or os.environ.get("WANDB_PROJECT") or "rlpost", name=run_name,
                              id=run_id, resume="allow", dir=str(run_dir), mode=mode or wandb_mode(os.environ),
                              **init_kwargs)  # fmt: skip
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**metrics, "step": step})

    def close(self) -> None:
        self.run.finish()


def mlflow_tracking_uri(run_dir: str | Path, environ: Mapping[str, str]) -> str:
    """``MLFLOW_TRACKING_URI`` when set, else a SQLite store in ``RUN_DIR/mlruns/mlflow.db``."""
    if environ.get("MLFLOW_TRACKING_URI"):
        return environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{(Path(run_dir) / 'mlruns' / 'mlflow.db').resolve()}"


class MlflowTracker:
    """An MLflow run, through an ``MlflowClient`` (no global active run). A local store keeps its
    (unused) artifacts in ``RUN_DIR/mlruns/artifacts``. A resume logs to the remembered run (set
    back to RUNNING), or a new one when the store lacks it."""

    name = "mlflow"

    def __init__(self, run_dir: str | Path, run_name: str):
        import mlflow
        from mlflow.entities import Metric

        run_dir = Path(run_dir)
        self._metric = Metric
        uri = mlflow_tracking_uri(run_dir, os.environ)
        local = not os.environ.get("MLFLOW_TRACKING_URI")
        if local:
            (run_dir / "mlruns").mkdir(parents=True, exist_ok=True)
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "rlpost"
        experiment = self.client.get_experiment_by_name(experiment_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifacts = (run_dir / "mlruns" / "artifacts").resolve().as_uri() if local else None
            experiment_id = self.client.create_experiment(experiment_name, artifact_location=artifacts)
        self.run_id = self._existing_run(run_dir)
        if self.run_id is None:
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            remember_id(run_dir, "mlflow", self.run_id)

    def _existing_run(self, run_dir: Path) -> str | None:
        """The remembered run id when that run is in the store (set back to RUNNING), else None."""
        run_id = read_ids(run_dir).get("mlflow")
        if run_id is None:
            return None
        try:
            self.client.get_run(run_id)
        except Exception:  # another store, or the run was deleted
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        now_ms = int(time.time() * 1000)
        batch = [self._metric(key, value, now_ms, step) for key, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def read_ids(run_dir: str | Path) -> dict[str, str]:
    """The tracker run ids kept in ``RUN_DIR/trackers.json`` (empty when there is none)."""
    path = Path(run_dir) / IDS_FILE
    if not path.is_file():
        return {}
    return dict(json.loads(path.read_text()))


def remember_id(run_dir: str | Path, name: str, run_id: str) -> None:
    """Keep ``run_id`` as tracker ``name``'s run id in ``RUN_DIR/trackers.json``."""
    ids = read_ids(run_dir)
    ids[name] = run_id
    path = Path(run_dir) / IDS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ids, indent=1) + "\n")


def remembered_id(run_dir: str | Path, name: str, new_id: Callable[[], str]) -> str:
    """Tracker ``name``'s remembered run id, or ``new_id()`` remembered from now on."""
    run_id = read_ids(run_dir).get(name)
    if run_id is None:
        run_id = new_id()
        remember_id(run_dir, name, run_id)
    return run_id
