"""The containers LLM wrappers read and write (TorchRL's ``ChatHistory``, ``Text``, ``Tokens``,
``LogProbs``, ``Masks`` and the older ``LLMData``), one tensorclass per TensorDict key.

Policies write them, environments write the ``prompt`` fields; the loss, KL transforms and
collector read them (they cross processes inside TensorDicts). Layout (one row per sequence):

- ``prompt``: what the model was conditioned on; ``response``: what it generated (when scoring,
  the part after the prompt); ``full``: prompt followed by response.
- ``padded=False``: a ``lazy_stack`` of per-row tensors (``td.get(key, as_list=True)``).
- ``padded=True``: ``prompt`` left-padded, ``response`` right-padded, ``full`` their ``cat``.
  Trap: ``Masks.all_attention_mask`` marks the real tokens; never infer it from the pad id
  (the EOS id for Qwen-family tokenizers).
- ``LogProbs.full[t]`` is ``log p(full[t] | full[:t])``; position 0 holds 0. ``LogProbs`` and
  ``Masks`` always have the shape of ``Tokens.full``.

The conversions (``to_tokens`` / ``to_text`` / ``to_history``) render with the tokenizer as the
wrappers do, and keep TorchRL's layout when a field holds more rows than the batch: a 0-d
ChatHistory over a ``[k, n]`` History converts to ``k`` strings or ``[k, L]`` ids (jagged when
lengths differ) and back; a str, ``[L]`` ids or ``[n]`` History is one row.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorClass, lazy_stack
from torch.nn.utils.rnn import pad_sequence

from rlpost.data import specs, templates
from rlpost.data.history import History

_PARTS = ("prompt", "response", "full")


class ChatHistory(TensorClass["nocast"]):
    """Conversation state under the ``"history"`` key: the prompt, the response and both joined.

    Each field is a :class:`History` with one more batch dim (the messages); one with as many
    batch dims is unsqueezed with a warning, as TorchRL does.
    """

    prompt: History | None = None
    response: History | None = None
    full: History | None = None

    def __post_init__(self):
        for name in _PARTS:
            history = getattr(self, name)
            if isinstance(history, History) and history.batch_dims == self.batch_dims:
                warnings.warn(
                    f"ChatHistory.{name} should have one more batch dim than the ChatHistory (the messages); "
                    f"got {history.batch_dims} and {self.batch_dims}: unsqueezing it along its last dim",
                    stacklevel=2,
                )
                setattr(self, name, lazy_stack([history], -1))

    @classmethod
    def default_spec(cls, shape=(-1,), keys: list[str] | None = None):
        """TorchRL's spec: each of ``keys`` a ``History.default_spec(shape + (-1,))``."""
        shape = tuple(shape)
        entries = {key: History.default_spec(shape=shape + (-1,)) for key in (keys or _PARTS)}
        return specs.Composite(entries, shape=shape[:-1], data_cls=cls, step_mdp_static=True)

    def apply_chat_template(self, tokenizer=None, **kwargs):
        """Render ``full`` (else ``prompt``) as :meth:`History.apply_chat_template` does, so code
        for TorchRL 0.9 (``td["history"]`` was the History) keeps working."""
        history = self.full if self.full is not None else self.prompt
        if history is None:
            raise ValueError("ChatHistory.apply_chat_template: neither full nor prompt is set")
        return history.apply_chat_template(tokenizer=tokenizer, **kwargs)

    def to_text(self, tokenizer, chat_template_name: str | None = None, chat_template: str | None = None) -> Text:
        """Render the conversations into a :class:`Text` (TorchRL's ``ChatHistory.to_text``).

        ``prompt`` is rendered with the generation prompt, ``full`` without; ``response`` is
        ``full`` minus the ``prompt`` text when both are set (ValueError unless a prefix), else
        the ``response`` History alone. Two or more batch dims give a lazy stack of Texts.
        """
        if self.batch_dims > 1:
            return lazy_stack([row.to_text(tokenizer, chat_template_name, chat_template) for row in self.unbind(0)])
        kwargs = _template_kwargs(chat_template_name, chat_template)
        out: dict[str, Any] = {}
        if self.prompt is not None:
            out["prompt"] = self.prompt.apply_chat_template(tokenizer, add_generation_prompt=True, **kwargs)
        if self.full is not None:
            out["full"] = self.full.apply_chat_template(tokenizer, add_generation_prompt=False, **kwargs)
        if self.prompt is not None and self.full is not None:
            out["response"] = _map_rows(_text_suffix, out["prompt"], out["full"])
        elif self.response is not None:
            out["response"] = self.response.apply_chat_template(tokenizer, add_generation_prompt=False, **kwargs)
        return Text(**out, batch_size=self.batch_size)

    def to_tokens(self, tokenizer, chat_template_name: str | None = None, chat_template: str | None = None) -> Tokens:
        """Tokenize the conversations into unpadded :class:`Tokens` (TorchRL's ``ChatHistory.to_tokens``).

        Renderings as :meth:`to_text`; ``response`` is ``full`` after the prompt's ids (ValueError
        unless they are a prefix). A batch gives a lazy stack of per-row Tokens.
        """
        if self.batch_dims > 1 or (self.batch_dims == 1 and self._num_extra_dims() > 0):
            return lazy_stack([row.to_tokens(tokenizer, chat_template_name, chat_template) for row in self.unbind(0)])
        if self._num_extra_dims() > 1:
            raise ValueError(
                "ChatHistory.to_tokens: a History field may have at most one batch dim more than the ChatHistory "
                "and its messages"
            )
        kwargs = dict(tokenize=True, return_dict=True, **_template_kwargs(chat_template_name, chat_template))
        parts: dict[str, list[torch.Tensor]] = {}
        several: dict[str, bool] = {}  # for a 0-d ChatHistory: whether the field holds several rows
        if self.prompt is not None:
            parts["prompt"] = _ids(self.prompt.apply_chat_template(tokenizer, add_generation_prompt=True, **kwargs))
            several["prompt"] = self.prompt.batch_dims > 1
        if self.full is not None:
            parts["full"] = _ids(self.full.apply_chat_template(tokenizer, add_generation_prompt=False, **kwargs))
            several["full"] = self.full.batch_dims > 1
        if self.prompt is not None and self.full is not None:
            parts["response"] = [_ids_suffix(p, f) for p, f in zip(parts["prompt"], parts["full"], strict=True)]
            several["response"] = several["full"]
        elif self.response is not None:
            parts["response"] = _ids(
                self.response.apply_chat_template(tokenizer, add_generation_prompt=False, **kwargs)
            )
            several["response"] = self.response.batch_dims > 1
        if self.batch_dims == 0:
            fields = {name: _stack_rows(rows) if several[name] else rows[0] for name, rows in parts.items()}
            return Tokens(**fields, padded=False)
        return _unpadded_tokens(parts, self.batch_size)

    def _num_extra_dims(self) -> int:
        """How many batch dims the fields have beyond ``self.batch_dims + 1`` (the messages)."""
        dims = [h.batch_dims for h in (self.prompt, self.response, self.full) if h is not None]
        return max(dims, default=self.batch_dims + 1) - self.batch_dims - 1


class Text(TensorClass["nocast"]):
    """Strings under the ``"text"`` key. ``padded`` exists because TorchRL's tutorial reads it;
    strings are never padded, so wrappers leave it None."""

    prompt: Any = None
    response: Any = None
    full: Any = None
    padded: Any = None

    @classmethod
    def default_spec(cls, shape=(-1,), keys: list[str] | None = None):
        """The spec of a Text of batch ``shape`` (TorchRL's): ``NonTensor`` strings per key."""
        shape = tuple(shape)
        entries = {key: specs.NonTensor(shape=shape, example_data="a string") for key in (keys or _PARTS)}
        return specs.Composite(entries, shape=shape[:-1], data_cls=cls, step_mdp_static=True)

    def to_tokens(
        self, tokenizer, padding: bool = False, truncation: bool = False, return_tensors: str = "pt"
    ) -> Tokens:
        """Tokenize each text field into unpadded :class:`Tokens` (TorchRL's ``Text.to_tokens``).

        Deviation: ``add_special_tokens=False``: rendered chat text already holds the
        template's, and a second BOS would change what the model sees.
        """
        if padding:
            raise ValueError(
                "Padding is not yet supported by Text.to_tokens: it gives unpadded Tokens; "
                "pad them with as_padded_tensor or pad_rows"
            )
        del return_tensors  # rows are always torch tensors
        if self.batch_dims > 1 or (self.batch_dims == 1 and any(_is_nested_list(getattr(self, n)) for n in _PARTS)):
            return lazy_stack([row.to_tokens(tokenizer, truncation=truncation) for row in self.unbind(0)])
        parts = {}
        for name in _PARTS:
            texts = getattr(self, name)
            if texts is not None:
                rows = [texts] if isinstance(texts, str) else list(texts)
                encoded = tokenizer(rows, add_special_tokens=False, truncation=truncation)["input_ids"]
                parts[name] = [torch.tensor(ids, dtype=torch.int64) for ids in encoded]
        if self.batch_dims == 0:
            one_row = {name: isinstance(getattr(self, name), str) for name in parts}
            fields = {name: rows[0] if one_row[name] else _stack_rows(rows) for name, rows in parts.items()}
            return Tokens(**fields, padded=False)
        return _unpadded_tokens(parts, self.batch_size)

    def to_history(self, tokenizer, chat_template_name: str | None = None) -> ChatHistory:
        """Parse the texts back into a :class:`ChatHistory` (TorchRL's ``Text.to_history``).

        ``response`` texts hold no header of their own: they are parsed after their prompt, and
        the messages beyond the prompt's finished ones are the response.
        """
        name = chat_template_name or templates.detect_chat_template_name(tokenizer)
        out = {}
        for key in ("prompt", "full"):
            if getattr(self, key) is not None:
                out[key] = _parse_texts(getattr(self, key), name, tokenizer)
        if self.prompt is not None and self.response is not None:
            out["response"] = _parse_responses(self.prompt, self.response, name, tokenizer)
        return ChatHistory(**out, batch_size=self.batch_size)


class Tokens(TensorClass["nocast"]):
    """Token ids under the ``"tokens"`` key (int64); see the module docstring for padding."""

    prompt: torch.Tensor | None = None
    response: torch.Tensor | None = None
    full: torch.Tensor | None = None
    padded: Any = None

    @classmethod
    def default_spec(cls, shape=(-1,), keys: list[str] | None = None):
        """TorchRL's spec. Deviation: the ids are int64 (TorchRL: the default float dtype)."""
        return _sequence_spec(cls, shape, keys or _PARTS, torch.int64)

    def to_text(self, tokenizer, skip_special_tokens: bool = False) -> Text:
        """Decode each field into a :class:`Text` (TorchRL's ``Tokens.to_text``); unpadded only."""
        if _any_flag(self.padded):
            raise ValueError("Tokens.to_text needs unpadded tokens (padded=False): padding ids would be decoded")
        if self.batch_dims > 1:
            return lazy_stack([row.to_text(tokenizer, skip_special_tokens) for row in self.unbind(0)])
        out = {}
        for name in _PARTS:
            if name in self._tensordict.keys():
                value = self._tensordict.get(name, as_list=True) if self.batch_dims else self._tensordict.get(name)
                out[name] = _decode(value, tokenizer, skip_special_tokens)
        return Text(**out, batch_size=self.batch_size)

    def to_history(
        self, tokenizer, chat_template_name: str | None = None, skip_special_tokens: bool = False
    ) -> ChatHistory:
        """Decode, then parse: ``self.to_text(...).to_history(...)`` (TorchRL's ``Tokens.to_history``)."""
        return self.to_text(tokenizer, skip_special_tokens).to_history(tokenizer, chat_template_name)


class LogProbs(TensorClass["nocast"]):
    """Per-token log-probabilities (float32) under the ``"log_probs"`` key, aligned with Tokens.

    From generation they are the engine's *processed* log-probs (after temperature), i.e. the
    behaviour policy's; prompt positions are not scored then (``prompt`` is None and ``full``
    holds 0 there). From scoring (``generate=False``) every position but the first is scored.
    """

    prompt: torch.Tensor | None = None
    response: torch.Tensor | None = None
    full: torch.Tensor | None = None
    padded: Any = None

    @classmethod
    def default_spec(cls, shape=(-1,), keys: list[str] | None = None):
        """TorchRL's spec: float32 ``[*shape, -1]`` per key."""
        return _sequence_spec(cls, shape, keys or _PARTS, torch.float32)


class Masks(TensorClass["nocast"]):
    """Bool masks shaped like ``Tokens.full`` under the ``"masks"`` key.

    ``all_attention_mask``: real (non-padding) tokens. ``all_assistant_mask``: the tokens a
    policy-gradient loss counts. From generation: the tokens generated by that call (the only
    ones with behaviour log-probs; earlier assistant turns inside the prompt are excluded). From
    scoring a history: the chat template's ``{% generation %}`` spans (every assistant turn);
    scoring text or tokens with a prompt: the tokens after the prompt.
    """

    all_attention_mask: torch.Tensor | None = None
    all_assistant_mask: torch.Tensor | None = None
    padded: Any = None

    @classmethod
    def default_spec(cls, shape=(-1,), keys: list[str] | None = None):
        """TorchRL's spec. Deviation: the masks are bool (TorchRL: the default float dtype)."""
        return _sequence_spec(cls, shape, keys or ("all_attention_mask", "all_assistant_mask"), torch.bool)


class LLMData(TensorClass["nocast"]):
    """The input or output of an LLM as one record (TorchRL's older ``torchrl.data.llm.LLMData``).

    Kept for code written against TorchRL's data API; rlpost's wrappers write :class:`Tokens`,
    :class:`Text`, ... instead. ``*_list`` fields hold the same ids as Python lists.
    """

    tokens: torch.Tensor | None = None
    tokens_response: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    token_list: Any = None
    tokens_response_list: Any = None
    logits: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    text: Any = None
    text_response: Any = None


class _RaggedField:
    """A tensor field that also reads ragged rows: on a lazy stack it is a jagged nested tensor
    where tensordict would raise (TorchRL's tutorial reads ``.response.shape`` there)."""

    def __init__(self, name: str, getter):
        self.name, self.getter = name, getter

    def __get__(self, obj, objtype=None):
        try:
            return self.getter.__get__(obj, objtype)
        except RuntimeError:
            td = getattr(obj, "_tensordict", None)
            if not isinstance(td, LazyStackedTensorDict):
                raise
            return td.get(self.name, as_nested_tensor=True, layout=torch.jagged)


for _cls, _fields in ((Tokens, _PARTS), (LogProbs, _PARTS), (Masks, ("all_attention_mask", "all_assistant_mask"))):
    for _name in _fields:
        setattr(_cls, _name, _RaggedField(_name, vars(_cls)[_name]))


def pad_rows(rows: list[torch.Tensor], side: str, value) -> torch.Tensor:
    """Stack 1-D rows into ``[len(rows), max_len]``, padding with ``value`` on ``side``."""
    if not rows:
        return torch.zeros((0, 0))
    return pad_sequence(rows, batch_first=True, padding_value=value, padding_side=side)


def pad_full(rows: list[torch.Tensor], split: list[int] | None, value) -> torch.Tensor:
    """Full-length rows in the padded layout: ``cat(left-padded rows[:split], right-padded
    rows[split:])`` when the prompt/response split is known, else right-padded."""
    if split is None:
        return pad_rows(rows, "right", value)
    left = pad_rows([r[:s] for r, s in zip(rows, split)], "left", value)
    right = pad_rows([r[s:] for r, s in zip(rows, split)], "right", value)
    return torch.cat([left, right], dim=-1)


# ---------------------------------------------------------------------- helpers


def _sequence_spec(cls, shape, keys, dtype: torch.dtype):
    shape = tuple(shape)
    entries: dict[str, Any] = {key: specs.Unbounded(shape=shape + (-1,), dtype=dtype) for key in keys}
    entries["padded"] = specs.NonTensor(shape=shape, example_data=False)
    return specs.Composite(entries, shape=shape[:-1], data_cls=cls, step_mdp_static=True)


def _template_kwargs(chat_template_name: str | None, chat_template: str | None) -> dict:
    return {"chat_template_name": chat_template_name, "chat_template": chat_template}


def _map_rows(fn, *columns):
    """``fn`` over rows given as strings (one conversation) or lists of strings (a batch)."""
    if isinstance(columns[0], str):
        return fn(*columns)
    return [fn(*row) for row in zip(*columns)]


def _text_suffix(prompt: str, full: str) -> str:
    if not full.startswith(prompt):
        raise ValueError(
            f"the full text does not start with the prompt text: prompt {prompt[:50]!r}..., full {full[:50]!r}..."
        )
    return full[len(prompt) :]


def _ids(encoded) -> list[torch.Tensor]:
    """Per-conversation ``input_ids`` of an ``apply_chat_template(return_dict=True)`` result."""
    if encoded.batch_dims == 0:
        return [encoded["input_ids"]]
    return list(encoded.get("input_ids", as_list=True))


def _ids_suffix(prompt: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    n = prompt.shape[-1]
    if not torch.equal(full[:n], prompt):
        raise ValueError("the prompt's token ids are not a prefix of the full ids: cannot slice the response")
    return full[n:]


def _unpadded_tokens(parts: dict[str, list[torch.Tensor]], batch_size: torch.Size) -> Tokens:
    """A ``[B]`` lazy stack of Tokens, row ``i`` holding ``rows[i]`` of every field."""
    count = batch_size[0]
    return lazy_stack([Tokens(**{name: rows[i] for name, rows in parts.items()}, padded=False) for i in range(count)])


def _stack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """``[k, L]`` from ``k`` id rows: dense when they have one length, else a jagged nested tensor."""
    if all(row.shape == rows[0].shape for row in rows):
        return torch.stack(rows)
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _decode(value, tokenizer, skip_special_tokens: bool):
    """A string per 1-D row of ids, nested like ``value`` (a tensor, nested tensor or list)."""
    if isinstance(value, torch.Tensor) and not value.is_nested and value.dim() == 1:
        return tokenizer.decode(value.tolist(), skip_special_tokens=skip_special_tokens)
    rows = value.unbind(0) if isinstance(value, torch.Tensor) else value
    return [_decode(row, tokenizer, skip_special_tokens) for row in rows]


def _is_nested_list(texts) -> bool:
    return isinstance(texts, list) and any(not isinstance(t, str) for t in texts)


def _parse_texts(texts, name: str, tokenizer) -> History:
    """A History from a string (``[n]``), a list of strings (``[k, n]``) or nested lists (a lazy stack)."""
    texts = texts if isinstance(texts, str) else list(texts)
    if isinstance(texts, str) or not _is_nested_list(texts):
        return History.from_text(texts, chat_template_name=name, tokenizer=tokenizer)
    return lazy_stack([_parse_texts(t, name, tokenizer) for t in texts])


def _parse_responses(prompt, response, name: str, tokenizer) -> History:
    """The messages that ``response`` adds after ``prompt``, laid out as :func:`_parse_texts` does."""
    if isinstance(prompt, str):
        return History._from_rows([_response_messages(prompt, response, name, tokenizer)], squeeze=True)
    pairs = list(zip(prompt, response, strict=True))
    if all(isinstance(p, str) for p, _ in pairs):
        return History._from_rows([_response_messages(p, r, name, tokenizer) for p, r in pairs], squeeze=False)
    return lazy_stack([_parse_responses(p, r, name, tokenizer) for p, r in pairs])


def _response_messages(prompt: str, response: str, name: str, tokenizer) -> list[dict]:
    # The prompt ends with the generation header, parsed as an unfinished empty message: the
    # response's messages are those after the prompt's finished ones.
    done = sum(m["is_complete"] for m in templates.parse_text(prompt, name, tokenizer))
    return templates.parse_text(prompt + response, name, tokenizer)[done:]


def _any_flag(value) -> bool:
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, torch.Tensor):
        return bool(value.any())
    return any(_any_flag(v) for v in value)
