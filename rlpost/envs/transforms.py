"""Env transforms: the small hook protocol of :class:`ChatEnv`, and the Python tool.

A transform adds one capability to a :class:`~rlpost.envs.chat.ChatEnv` (data loading, a reward,
a tool) through hooks the env calls around its own reset and step::

    reset(td):  td = t.reset_preprocess(td)   for t in transforms    # e.g. load the query
                out = base reset(td)
                out = t.on_reset(td, out)      for t in transforms
    step(td):   next = base step(td)                                  # full -> next prompt
                next = t.on_step(td, next)     for t in transforms    # e.g. reward, tool turn

This mirrors TorchRL's ``Transform._reset_env_preprocess`` / ``_reset`` / ``_step``. Deliberate
deviations: no specs, no ``_call``/``_inv_call`` (observations and actions are not rewritten on
the way in or out), and no ``TransformedEnv``: the env holds its transforms in a list
(``env.append_transform(t)`` appends and returns the env).

:class:`PythonInterpreter` runs the ```` ```python ```` blocks of the last assistant message in
the sandbox of :func:`rlpost.envs.tools.run_python` and appends the results as a ``"tool"``
message to the next prompt, rendered as in seed 000.
"""

from __future__ import annotations

import inspect
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tensordict import TensorDictBase

from rlpost.envs.tools import extract_python_blocks, format_tool_response, run_python

if TYPE_CHECKING:
    from rlpost.envs.chat import ChatEnv

_OPEN, _CLOSE = "<tool_response>\n", "\n</tool_response>"


class Transform:
    """Base class of env transforms; every hook defaults to "no change".

    Attributes:
        parent: the env the transform was appended to (set by ``ChatEnv.append_transform``).
        state_keys: keys this transform writes at reset that must be carried from step to step
            (the env copies them into ``next``), e.g. the dataset row a reward reads later.
    """

    state_keys: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.parent: ChatEnv | None = None

    def reset_preprocess(self, td: TensorDictBase) -> TensorDictBase:
        """Before the base reset: fill or edit the reset input (``td`` has batch ``[k]``)."""
        return td

    def on_reset(self, td: TensorDictBase, reset_td: TensorDictBase) -> TensorDictBase:
        """After the base reset: edit its output ``reset_td`` (``td`` is the reset input)."""
        return reset_td

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        """After the base step: edit ``next_td`` (reward, done, next prompt) from ``td``, the
        step input carrying the policy's output."""
        return next_td

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs to continue as if uninterrupted (empty for stateless transforms)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} is stateless but got state {sorted(state)}")

    def _env(self) -> ChatEnv:
        if self.parent is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to an env (use env.append_transform)")
        return self.parent

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class PythonInterpreter(Transform):
    """Run the ```` ```python ```` blocks of each last assistant message; append a tool message.

    For each env of the batch whose latest response holds closed python blocks, every block runs
    in its own sandboxed process (:func:`~rlpost.envs.tools.run_python` with ``run_kwargs``) and
    a ``tool_role`` message whose content is :func:`~rlpost.envs.tools.format_tool_response` is
    appended to the next prompt, so the policy sees the results on its next turn. A failing
    block (exception, timeout, limit, hostile code) is reported in that message; nothing raises.
    Responses without code leave the next prompt unchanged.

    Deviations from TorchRL's ``PythonInterpreter``: blocks never share state (no persistent
    interpreter: each block is a fresh process, so a block cannot use a name defined by an
    earlier one), and the sandbox limits CPU, memory, files, processes and network rather than
    only time. ``max_workers`` > 1 runs the blocks of a batch concurrently (threads, each
    waiting on its own child process).
    """

    def __init__(self, *, tool_role: str = "tool", max_workers: int = 1, **run_kwargs: Any) -> None:
        super().__init__()
        if max_workers < 1:
            raise ValueError(f"PythonInterpreter max_workers must be >= 1, got {max_workers}")
        try:  # an unknown sandbox option should fail here, not at the first tool call
            inspect.signature(run_python).bind("", **run_kwargs)
        except TypeError as exc:
            raise ValueError(f"PythonInterpreter: bad run_python options {sorted(run_kwargs)}: {exc}") from exc
        self.tool_role = tool_role
        self.max_workers = max_workers
        self.run_kwargs = run_kwargs
        self.num_blocks_run = 0

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        env = self._env()
        blocks_per_env = [extract_python_blocks(text) for text in env.last_responses(td)]
        flat = [code for blocks in blocks_per_env for code in blocks]
        if not flat:
            return next_td
        results = self._run_all(flat)
        self.num_blocks_run += len(flat)
        messages: list[str | None] = []
        for blocks in blocks_per_env:
            mine, results = results[: len(blocks)], results[len(blocks) :]
            messages.append(self._message_content(mine) if mine else None)
        return env.append_messages(next_td, self.tool_role, messages)

    def _message_content(self, results: list) -> str:
        """The tool message's content. Qwen-style templates (the tiny model's too) wrap a
        ``"tool"`` message in ``<tool_response>\\n...\\n</tool_response>`` themselves, so that
        role gets the inner text and renders exactly as :func:`format_tool_response`; any other
        role (e.g. ``"user"``, for templates without a tool role) gets the wrapped text."""
        wrapped = format_tool_response(results)
        if self.tool_role != "tool":
            return wrapped
        assert wrapped.startswith(_OPEN) and wrapped.endswith(_CLOSE), wrapped[:40]
        return wrapped[len(_OPEN) : -len(_CLOSE)]

    def _run_all(self, codes: list[str]) -> list:
        if self.max_workers == 1 or len(codes) == 1:
            return [run_python(code, **self.run_kwargs) for code in codes]
        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(codes))) as pool:
            return list(pool.map(lambda code: run_python(code, **self.run_kwargs), codes))

    def __repr__(self) -> str:
        return f"PythonInterpreter(tool_role={self.tool_role!r}, run_kwargs={self.run_kwargs})"
