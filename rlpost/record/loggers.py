"""TorchRL's ``WandbLogger``, writing through rlpost's wandb tracker.

TorchRL's GRPO and expert-iteration scripts log with::

    wandb_logger = WandbLogger(project="grpo-sync", exp_name="grpo-sync-gsm8k-Qwen")
    wandb_logger.log_metrics(metrics, step=global_step)
    wandb_logger.log_str("history", history_str, step=global_step)
    wandb_logger.experiment.finish()

Here the run is a :class:`~rlpost.record.trackers.WandbTracker` (files in ``save_dir/wandb/``,
run id in ``save_dir/trackers.json``, every chart's x-axis the metric ``step``); strings, tables,
histograms and videos go to the same run with the same ``step``. ``offline=True`` writes local
files only; ``offline=False`` leaves the mode to :func:`~rlpost.record.trackers.wandb_mode`.

Deviations from TorchRL: the project is ``project``, else ``WANDB_PROJECT``, else ``"rlpost"``
(TorchRL: wandb's "Uncategorized"); without ``save_dir`` the files go to ``WANDB_DIR`` or the
working directory; every metric is charted against the one ``step`` (TorchRL: one step per metric
group, e.g. ``train/step``); when ``step`` is not given it is one more than the last step logged
for that group, as in TorchRL; ``wandb.init`` arguments other than ``config``, ``entity``,
``group``, ``tags``, ``notes`` and ``job_type`` are refused (TypeError naming them); not a Ray
service (no ``use_ray_service``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlpost.config import TRACKER_PACKAGES
from rlpost.record.trackers import WandbTracker, numeric_values, remember_id

# wandb.init arguments a WandbLogger passes on to the tracker's run
_INIT_ARGUMENTS = ("entity", "group", "tags", "notes", "job_type")


def environment_metadata() -> dict[str, Any]:
    """The Python runtime and installed package versions (TorchRL logs them as ``config["env"]``)."""
    packages = {}
    for distribution in importlib.metadata.distributions():
        name = distribution.metadata.get("Name")
        if name:
            packages[name] = distribution.version
    python = {"version": sys.version, "executable": sys.executable, "prefix": sys.prefix,
              "platform": platform.platform()}  # fmt: skip
    return {"python": python, "packages": dict(sorted(packages.items()))}


def plain_metrics(metrics: Any, keys_sep: str = "/") -> dict[str, Any]:
    """``metrics`` (a dict or a TensorDict, nested keys joined with ``keys_sep``) with tensors as
    Python numbers (one element) or lists (several): what TorchRL's ``log_metrics`` returns."""
    if hasattr(metrics, "flatten_keys"):  # a TensorDict
        metrics = metrics.detach().cpu().flatten_keys(keys_sep).to_dict()
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if hasattr(value, "detach") and hasattr(value, "numel"):  # a tensor
            value = value.detach().cpu()
            value = value.item() if value.numel() == 1 else value.tolist()
        out[key] = value
    return out


def _step_group(name: str) -> str:
    """The metric group whose step ``name`` counts with: its prefix up to the last ``/``."""
    return name.rpartition("/")[0]


class WandbLogger:
    """TorchRL's ``torchrl.record.loggers.wandb.WandbLogger`` on rlpost's wandb tracker (module
    docstring). ``id``: a wandb run id to continue (default: a new run); ``log_dir``: the same as
    ``save_dir`` (give one); ``log_env_packages``: log the Python runtime and package versions
    under ``config["env"]``; ``config``, ``entity``, ``group``, ``tags``, ``notes``, ``job_type``:
    as for ``wandb.init``. ImportError without wandb (``pip install 'rlpost[wandb]'``)."""

    def __init__(self, exp_name: str, offline: bool = False, save_dir: str | os.PathLike | None = None,
                 id: str | None = None, project: str | None = None, *,  # noqa: A002  (TorchRL's name)
                 video_fps: int = 32, log_env_packages: bool = True, **kwargs: Any) -> None:  # fmt: skip
        log_dir = kwargs.pop("log_dir", None)
        if save_dir and log_dir:
            raise ValueError("log_dir and save_dir point to the same value in WandbLogger. Both cannot be specified.")
        config = kwargs.pop("config", None)
        init_kwargs = {name: value for name in _INIT_ARGUMENTS if (value := kwargs.pop(name, None)) is not None}
        if kwargs:
            raise TypeError(
                f"WandbLogger: rlpost's wandb run takes no {sorted(kwargs)} (it passes config, entity, group, tags, "
                "notes and job_type to wandb.init)"
            )
        module, requirement = TRACKER_PACKAGES["wandb"]
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ImportError(f"wandb could not be imported: pip install {requirement}") from err
        self.exp_name = exp_name
        self.offline = offline
        self.save_dir = save_dir or log_dir
        self.project = project
        self.video_fps = video_fps
        self.log_env_packages = log_env_packages
        self.log_dir = Path(self.save_dir or os.environ.get("WANDB_DIR") or os.getcwd())
        # a new run unless an id is given (the tracker would continue the run it remembers)
        self.id = id or uuid.uuid4().hex[:12]
        remember_id(self.log_dir, "wandb", self.id)
        self.tracker = WandbTracker(
            self.log_dir, exp_name, project=project, mode="offline" if offline else None, **init_kwargs
        )
        self._last_steps: dict[str, int] = {}
        if config:
            self.log_hparams(config)
        if log_env_packages:
            self.experiment.config.update({"env": environment_metadata()}, allow_val_change=True)

    @property
    def experiment(self) -> Any:
        """The wandb run (``wandb_logger.experiment.finish()``, ``.id``)."""
        return self.tracker.run

    # ------------------------------------------------------------------ steps

    def _step_for(self, names: Sequence[str], step: int | None) -> int:
        """``step``, or one more than the last step of the names' groups; recorded for them."""
        groups = {_step_group(name) for name in names} or {""}
        if step is None:
            step = max(self._last_steps.get(group, -1) for group in groups) + 1
        step = int(step)
        for group in groups:
            self._last_steps[group] = max(self._last_steps.get(group, -1), step)
        return step

    def _log(self, payload: Mapping[str, Any], step: int | None, override_global_step: bool = False) -> None:
        payload = dict(payload)
        if override_global_step:  # TorchRL's escape hatch: wandb's own step
            self.experiment.log(payload, step=step)
            return
        if step is None and "step" in payload:
            step = payload.pop("step")
        step = self._step_for(list(payload), step)
        numbers = numeric_values(payload)
        others = {key: value for key, value in payload.items() if key not in numbers}
        if numbers:
            self.tracker.log(numbers, step)
        if others:
            self.experiment.log({**others, "step": step})

    # ------------------------------------------------------------------ TorchRL's Logger API

    def log_scalar(self, name: str, value: float, step: int | None = None, commit: bool = True, *,
                   override_global_step: bool = False) -> None:  # fmt: skip
        """Log one number at ``step`` (default: one more than its group's last step)."""
        self._log({name: value}, step, override_global_step)

    def log_metrics(self, metrics: Mapping[str, Any] | Any, step: int | None = None, *, keys_sep: str = "/",
                    override_global_step: bool = False) -> dict[str, Any]:  # fmt: skip
        """Log several metrics at one step; a TensorDict's nested keys are joined with
        ``keys_sep``. Returns them with tensors as Python numbers or lists."""
        plain = plain_metrics(metrics, keys_sep)
        self._log(plain, step, override_global_step)
        return plain

    def log_str(self, name: str, value: str, step: int | None = None, *, override_global_step: bool = False) -> None:
        """Log a string: as it is at a given step, else as a one-cell table (TorchRL's)."""
        if step is None:
            import wandb

            value = wandb.Table(columns=["text"], data=[[value]])
        self._log({name: value}, step, override_global_step)

    def log_hparams(self, cfg: Any) -> None:
        """Put ``cfg`` (a dict, or an OmegaConf config) in the run's config."""
        if not isinstance(cfg, dict):
            try:
                from omegaconf import OmegaConf
            except ImportError:
                cfg = dict(cfg)
            else:
                cfg = OmegaConf.to_container(cfg, resolve=True)
        self.experiment.config.update(cfg, allow_val_change=True)

    def log_histogram(self, name: str, data: Sequence, **kwargs: Any) -> None:
        """Log a histogram of ``data`` (keyword args ``step`` and ``bins``)."""
        import wandb

        bins = kwargs.pop("bins", None)
        step = kwargs.pop("step", None)
        override = kwargs.pop("override_global_step", False)
        self._log({name: wandb.Histogram(data, num_bins=bins or 64)}, step, override)

    def log_video(self, name: str, video: Any, **kwargs: Any) -> None:
        """Log a video (keyword args ``step``, ``fps`` and ``format``; wandb needs moviepy)."""
        import wandb

        fps = kwargs.pop("fps", self.video_fps)
        video_format = kwargs.pop("format", "mp4")
        step = kwargs.pop("step", None)
        override = kwargs.pop("override_global_step", False)
        self._log({name: wandb.Video(video, fps=fps, format=video_format)}, step, override)

    def close(self) -> None:
        """Finish the wandb run (TorchRL's scripts call ``experiment.finish()``)."""
        self.tracker.close()

    def __repr__(self) -> str:
        return f"WandbLogger(experiment={self.experiment!r})"
