"""MLGym's text as :class:`~rlpost.envs.mlgym.MLGymWrapper` reads and writes it: the command of an
assistant message (:func:`parse_command`), the scores of an evaluation (:class:`EvaluationOutputParser`),
the agent config's templates, the env's outputs and the batch's string entries."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tensordict import NonTensorData, NonTensorStack

from rlpost.data import History

# What the wrapper uses of an MLGym env (mlgym.environment.env.MLGymEnv) and of its agent config.
_ENV_ATTRIBUTES = (
    "reset", "step", "communicate", "reset_container", "add_commands",
    "config", "task_workspace", "current_step", "max_steps",
)  # fmt: skip
_CONFIG_ATTRIBUTES = (
    "system_template", "task_template", "state_command", "env_variables", "command_files", "tools_handler",
)  # fmt: skip
_FENCE = re.compile(r"```(\S*)\s*")
_SCORE = r"\{'Score': (?:[\w.]+\()?([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf)"


def parse_command(response: str) -> str | None:
    """The command of an assistant message: its last top-level fenced block, stripped.

    A fence with a language tag (```` ```bash ````) always opens a block, possibly nested; a bare
    fence closes the open block, or opens one. Blocks still open at the end are ignored. None
    without a closed block or when the last is blank (where MLGym's ``ThoughtActionParser``
    raises its format error).
    """
    if not isinstance(response, str):
        raise ValueError(f"parse_command expects the assistant's text, got {type(response).__name__}")
    depth, content_start, found, offset = 0, 0, None, 0
    for line in response.splitlines(keepends=True):
        fence = _FENCE.fullmatch(line.rstrip("\r\n"))
        if fence is not None:
            if depth and not fence.group(1):
                depth -= 1
                if depth == 0:
                    found = response[content_start:offset]
            else:
                if depth == 0:
                    content_start = offset + len(line)
                depth += 1
        offset += len(line)
    if found is None or not found.strip():
        return None
    return found.strip()


class EvaluationOutputParser:
    """Reads MLGym's evaluation output (TorchRL's parser of the same name): calling it returns
    the fields of :attr:`patterns` found (scores as floats, steps as ints); :meth:`reward` is
    ``evaluation_score - baseline_score``, a missing one counting as 0.

    Deviation from TorchRL: a score written ``np.float64(x)`` or followed by other metrics in
    the same dict is read; TorchRL's float conversion fails on both.
    """

    patterns: dict[str, re.Pattern] = {
        "submission_artefact_path": re.compile(r"valid submission artefact at (.*)\."),
        "baseline_score": re.compile(r"Baseline Score: " + _SCORE),
        "evaluation_score": re.compile(r"Evaluation Score: " + _SCORE),
        "current_step": re.compile(r"\(Current Step: (\d+),"),
        "remaining_steps": re.compile(r"Remaining Steps: (\d+)\)"),
        "open_file": re.compile(r"\(Open file: (.*)\)"),
        "current_directory": re.compile(r"\(Current directory: (.*)\)"),
    }
    converters: dict[str, Callable[[str], Any]] = {
        "baseline_score": float,
        "evaluation_score": float,
        "current_step": int,
        "remaining_steps": int,
    }

    def __call__(self, output: str) -> dict[str, Any]:
        if not isinstance(output, str):
            raise ValueError(f"EvaluationOutputParser reads text, got {type(output).__name__}")
        parsed: dict[str, Any] = {}
        for name, pattern in self.patterns.items():
            match = pattern.search(output)
            if match is not None:
                parsed[name] = self.converters.get(name, str)(match.group(1).strip())
        return parsed

    def reward(self, output: str) -> float:
        parsed = self(output)
        return parsed.get("evaluation_score", 0.0) - parsed.get("baseline_score", 0.0)


# ---------------------------------------------------------------------------- messages


def user_message(env: Any, *, first: bool, observation: str, state_fields: dict[str, Any]) -> str:
    """The user message after a reset (``first``) or after a command's ``observation``."""
    config = env.config
    if first:
        names = ["task_template"]
        if getattr(config, "strategy_template", None) is not None:
            names.append("strategy_template")
    elif not observation.strip():
        names = [first_template(config, "next_step_no_output_template", "next_step_template", "task_template")]
    else:
        names = [first_template(config, "next_step_template", "task_template")]
    fields = {
        **task_fields(env),
        **tool_fields(env),
        **state_fields,
        "current_step": env.current_step,
        "remaining_steps": env.max_steps - env.current_step,
        "observation": observation,
    }
    return "\n".join(fill(config, name, fields) for name in names)


def task_fields(env: Any) -> dict[str, Any]:
    args = getattr(getattr(env, "task", None), "args", None)
    if dataclasses.is_dataclass(args) and not isinstance(args, type):
        return dataclasses.asdict(args)
    if isinstance(args, Mapping):
        return dict(args)
    if hasattr(args, "model_dump"):
        return dict(args.model_dump())
    raise ValueError(
        "the MLGym env's env.task.args (the task config, set by env.reset) must be a dataclass or a "
        f"mapping, got {type(args).__name__}"
    )


def check_env(env: Any) -> None:
    missing = [name for name in _ENV_ATTRIBUTES if not hasattr(env, name)]
    if missing:
        raise ValueError(
            f"MLGymWrapper wraps MLGym envs (mlgym.environment.env.MLGymEnv, with the agent config set "
            f"as env.config); {type(env).__name__} has no {', '.join(missing)}"
        )
    missing = [name for name in _CONFIG_ATTRIBUTES if not hasattr(env.config, name)]
    if missing:
        raise ValueError(f"the MLGym env's agent config (env.config) has no {', '.join(missing)}")


def tool_fields(env: Any) -> dict[str, Any]:
    tools = env.config.tools_handler
    return {"command_docs": tools.command_docs, **dict(tools.env_variables)}


def read_state(env: Any) -> tuple[str, dict[str, Any]]:
    """What the state command printed, and its JSON fields ("" and none without a command)."""
    command = getattr(env.config.state_command, "name", None)
    if not command:
        return "", {}
    text = env.communicate(command)
    try:
        fields = json.loads(text)
    except (TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"the MLGym state command {command!r} printed {text!r}, which is not JSON") from err
    if not isinstance(fields, dict):
        raise ValueError(f"the MLGym state command {command!r} printed {text!r}, not a JSON object")
    return text, fields


def first_template(config: Any, *names: str) -> str:
    for name in names:
        if getattr(config, name, None) is not None:
            return name
    return names[-1]


def fill(config: Any, name: str, fields: dict[str, Any]) -> str:
    template = getattr(config, name, None)
    if not isinstance(template, str):
        raise ValueError(f"the MLGym config's {name} must be a str, got {type(template).__name__}")
    try:
        return template.format(**fields)
    except KeyError as err:
        raise ValueError(
            f"the MLGym config's {name} uses the field {{{err.args[0]}}}, which is not among the fields "
            f"it is filled with: {sorted(fields)}"
        ) from err
    except (IndexError, ValueError) as err:
        raise ValueError(f"the MLGym config's {name} is not a valid format string: {err}") from err


def command_file(path: Path) -> dict[str, str]:
    """One of the config's command files, as MLGym's ``add_commands`` takes it."""
    contents = path.read_text()
    if contents.strip().startswith("#!"):  # a script, made executable
        return {"contents": contents, "name": path.name.rsplit(".", 1)[0], "type": "script"}
    if path.name.endswith(".sh"):  # sourced
        return {"contents": contents, "name": path.name, "type": "source_file"}
    if path.name.startswith("_"):  # a helper the other commands use
        return {"contents": contents, "name": path.name, "type": "utility"}
    raise ValueError(
        f"MLGym command file {str(path)!r} is not a shell script: start it with a shebang (#!), name it "
        "*.sh to have it sourced, or start its name with '_' for a utility file"
    )


def observation_text(observation: Any) -> str:
    if isinstance(observation, Mapping):
        observation = observation.get("observation")
    if observation is None:
        return ""
    if not isinstance(observation, str):
        raise ValueError(f"MLGym observations are text, got {type(observation).__name__}: {observation!r}")
    return observation


def reset_observation(output: Any) -> str:
    """The observation of ``env.reset()``: ``(observation, info)`` or the observation alone."""
    if isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], Mapping):
        output = output[0]
    return observation_text(output)


def step_output(output: Any) -> tuple[str, float, bool, bool]:
    """(observation, reward, terminated, truncated) of MLGym's ``(observation, reward, done,
    info)`` or gymnasium's ``(observation, reward, terminated, truncated, info)``."""
    if not isinstance(output, tuple) or len(output) not in (4, 5):
        raise ValueError(
            "the MLGym env's step must return (observation, reward, done, info) or "
            f"(observation, reward, terminated, truncated, info), got {output!r:.200}"
        )
    if len(output) == 4:
        observation, reward, terminated, _ = output
        truncated = False
    else:
        observation, reward, terminated, truncated, _ = output
    return observation_text(observation), float(reward), bool(terminated), bool(truncated)


def strings(value: Any, num_rows: int, key: str) -> list[str]:
    """The text of each row of entry ``key`` (a non-tensor stack or datum, a str or a list)."""
    if isinstance(value, NonTensorStack):
        value = value.tolist()
    elif isinstance(value, NonTensorData):
        value = [value.data] * num_rows
    elif isinstance(value, str):
        value = [value] * num_rows
    elif isinstance(value, (list, tuple)):
        value = list(value)
    else:
        raise ValueError(f"{key!r} must hold one str per row, got {type(value).__name__}")
    if len(value) != num_rows:
        raise ValueError(f"{key!r} has {len(value)} values for a batch of {num_rows}")
    if not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key!r} must hold one str per row, got {value!r}")
    return value


def rows_of(history: History, num_rows: int, key: tuple[str, str]) -> list[list[dict]]:
    if history.batch_dims != 2 or history.batch_size[0] != num_rows:
        raise ValueError(f"{key} must be a History of batch [{num_rows}, n_messages], got {tuple(history.batch_size)}")
    return history.to_chats(include_state=True)


def string_stack(values: list[str]) -> NonTensorStack:
    return NonTensorStack(*[NonTensorData(v) for v in values], batch_size=[len(values)])
