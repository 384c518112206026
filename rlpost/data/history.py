"""History: a batch of chat messages as a tensorclass (TorchRL's ``torchrl.data.llm.History``).

One message per batch element: a conversation is ``[n_messages]``, a batch ``[B, n_messages]``.
Conversations of different lengths are right-padded with ``"<none>"`` (:data:`PAD_ROLE`)
messages so a batch stays dense; padding is dropped whenever a History becomes chats or text. A
``lazy_stack`` of ragged Histories works everywhere (``torch.cat`` of different lengths gives one).

Deliberate deviations from TorchRL, each because TorchRL's behaviour is wrong for training:

- Rendering uses the tokenizer's own chat template unless a template is asked for by name
  (``chat_template_name``) or registered for the model with :func:`add_chat_template`. TorchRL
  swaps in its own template for Qwen, Llama, DeepSeek, ... tokenizers; the inference engine
  renders prompts with the model's template, so the learner would score other tokens.
- A conversation whose last message is unfinished (``is_complete=False``, e.g. a response cut
  at ``max_tokens``) is rendered with ``continue_final_message=True`` (no end-of-turn marker, no
  generation prompt), so that rendering the history of a truncated sample gives back the text
  the model actually saw; its assistant mask is the complete rendering's mask, cut.
- ``from_text`` keeps each content exactly as written (TorchRL strips whitespace) and leaves
  tool calls in the assistant's content instead of also copying them to ``tool_calls`` (a
  template that renders ``tool_calls`` would write them twice); a last message ending with
  ``<|endoftext|>`` stays unfinished with the marker in its content, so it renders back as the
  model wrote it. ``from_chats`` and ``from_text`` of several chats give a ``"<none>"``-padded
  dense batch (TorchRL: a ragged lazy stack).
- ``is_complete`` is a bool tensor (TorchRL: non-tensor data), so masks can be computed from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorClass, TensorDict, lazy_stack
from tensordict.utils import is_non_tensor

from rlpost.data import specs, templates
from rlpost.data.content import ContentBase, blocks_to_content, is_content_blocks
from rlpost.data.rendering import RenderRequest
from rlpost.data.templates import add_chat_template, parse_chatml

__all__ = ["PAD_ROLE", "History", "HistoryError", "add_chat_template", "parse_chatml"]

PAD_ROLE = "<none>"
_OPTIONAL_FIELDS = ("tool_calls", "tool_responses")


class HistoryError(ValueError, RuntimeError):
    """A History operation that cannot be done as asked (wrong batch dims, unparseable text).
    A ValueError (rlpost's convention) and a RuntimeError (TorchRL's), so either catches it."""


class History(TensorClass["nocast"]):
    """One chat message per batch element; see the module docstring.

    Fields:
        role: "system", "user", "assistant", "tool" or the padding role ``"<none>"``.
        content: the text, or a :class:`ContentBase` stack (one more batch dim) for multimodal
            content, rendered as a list of block dicts.
        is_complete: False for a message cut before its end-of-turn marker.
        tool_calls / tool_responses: optional per-message lists, passed to the chat template as
            ``message["tool_calls"]`` / ``message["tool_responses"]``.
    """

    role: str
    content: Any
    is_complete: Any = True
    tool_calls: Any = None
    tool_responses: Any = None

    def __post_init__(self):
        complete = self._tensordict.get("is_complete", None)
        if is_non_tensor(complete):
            complete = complete.tolist()
        if not isinstance(complete, torch.Tensor):
            if complete is None or isinstance(complete, bool):
                complete = torch.full(self.batch_size, complete is not False, dtype=torch.bool)
            else:
                complete = torch.as_tensor(complete, dtype=torch.bool)
        elif complete.dtype != torch.bool:
            complete = complete.bool()
        if complete.shape[: self.batch_dims] != self.batch_size:
            complete = complete.expand(self.batch_size).clone()
        self.is_complete = complete

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # torch.cat of Histories of different lengths: a lazy stack, as TorchRL's concatenate.
        if func is torch.cat:
            joined = _cat_ragged(*args, **(kwargs or {}))
            if joined is not None:
                return joined
        return super().__torch_function__(func, types, args, kwargs)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_chats(cls, chats: Sequence[dict] | Sequence[Sequence[dict]]) -> History:
        """A History of one chat (``[n_messages]``) or a ``"<none>"``-padded batch of chats
        (``[B, max_n_messages]``). Dicts need ``role`` and ``content``; a content given as a
        list of blocks becomes a :class:`ContentBase` stack (the result is then a lazy stack)."""
        if len(chats) == 0:
            raise HistoryError("from_chats needs at least one message or one chat")
        if isinstance(chats[0], dict):
            return cls._from_rows([list(chats)], squeeze=True)
        if any(len(chat) == 0 for chat in chats):
            raise HistoryError("from_chats: every chat needs at least one message")
        return cls._from_rows([list(chat) for chat in chats], squeeze=False)

    @classmethod
    def _from_rows(cls, rows: list[list[dict]], *, squeeze: bool) -> History:
        for row in rows:
            for message in row:
                if "role" not in message or "content" not in message:
                    raise HistoryError(f"a chat message needs 'role' and 'content', got keys {sorted(message)}")
        if any(not isinstance(m["content"], str) for row in rows for m in row):
            history = lazy_stack([_blocks_row(row, max(len(r) for r in rows)) for row in rows])
            return history[0] if squeeze else history
        num_messages = max(len(row) for row in rows)
        pad = {"role": PAD_ROLE, "content": "", "is_complete": True}
        padded = [row + [pad] * (num_messages - len(row)) for row in rows]
        fields = {
            "role": [[m["role"] for m in row] for row in padded],
            "content": [[m["content"] for m in row] for row in padded],
            "is_complete": torch.tensor([[bool(m.get("is_complete", True)) for m in row] for row in padded]),
        }
        for name in _OPTIONAL_FIELDS:
            if any(m.get(name) is not None for row in padded for m in row):
                fields[name] = _nontensor([[m.get(name) for m in row] for row in padded], 2)
        history = cls(**fields, batch_size=[len(padded), num_messages])
        return history[0] if squeeze else history

    @classmethod
    def from_text(
        cls,
        text: str | Sequence[str],
        chat_template_name: str | None = None,
        chat_template: str | None = None,
        tokenizer=None,
    ) -> History:
        """Parse rendered text back into messages (TorchRL's ``History.from_text``).

        ``chat_template_name``: "chatml_format", "qwen", "dialogpt", "falcon", "deepseek",
        "llama" or one from :func:`add_chat_template`; None detects it from the tokenizer's name
        as TorchRL does. ``chat_template`` has no effect (as in TorchRL). A last message without
        its end marker is ``is_complete=False``, so rendering the result gives the text back;
        ChatML text after an ``<|im_end|>`` that opens no block is dropped, as in TorchRL.
        """
        del chat_template  # TorchRL's parser ignores it too
        name = chat_template_name or templates.detect_chat_template_name(tokenizer)
        texts = [text] if isinstance(text, str) else list(text)
        parsed = []
        for one in texts:
            try:
                parsed.append(templates.parse_text(one, name, tokenizer))
            except ValueError as err:
                raise HistoryError(str(err)) from err
        if all(isinstance(p, History) for p in parsed):  # a custom inverse parser
            return parsed[0] if isinstance(text, str) else lazy_stack(parsed)
        return cls._from_rows(parsed, squeeze=isinstance(text, str))

    # ------------------------------------------------------------------ conversion

    def to_chats(self, *, include_state: bool = False) -> list:
        """Message dicts nested like the batch dims minus the last, ``"<none>"`` messages dropped
        (what chat templates read); ``include_state=True`` adds ``is_complete`` for ``from_chats``."""
        if self.batch_dims == 0:
            return self.unsqueeze(0).to_chats(include_state=include_state)
        if self.batch_dims > 1:
            return [row.to_chats(include_state=include_state) for row in self.unbind(0)]
        columns = {name: self._column(name) for name in ("role", "content", *_OPTIONAL_FIELDS)}
        complete = self.is_complete.tolist()
        messages = []
        for i, role in enumerate(columns["role"]):
            if role == PAD_ROLE:
                continue
            content = columns["content"][i]
            message = {"role": role, "content": content.to_blocks() if isinstance(content, ContentBase) else content}
            for name in _OPTIONAL_FIELDS:
                if columns[name] is not None and columns[name][i] is not None:
                    message[name] = list(columns[name][i])
            if include_state:
                message["is_complete"] = complete[i]
            messages.append(message)
        return messages

    def _column(self, name: str) -> list | None:
        """One field of a ``[n]`` History as a list of ``n`` values (None when no message has it)."""
        try:
            raw = self._tensordict.get(name, None)
        except (KeyError, RuntimeError):  # a lazy stack whose messages disagree on the field
            raw = None
            values = [getattr(message, name) for message in self.unbind(0)]
        else:
            if raw is None:
                return None
            if isinstance(raw, NonTensorData):  # one value shared by every message
                values = [raw.data] * self.batch_size[0]
            elif is_non_tensor(raw):
                values = raw.tolist()
            else:  # content blocks
                values = list(getattr(self, name).unbind(0))
        return None if all(v is None for v in values) else values

    def _last_is_incomplete(self) -> bool:
        """For a ``[n]`` History: whether the last non-padding message is unfinished."""
        for role, done in zip(reversed(list(self.role)), reversed(self.is_complete.tolist())):
            if role != PAD_ROLE:
                return not done
        return False

    def apply_chat_template(
        self,
        tokenizer=None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_name: str | None = None,
        continue_final_message: bool = False,
        tokenize: bool | None = None,
        padding: bool | str = False,
        truncation: bool | str = False,
        return_tensors: str | None = None,
        return_dict: bool | None = None,
        return_assistant_tokens_mask: bool = False,
        **kwargs,
    ):
        """Render (and optionally tokenize) the conversations (TorchRL's signature and defaults).

        ``tokenize=None``: True when ``return_assistant_tokens_mask`` or ``return_tensors`` is
        set. Tokenizing supports only ``return_tensors="pt"``; ``return_dict`` defaults to the
        assistant mask's flag. Per ``[n]`` conversation: text, a ``[L]`` ids tensor, or a
        TensorDict of ``[L]`` ``input_ids``, ``attention_mask`` (``assistant_masks``); ``[B, n]``
        gives a list or a lazy stack, or with ``padding=True`` one dense ``[B, L_max]`` result
        padded as the tokenizer pads (masks 0 there).

        Template: ``chat_template``, else ``chat_template_name``, else one registered with
        :func:`add_chat_template`, else the tokenizer's own (``"chatml_format"`` without one).
        Deviations from TorchRL beyond the module's: one conversation's ids are ``[L]`` with or
        without ``return_dict`` (TorchRL: ``[1, L]`` without), and ``padding`` pads across the
        batch (TorchRL renders each conversation alone, so padding has no effect there).
        """
        if tokenizer is None:
            raise HistoryError("apply_chat_template needs a tokenizer (or processor) to render with")
        if tokenize is None:
            tokenize = bool(return_assistant_tokens_mask or return_tensors is not None)
        if tokenize:
            return_tensors = return_tensors or "pt"
            if return_tensors != "pt":
                raise HistoryError(f"return_tensors={return_tensors!r}: History returns torch tensors ('pt') only")
            if return_dict is None:
                return_dict = bool(return_assistant_tokens_mask)
            if return_assistant_tokens_mask and not return_dict:
                raise HistoryError("return_assistant_tokens_mask=True needs return_dict=True")
        request = RenderRequest(
            tokenizer=tokenizer,
            chat_template=templates.resolve_template(tokenizer, chat_template, chat_template_name),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=bool(tokenize),
            padding=padding,
            truncation=truncation,
            return_dict=bool(return_dict),
            return_assistant_tokens_mask=return_assistant_tokens_mask,
            template_kwargs=kwargs,
        )
        return request.render(self)

    # ------------------------------------------------------------------ growth

    def append(self, history: History, *, inplace: bool = True, dim: int = -1) -> History:
        """Append ``history`` (one batch dim less than ``self``) along ``dim`` (TorchRL's append);
        a 0-d History must be ``unsqueeze(0)``-ed first."""
        if not self.batch_dims:
            raise HistoryError("Cannot append an element to a batchless History. Call unsqueeze(dim=0) first on self.")
        if history.batch_dims != self.batch_dims - 1:
            raise HistoryError(
                "The new history to append must have one less dimension than self. "
                f"Got self.batch_size={tuple(self.batch_size)} and history.batch_size={tuple(history.batch_size)}."
            )
        dim = _positive_dim(dim, self.batch_dims)
        return self._grow(history.unsqueeze(dim), dim, inplace)

    def extend(self, history: History, *, inplace: bool = True, dim: int = 0) -> History:
        """Concatenate ``history`` (as many batch dims as ``self``) along ``dim`` (TorchRL's extend):
        ``dim=0`` adds conversations to ``[B, n]`` (messages to ``[n]``), ``dim=-1`` messages to each."""
        if not self.batch_dims:
            raise HistoryError("Cannot add an element to a batchless History. Call unsqueeze(dim=0) first on self.")
        if history.batch_dims != self.batch_dims:
            raise HistoryError(
                "The new history to extend must have as many dimensions as self. "
                f"Got self.batch_size={tuple(self.batch_size)} and history.batch_size={tuple(history.batch_size)}."
            )
        return self._grow(history, _positive_dim(dim, self.batch_dims), inplace)

    def _grow(self, history: History, dim: int, inplace: bool) -> History:
        if history.device != self.device:
            history = history.to(self.device) if self.device is not None else history.copy().clear_device_()
        joined = _join(self, history, dim)
        if not inplace:
            return joined
        # A tensorclass is a view over its tensordict: swapping it resizes self in place.
        self.__dict__["_tensordict"] = joined._tensordict
        return self

    # ------------------------------------------------------------------ specs

    def _spec_view(self) -> History:
        """This History as :meth:`Composite.is_in <rlpost.data.specs.Composite.is_in>` checks it:
        a 0-d History built from lists (``History(role=[...], content=[...])``, TorchRL's way)
        is read as the ``[n]`` conversation it holds, so ``default_spec().is_in`` holds on it."""
        role = self._tensordict.get("role", None)
        if self.batch_dims or not is_non_tensor(role) or role.batch_dims != 1:
            return self
        td = self._tensordict.copy()
        td.set("is_complete", self.is_complete.expand(role.batch_size).clone())
        try:
            td.batch_size = role.batch_size
        except RuntimeError:  # a field that does not hold one value per message
            return self
        return History._from_tensordict(td)

    @classmethod
    def default_spec(cls, shape=(-1,)):
        """The spec of a History field in an env or transform (TorchRL's ``History.default_spec``).

        ``shape``: the batch shape, message dim last (``-1``: any length); the Composite has
        ``shape[:-1]``, each field ``shape``. Deviation: ``is_complete`` is an ``Unbounded`` bool
        spec (rlpost stores a bool tensor).
        """
        shape = tuple(shape)
        fields = {
            "role": specs.NonTensor(shape=shape, example_data="foo"),
            "content": specs.NonTensor(shape=shape, example_data="foo"),
            "is_complete": specs.Unbounded(shape=shape, dtype=torch.bool),
            "tool_calls": specs.NonTensor(shape=shape, example_data=None),
            "tool_responses": specs.NonTensor(shape=shape, example_data=None),
        }
        return specs.Composite(fields, shape=shape[:-1], data_cls=cls)


# ---------------------------------------------------------------------- helpers


def _blocks_row(row: list[dict], num_messages: int) -> History:
    """A ``[num_messages]`` lazy stack of one chat's messages with :class:`ContentBase` content."""
    pad = {"role": PAD_ROLE, "content": "", "is_complete": True}
    messages = []
    for message in row + [pad] * (num_messages - len(row)):
        content = message["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        elif not is_content_blocks(content):
            raise HistoryError(
                f"message content must be a string or a list of block dicts, got {type(content).__name__}"
            )
        fields = {name: message[name] for name in _OPTIONAL_FIELDS if message.get(name) is not None}
        messages.append(
            History(
                role=message["role"],
                content=blocks_to_content(content),
                is_complete=bool(message.get("is_complete", True)),
                **fields,
            )
        )
    return lazy_stack(messages)


def _nontensor(nested, ndim: int):
    """Non-tensor data of ``ndim`` batch dims from nested lists, leaves kept as they are
    (``NonTensorStack.from_list`` would also split a leaf that is itself a list, e.g. tool calls)."""
    if ndim == 0:
        return NonTensorData(data=nested)
    return NonTensorStack(*[_nontensor(item, ndim - 1) for item in nested])


def _positive_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise HistoryError(f"dim {dim} is out of range for a History of {ndim} batch dims")
    return dim % ndim


def _is_lazy(history: History) -> bool:
    return isinstance(history._tensordict, LazyStackedTensorDict)


def _join(a: History, b: History, dim: int) -> History:
    """``cat([a, b], dim)`` for any mix of dense, lazily stacked and unsqueezed Histories.
    Trap: ``unsqueeze`` leaves non-tensor fields stacked along other dims, which ``torch.cat``
    refuses, so dense ones are rebuilt (:func:`_canonical`) first."""
    lazy = a if _is_lazy(a) else b if _is_lazy(b) else None
    if lazy is not None:
        stack_dim = lazy._tensordict.stack_dim
        if stack_dim == dim:
            return lazy_stack(list(a.unbind(dim)) + list(b.unbind(dim)), dim)
        if a.batch_size[stack_dim] != b.batch_size[stack_dim]:
            raise HistoryError(
                f"cannot join Histories of batch {tuple(a.batch_size)} and {tuple(b.batch_size)} along dim {dim}"
            )
        inner = dim - 1 if dim > stack_dim else dim
        return lazy_stack([_join(x, y, inner) for x, y in zip(a.unbind(stack_dim), b.unbind(stack_dim))], stack_dim)
    if a.batch_size[:dim] + a.batch_size[dim + 1 :] != b.batch_size[:dim] + b.batch_size[dim + 1 :]:
        return lazy_stack(list(a.unbind(dim)) + list(b.unbind(dim)), dim)
    keys = set(a._tensordict.keys()) | set(b._tensordict.keys())
    try:
        return torch.cat([_canonical(a, keys), _canonical(b, keys)], dim)
    except RuntimeError:  # e.g. content blocks of different counts: keep them ragged
        return lazy_stack(list(a.unbind(dim)) + list(b.unbind(dim)), dim)


def _cat_ragged(tensors, dim: int = 0, *, out=None) -> History | None:
    """``torch.cat`` of Histories that differ off ``dim``: a lazy stack of their elements; None
    when they agree there (or are not all Histories): the tensorclass concatenates them."""
    histories = list(tensors)
    if out is not None or not histories or not all(isinstance(h, History) for h in histories):
        return None
    ndim = histories[0].batch_dims
    if ndim == 0 or any(h.batch_dims != ndim for h in histories):
        return None
    dim = _positive_dim(dim, ndim)
    others = {h.batch_size[:dim] + h.batch_size[dim + 1 :] for h in histories}
    if len(others) == 1:
        return None
    return lazy_stack([element for h in histories for element in h.unbind(dim)], dim)


def _canonical(history: History, keys: set[str]) -> History:
    """The same History with every field in ``keys`` present (missing optional fields as None)
    and its non-tensor fields stacked along dim 0 at every level."""
    td = TensorDict(batch_size=history.batch_size, device=history.device)
    for key in sorted(keys):
        value = history._tensordict.get(key, None)
        if value is None:
            value = _nontensor(_filled(None, history.batch_size), history.batch_dims)
        elif is_non_tensor(value):
            value = _nontensor(value.tolist(), history.batch_dims)
        td.set(key, value)
    return History._from_tensordict(td)


def _filled(value: Any, shape: torch.Size) -> Any:
    return value if not shape else [_filled(value, shape[1:]) for _ in range(shape[0])]
