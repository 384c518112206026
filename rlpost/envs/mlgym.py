"""MLGym tasks as LLM chat environments (TorchRL's ``make_mlgym`` and ``MLGymWrapper``).

`MLGym <https://github.com/facebookresearch/MLGym>`_ runs ML research tasks in a container
behind a gymnasium-shaped text env (``step(command)`` runs a shell or MLGym command such as
``validate``/``submit``; ``env.config`` holds the prompt templates). :class:`MLGymWrapper` makes
it a chat for an LLM policy in rlpost's history mode (:class:`~rlpost.envs.ChatEnv`)::

    reset() -> td (batch [B], one MLGym env per row):
        ("history", "prompt")   ChatHistory: [system message, first user message]
        ("text", "prompt")      the prompt rendered with the tokenizer (only with a tokenizer)
        "observation"           the MLGym env's latest output ("" when it gave none)
        "state"                 what the config's state command printed (JSON text)
        "message"               the latest user message
        "task"                  the task name (when tasks are sampled, or asked for at reset)
        "done", "terminated", "truncated"   bool [B, 1], False
    step(td) reads ("history", "full") = prompt + the policy's assistant message (or TorchRL's
    older "text_response": the policy's text after the prompt), and writes
        td["retry"]   bool [B, 1]: the response held no command, the MLGym env was not stepped
        td["action"]  the command sent to the MLGym env ("" on retry)
        td["next"]    the keys of a reset output (the chat grown by the assistant message and a
                      user message showing the command's output) + "reward" float32 [B, 1]

The command is the assistant message's last fenced block (```...```), as MLGym's
``ThoughtActionParser`` reads it. The user message is the config's ``task_template`` (+
``strategy_template``) at reset, then ``next_step_template`` (``next_step_no_output_template``
when the command printed nothing), filled with the task's fields, the tools' docs and
variables, the state command's JSON fields, ``current_step``, ``remaining_steps`` and
``observation``. The reward is MLGym's (0) plus ``evaluation score - baseline score`` read from
the message (:class:`EvaluationOutputParser`), plus ``reward_wrong_format`` on a retry.
``done`` is MLGym's ``done`` (``terminated``). :func:`make_mlgym` imports MLGym (not on PyPI:
``pip install git+https://github.com/facebookresearch/MLGym``).

Deliberate deviations from TorchRL (whose ``make_mlgym`` is a ``TransformedEnv`` over a
batch-less ``MLGymWrapper`` and its transforms):

- One class does the work of TorchRL's wrapper and transforms; no specs, no
  ``append_transform``. A :class:`ChatHistory` under ``"history"`` (TorchRL: a plain History);
  a tokenizer is optional (TorchRL's template transform fails without one).
- Batch ``[B]``, one MLGym env per row (TorchRL: batch-less, one env), rewards and flags
  ``[B, 1]`` as in every rlpost env.
- The user message of a step shows the output of the command run in that step; TorchRL's
  message reads the observation and state of the step's input, one step late.
- On a retry the MLGym env is not stepped (as in TorchRL) and the message shows the latest
  output again; its score is not counted again, so a validation score is rewarded once.
- The command goes under ``"action"``; TorchRL overwrites ``"text_response"`` with it, losing
  the model's text. An empty fenced block is no command (a retry).
- Task sampling uses the env's own RNG (:meth:`MLGymWrapper.set_seed`), not NumPy's global
  one, and a reset rebuilds an MLGym env only when its task changes (TorchRL: whenever the
  reset input names a task).
- Scores written ``np.float64(x)`` or next to other metrics are read (TorchRL's parser fails
  to convert them); an observation of None is ``""``; a config without a state command gives
  no state fields (TorchRL fails); a template field that cannot be filled raises ValueError
  naming it; a missing ``next_step(_no_output)_template`` falls back as MLGym's agent config
  does; fields of the same name are taken from, by priority, ``observation`` and the step
  counts, the state, the tools, the task (TorchRL raises TypeError on duplicates).
"""

from __future__ import annotations

import numbers
import os
import random
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack

from rlpost.data import ChatHistory, History, Text
from rlpost.envs.mlgym_tasks import MLGYM_INSTALL_HINT, MLGymTasks, chdir
from rlpost.envs.mlgym_text import (
    EvaluationOutputParser,
    check_env,
    command_file,
    fill,
    parse_command,
    read_state,
    reset_observation,
    rows_of,
    step_output,
    string_stack,
    strings,
    task_fields,
    tool_fields,
    user_message,
)

__all__ = ["MLGYM_INSTALL_HINT", "EvaluationOutputParser", "MLGymWrapper", "make_mlgym", "parse_command"]

SYSTEM_ROLE, USER_ROLE, POLICY_ROLE = "system", "user", "assistant"
RESPONSE_KEY = "text_response"  # TorchRL's action key: the policy's text after the prompt
# End-of-turn markers cut from a "text_response" (with the tokenizer's EOS token).
_TURN_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>")


# ---------------------------------------------------------------------------- the wrapper


class MLGymWrapper:
    """MLGym env(s) as an LLM chat env in history mode (module docstring for the keys).

    Args:
        env: an MLGym env (``MLGymEnv``, or an object with its methods and ``env.config``), or
            a list of them, one per batch row.
        tokenizer: a tokenizer, or a name for ``AutoTokenizer``; renders ``("text", "prompt")``.
        reward_wrong_format: added to the reward of a step whose response held no command.
        task: the task the given env(s) run (None: unnamed).
        tasks: task names drawn uniformly at each reset of a row (needs ``make_env``).
        make_env: task name -> MLGym env, for a reset that draws or names (``"task"``) another
            task than the row's (the old env is closed).
        workdir: where the MLGym env is driven from (MLGym resolves its config paths from its
            repository root; :func:`make_mlgym` passes it).
        template_kwargs: extra keyword arguments for ``apply_chat_template``.

    ``envs`` and ``current_tasks`` hold each row's env and task name (None: unnamed).
    """

    input_mode = "history"

    def __init__(
        self,
        env: Any,
        *,
        tokenizer: Any = None,
        device: torch.device | str | None = None,
        reward_wrong_format: float | None = None,
        task: str | None = None,
        tasks: Sequence[str] | None = None,
        make_env: Callable[[str], Any] | None = None,
        workdir: str | os.PathLike | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        envs = list(env) if isinstance(env, (list, tuple)) else [env]
        if not envs:
            raise ValueError("MLGymWrapper needs at least one MLGym env, got an empty list")
        for one in envs:
            check_env(one)
        if task is not None and (not isinstance(task, str) or not task):
            raise ValueError(f"task must be a task name (a non-empty str), got {task!r}")
        if tasks is not None:
            if isinstance(tasks, str) or not isinstance(tasks, Iterable):
                raise ValueError(f"tasks must be a non-empty list of task names, got {tasks!r}")
            tasks = list(tasks)
            if not tasks or not all(isinstance(t, str) and t for t in tasks):
                raise ValueError(f"tasks must be a non-empty list of task names, got {tasks!r}")
            if make_env is None:
                raise ValueError("tasks=... needs make_env, which builds the MLGym env of a task name")
        if make_env is not None and not callable(make_env):
            raise ValueError(f"make_env must be callable (task name -> MLGym env), got {make_env!r}")
        if reward_wrong_format is not None:
            if isinstance(reward_wrong_format, bool) or not isinstance(reward_wrong_format, numbers.Real):
                raise ValueError(f"reward_wrong_format must be a number or None, got {reward_wrong_format!r}")
            reward_wrong_format = float(reward_wrong_format)
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.envs = envs
        self.batch_size = torch.Size([len(envs)])
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else None
        self.reward_wrong_format = reward_wrong_format
        self.tasks = tasks
        self.make_env = make_env
        self.workdir = Path(workdir) if workdir is not None else None
        self.template_kwargs = dict(template_kwargs or {})
        self.parser = EvaluationOutputParser()
        self.current_tasks: list[str | None] = [task] * len(envs)
        self._rng = random.Random()

    # ------------------------------------------------------------------ rlpost env helpers

    @property
    def state_keys(self) -> tuple[str, ...]:
        """Keys a step reads from its input besides the policy's output (carried from ``next``)."""
        return ("observation", "task")

    def prompt_rows(self, td: TensorDictBase) -> list[list[dict]]:
        """Per-row prompts (message dicts) of a reset output or ``next``."""
        return td.get("history").prompt.to_chats(include_state=True)

    def set_seed(self, seed: int | None, static_seed: bool = False) -> int | None:
        """Seed the task draws of ``tasks``; ``static_seed`` (TorchRL's) has no effect."""
        self._rng.seed(seed)
        return seed

    def close(self) -> None:
        """Close every MLGym env (their containers)."""
        for env in self.envs:
            env.close()

    # ------------------------------------------------------------------ reset

    def reset(self, td: TensorDictBase | None = None) -> TensorDictBase:
        """Start a task in every row; the output holds the module docstring's keys and the
        input's. ``td`` (batch ``[B]``, or 0-d) may name each row's task under ``"task"``;
        otherwise rows draw one from ``tasks``, or keep theirs."""
        td = self._reset_input(td)
        num_rows = self.batch_size[0]
        if "task" in td.keys():
            names = strings(td.get("task"), num_rows, "task")
            if not all(names):
                raise ValueError(f"the reset input's 'task' must name a task in every row, got {names!r}")
        else:
            names = [self._draw_task() for _ in range(num_rows)]
        rows = [self._reset_row(i, name) for i, name in enumerate(names)]
        out = td.exclude("next").clone(recurse=False)
        out.update(self._pack(rows, with_task=self.tasks is not None or "task" in td.keys(), with_reward=False))
        return out

    def _reset_input(self, td: TensorDictBase | None) -> TensorDictBase:
        if td is None:
            return TensorDict(batch_size=self.batch_size, device=self.device)
        if not isinstance(td, TensorDictBase):
            raise ValueError(f"reset expects a TensorDict or None, got {type(td).__name__}")
        if td.batch_dims == 0:
            td = td.expand(self.batch_size).clone()
        return self._check_batch(td, "reset")

    def _check_batch(self, td: TensorDictBase, call: str) -> TensorDictBase:
        if td.batch_size != self.batch_size:
            raise ValueError(
                f"{call} expects a TensorDict of batch {tuple(self.batch_size)} (one row per MLGym env), "
                f"got batch {tuple(td.batch_size)}"
            )
        return td

    def _draw_task(self) -> str | None:
        return self._rng.choice(self.tasks) if self.tasks is not None else None

    def _reset_row(self, row: int, task: str | None) -> dict[str, Any]:
        with chdir(self.workdir):
            if task is not None and task != self.current_tasks[row]:
                self._switch_task(row, task)
            env = self.envs[row]
            env.reset_container()
            env.communicate(f"cd {Path(str(env.task_workspace)).parent}")
            observation = reset_observation(env.reset())
            self._set_environment_variables(env)
            system = fill(env.config, "system_template", {**task_fields(env), **tool_fields(env)})
            state, state_fields = read_state(env)
            message = user_message(env, first=True, observation=observation, state_fields=state_fields)
        chat = [{"role": SYSTEM_ROLE, "content": system}, {"role": USER_ROLE, "content": message}]
        return {
            "chat": chat, "observation": observation, "state": state, "message": message,
            "task": self.current_tasks[row], "reward": 0.0, "terminated": False, "truncated": False,
        }  # fmt: skip

    def _switch_task(self, row: int, task: str) -> None:
        if self.make_env is None:
            raise ValueError(
                f"row {row} is asked to run task {task!r} but runs {self.current_tasks[row]!r}, and this "
                "MLGymWrapper has no make_env to build another task's env (make_mlgym(tasks=[...]) has one)"
            )
        old = self.envs[row]
        try:
            old.close()
        except Exception as err:  # a container that will not stop must not block the next task
            warnings.warn(f"closing the MLGym env of task {self.current_tasks[row]!r} failed: {err!r}", stacklevel=3)
        env = self.make_env(task)
        check_env(env)
        self.envs[row], self.current_tasks[row] = env, task

    def _set_environment_variables(self, env: Any) -> None:
        """Define the state command and the config's variables in the container, and install
        the config's command files."""
        config = env.config
        lines = [] if config.state_command is None else [config.state_command.code]
        lines += [f"{name}={value}" for name, value in dict(config.env_variables).items()]
        output = env.communicate("\n".join(lines))
        if getattr(env, "returncode", 0) != 0:
            raise RuntimeError(
                f"setting the MLGym env's variables failed with return code {env.returncode}: {output!r}"
            )
        env.add_commands([command_file(Path(path)) for path in config.command_files])

    # ------------------------------------------------------------------ step

    def step(self, td: TensorDictBase) -> TensorDictBase:
        """Run each row's command; ``td`` gets ``"retry"``, ``"action"`` and ``"next"`` (see the
        module docstring) and is returned."""
        td, _, _ = self._step(td)
        return td

    def step_and_maybe_reset(self, td: TensorDictBase) -> tuple[TensorDictBase, TensorDictBase]:
        """``step(td)``, and the input of the next step: ``td["next"]``'s prompt and state keys,
        where the rows that are done were reset (drawing a new task when ``tasks`` is set)."""
        td, rows, with_task = self._step(td)
        return td, self._next_root(rows, with_task)

    def _next_root(self, rows: list[dict[str, Any]], with_task: bool) -> TensorDict:
        """The next step's input from a step's rows, the finished rows reset."""
        done = [i for i, row in enumerate(rows) if row["terminated"] or row["truncated"]]
        for i in done:
            rows[i] = self._reset_row(i, self._draw_task())
        with_task = with_task or (bool(done) and self.tasks is not None)
        return self._pack(rows, with_task=with_task, with_reward=False)

    def rollout(
        self,
        max_steps: int,
        policy: Callable[[TensorDictBase], TensorDictBase] | None = None,
        callback: Callable[[Any, TensorDictBase], Any] | None = None,
        *,
        auto_reset: bool = True,
        break_when_any_done: bool | None = None,
        break_when_all_done: bool | None = None,
        tensordict: TensorDictBase | None = None,
    ) -> TensorDictBase:
        """TorchRL's ``EnvBase.rollout``: up to ``max_steps`` steps stacked lazily along a new
        last dim (``[B, T]``: the prompts grow). It stops after a step where any row is done
        (default) or all are (``break_when_all_done``); with neither, finished rows are reset and
        go on. A policy is required (a chat env has no random action)."""
        if not callable(policy):
            raise ValueError(f"rollout needs a policy (a callable td -> td, e.g. an LLM wrapper), got {policy!r}")
        if max_steps < 1:
            raise ValueError(f"rollout max_steps must be >= 1, got {max_steps}")
        if break_when_any_done is None:
            break_when_any_done = not break_when_all_done
        if auto_reset:
            td = self.reset(tensordict)
        elif tensordict is None:
            raise ValueError("rollout(auto_reset=False) needs the first step's input as tensordict=")
        else:
            td = tensordict
        steps = []
        for step in range(max_steps):
            td, rows, with_task = self._step(policy(td))
            steps.append(td)
            if callback is not None:
                callback(self, td)
            done = td.get(("next", "done"))
            if step == max_steps - 1 or (break_when_any_done and done.any()) or (break_when_all_done and done.all()):
                break
            td = self._next_root(rows, with_task)  # no container is restarted after the last step
        return lazy_stack(steps, dim=1)

    def _step(self, td: TensorDictBase) -> tuple[TensorDictBase, list[dict[str, Any]], bool]:
        if not isinstance(td, TensorDictBase):
            raise ValueError(f"step expects a TensorDict, got {type(td).__name__}")
        self._check_batch(td, "step")
        num_rows = self.batch_size[0]
        chats, responses = self._responses(td)
        previous = [""] * num_rows
        if "observation" in td.keys():
            previous = strings(td.get("observation"), num_rows, "observation")
        with_task = "task" in td.keys()
        tasks = strings(td.get("task"), num_rows, "task") if with_task else self.current_tasks
        rows, actions = [], []
        for i, (chat, response) in enumerate(zip(chats, responses)):
            command = parse_command(response)
            actions.append(command or "")
            env = self.envs[i]
            with chdir(self.workdir):
                if command is None:
                    observation, reward, terminated, truncated = previous[i], 0.0, False, False
                    if self.reward_wrong_format is not None:
                        reward += self.reward_wrong_format
                else:
                    observation, reward, terminated, truncated = step_output(env.step(command))
                state, state_fields = read_state(env)
                message = user_message(env, first=False, observation=observation, state_fields=state_fields)
            if command is not None:
                reward += self.parser.reward(message)
            rows.append({
                "chat": chat + [{"role": USER_ROLE, "content": message}], "observation": observation,
                "state": state, "message": message, "task": tasks[i], "reward": reward,
                "terminated": terminated, "truncated": truncated,
            })  # fmt: skip
        td.set("retry", torch.tensor([[not a] for a in actions], dtype=torch.bool, device=self.device))
        td.set("action", string_stack(actions))
        td.set("next", self._pack(rows, with_task=with_task, with_reward=True))
        return td, rows, with_task

    def _responses(self, td: TensorDictBase) -> tuple[list[list[dict]], list[str]]:
        """Each row's chat up to and with the assistant's message, and that message's text. A
        ``("history", "full")`` chat not ending with an assistant message gets an empty one (as in
        TorchRL); a ``"text_response"`` is cut at its first end-of-turn marker."""
        num_rows = self.batch_size[0]
        history = td.get("history", None)
        if isinstance(history, ChatHistory) and history.full is not None:
            chats = rows_of(history.full, num_rows, ("history", "full"))
            for chat in chats:
                if not chat or chat[-1]["role"] != POLICY_ROLE:
                    chat.append({"role": POLICY_ROLE, "content": ""})
            responses = [chat[-1]["content"] for chat in chats]
            for i, content in enumerate(responses):
                if not isinstance(content, str):
                    raise ValueError(f"row {i}: the assistant's message must be text, got {type(content).__name__}")
            return chats, responses
        if RESPONSE_KEY in td.keys():
            if not isinstance(history, ChatHistory) or history.prompt is None:
                raise ValueError(f"a step with {RESPONSE_KEY!r} also needs the prompt under ('history', 'prompt')")
            chats = rows_of(history.prompt, num_rows, ("history", "prompt"))
            responses = [self._strip_turn_end(t) for t in strings(td.get(RESPONSE_KEY), num_rows, RESPONSE_KEY)]
            for chat, response in zip(chats, responses):
                chat.append({"role": POLICY_ROLE, "content": response})
            return chats, responses
        raise ValueError(
            "MLGymWrapper.step needs the policy's output under ('history', 'full') (or TorchRL's "
            f"{RESPONSE_KEY!r}); the step input has keys {sorted(map(str, td.keys(include_nested=True)))}"
        )

    def _strip_turn_end(self, text: str) -> str:
        markers = [m for m in (getattr(self.tokenizer, "eos_token", None), *_TURN_END_MARKERS) if m]
        cut = min((text.find(m) for m in markers if m in text), default=len(text))
        return text[:cut].strip()

    # ------------------------------------------------------------------ output

    def _pack(self, rows: list[dict[str, Any]], *, with_task: bool, with_reward: bool) -> TensorDict:
        num_rows = len(rows)
        out = TensorDict(batch_size=[num_rows], device=self.device)
        history = History.from_chats([row["chat"] for row in rows])
        out.set("history", ChatHistory(prompt=history, batch_size=[num_rows]))
        if self.tokenizer is not None:
            rendered = history.apply_chat_template(
                tokenizer=self.tokenizer, add_generation_prompt=True, tokenize=False, **self.template_kwargs
            )
            out.set("text", Text(prompt=string_stack(rendered), batch_size=[num_rows]))
        for key in ("observation", "state", "message"):
            out.set(key, string_stack([row[key] for row in rows]))
        if with_task:
            out.set("task", string_stack([row["task"] or "" for row in rows]))
        if with_reward:
            out.set("reward", self._column([row["reward"] for row in rows], torch.float32))
        terminated = self._column([row["terminated"] for row in rows], torch.bool)
        truncated = self._column([row["truncated"] for row in rows], torch.bool)
        out.set("terminated", terminated)
        out.set("truncated", truncated)
        out.set("done", terminated | truncated)
        return out

    def _column(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device).view(-1, 1)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(batch_size={tuple(self.batch_size)}, tasks={self.current_tasks}, "
            f"reward_wrong_format={self.reward_wrong_format}, device={self.device})"
        )


# ---------------------------------------------------------------------------- make_mlgym


def make_mlgym(
    *,
    task: str | None = None,
    tasks: list[str] | None = None,
    tokenizer: Any = None,
    device: torch.device | str | None = "cpu",
    reward_wrong_format: float | None = None,
) -> MLGymWrapper:
    """An :class:`MLGymWrapper` over MLGym's env of a task (TorchRL's ``make_mlgym``).

    ``task``: an MLGym task name (e.g. ``"prisonersDilemma"``, config ``tasks/<task>.yaml``), or
    ``tasks``: one drawn at each reset (reported under ``"task"``); exactly one of the two.

    As in TorchRL, each task is registered with MLGym's default agent config, at most 10 steps,
    seed 42 and the podman runtime, its env made on device ``cpu_0``; the (last) task's env is
    built at once. MLGym must be installed (module docstring).
    """
    if bool(task) == bool(tasks):
        raise ValueError(
            f"make_mlgym needs either task or tasks, not both and not neither; got task={task!r}, tasks={tasks!r}"
        )
    if task and not isinstance(task, str):
        raise ValueError(f"task must be a task name (str), got {task!r}")
    if tasks and (isinstance(tasks, str) or not all(isinstance(t, str) and t for t in tasks)):
        raise ValueError(f"tasks must be a list of task names, got {tasks!r}")
    names = [task] if task else list(tasks)
    registry = MLGymTasks()
    for name in names:
        registry.register(name)
    return MLGymWrapper(
        registry.make(names[-1]),
        tokenizer=tokenizer,
        device=device,
        reward_wrong_format=reward_wrong_format,
        task=names[-1],
        tasks=list(tasks) if tasks else None,
        make_env=registry.make,
        workdir=registry.root,
    )
