"""The run directory: what a run leaves on disk for people and tools (a contract: keep it stable).

    <run_dir>/config.yaml        the resolved config (every default filled in)
    <run_dir>/metrics.jsonl      one JSON object per learner step
    <run_dir>/eval.jsonl         one JSON object per evaluation (eval section; step 0: before training)
    <run_dir>/checkpoints/step_<N>/
    <run_dir>/reward.png         and kl.png, length.png, staleness.png, step_time.png (rlpost plot)
    <run_dir>/tensorboard/       the default tracker's event files (logging.trackers)

A resumed run (``rlpost train --resume RUN_DIR``) continues in the same folder: the config comes
from its ``config.yaml`` (plus overrides), training goes on after the latest checkpoint, and the
metrics lines of steps after that checkpoint (they are trained again) move to
``metrics.superseded.jsonl``, so ``metrics.jsonl`` keeps one line per step.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from rlpost.config import ConfigError, JobConfig, default_run_name, load_config, save_config

_STEP_DIR = re.compile(r"^step_(\d+)$")

LOCAL_DATA_SUFFIXES = (".json", ".jsonl", ".parquet")


def create_run_dir(cfg: JobConfig, run_dir: str | Path | None = None) -> Path:
    """Make a fresh run directory holding the resolved config; the run name is filled in on
    ``cfg`` (so the Ray namespace and the folder agree). An existing run directory is never
    overwritten: that would mix two runs' metrics and checkpoints."""
    if run_dir is None and cfg.logging.run_name is None:
        cfg.logging.run_name = _unused_name(Path(cfg.logging.run_dir), default_run_name())
    if cfg.logging.run_name is None:
        cfg.logging.run_name = Path(run_dir).name
    path = Path(run_dir) if run_dir else Path(cfg.logging.run_dir) / cfg.logging.run_name
    if (path / "config.yaml").exists():
        raise ConfigError(f"run directory {path} already holds a run; choose another --run-dir or logging.run_name")
    path.mkdir(parents=True, exist_ok=True)
    save_config(cfg, path / "config.yaml")
    return path


def _unused_name(parent: Path, base: str) -> str:
    """``base``, or ``base-2``, ``base-3``... when runs started within the same second."""
    name, n = base, 1
    while (parent / name).exists():
        n += 1
        name = f"{base}-{n}"
    return name


def check_inputs_exist(cfg: JobConfig) -> None:
    """Fail early, naming the key, when a local model folder or dataset file is missing (other
    names are hub names, checked by the loaders)."""
    model = Path(cfg.model.name_or_path)
    if _looks_local(cfg.model.name_or_path) and not (model / "config.json").is_file():
        hint = (
            " (the tiny models are shipped in the repository's models/ folder: run from the checkout's root, "
            "or rebuild one with `rlpost make-tiny-model DIR`)"
            if "tiny" in model.name
            else ""
        )
        raise ConfigError(f"model.name_or_path: no model folder with config.json at {model}{hint}")
    if cfg.model.tokenizer and _looks_local(cfg.model.tokenizer) and not Path(cfg.model.tokenizer).exists():
        raise ConfigError(f"model.tokenizer: not found: {cfg.model.tokenizer}")
    dataset = cfg.data.dataset
    if dataset and (dataset.endswith(LOCAL_DATA_SUFFIXES) or _looks_local(dataset)) and not Path(dataset).exists():
        raise ConfigError(f"data.dataset: file not found: {dataset}")


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).exists()


# ------------------------------------------------------------------------------------ resume


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The ``step_<N>`` folders of ``run_dir/checkpoints``, oldest (lowest N) first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def open_run_for_resume(run_dir: str | Path, config: str | Path | None, overrides: list[str]) -> JobConfig:
    """The config to resume ``run_dir`` with: ``config`` (default: the run's own config.yaml)
    plus ``overrides``; errors name the folder when it holds no run or no checkpoint."""
    run_dir = Path(run_dir)
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"--resume {run_dir}: not a run directory (no config.yaml)")
    if latest_checkpoint(run_dir) is None:
        raise ConfigError(
            f"--resume {run_dir}: no checkpoint in {run_dir / 'checkpoints'} (set trainer.checkpoint_interval "
            "to write them during a run)"
        )
    cfg = load_config(config or saved, overrides)
    cfg.logging.run_name = cfg.logging.run_name or run_dir.name
    if overrides or config:
        save_config(cfg, saved)  # the folder's config is the one the run goes on with
    return cfg


def supersede_metrics_after(run_dir: str | Path, step: int) -> int:
    """Move metrics.jsonl lines of steps after ``step`` to metrics.superseded.jsonl (appended),
    and eval.jsonl's to eval.superseded.jsonl; returns how many metrics lines moved. Nothing is
    deleted: those steps are trained (and evaluated) again after a resume."""
    _supersede_lines(Path(run_dir) / "eval.jsonl", step)
    return _supersede_lines(Path(run_dir) / "metrics.jsonl", step)


def _supersede_lines(path: Path, step: int) -> int:
    """Move the JSON lines of ``path`` whose step is after ``step`` to ``<name>.superseded.jsonl``."""
    if not path.is_file():
        return 0
    keep, moved = [], []
    for line in path.read_text().splitlines():
        try:
            later = json.loads(line).get("step", 0) > step
        except json.JSONDecodeError:  # a torn last line from the crash
            later = True
        (moved if later else keep).append(line)
    if moved:
        with path.with_name(path.stem + ".superseded.jsonl").open("a") as f:
            f.write("".join(line + "\n" for line in moved))
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)
    return len(moved)
