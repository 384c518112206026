"""A small MLGym stand-in for the tests of :mod:`rlpost.envs.mlgym` (MLGym itself needs a container
runtime and is not on PyPI).

:class:`FakeMLGymEnv` has the surface of ``mlgym.environment.env.MLGymEnv`` that an agent uses:
``reset(*, seed, options) -> ({"observation": None}, {})``, ``step(action) -> (observation, 0,
done, info)`` (MLGym's four-tuple), ``communicate``, ``returncode``, ``reset_container``,
``add_commands``, ``close``, ``task`` (whose ``args`` is a dataclass, set by ``reset``),
``task_workspace``, ``current_step``, ``max_steps``, and the agent config under ``config``
(templates formatted with ``str.format``, a state command printing JSON, tools' docs and
variables). Commands it knows: ``ls``, ``python train.py``, ``validate`` (scores the submission
against the baseline, as MLGym prints it), ``submit`` (ends the episode) and ``exit_forfeit``;
any other command prints nothing. It records what it was sent.

:func:`install_fake_mlgym` puts a fake ``mlgym`` package (the modules ``make_mlgym`` imports)
and a fake ``gymnasium`` in ``sys.modules``; ``gymnasium.make("mlgym/<id>")`` builds a
FakeMLGymEnv for a registered task.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace

STEP_INFO = "(Current Step: {current_step}, Remaining Steps: {remaining_steps})"
STATE_INFO = "(Open file: {open_file})\n(Current directory: {working_dir})\nbash-$"
COMMAND_OUTPUTS = {"ls": "data\nevaluate.py\ntrain.py", "python train.py": "Epoch 1: loss 0.52\nSaved submission.csv"}
STATE = {"open_file": "n/a", "working_dir": "/home/agent/workspace"}


@dataclass
class FakeTaskArgs:
    """The fields of MLGym's TaskConfig that templates use."""

    id: str = "regressionFake"
    name: str = "Fake house prices"
    description: str = "Predict the sale price of each house in data/test.csv."
    baseline_scores: list = field(default_factory=lambda: [{"Score": 1.0}])


@dataclass
class FakeCommand:
    name: str
    code: str


@dataclass
class FakeToolsHandler:
    command_docs: str = "validate:\n  docstring: scores your submission file\nsubmit:\n  docstring: ends the task"
    env_variables: dict = field(default_factory=lambda: {"WINDOW": 100})


@dataclass
class FakeAgentConfig:
    """The agent config fields MLGym's agents (and the wrapper) read."""

    system_template: str = "You are an autonomous ML researcher.\nCOMMANDS:\n{command_docs}\nWINDOW: {WINDOW}"
    task_template: str = "TASK: {description}\n" + STEP_INFO + "\n" + STATE_INFO
    next_step_template: str | None = "{observation}\n" + STEP_INFO + "\n" + STATE_INFO
    next_step_no_output_template: str | None = (
        "Your command ran successfully and did not produce any output.\n" + STEP_INFO + "\n" + STATE_INFO
    )
    strategy_template: str | None = None
    state_command: FakeCommand | None = field(
        default_factory=lambda: FakeCommand("state", "state() {\n  echo '" + json.dumps(STATE) + "'\n}")
    )
    env_variables: dict = field(default_factory=lambda: {"CURRENT_FILE": '""', "CURRENT_LINE": "0"})
    command_files: list = field(default_factory=list)
    tools_handler: FakeToolsHandler = field(default_factory=FakeToolsHandler)


class FakeMLGymEnv:
    """See the module docstring."""

    def __init__(self, task_id: str = "regressionFake", *, max_steps: int = 10, score: float = 1.75) -> None:
        self.task_id, self.max_steps, self.score = task_id, max_steps, score
        self.config = FakeAgentConfig()
        self.task = None
        self.task_workspace = Path("/home/agent/workspace")
        self.current_step = 0
        self.returncode: int | None = None
        self.next_returncode = 0
        self.state = dict(STATE)
        self.communicated: list[str] = []
        self.actions: list[str] = []
        self.added_commands: list[list[dict]] = []
        self.num_resets = self.num_container_resets = 0
        self.reset_cwd: list[str] = []
        self.closed = False

    def reset(self, *, seed=None, options=None):
        self.num_resets += 1
        self.reset_cwd.append(os.getcwd())
        self.current_step = 0
        self.task = SimpleNamespace(args=FakeTaskArgs(id=self.task_id))
        return {"observation": None}, {}

    def step(self, action: str):
        self.actions.append(action)
        self.current_step += 1
        info = {"score": []}
        if self.current_step > self.max_steps:
            info["exit_status"] = "autosubmission (max_steps)"
            return "Exited (max_steps)", 0, True, info
        action = action.strip()
        if action == "submit":
            info["exit_status"] = "submitted"
            return "Exited (submit)", 0, True, info
        if action == "exit_forfeit":
            return "Exited (exit_forfeit)", 0, True, info
        if action == "validate":
            baseline = self.task.args.baseline_scores[0]
            return (
                "Your code produced a valid submission artefact at /home/agent/workspace/submission.csv.\n"
                f"Baseline Score: {baseline}\nEvaluation Score: {{'Score': {self.score}}}",
                0,
                False,
                info,
            )
        if action.startswith("open "):
            self.state["open_file"] = action.split(" ", 1)[1]
        return COMMAND_OUTPUTS.get(action, ""), 0, False, info

    def communicate(
        self, input: str, timeout_duration: float = 25, no_output_timeout_duration=None, *, set_last_action=False
    ) -> str:
        self.communicated.append(input)
        self.returncode = self.next_returncode
        if input.strip() == "state":
            return json.dumps(self.state) + "\n"
        return ""

    def reset_container(self) -> None:
        self.num_container_resets += 1

    def add_commands(self, commands: list[dict]) -> None:
        self.added_commands.append(list(commands))

    def close(self) -> None:
        self.closed = True


def install_fake_mlgym(monkeypatch, root: Path) -> SimpleNamespace:
    """Fake ``mlgym`` (living in ``root/mlgym``) and ``gymnasium`` modules in ``sys.modules``;
    returns a record of what they were asked (``registered``, ``made``, ``envs``)."""
    record = SimpleNamespace(registered=[], made=[], envs=[], agent_args=[])
    (root / "mlgym").mkdir(parents=True, exist_ok=True)

    @dataclass
    class EnvironmentArguments:
        task_config_path: str
        max_steps: int = 50
        seed: int = 0
        container_type: str = "docker"
        verbose: bool = True
        aliases_file: str | None = None

        def __post_init__(self):  # MLGym loads the task config here
            self.task = SimpleNamespace(id=Path(self.task_config_path).stem + "-v0")

    @dataclass
    class ModelArguments:
        model_name: str

    class AgentArguments:
        def __init__(self, model, agent_config_path):
            self.model, self.agent_config_path = model, agent_config_path
            self.config = FakeAgentConfig()
            record.agent_args.append(self)

    ids: dict[str, int] = {}

    def register_task(args):
        record.registered.append((args, os.getcwd()))
        ids[f"mlgym/{args.task.id}"] = args.max_steps

    def make(env_id, **kwargs):
        if env_id not in ids:
            raise KeyError(f"no env registered under {env_id}")
        record.made.append((env_id, kwargs, os.getcwd()))
        env = FakeMLGymEnv(env_id.split("/", 1)[1], max_steps=ids[env_id])
        env.config = None  # MLGym's env has no agent config until the caller sets one
        record.envs.append(env)
        return SimpleNamespace(unwrapped=env)

    modules = {
        "mlgym": {"CONFIG_DIR": root / "configs", "__path__": [str(root / "mlgym")]},
        "mlgym.environment": {},
        "mlgym.environment.registration": {"register_task": register_task},
        "mlgym.environment.env": {"EnvironmentArguments": EnvironmentArguments},
        "mlgym.agent": {},
        "mlgym.agent.base": {"AgentArguments": AgentArguments},
        "mlgym.backend": {},
        "mlgym.backend.base": {"ModelArguments": ModelArguments},
        "gymnasium": {"make": make},
    }
    for name, attributes in modules.items():
        module = ModuleType(name)
        module.__dict__.update(attributes)
        monkeypatch.setitem(sys.modules, name, module)
    for name in modules:  # parents expose their submodules, as after a real import
        parent, _, child = name.rpartition(".")
        if parent:
            monkeypatch.setattr(sys.modules[parent], child, sys.modules[name], raising=False)
    return record
