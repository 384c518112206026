"""TorchRL's older text env, :class:`LLMEnv` (strings or token ids; its observation grows by each
action), on the loop of :mod:`rlpost.envs.llm_env_loop` (LLMHashingEnv is in
:mod:`rlpost.envs.hashing_env`)::

    LLMEnv(from_text=True):   reset: text = the prompt      step: next text = text + text_response
    LLMEnv(from_text=False):  reset: tokens = the prompt    step: next tokens = cat(tokens, tokens_response)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from rlpost.data.specs import Composite, NonTensor, Unbounded
from rlpost.envs.common import FLAGS, EnvBase
from rlpost.envs.datasets import DataLoadingPrimer
from rlpost.envs.errors import EnvInputError
from rlpost.envs.hashing_env import LLMHashingEnv, hash_rows
from rlpost.envs.llm_env_loop import LLMEnvLoop, batch_size_of, merge_rows, restack_nested, stack_row_tds
from rlpost.envs.llm_transforms import Tokenizer
from rlpost.envs.td_rows import (
    NestedKey,
    as_key,
    count_rows,
    has_key,
    object_rows,
    replace_last,
    stack_rows,
    tensor_rows,
)
from rlpost.envs.transforms import TransformedEnv


class LLMEnv(LLMEnvLoop, EnvBase):
    """A text generation env whose observation (a string or token ids) grows by each action.

    TorchRL's ``LLMEnv`` (deprecated there in favour of :class:`~rlpost.envs.chat.ChatEnv`, and
    warning so here too): the observation is the prompt of the reset input, then grows by each
    action (the attention mask extended by ones with ``has_attention``). Token-only options:
    ``assign_reward`` (a zero reward per action token), ``assign_done`` (per-token
    ``("tokens_data", "done" / "terminated")`` flags, zero, the root flags their ``any``).
    ``as_llm_data``: only False; ``batch_size`` ``None``, ``0`` or ``()``: batch-less. ``eos_token_id``: an action holding it
    ends the episode (a text env reads its action's tokens under ``"tokens_response"``); without
    it the env warns, as TorchRL's. A text env's reset also takes the prompt under ``"query"``,
    where a DataLoadingPrimer puts a dataset's ``"text"`` column; it wins over ``str_key``, so a
    primer's new prompt replaces the previous observation.

    Deliberate deviations from TorchRL: a step also writes ``truncated`` (False: rlpost's loop
    reads it); ``vocab_size`` gives no bounded spec; a reset input of a batch-less env must be
    batch-less; ``check_env_specs`` and random actions are not provided (``rollout`` needs a
    policy); a partial reset of rows of different lengths stacks the rows lazily (as TorchRL's
    reset output always is).
    """

    _DEFAULT_TOKEN_KEY = "tokens"
    _DEFAULT_STR_KEY = "text"
    _DEFAULT_ATTENTION_KEY = "attention_mask"
    _DEFAULT_ACTION_TOKENS_KEY = "tokens_response"
    _DEFAULT_ACTION_STR_KEY = "text_response"
    QUERY_KEY = "query"

    def __init__(
        self,
        *,
        token_key: NestedKey | None = None,
        str_key: NestedKey | None = None,
        attention_key: NestedKey | None = None,
        action_key: NestedKey | None = None,
        reward_key: NestedKey = "reward",
        from_text: bool = True,
        device: torch.device | str | None = None,
        vocab_size: int | None = None,
        assign_reward: bool = False,
        assign_done: bool = False,
        batch_size: int | tuple | torch.Size | None = None,
        has_attention: bool = True,
        as_llm_data: bool = False,
        eos_token_id: int | None = None,
    ) -> None:
        self._warn_deprecated()
        if as_llm_data:
            raise NotImplementedError("LLMEnv(as_llm_data=True) is TorchRL's unfinished option; it is not supported")
        self.from_text = from_text
        self.token_key = as_key(token_key if token_key is not None else self._DEFAULT_TOKEN_KEY)
        self.str_key = as_key(str_key if str_key is not None else self._DEFAULT_STR_KEY)
        self.attention_key = as_key(attention_key if attention_key is not None else self._DEFAULT_ATTENTION_KEY)
        default_action = self._DEFAULT_ACTION_STR_KEY if from_text else self._DEFAULT_ACTION_TOKENS_KEY
        self._action_key = as_key(action_key if action_key is not None else default_action)
        self._reward_key = as_key(reward_key)
        self.batch_size = batch_size_of(batch_size, what="LLMEnv")
        self.device = torch.device(device) if device is not None else None
        self.vocab_size, self.has_attention = vocab_size, has_attention
        self.assign_reward, self.assign_done = assign_reward, assign_done
        self.as_llm_data = as_llm_data
        self.eos_token_id = eos_token_id
        if eos_token_id is None:
            warnings.warn(
                "eos_token_id is missing. This means that the environment will not be able to capture its done "
                "state automatically. This may lead to undefined behaviors when the generated text reaches an "
                "eos_token.",
                UserWarning,
                stacklevel=2,
            )
        if from_text and (assign_reward or assign_done):
            raise ValueError(
                "from_text cannot be True when either of assign_reward / assign_done are True: "
                "they are shaped like the action's tokens"
            )

    @classmethod
    def _warn_deprecated(cls) -> None:
        warnings.warn("LLMEnv is deprecated. Please use ChatEnv instead.", DeprecationWarning, stacklevel=3)

    # ------------------------------------------------------------------ what the loop reads

    @property
    def base_env(self) -> LLMEnv:
        return self

    @property
    def input_mode(self) -> NestedKey:
        """The observation's key (what the loop carries from a step's ``next`` to the next root)."""
        return self.str_key if self.from_text else self.token_key

    @property
    def data_key(self) -> NestedKey:
        """What a reset of done rows keeps when no transform supplies the prompt: the current
        observation (as TorchRL, whose reset copies its input)."""
        return self.input_mode

    @property
    def base_state_keys(self) -> tuple:
        return (self.attention_key,) if not self.from_text and self.has_attention else ()

    def _action_keys(self) -> list:
        return [self._action_key]

    def _reward_keys(self) -> list:
        return [self._reward_key] if self.assign_reward else []

    def _done_keys(self) -> list:
        nested = [("tokens_data", "done"), ("tokens_data", "terminated")] if self.assign_done else []
        return list(FLAGS) + nested

    # ------------------------------------------------------------------ specs

    def _shape(self, *extra: int) -> tuple:
        return (*self.batch_size, *extra)

    def _composite(self, entries: dict) -> Composite:
        spec = Composite(shape=self.batch_size, device=self.device)
        for key, value in entries.items():
            spec[key] = value
        return spec

    def _observation_spec(self) -> Composite:
        if self.from_text:
            text = NonTensor(example_data="a string", shape=self.batch_size, device=self.device)
            return self._composite({self.str_key: text})
        entries = {self.token_key: Unbounded(shape=self._shape(-1), dtype=torch.int64, device=self.device)}
        if self.has_attention:
            entries[self.attention_key] = Unbounded(shape=self._shape(-1), dtype=torch.int64, device=self.device)
        return self._composite(entries)

    def _action_spec(self) -> Composite:
        if self.from_text:
            leaf = NonTensor(example_data="a string", shape=self.batch_size, device=self.device)
        else:
            leaf = Unbounded(shape=self._shape(-1), dtype=torch.int64, device=self.device)
        return self._composite({self._action_key: leaf})

    def _state_spec(self) -> Composite:
        return self._composite({})

    def _reward_spec(self) -> Composite:
        if not self.assign_reward:
            return self._composite({})
        reward = Unbounded(shape=self._shape(-1), dtype=torch.float32, device=self.device)
        return self._composite({self._reward_key: reward})

    def _done_spec(self) -> Composite:
        entries = {flag: Unbounded(shape=self._shape(1), dtype=torch.bool, device=self.device) for flag in FLAGS}
        if self.assign_done:
            for flag in ("done", "terminated"):
                entries[("tokens_data", flag)] = Unbounded(shape=self._shape(-1), dtype=torch.bool, device=self.device)
        return self._composite(entries)

    # ------------------------------------------------------------------ reset

    def _reset_input(self, td: TensorDictBase | None) -> TensorDictBase:
        """The reset input the transforms fill: ``[k]`` rows (``[1]`` for a batch-less env)."""
        if td is None:
            return TensorDict(batch_size=self.batch_size or [1], device=self.device)
        if not isinstance(td, TensorDictBase):
            raise EnvInputError(f"LLMEnv.reset expects a TensorDict, got {type(td).__name__}")
        if not self.batch_size:
            if td.batch_dims:
                raise EnvInputError(
                    "LLMEnv(batch_size=()) is batch-less: its reset input must have batch [], got "
                    f"{tuple(td.batch_size)}"
                )
            return td.unsqueeze(0)
        if td.batch_dims == 0:
            return td.expand(self.batch_size).clone()
        if td.batch_dims != 1:
            raise EnvInputError(f"LLMEnv.reset expects a TensorDict of batch [k], got batch {tuple(td.batch_size)}")
        return td

    def _prompt_key(self, td: TensorDictBase) -> NestedKey:
        if self.from_text and self.str_key != self.QUERY_KEY and has_key(td, self.QUERY_KEY):
            return self.QUERY_KEY
        if has_key(td, self.input_mode):
            return self.input_mode
        also = ""
        if self.from_text:
            also = f" (or {self.QUERY_KEY!r}, where DataLoadingPrimer puts a dataset's 'text' column)"
        raise EnvInputError(
            f"LLMEnv.reset needs the observation under {self.input_mode!r}{also}; the reset input has keys "
            f"{sorted(map(str, td.keys(include_nested=True)))}. Append a DataLoadingPrimer (LLMEnv.from_dataloader "
            "does) or pass the prompt in the reset input"
        )

    def _reset(self, td: TensorDictBase, *, given: bool = True) -> TensorDictBase:
        """The prompt is the observation; flags False. Every key of the input is kept."""
        num = td.batch_size[0]
        key = self._prompt_key(td)
        if self.from_text:
            prompts = object_rows(td, key)
            bad = sorted({type(p).__name__ for p in prompts if not isinstance(p, str)})
            if bad:
                raise EnvInputError(f"LLMEnv(from_text=True) expects strings under {key!r}, got {bad}")
        else:
            rows = tensor_rows(td, key)
            if any(row.is_floating_point() or row.is_complex() for row in rows):
                raise EnvInputError(f"LLMEnv(from_text=False) expects integer token ids under {key!r}")
        out = td.exclude("next").clone(recurse=False)
        if key != self.input_mode:
            out.set(self.input_mode, td.get(key))
        for flag in FLAGS:
            out.set(flag, torch.zeros(num, 1, dtype=torch.bool))
        if self.assign_done:
            for flag in ("done", "terminated"):
                out.set(("tokens_data", flag), torch.zeros(num, 1, dtype=torch.bool))
        if self.device is not None:
            out = out.to(self.device)
        out = restack_nested(out)
        return out.squeeze(0) if not self.batch_size else out

    # ------------------------------------------------------------------ step

    def _step(self, td: TensorDictBase) -> TensorDictBase:
        """The next observation (observation + action), the flags and, optionally, the reward."""
        num = count_rows(td)
        self._require(td, self._action_key, "action")
        self._require(td, self.input_mode, "observation")
        entries: dict[NestedKey, list] = {}
        if self.from_text:
            observations, actions = object_rows(td, self.str_key), object_rows(td, self._action_key)
            for observation, action in zip(observations, actions):
                if not isinstance(observation, str) or not isinstance(action, str):
                    raise TypeError(
                        f"LLMEnv(from_text=True) concatenates strings: {self.str_key!r} holds a "
                        f"{type(observation).__name__} and {self._action_key!r} a {type(action).__name__}"
                    )
            entries[self.str_key] = [o + a for o, a in zip(observations, actions)]
            token_actions = self._token_actions(td) if self.eos_token_id is not None else None
        else:
            observations, actions = tensor_rows(td, self.token_key), tensor_rows(td, self._action_key)
            entries[self.token_key] = [torch.cat([o, a.to(o.dtype)], -1) for o, a in zip(observations, actions)]
            if self.has_attention:
                self._require(td, self.attention_key, "attention mask (has_attention=True)")
                masks = tensor_rows(td, self.attention_key)
                entries[self.attention_key] = [torch.cat([m, m.new_ones(a.shape)], -1) for m, a in zip(masks, actions)]
            token_actions = actions
        if self.assign_reward:
            entries[self._reward_key] = [torch.zeros(a.shape, dtype=torch.float32) for a in token_actions]
        done = [torch.zeros(1, dtype=torch.bool) for _ in range(num)]
        per_token = [torch.zeros(a.shape, dtype=torch.bool) for a in token_actions] if self.assign_done else None
        if self.eos_token_id is not None:
            per_token_eos = [a == self.eos_token_id for a in token_actions]
            done = [hits.any().view(1) for hits in per_token_eos]
            if self.assign_done:
                per_token = per_token_eos
        elif self.assign_done:
            done = [hits.any().view(1) for hits in per_token]
        entries["done"], entries["terminated"] = done, [d.clone() for d in done]
        entries["truncated"] = [torch.zeros(1, dtype=torch.bool) for _ in range(num)]
        if per_token is not None:
            entries[("tokens_data", "done")] = per_token
            entries[("tokens_data", "terminated")] = [p.clone() for p in per_token]
        rows = []
        for i in range(num):
            row = TensorDict(batch_size=[], device=self.device)
            for key, values in entries.items():
                row.set(key, NonTensorData(values[i]) if isinstance(values[i], str) else values[i])
            rows.append(row)
        return rows[0] if td.batch_dims == 0 else stack_row_tds(rows)

    def _token_actions(self, td: TensorDictBase) -> list[torch.Tensor]:
        """The tokens of a text action, which ``eos_token_id`` is looked for in."""
        if not has_key(td, self._DEFAULT_ACTION_TOKENS_KEY):
            raise EnvInputError(
                f"LLMEnv(eos_token_id={self.eos_token_id}) looks for the end-of-sequence token in the action's "
                f"tokens under {self._DEFAULT_ACTION_TOKENS_KEY!r}, which the step input lacks"
            )
        return tensor_rows(td, self._DEFAULT_ACTION_TOKENS_KEY)

    def _require(self, td: TensorDictBase, key: NestedKey, what: str) -> None:
        if has_key(td, key):
            return
        hint = ""
        if key == self._action_key and self.from_text and has_key(td, self._DEFAULT_ACTION_TOKENS_KEY):
            hint = (
                f" (the input has {self._DEFAULT_ACTION_TOKENS_KEY!r}: append a Tokenizer with "
                f"in_keys_inv=[{self._action_key!r}], out_keys_inv=[{self._DEFAULT_ACTION_TOKENS_KEY!r}] to decode it)"
            )
        raise EnvInputError(
            f"LLMEnv.step needs the {what} under {key!r}{hint}; the step input has keys "
            f"{sorted(map(str, td.keys(include_nested=True)))}"
        )

    def _merge_rows(self, kept: TensorDictBase, fresh: TensorDictBase, fresh_idx: list[int]) -> TensorDictBase:
        return merge_rows(kept, fresh, fresh_idx)

    # ------------------------------------------------------------------ from a dataloader

    @classmethod
    def from_dataloader(
        cls,
        dataloader: Any,
        *,
        tokenizer: Any = None,
        token_key: NestedKey | None = None,
        str_key: NestedKey | None = None,
        attention_key: NestedKey | None = None,
        action_key: NestedKey | None = None,
        reward_key: NestedKey = "reward",
        from_text: bool = True,
        device: torch.device | str | None = None,
        vocab_size: int | None = None,
        batch_size: int | tuple | torch.Size | None = None,
        has_attention: bool = True,
        assign_reward: bool = False,
        assign_done: bool = False,
        primers: Composite | None = None,
        example_data: Any = None,
        stack_method: Callable[[Any], Any] | Literal["as_nested_tensor", "as_padded_tensor"] | None = None,
        repeats: int | None = None,
        group_repeats: bool = True,
        eos_token_id: int | None = None,
    ) -> TransformedEnv:
        """An LLMEnv whose prompts come from ``dataloader`` (any iterable of batches; TorchRL's
        keywords): a DataLoadingPrimer writes its columns, as named, into each reset input, the
        observation's (``str_key`` or ``token_key``) among them. ``batch_size`` defaults to the
        dataloader's; ``group_repeats`` (default True) multiplies the env's batch by ``repeats``
        so a reset takes all the copies. ``stack_method`` stacks token rows: None (dense when of
        one length, else lazily), ``"as_padded_tensor"`` (left-padded with 0),
        ``"as_nested_tensor"`` or a callable taking the row TensorDicts; ``example_data`` is
        unused (the columns are read from the first batch). A ``tokenizer`` (text envs only)
        appends a :class:`~rlpost.envs.llm_transforms.Tokenizer` first: the observation is
        tokenized under ``token_key``, and a policy may write token actions under
        ``"tokens_response"``.
        """
        cls._warn_deprecated()
        str_key = as_key(str_key if str_key is not None else cls._DEFAULT_STR_KEY)
        token_key = as_key(token_key if token_key is not None else cls._DEFAULT_TOKEN_KEY)
        if attention_key is None:
            attention_key = cls._DEFAULT_ATTENTION_KEY
            if tokenizer is not None:
                attention_key = replace_last(token_key, "attention_mask")
        elif tokenizer is not None and as_key(attention_key) != replace_last(token_key, "attention_mask"):
            raise ValueError(
                "When using the Tokenizer, attention key must match `(*token_key[:-1], 'attention_mask')`. "
                f"Got attention_key={attention_key!r} while expecting {replace_last(token_key, 'attention_mask')!r}."
            )
        tokenizer_transform = None
        if tokenizer is not None:
            if not from_text:
                raise EnvInputError("LLMEnv.from_dataloader: a tokenizer can only be used with from_text=True")
            if action_key is None:
                action_key = cls._DEFAULT_ACTION_STR_KEY
            tokenizer_transform = Tokenizer(
                in_keys=[str_key],
                out_keys=[token_key],
                in_keys_inv=[action_key],
                out_keys_inv=[cls._DEFAULT_ACTION_TOKENS_KEY],
                tokenizer=tokenizer,
                call_before_reset=False,
                missing_tolerance=False,
            )
        primer = _ColumnsPrimer(
            dataloader,
            observation_key=str_key if from_text else token_key,
            primers=primers,
            stack_method=stack_method,
            batch_size=batch_size,
            repeats=repeats,
            device=device,
            group_repeats=group_repeats,
        )
        env = cls(
            from_text=from_text, device=device, token_key=token_key, str_key=str_key, attention_key=attention_key,
            action_key=action_key, reward_key=reward_key, vocab_size=vocab_size, assign_reward=assign_reward,
            assign_done=assign_done, batch_size=primer.batch_size, has_attention=has_attention,
            eos_token_id=eos_token_id,
        )  # fmt: skip
        if tokenizer_transform is not None:
            env = env.append_transform(tokenizer_transform)
        return env.append_transform(primer)

    def __repr__(self) -> str:
        return (
            f"LLMEnv(from_text={self.from_text}, batch_size={tuple(self.batch_size)}, "
            f"observation={self.input_mode!r}, action={self._action_key!r})"
        )


# ---------------------------------------------------------------------------- the primer of from_dataloader


def _keep_batch(batch: Any) -> Any:
    return batch


def _torchrl_primer_batch(batch_size: Any, dataloader: Any, repeats: int | None, group_repeats: bool) -> torch.Size:
    """The primer's batch as TorchRL sizes it: the dataloader's batch size by default, 0 for
    none, times ``repeats`` with ``group_repeats``."""
    if batch_size is None:
        batch_size = getattr(dataloader, "batch_size", None)
    size = batch_size_of(batch_size, what="the DataLoadingPrimer", error=ValueError)
    if repeats and group_repeats:
        size = torch.Size([repeats]) if not size else torch.Size([size[0] * repeats])
    return size


class _ColumnsPrimer(DataLoadingPrimer):
    """The DataLoadingPrimer of :meth:`LLMEnv.from_dataloader`: writes the dataloader's columns
    under their own names (no ``"text"`` -> ``"query"`` renaming), tensors included, and owns the
    env's observation key (a reset of done rows takes new prompts)."""

    def __init__(
        self,
        dataloader: Any,
        *,
        observation_key: NestedKey,
        primers: Any = None,
        stack_method: Any = None,
        batch_size: Any = None,
        repeats: int | None = None,
        device: torch.device | str | None = None,
        group_repeats: bool = True,
    ) -> None:
        if not isinstance(observation_key, str):
            raise ValueError(
                f"LLMEnv.from_dataloader reads the observation from a top-level dataloader column; got the nested "
                f"key {observation_key!r}"
            )
        known = stack_method is None or callable(stack_method)
        if not known and stack_method not in ("as_padded_tensor", "as_nested_tensor"):
            raise ValueError(f"Unknown stack_method={stack_method!r}")
        self.observation_key = observation_key
        self.column_stack_method = stack_method
        size = _torchrl_primer_batch(batch_size, dataloader, repeats, group_repeats)
        super().__init__(
            dataloader, primers=primers, batch_size=size, repeats=repeats, device=device, collate_fn=_keep_batch,
            prompt_column=observation_key, data_key=observation_key, shuffle=False,
        )  # fmt: skip
        self.batch_size = size
        self.state_keys = tuple(dict.fromkeys([*self.columns, "prompt_id"]))

    def _check_columns(self, first: dict[str, Any], primers: Any) -> list[str]:
        columns = list(first)
        if self.observation_key not in first:
            raise ValueError(
                f"LLMEnv.from_dataloader: the batches of {self.description} have no {self.observation_key!r} column "
                f"(the env's observation key: str_key or token_key); their columns are {columns}"
            )
        wanted = list(primers.keys()) if primers is not None else columns
        for column in wanted:
            if column not in first:
                raise ValueError(
                    f"primers key {column!r} is not a column of {self.description}; its columns are {columns}"
                )
        return wanted

    def reset_preprocess(self, td: TensorDictBase) -> TensorDictBase:
        if has_key(td, self.observation_key):
            return td
        items = self.next_items(td.batch_size[0])
        for column in self.columns:
            td.set(column, self._stack_column([item.row[column] for item in items], column, td))
        td.set("prompt_id", torch.tensor([item.prompt_id for item in items], dtype=torch.int64, device=self.device))
        return td

    def _stack_column(self, values: list, column: str, td: TensorDictBase) -> Any:
        values = [_as_ids(v) for v in values]
        if not all(isinstance(v, torch.Tensor) for v in values):
            return NonTensorStack(*[NonTensorData(v) for v in values], batch_size=td.batch_size)
        if self.device is not None:
            values = [v.to(self.device) for v in values]
        method = self.column_stack_method
        if method is None:
            return stack_rows(values)
        if method == "as_nested_tensor":
            return torch.nested.as_nested_tensor(values, layout=torch.jagged)
        if method == "as_padded_tensor":
            length = max(v.shape[0] for v in values)
            return torch.stack([torch.cat([v.new_zeros(length - v.shape[0], *v.shape[1:]), v]) for v in values])
        return method([TensorDict({column: v}, batch_size=[]) for v in values]).get(column)


def _as_ids(value: Any) -> Any:
    """A list of ints (a dataloader column of token ids) as an int64 tensor."""
    ints = isinstance(value, (list, tuple)) and value
    if ints and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return torch.tensor(value, dtype=torch.int64)
    return value


__all__ = ["LLMEnv", "LLMHashingEnv", "hash_rows"]
