"""ChatEnv: the conversation around the LLM, in history, text or tokens mode (TorchRL's ``ChatEnv``).

The env never calls the model: ``reset`` turns a query (and a system prompt) into the first
prompt; the policy writes its output (``full`` = prompt + response); ``step`` makes ``full`` the
next prompt and writes ``reward`` (float32 ``[B, 1]``) and the flags (bool ``[B, 1]``).
Transforms add the rest: prompts from a dataset, rewards, tools. Keys per ``input_mode``::

    "history": reset -> history.prompt (History [B, n]);  step reads history.full
    "text":    reset -> text.prompt (rendered str per row); step reads text.full
    "tokens":  reset -> tokens.prompt (int64 ids per row, lazily stacked, unpadded);
               step reads tokens.full (unpadded rows, or padded rows + masks.all_attention_mask),
               or only tokens.response (the next prompt is then prompt + response)

As in TorchRL, the reset input's keys are carried into its output, and ``reset(None)`` or a reset
input without the query raises :class:`~rlpost.envs.errors.EnvInputError` (a RuntimeError).
TorchRL 0.9's keys, still shown on TorchRL's LLM API page, work in history mode: the query under
``"text"``; the response text under ``"text_response"``, or a bare History under ``"history"``.

Deliberate deviations: transforms use rlpost's hooks (:mod:`rlpost.envs.transforms`);
``max_steps`` truncates episodes (TorchRL uses a ``StepCounter``) and ``step_count`` is carried in
the TensorDict; a reset input may carry a per-row ``"system_prompt"``; a partial reset is a
``reset`` of the sub-batch of done envs (batch ``[k]``), not a ``"_reset"`` mask; batch sizes
have one dim (more raise ``ValueError``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase

from rlpost.data import ChatHistory, History, Text, Tokens
from rlpost.data.specs import Composite, NonTensor, Unbounded
from rlpost.envs.chat_rows import (
    as_list,
    distinct_chats,
    is_padded,
    is_strings,
    make_text,
    make_tokens,
    row_list,
    row_values,
    stack_values,
)
from rlpost.envs.common import FLAGS, EnvBase
from rlpost.envs.datasets import DataLoadingPrimer
from rlpost.envs.errors import EnvInputError
from rlpost.envs.incremental_tokenizer import IncrementalTokenizer
from rlpost.envs.ray_primer import RayDataLoadingPrimer
from rlpost.envs.row_sources import is_batch_iterable
from rlpost.envs.transforms import Transform, TransformedEnv
from rlpost.envs.turns import TurnRenderer

INPUT_MODES = ("history", "text", "tokens")
# TorchRL 0.9's keys (see the module docstring)
LEGACY_QUERY_KEY = "text"
LEGACY_RESPONSE_KEY = "text_response"
_CONTAINERS = {"history": ChatHistory, "text": Text, "tokens": Tokens}


class ChatEnv(EnvBase):
    """A batch of ``B`` conversations (``batch_size``: an int or a 1-D size); see the module
    docstring for the keys of each mode. ``tokenizer`` renders histories in text and tokens
    modes (``template_kwargs`` go to ``apply_chat_template``); ``data_key``: the query's key in
    the reset input (default the class attribute, "query"); ``max_steps``: episodes are
    truncated after this many steps. ``with_tokenizer`` (TorchRL's): return the env in a
    TransformedEnv with an :class:`~rlpost.envs.incremental_tokenizer.IncrementalTokenizer`
    of ``tokenizer``, which keeps ``tokens.prompt`` beside ``history.prompt``.
    """

    data_key = "query"
    text_key = ("text", "prompt")
    response_key = ("text", "response")

    def __new__(cls, *args: Any, with_tokenizer: bool = False, **kwargs: Any) -> Any:
        if not with_tokenizer:
            return super().__new__(cls)
        tokenizer = kwargs.get("tokenizer")
        if tokenizer is None:
            raise ValueError("tokenizer must be provided when with_tokenizer=True")
        # a returned object that is not a ChatEnv is not initialised by Python: do it here
        env = super().__new__(cls)
        env.__init__(*args, **kwargs)
        return TransformedEnv(env, IncrementalTokenizer(tokenizer))

    @classmethod
    def with_tokenizer(cls, tokenizer: Any, **kwargs: Any) -> TransformedEnv:
        """This env wrapped with an IncrementalTokenizer of ``tokenizer`` (TorchRL's classmethod):
        ``ChatEnv(tokenizer=tokenizer, with_tokenizer=True, **kwargs)``."""
        return cls(tokenizer=tokenizer, with_tokenizer=True, **kwargs)

    def __init__(
        self,
        *,
        input_mode: Literal["history", "text", "tokens"] = "history",
        batch_size: int | tuple[int, ...] | torch.Size | None = None,
        system_prompt: str | None = None,
        tokenizer: Any = None,
        template_kwargs: dict[str, Any] | None = None,
        system_role: str = "system",
        user_role: str = "user",
        policy_role: str = "assistant",
        data_key: str | None = None,
        device: torch.device | str | None = None,
        max_steps: int | None = None,
        with_tokenizer: bool = False,
    ) -> None:
        del with_tokenizer  # handled by __new__, which wraps the env
        if input_mode not in INPUT_MODES:
            raise ValueError(f"input_mode must be one of {INPUT_MODES}, got {input_mode!r}")
        if input_mode != "history" and tokenizer is None:
            raise ValueError(f"input_mode={input_mode!r} renders chats and needs a tokenizer")
        batch_size = torch.Size([batch_size] if isinstance(batch_size, int) else (batch_size or (1,)))
        if len(batch_size) != 1:
            raise ValueError(f"{type(self).__name__} needs a 1-D batch size, got {tuple(batch_size)}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")
        self.input_mode, self.batch_size = input_mode, batch_size
        self.system_prompt, self.tokenizer = system_prompt, tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.system_role, self.user_role, self.policy_role = system_role, user_role, policy_role
        if data_key is not None:
            self.data_key = data_key
        self.device = torch.device(device) if device is not None else None
        self.max_steps = max_steps

    # ------------------------------------------------------------------ transforms and state

    @property
    def base_env(self) -> ChatEnv:
        return self

    @property
    def base_state_keys(self) -> tuple[str, ...]:
        """The keys this env carries from step to step by itself (transforms add theirs)."""
        return (self.data_key, "system_prompt", "step_count")

    def append_transform(self, transform: Transform) -> TransformedEnv:
        """A new TransformedEnv of this env and ``transform``; this env is left as it was."""
        return TransformedEnv(self, transform)

    @classmethod
    def from_dataloader(cls, dataloader: Any, **kwargs: Any) -> Any:
        """:meth:`DatasetChatEnv.from_dataloader` (a DataLoader, any iterable of batches, or rows)."""
        return DatasetChatEnv.from_dataloader(dataloader, **kwargs)

    # ------------------------------------------------------------------ specs

    def _observation_spec(self) -> Composite:
        """What reset and step write: the mode's container with its ``prompt``."""
        return self._container_spec(["prompt"])

    def _action_spec(self) -> Composite:
        """What the policy must write before a step: the mode's container with ``full``."""
        return self._container_spec(["full"])

    def _container_spec(self, keys: list[str]) -> Composite:
        container = _CONTAINERS[self.input_mode]
        inner = container.default_spec(shape=self.batch_size, keys=keys)
        return Composite({self.input_mode: inner}, shape=self.batch_size, device=self.device)

    def _state_spec(self) -> Composite:
        """What a reset reads: the query under ``data_key``."""
        query = NonTensor(example_data="a string", shape=self.batch_size, device=self.device)
        return Composite({self.data_key: query}, shape=self.batch_size, device=self.device)

    def _reward_spec(self) -> Composite:
        reward = Unbounded(shape=(*self.batch_size, 1), dtype=torch.float32, device=self.device)
        return Composite({"reward": reward}, shape=self.batch_size, device=self.device)

    def _done_spec(self) -> Composite:
        flags = {flag: Unbounded(shape=(*self.batch_size, 1), dtype=torch.bool, device=self.device) for flag in FLAGS}
        return Composite(flags, shape=self.batch_size, device=self.device)

    # ------------------------------------------------------------------ reset

    def _reset(self, td: TensorDictBase, *, given: bool = True) -> TensorDictBase:
        """The prompt under the mode's key, ``step_count`` 0, the flags False, and every key of
        ``td`` (the query under ``data_key``, optionally a per-row ``"system_prompt"``)."""
        num_envs = td.batch_size[0]
        if self.input_mode in td.keys() and not isinstance(td.get(self.input_mode), _CONTAINERS[self.input_mode]):
            raise EnvInputError(
                f"{type(self).__name__}.reset: the reset input holds {self.input_mode!r}, the key of this env's "
                f"prompt container; rename that dataset column (e.g. with a collate_fn)"
            )
        chats = [
            self._first_chat(query, system)
            for query, system in zip(self._queries(td, given=given), self._system_prompts(td))
        ]
        out = td.exclude(self.input_mode, "next").clone(recurse=False)
        out.set(self.input_mode, self._make_prompt(chats))
        out.set("step_count", torch.zeros(num_envs, 1, dtype=torch.int64, device=self.device))
        for flag in FLAGS:
            out.set(flag, torch.zeros(num_envs, 1, dtype=torch.bool, device=self.device))
        return out

    def _reset_input(self, td: TensorDictBase | None) -> TensorDictBase:
        if td is None:
            return TensorDict(batch_size=self.batch_size, device=self.device)
        if not isinstance(td, TensorDictBase):
            raise EnvInputError(f"{type(self).__name__}.reset expects a TensorDict, got {type(td).__name__}")
        if td.batch_dims == 0:  # one query for every env, as TorchRL allows
            td = td.expand(self.batch_size).clone()
        if td.batch_dims != 1:
            raise EnvInputError(
                f"{type(self).__name__}.reset expects a TensorDict of batch [k], got batch {tuple(td.batch_size)}"
            )
        return td

    def _queries(self, td: TensorDictBase, *, given: bool = True) -> list[str]:
        if self.data_key not in td.keys() and is_strings(td.get(LEGACY_QUERY_KEY, None)):
            return as_list(td.get(LEGACY_QUERY_KEY), td.batch_size[0])
        if self.data_key not in td.keys() and not given:
            raise EnvInputError(
                f"{type(self).__name__} expects a tensordict as input (got None): reset needs the query under "
                f"{self.data_key!r}, e.g. env.reset(TensorDict({{{self.data_key!r}: 'Hello'}}, batch_size=[1])), "
                "or a DataLoadingPrimer transform that supplies it"
            )
        if self.data_key not in td.keys():
            raise EnvInputError(
                f"{type(self).__name__}.reset needs the query under {self.data_key!r}; "
                f"the reset input has keys {sorted(map(str, td.keys()))}"
            )
        queries = as_list(td.get(self.data_key), td.batch_size[0])
        bad = sorted({type(q).__name__ for q in queries if not isinstance(q, str)})
        if bad:
            raise EnvInputError(f"{type(self).__name__}.reset expects strings under {self.data_key!r}, got {bad}")
        return queries

    def _system_prompts(self, td: TensorDictBase) -> list[str | None]:
        if "system_prompt" in td.keys():
            return as_list(td.get("system_prompt"), td.batch_size[0])
        return [self.system_prompt] * td.batch_size[0]

    def _first_chat(self, query: str, system: str | None) -> list[dict]:
        chat = [] if system is None else [{"role": self.system_role, "content": system}]
        return chat + [{"role": self.user_role, "content": query}]

    def _make_prompt(self, chats: list[list[dict]]) -> Any:
        """The mode's prompt container for a batch of chats (lists of message dicts). Text and
        tokens modes render each distinct chat once (a group's rows repeat one prompt, and equal
        chats render to equal text: 16 renders for a 16 x 8 batch instead of 128); each row still
        gets a tensor of its own."""
        if self.input_mode == "history":
            return ChatHistory(prompt=History.from_chats(chats), batch_size=[len(chats)])
        distinct, row_of = distinct_chats(chats)
        rendered = self._render(History.from_chats(distinct), tokenize=self.input_mode == "tokens")
        if self.input_mode == "text":
            return make_text([rendered[i] for i in row_of])
        return make_tokens([torch.as_tensor(rendered[i], dtype=torch.int64).clone() for i in row_of])

    def _render(self, history: History, *, tokenize: bool) -> list:
        return history.apply_chat_template(
            tokenizer=self.tokenizer, add_generation_prompt=True, tokenize=tokenize, **self.template_kwargs
        )

    # ------------------------------------------------------------------ step

    def _step(self, td: TensorDictBase) -> TensorDictBase:
        """The next prompt from the policy's ``full``, ``step_count`` + 1, ``reward`` 0 and the
        flags (``truncated`` and ``done`` once ``max_steps`` is reached)."""
        if td.batch_dims != 1:
            raise EnvInputError(
                f"{type(self).__name__}.step expects a TensorDict of batch [k], got batch {tuple(td.batch_size)}"
            )
        num_envs = td.batch_size[0]
        self._read_legacy_history(td)
        self._read_legacy_response(td)
        next_td = TensorDict(batch_size=td.batch_size, device=self.device)
        next_td.set(self.input_mode, self._next_prompt(td))
        step_count = td.get("step_count", torch.zeros(num_envs, 1, dtype=torch.int64)) + 1
        truncated = step_count >= self.max_steps if self.max_steps else torch.zeros_like(step_count, dtype=torch.bool)
        next_td.set("step_count", step_count)
        next_td.set("reward", torch.zeros(num_envs, 1, dtype=torch.float32, device=self.device))
        next_td.set("terminated", torch.zeros(num_envs, 1, dtype=torch.bool, device=self.device))
        next_td.set("truncated", truncated)
        next_td.set("done", truncated.clone())
        return next_td

    def _read_legacy_history(self, td: TensorDictBase) -> None:
        """TorchRL 0.9's action, a bare History under ``"history"``, turned in place into
        ``ChatHistory(prompt=..., full=history)`` (the prompt lacks a last policy message)."""
        if self.input_mode != "history" or not isinstance(td.get("history", None), History):
            return
        rows = td.get("history").to_chats(include_state=True)
        prompts = [row[:-1] if row and row[-1]["role"] == self.policy_role else row for row in rows]
        full = History.from_chats(rows)
        td.set("history", ChatHistory(prompt=History.from_chats(prompts), full=full, batch_size=td.batch_size))

    def _read_legacy_response(self, td: TensorDictBase) -> None:
        """TorchRL 0.9's action, the response text under ``"text_response"``, turned in place
        into ``history.full`` = prompt + one policy message (stripped, and without the
        end-of-turn marker when the env has a tokenizer, as TorchRL 0.9 parsed it)."""
        if self.input_mode != "history" or LEGACY_RESPONSE_KEY not in td.keys():
            return
        chat = td.get("history", None)
        if not isinstance(chat, ChatHistory) or chat.prompt is None or chat.full is not None:
            return
        texts = as_list(td.get(LEGACY_RESPONSE_KEY), td.batch_size[0])
        rows = chat.prompt.to_chats(include_state=True)
        for row, text in zip(rows, texts):
            if self.tokenizer is not None:  # without one the end-of-turn marker is unknown: kept
                text = self._turns.strip_turn_end(text)
            row.append({"role": self.policy_role, "content": text.strip()})
        td.set("history", ChatHistory(prompt=chat.prompt, full=History.from_chats(rows), batch_size=td.batch_size))

    def _next_prompt(self, td: TensorDictBase) -> Any:
        if self.input_mode == "history":
            full = self._policy_field(td, "full")
            return ChatHistory(prompt=full, batch_size=td.batch_size)
        if self.input_mode == "text":
            return make_text(self._full_texts(td))
        return make_tokens(self._full_tokens(td))

    def _policy_field(self, td: TensorDictBase, field: str) -> Any:
        """``td[input_mode].<field>`` (a History, or strings); tokens mode only checks presence,
        its ragged rows are read row by row."""
        if (self.input_mode, field) not in td.keys(include_nested=True):
            raise EnvInputError(
                f"{type(self).__name__} (input_mode={self.input_mode!r}) needs the policy's output "
                f"under ({self.input_mode!r}, {field!r})"
            )
        return None if self.input_mode == "tokens" else getattr(td.get(self.input_mode), field)

    def _full_texts(self, td: TensorDictBase) -> list[str]:
        return as_list(self._policy_field(td, "full"), td.batch_size[0])

    def _full_tokens(self, td: TensorDictBase) -> list[torch.Tensor]:
        """Each row's full ids: ``tokens.full`` (padding removed with ``masks.all_attention_mask``),
        or, when the policy wrote only ``tokens.response``, the row's prompt followed by it."""
        keys = td.keys(include_nested=True)
        if ("tokens", "full") not in keys and ("tokens", "prompt") in keys and ("tokens", "response") in keys:
            rows = td.get("tokens").unbind(0)
            if any(is_padded(row) for row in rows):
                raise EnvInputError(
                    "tokens mode: the policy wrote padded tokens.prompt/tokens.response without tokens.full; "
                    "padding cannot be told apart from ids here: return tokens.full (return_tokens=True) or use pad_output=False"
                )
            return [torch.cat([row.prompt.reshape(-1), row.response.reshape(-1).to(row.prompt.dtype)]) for row in rows]
        self._policy_field(td, "full")
        rows = row_list(td, ("tokens", "full"))
        if ("masks", "all_attention_mask") in td.keys(include_nested=True):
            masks = row_list(td, ("masks", "all_attention_mask"))
            rows = [ids[mask.bool()] for ids, mask in zip(rows, masks)]
        return rows

    def _merge_rows(self, kept: TensorDictBase, fresh: TensorDictBase, fresh_idx: list[int]) -> TensorDictBase:
        """``kept`` with rows ``fresh_idx`` taken from ``fresh`` (one row each, in order)."""
        source = [(kept, i) for i in range(kept.batch_size[0])]
        for j, i in enumerate(fresh_idx):
            source[i] = (fresh, j)
        out = TensorDict(batch_size=kept.batch_size, device=self.device)
        for key in kept.keys():
            if key == self.input_mode:
                continue
            values = {id(t): row_values(t.get(key), t.batch_size[0]) for t in (kept, fresh) if key in t.keys()}
            if len(values) < 2:
                raise ValueError(f"cannot merge reset rows: key {key!r} is missing from the reset output")
            out.set(key, stack_values([values[id(t)][i] for t, i in source]))
        prompts = {id(t): self.prompt_rows(t) for t in (kept, fresh)}
        out.set(self.input_mode, self._from_prompt_rows([prompts[id(t)][i] for t, i in source]))
        return out

    # ------------------------------------------------------------------ helpers for transforms

    def last_responses(self, td: TensorDictBase) -> list[str]:
        """The text of each row's latest policy response in a step input ``td``: the last
        message of ``history.full`` when it is ``policy_role``'s (else ""); ``text.response`` (or
        ``full`` minus ``prompt``) without its end-of-turn marker; or ``tokens.response`` decoded
        without special tokens."""
        num_envs = td.batch_size[0]
        if self.input_mode == "history":
            rows = self._policy_field(td, "full").to_chats(include_state=True)
            return [row[-1]["content"] if row and row[-1]["role"] == self.policy_role else "" for row in rows]
        if self.input_mode == "text":
            response = td.get(self.response_key, None)
            if response is not None:
                texts = as_list(response, num_envs)
            else:
                prompts = as_list(td.get(self.text_key), num_envs)
                texts = [full[len(p) :] if full.startswith(p) else "" for full, p in zip(self._full_texts(td), prompts)]
            return [self._turns.strip_turn_end(text) for text in texts]
        self._policy_field(td, "response")
        responses = [row.response for row in td.get("tokens").unbind(0)]
        return [self.tokenizer.decode(ids.tolist(), skip_special_tokens=True) for ids in responses]

    def prompt_rows(self, td: TensorDictBase) -> list:
        """Per-row prompts of a reset output or ``next``: message-dict lists, strings or ids."""
        if self.input_mode == "history":
            return td.get("history").prompt.to_chats(include_state=True)
        if self.input_mode == "text":
            return as_list(td.get(self.text_key), td.batch_size[0])
        return [row.prompt for row in td.get("tokens").unbind(0)]

    def _from_prompt_rows(self, rows: list) -> Any:
        if self.input_mode == "history":
            return ChatHistory(prompt=History.from_chats(rows), batch_size=[len(rows)])
        return make_text(rows) if self.input_mode == "text" else make_tokens(rows)

    def append_messages(self, next_td: TensorDictBase, role: str, contents: list[str | None]) -> TensorDictBase:
        """Add a ``role`` message with ``contents[i]`` to row ``i``'s prompt (None: row left as it
        is). Text and tokens modes render it with the chat template after closing the previous
        assistant turn (its end-of-turn text completed when the response stopped inside it)."""
        rows = self.prompt_rows(next_td)
        for i, content in enumerate(contents):
            if content is None:
                continue
            if self.input_mode == "history":
                rows[i] = rows[i] + [{"role": role, "content": content}]
            elif self.input_mode == "text":
                rows[i] = self._turns.append_text(rows[i], role, content)
            else:
                rows[i] = self._turns.append_tokens(rows[i], role, content)
        next_td.set(self.input_mode, self._from_prompt_rows(rows))
        return next_td

    @property
    def _turns(self) -> TurnRenderer:
        if getattr(self, "_turn_renderer", None) is None:
            self._turn_renderer = TurnRenderer(self.tokenizer, self.policy_role, self.template_kwargs)
        return self._turn_renderer

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(input_mode={self.input_mode!r}, batch_size={tuple(self.batch_size)}, "
            f"max_steps={self.max_steps})"
        )


# ---------------------------------------------------------------------------- prompts from a dataset


class DatasetChatEnv(TransformedEnv):
    """A :class:`ChatEnv` (``env.base_env``) whose prompts come from a dataset through a
    :class:`DataLoadingPrimer` (``env.primer``, ``env.transform[0]``): the base of GSM8KEnv,
    ArithmeticEnv and custom tasks. ``reset()`` needs no input: the primer supplies the query
    (and the row's columns, ``answer``, ``prompt_id``, ``row``). Subclasses set ``SYSTEM_PROMPT``;
    a ``system_prompt`` argument overrides it.

    TorchRL's keyword args (``name`` is the subset) plus ``prompt_column``, ``answer_column``,
    ``max_steps``, ``num_shards`` and ``shard_index``. ``dataset`` may also be a local file, a
    list of rows, a ``datasets.Dataset``, a DataLoader or any iterable of batches.
    ``apply_template`` has no effect, as in TorchRL: ``input_mode`` decides the rendering.
    """

    SYSTEM_PROMPT: str | None = None

    def __init__(
        self,
        *,
        dataset: Any,
        shuffle: bool = True,
        name: str | None = None,
        split: str | None = "train",
        num_envs: int = 1,
        repeats: int | None = None,
        batch_size_dl: int = 1,
        seed: int | None = None,
        group_repeats: bool = False,
        tokenizer: Any = None,
        device: torch.device | str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        apply_template: bool | None = False,
        collate_fn: Callable[[Any], Any] | None = None,
        input_mode: Literal["history", "text", "tokens"] = "history",
        data_key: str | None = None,
        primers: Any = None,
        system_prompt: str | None = None,
        prompt_column: str | None = None,
        answer_column: str | None = None,
        max_steps: int | None = None,
        num_shards: int = 1,
        shard_index: int = 0,
        ray_backend: bool = False,
        dataloader_actor_name: str | None = None,
    ) -> None:
        if dataloader_actor_name is not None and not ray_backend:
            raise ValueError("dataloader_actor_name must be None if ray_backend is False")
        base = ChatEnv(
            batch_size=(num_envs,),
            system_prompt=self.SYSTEM_PROMPT if system_prompt is None else system_prompt,
            tokenizer=tokenizer,
            template_kwargs=template_kwargs,
            input_mode=input_mode,
            data_key=data_key,
            device=device,
            max_steps=max_steps,
        )
        if ray_backend:  # one stream in a Ray actor, shared by every env naming it
            source = {"dataloader": dataset} if is_batch_iterable(dataset) else {"dataset": dataset}
            make_primer = partial(RayDataLoadingPrimer, actor_name=dataloader_actor_name, **source)
        else:
            make_primer = partial(DataLoadingPrimer, dataset)
        primer = make_primer(
            primers=primers,
            repeats=repeats,
            device=device,
            group_repeats=group_repeats,
            batch_size=num_envs,
            batch_size_dl=batch_size_dl,
            collate_fn=collate_fn,
            prompt_column=prompt_column,
            answer_column=answer_column,
            data_key=base.data_key,
            name=name,
            split=split,
            shuffle=shuffle,
            seed=seed,
            num_shards=num_shards,
            shard_index=shard_index,
        )
        if primer.prompt_column is None:
            raise ValueError(
                f"dataset {primer.description} has no prompt column: its columns are {primer.columns}; name the "
                f"prompt with prompt_column= (the env reads it under {base.data_key!r})"
            )
        self.apply_template = apply_template
        TransformedEnv.__init__(self, base, primer)

    @property
    def primer(self) -> DataLoadingPrimer:
        return self.transform[0]

    def prompt_lengths(self, chunk: int = 256) -> list[int] | None:
        """The token count of each row's first prompt as a reset renders it (system prompt,
        template, tools), in row order; None for a dataloader source. rlpost's: the run checks the
        prompts against its engine's length before it starts (rlpost.envs.tasks)."""
        primer, base = self.primer, self.base_env
        if primer.is_iterable or base.tokenizer is None:
            return None
        lengths: list[int] = []
        for start in range(0, len(primer.rows), chunk):
            stop = min(start + chunk, len(primer.rows))
            systems = [primer.rows[i].get("system_prompt", base.system_prompt) for i in range(start, stop)]
            chats = [base._first_chat(prompt, system) for prompt, system in zip(primer.prompts(start, stop), systems)]
            lengths += [len(ids) for ids in base._render(History.from_chats(chats), tokenize=True)]
        return lengths

    @classmethod
    def from_dataloader(
        cls,
        dataloader: Any,
        *,
        repeats: int | None = None,
        device: torch.device | str | None = None,
        group_repeats: bool = False,
        batch_size: int | tuple[int, ...] | torch.Size | None = None,
        primers: Any = None,
        tokenizer: Any = None,
        template_kwargs: dict[str, Any] | None = None,
        input_mode: Literal["history", "text", "tokens"] = "history",
        data_key: str | None = None,
        system_prompt: str | None = None,
        max_steps: int | None = None,
    ) -> DatasetChatEnv:
        """A chat env over ``dataloader`` (TorchRL's keywords; ``batch_size`` is the number of
        envs, default 1). The dataloader's batches go through :func:`default_collate_fn` unless
        it collates them itself."""
        num_envs = batch_size if isinstance(batch_size, int) else (int(batch_size[0]) if batch_size else 1)
        self = cls.__new__(cls)
        DatasetChatEnv.__init__(
            self, dataset=dataloader, num_envs=num_envs, repeats=repeats, device=device, group_repeats=group_repeats,
            primers=primers, tokenizer=tokenizer, template_kwargs=template_kwargs, input_mode=input_mode,
            data_key=data_key, system_prompt=system_prompt, max_steps=max_steps,
        )  # fmt: skip
        return self

    def reset_dataloader(self) -> DatasetChatEnv:
        """Restart the prompt stream at epoch 0."""
        self.primer.reset_dataloader()
        return self
