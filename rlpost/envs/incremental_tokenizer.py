"""Token ids kept in step with a history-mode conversation: TorchRL's ``IncrementalTokenizer``.

A policy that prefers tokens wants the prompt's ids, with the ids it generated kept as they were
(re-tokenizing the rendered text may split them differently, which changes what the log-probs
are computed on). This transform writes ``tokens.prompt`` next to ``history.prompt``::

    reset:  tokens.prompt = tokenize(render(history.prompt, generation prompt))
    step:   tokens.prompt = tokens.full                                     no message added
                          = tokens.full + end of turn + tokens(new messages + generation prompt)
                          = tokenize(render(next history.prompt))          no tokens.full given

which are the ids a tokens-mode ChatEnv would hold for the same conversation.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack

from rlpost.data import History
from rlpost.data.specs import Composite, Unbounded
from rlpost.data.templates import resolve_template  # the template History itself renders with
from rlpost.envs.errors import EnvInputError
from rlpost.envs.llm_transforms import AddThinkingPrompt
from rlpost.envs.td_rows import NestedKey, as_key, stack_rows, tensor_rows
from rlpost.envs.tool_transforms import ToolTransformBase
from rlpost.envs.transforms import Transform
from rlpost.envs.turns import TurnRenderer, close_with


class IncrementalTokenizer(Transform):
    """Keep ``tokens_key`` in step with ``history_key`` (see the module docstring); TorchRL's
    constructor. A two-part key is stored unpadded, one TensorDict per row (read with
    ``td.get(("tokens", "prompt"), as_list=True)``); a one-part key as a tensor (jagged when the
    rows differ in length). Trap: append it after the transforms that add messages (tools,
    AddThinkingPrompt); before one of them it raises ``ValueError`` at the first reset.

    Deliberate deviations from TorchRL: when a transform added messages after the policy's
    turn (a tool result), those messages and the generation prompt are tokenized and appended
    to ``tokens.full`` (TorchRL copies ``tokens.full`` alone, so the tokens lose the tool
    result that the history holds); the transform refuses a tokens-mode env (whose own
    ``tokens.prompt`` it would overwrite) and the misplacement above; the observation spec of
    ``tokens_key`` is int64 ids of shape ``[*batch, -1]`` (TorchRL: a ``Bounded`` spec in
    ``[0, vocab_size)``; rlpost's specs have ``Unbounded`` only).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        history_key: NestedKey = ("history", "prompt"),
        tokens_key: NestedKey = ("tokens", "prompt"),
        chat_template_name: str | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> None:
        super().__init__()
        if tokenizer is None:
            raise ValueError("IncrementalTokenizer needs a tokenizer")
        self.tokenizer = tokenizer
        self.history_key, self.tokens_key = as_key(history_key), as_key(tokens_key)
        if isinstance(self.tokens_key, tuple) and len(self.tokens_key) > 2:
            raise ValueError(f"IncrementalTokenizer tokens_key has at most two parts, got {tokens_key!r}")
        self.chat_template_name, self.chat_template = chat_template_name, chat_template
        self.add_generation_prompt = add_generation_prompt
        self._renderers: dict[str, TurnRenderer] = {}

    @property
    def state_keys(self) -> tuple[str, ...]:
        """The ids are an observation: carried into each step's next root."""
        return (self._container_key,)

    @property
    def _container_key(self) -> str:
        return self.tokens_key[0] if isinstance(self.tokens_key, tuple) else self.tokens_key

    # ------------------------------------------------------------------ hooks

    def on_reset(self, td: TensorDictBase, reset_td: TensorDictBase) -> TensorDictBase:
        self._check_env()
        chats = self._chats(reset_td, self.history_key)
        if chats is not None:
            self._set_rows(reset_td, [self._tokenize(chat) for chat in chats])
        return reset_td

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        next_chats = self._chats(next_td, self.history_key)
        if next_chats is None:
            return next_td
        full_key = (self._container_key, "full") if isinstance(self.tokens_key, tuple) else "tokens_full"
        if full_key not in td.keys(include_nested=True):
            self._set_rows(next_td, [self._tokenize(chat) for chat in next_chats])
            return next_td
        full_rows = tensor_rows(td, full_key)
        if ("masks", "all_attention_mask") in td.keys(include_nested=True):  # padded rows: drop the padding
            full_rows = [
                ids[mask.bool()] for ids, mask in zip(full_rows, tensor_rows(td, ("masks", "all_attention_mask")))
            ]
        full_chats = self._full_chats(td)
        rows = [
            self._extend(ids.reshape(-1).to(torch.int64), full_chats[i] if full_chats else None, next_chats[i])
            for i, ids in enumerate(full_rows)
        ]
        self._set_rows(next_td, rows)
        return next_td

    def transform_observation_spec(self, observation_spec: Composite) -> Composite:
        """``observation_spec`` with ``tokens_key``: the prompt's ids, ``[*batch, -1]`` int64."""
        ids = Unbounded(shape=(*observation_spec.shape, -1), dtype=torch.int64, device=observation_spec.device)
        observation_spec[self.tokens_key] = ids
        return observation_spec

    # ------------------------------------------------------------------ ids

    def _extend(self, full_ids: torch.Tensor, full_chat: list[dict] | None, next_chat: list[dict]) -> torch.Tensor:
        """The next prompt's ids from the policy's ``full_ids`` (see the module docstring)."""
        if full_chat is None or len(next_chat) == len(full_chat):
            return full_ids  # TorchRL's copy: nothing was added after the policy's turn
        if [_message(m) for m in next_chat[: len(full_chat)]] != [_message(m) for m in full_chat]:
            return self._tokenize(next_chat)  # a transform rewrote the conversation: start over
        closed = self._render(full_chat, add_generation_prompt=False)
        extended = self._render(next_chat, add_generation_prompt=True)
        if not extended.startswith(closed):
            raise ValueError("IncrementalTokenizer: this chat template does not render message by message")
        end_ids = self.tokenizer.encode(self._turn_end(full_chat[-1]["role"]), add_special_tokens=False)
        new_ids = self.tokenizer.encode(extended[len(closed) :], add_special_tokens=False)
        return torch.tensor(close_with(full_ids.tolist(), end_ids) + new_ids, dtype=torch.int64)

    def _tokenize(self, chat: list[dict]) -> torch.Tensor:
        history = History.from_chats([chat])
        ids = history.apply_chat_template(tokenizer=self.tokenizer, tokenize=True,
                                          add_generation_prompt=self.add_generation_prompt, **self._template())  # fmt: skip
        return torch.as_tensor(ids[0], dtype=torch.int64).reshape(-1)

    def _render(self, chat: list[dict], *, add_generation_prompt: bool) -> str:
        history = History.from_chats([chat])
        return history.apply_chat_template(tokenizer=self.tokenizer, add_generation_prompt=add_generation_prompt,
                                           **self._template())[0]  # fmt: skip

    def _template(self) -> dict[str, str]:
        kwargs = {"chat_template": self.chat_template, "chat_template_name": self.chat_template_name}
        return {key: value for key, value in kwargs.items() if value is not None}

    def _turn_end(self, role: str) -> str:
        if role not in self._renderers:
            template = resolve_template(self.tokenizer, self.chat_template, self.chat_template_name)
            kwargs = {} if template is None else {"chat_template": template}
            self._renderers[role] = TurnRenderer(self.tokenizer, role, kwargs)
        return self._renderers[role].turn_end()

    # ------------------------------------------------------------------ keys

    def _chats(self, td: TensorDictBase, key: NestedKey) -> list[list[dict]] | None:
        """The conversations under ``key`` (``("history", "prompt")`` reads the ChatHistory's
        ``prompt``), one message-dict list per row, or None when ``td`` has none."""
        if isinstance(key, tuple) and len(key) == 2 and key[0] in td.keys():
            history = getattr(td.get(key[0]), key[1], None)
        else:
            history = td.get(key, None)
        return history.to_chats() if isinstance(history, History) else None

    def _full_chats(self, td: TensorDictBase) -> list[list[dict]] | None:
        container = self.history_key[0] if isinstance(self.history_key, tuple) else None
        return self._chats(td, (container, "full")) if container is not None else None

    def _set_rows(self, td: TensorDictBase, rows: list[torch.Tensor]) -> None:
        device = getattr(self.parent, "device", None)
        if device is not None:
            rows = [row.to(device) for row in rows]
        if isinstance(self.tokens_key, tuple):
            td.set(self._container_key, lazy_stack([TensorDict({self.tokens_key[1]: row}) for row in rows]))
        else:
            td.set(self.tokens_key, stack_rows(rows))

    def _check_env(self) -> None:
        env = self._env()
        if getattr(env, "input_mode", "history") != "history":
            raise EnvInputError(
                f"IncrementalTokenizer keeps the ids of a history-mode ChatEnv; this env's input_mode is "
                f"{env.input_mode!r}, which keeps tokens.prompt itself"
            )
        transforms = list(getattr(env, "transforms", ()))
        later = transforms[transforms.index(self) + 1 :] if self in transforms else []
        adders = [type(t).__name__ for t in later if isinstance(t, (ToolTransformBase, AddThinkingPrompt))]
        if adders:
            raise ValueError(
                f"IncrementalTokenizer runs before {adders}, which add messages its ids would miss: append it after them"
            )

    def __repr__(self) -> str:
        return f"IncrementalTokenizer(history_key={self.history_key!r}, tokens_key={self.tokens_key!r})"


def _message(message: dict) -> tuple[str, Any]:
    return message.get("role"), message.get("content")
