"""MLGym's task registry for :func:`~rlpost.envs.mlgym.make_mlgym`: registers a task with the agent config
TorchRL's ``make_mlgym`` uses and builds its gymnasium env (MLGym and gymnasium are imported here only)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

MLGYM_INSTALL_HINT = "pip install git+https://github.com/facebookresearch/MLGym"


class MLGymTasks:
    """Registers MLGym tasks and builds their envs (imports MLGym and gymnasium)."""

    def __init__(self) -> None:
        self.mlgym = import_optional("mlgym", f"MLGym is not installed; it is not on PyPI: {MLGYM_INSTALL_HINT}")
        self.gym = import_optional("gymnasium", "MLGym's envs are gymnasium envs: pip install gymnasium")
        locations = list(getattr(self.mlgym, "__path__", None) or [])
        self.root = Path(locations[0]).parent if locations else None
        self._registered: dict[str, tuple[str, Any]] = {}

    def register(self, task: str) -> None:
        with chdir(self.root):
            import mlgym.environment.registration  # noqa: F401  (registers MLGym's gymnasium envs)
            from mlgym import CONFIG_DIR
            from mlgym.agent.base import AgentArguments
            from mlgym.backend.base import ModelArguments
            from mlgym.environment.env import EnvironmentArguments
            from mlgym.environment.registration import register_task

            environment_args = EnvironmentArguments(
                task_config_path=f"tasks/{task}.yaml",
                max_steps=10,
                seed=42,
                container_type="podman",
                verbose=False,
                aliases_file="docker/aliases.sh",
            )
            agent_args = AgentArguments(
                model=ModelArguments(""), agent_config_path=Path(CONFIG_DIR) / "agents" / "default.yaml"
            )
            register_task(environment_args)
        self._registered[task] = (environment_args.task.id, agent_args)

    def make(self, task: str) -> Any:
        if task not in self._registered:
            self.register(task)
        task_id, agent_args = self._registered[task]
        with chdir(self.root):
            env = self.gym.make(f"mlgym/{task_id}", devices=["cpu_0"]).unwrapped
        env.config = agent_args.config  # the templates and tools the wrapper reads
        return env


def import_optional(name: str, hint: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name:  # the package is there but one of its own imports failed
            raise
        raise ImportError(f"make_mlgym needs the {name!r} package. {hint}") from err


@contextmanager
def chdir(path: Path | None) -> Iterator[None]:
    if path is None:
        yield
        return
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)
