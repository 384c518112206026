"""The run directory: what a run leaves on disk for people and tools (a DESIGN.md contract).

    <run_dir>/config.yaml        the resolved config (every default filled in)
    <run_dir>/metrics.jsonl      one JSON object per learner step
    <run_dir>/checkpoints/step_<N>/
    <run_dir>/reward.png
"""

from __future__ import annotations

from pathlib import Path

from rlpost.config import ConfigError, JobConfig, default_run_name, save_config

LOCAL_DATA_SUFFIXES = (".json", ".jsonl", ".parquet")


def create_run_dir(cfg: JobConfig, run_dir: str | Path | None = None) -> Path:
    """Make a fresh run directory and write the resolved config into it.

    The run name is filled in on ``cfg`` (so the Ray namespace and the folder agree). An existing
    run directory is never overwritten: that would mix two runs' metrics and checkpoints.
    """
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
    """Fail early, naming the key, when a local model folder or dataset file is missing.

    Names that are not local paths are hub names, resolved (and checked) by the loaders.
    """
    model = Path(cfg.model.name_or_path)
    if _looks_local(cfg.model.name_or_path) and not (model / "config.json").is_file():
        hint = " (build it with `rlpost make-tiny-model .cache/tiny-model`)" if "tiny" in model.name else ""
        raise ConfigError(f"model.name_or_path: no model folder with config.json at {model}{hint}")
    if cfg.model.tokenizer and _looks_local(cfg.model.tokenizer) and not Path(cfg.model.tokenizer).exists():
        raise ConfigError(f"model.tokenizer: not found: {cfg.model.tokenizer}")
    dataset = cfg.data.dataset
    if dataset and (dataset.endswith(LOCAL_DATA_SUFFIXES) or _looks_local(dataset)) and not Path(dataset).exists():
        raise ConfigError(f"data.dataset: file not found: {dataset}")


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).exists()
