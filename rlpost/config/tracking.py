"""The ``logging`` section: the run's name and directory, the progress line, the dashboard, the trackers."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from rlpost.config.base import Section

# tracker name -> (module that must be importable, pip requirement that provides it)
TRACKER_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard (a dependency of rlpost: reinstall it)"),
    "wandb": ("wandb", "'rlpost[wandb]'"),
    "mlflow": ("mlflow", "'rlpost[mlflow]'"),
}


def missing_tracker_packages(names: list[str]) -> list[str]:
    """For each tracker in ``names`` whose package cannot be imported here, a sentence naming
    what to install. Looks the module up with :func:`importlib.util.find_spec` (nothing is
    imported)."""
    import importlib.util

    problems = []
    for name in names:
        module, requirement = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            problems.append(
                f"tracker {name!r} needs the {module} package, which is not installed: pip install {requirement}"
            )
    return problems


class LoggingConfig(Section):
    run_dir: str = Field("runs", description="Parent folder of run directories.")
    run_name: str | None = Field(None, description="Run name (Ray namespace rlpost-<run_name>); default: a timestamp.")
    metrics_interval: int = Field(1, ge=1, description="Learner steps between metrics.jsonl lines.")
    progress: bool = Field(
        True, description="Show progress on the driver: a bar on a terminal, a plain line every few steps otherwise."
    )
    dashboard: bool = Field(
        True,
        description="On a local run (no resources.address): start Ray's dashboard on 127.0.0.1 and print its URL, "
        "the namespace and the metrics URL (one that cannot start is reported; the run goes on). Ignored on an "
        "existing cluster. It costs CPU: on 2 cores the demo's steps were ~9% slower with it.",
    )
    dashboard_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port of the local run's dashboard; None: 8265, or the next free port when 8265 is taken. "
        "An explicit port that is taken leaves the run without a dashboard.",
    )
    trackers: list[str] = Field(
        default_factory=lambda: ["tensorboard"],
        validate_default=True,
        description="Where every metrics.jsonl record also goes: any of tensorboard (RUN_DIR/tensorboard/), "
        "wandb (pip install 'rlpost[wandb]'; offline unless WANDB_MODE or WANDB_API_KEY say otherwise) and "
        "mlflow (pip install 'rlpost[mlflow]'; RUN_DIR/mlruns/ unless MLFLOW_TRACKING_URI is set); [] for none.",
    )

    @field_validator("trackers", mode="before")
    @classmethod
    def _trackers_from_text(cls, value: Any) -> Any:
        """Accept one name or a comma-separated string (``logging.trackers=wandb``) as a list."""
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("trackers")
    @classmethod
    def _trackers_known_and_installed(cls, value: list[str]) -> list[str]:
        """Each tracker is a known name, named once, and its package is importable here (checked
        with importlib's find_spec, nothing imported), so a missing one fails before any actor starts."""
        valid = ", ".join(TRACKER_PACKAGES)
        for name in value:
            if name not in TRACKER_PACKAGES:
                raise PydanticCustomError(
                    "unknown_tracker",
                    "unknown tracker {name}; valid trackers: {valid}",
                    {"name": repr(name), "valid": valid},
                )
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise PydanticCustomError(
                "repeated_tracker", "tracker {names} named more than once", {"names": ", ".join(repeated)}
            )
        problems = missing_tracker_packages(value)
        if problems:
            raise PydanticCustomError("tracker_not_installed", "{problems}", {"problems": "; ".join(problems)})
        return value
