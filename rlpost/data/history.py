"""History: a batch of chat messages as a tensorclass (TorchRL's ``torchrl.data.llm.History``).

A ``History`` holds one message per batch element: ``role``, ``content`` (strings, stored as
non-tensor data), ``is_complete`` (a bool tensor) and, optionally, ``tool_calls``. A conversation
is a History of batch ``[n_messages]``; a batch of conversations is ``[B, n_messages]``. It
batches, indexes, stacks and concatenates like any tensorclass: ``h[0]`` is the first
conversation, ``h[:, -1]`` the last message of each, ``torch.stack([h1, h2])`` a batch.

Conversations of different lengths are padded on the right with messages whose role is
``"<none>"`` (:data:`PAD_ROLE`), so a batch stays dense; padding messages are dropped whenever a
History is turned back into chats or rendered. (A ``lazy_stack`` of ragged Histories also works
everywhere a History is read.)

Rendering delegates to the tokenizer's own ``apply_chat_template`` so that rlpost and
transformers never disagree on a prompt. Deliberate deviation from TorchRL: a conversation whose
last message is unfinished (``is_complete=False``, e.g. a response cut at ``max_tokens``) is
rendered with ``continue_final_message=True`` (no end-of-turn marker, no generation prompt), so
that rendering the history of a truncated sample gives back the text the model actually saw.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch
from tensordict import TensorClass

PAD_ROLE = "<none>"

# ChatML / Qwen markers. ``from_text`` parses this format only (the tiny model's and Qwen's).
_IM_START = "<|im_start|>"
_IM_END = "<|im_end|>"
_TOOL_RESPONSE = re.compile(r"\A<tool_response>\n(.*)\n</tool_response>\Z", re.DOTALL)


class History(TensorClass["nocast"]):
    """One chat message per batch element; see the module docstring.

    Fields:
        role: "system", "user", "assistant", "tool" or the padding role ``"<none>"``.
        content: the message text.
        is_complete: bool tensor shaped like the batch; False for a message that was cut before
            its end-of-turn marker. Defaults to True.
        tool_calls: optional list of tool-call dicts per message (passed to the chat template as
            ``message["tool_calls"]``); messages joined by ``append``/``extend`` must agree on
            whether they carry it.
    """

    role: str
    content: str
    is_complete: Any = True
    tool_calls: Any = None

    def __post_init__(self):
        complete = self.is_complete
        if not isinstance(complete, torch.Tensor):
            if complete is None or isinstance(complete, bool):
                complete = torch.full(self.batch_size, complete is not False, dtype=torch.bool)
            else:
                complete = torch.as_tensor(complete, dtype=torch.bool)
        elif complete.dtype != torch.bool:
            complete = complete.bool()
        if complete.shape != self.batch_size:
            complete = complete.expand(self.batch_size).clone()
        self.is_complete = complete

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_chats(cls, chats: Sequence[dict] | Sequence[Sequence[dict]]) -> History:
        """Build a History from one chat (list of message dicts) or a batch of chats.

        One chat gives batch ``[n_messages]``; a batch gives ``[B, max_n_messages]`` with shorter
        chats padded by ``"<none>"`` messages. Message dicts need ``role`` and ``content``;
        ``is_complete`` and ``tool_calls`` are read when present.
        """
        if len(chats) == 0:
            raise ValueError("from_chats needs at least one message or one chat")
        if isinstance(chats[0], dict):
            return cls._from_rows([list(chats)], squeeze=True)
        if any(len(chat) == 0 for chat in chats):
            raise ValueError("from_chats: every chat needs at least one message")
        return cls._from_rows([list(chat) for chat in chats], squeeze=False)

    @classmethod
    def _from_rows(cls, rows: list[list[dict]], *, squeeze: bool) -> History:
        num_messages = max(len(row) for row in rows)
        pad = {"role": PAD_ROLE, "content": "", "is_complete": True}
        padded = [row + [pad] * (num_messages - len(row)) for row in rows]
        for row in padded:
            for message in row:
                if "role" not in message or "content" not in message:
                    raise ValueError(f"a chat message needs 'role' and 'content', got keys {sorted(message)}")
        has_tools = any(message.get("tool_calls") is not None for row in padded for message in row)
        fields = {
            "role": [[m["role"] for m in row] for row in padded],
            "content": [[_content_text(m["content"]) for m in row] for row in padded],
            "is_complete": torch.tensor([[bool(m.get("is_complete", True)) for m in row] for row in padded]),
        }
        if has_tools:
            fields["tool_calls"] = [[m.get("tool_calls") for m in row] for row in padded]
        history = cls(**fields, batch_size=[len(padded), num_messages])
        return history[0] if squeeze else history

    @classmethod
    def from_text(cls, text: str | Sequence[str]) -> History:
        """Parse rendered ChatML / Qwen text back into messages.

        ``"<|im_start|>role\\ncontent<|im_end|>"`` blocks become messages; a last block without
        ``<|im_end|>`` (an open generation prompt, or a response cut at ``max_tokens``) becomes a
        message with ``is_complete=False``, so rendering the result gives the text back. A user
        turn that only wraps ``<tool_response>`` tags (how Qwen templates render tool messages)
        becomes a ``"tool"`` message. A list of texts gives a padded ``[B, max_n]`` batch.
        """
        if isinstance(text, str):
            return cls._from_rows([parse_chatml(text)], squeeze=True)
        return cls._from_rows([parse_chatml(t) for t in text], squeeze=False)

    # ------------------------------------------------------------------ conversion

    def to_chats(self, *, include_state: bool = False) -> list:
        """Message dicts, nested like the batch dims minus the last; ``"<none>"`` messages dropped.

        A ``[n]`` History gives ``list[dict]``, ``[B, n]`` gives ``list[list[dict]]``. Dicts carry
        ``role`` and ``content`` (and ``tool_calls`` when set), which is what chat templates read;
        ``include_state=True`` adds ``is_complete`` so that ``from_chats`` restores it.
        """
        if self.batch_dims == 0:
            return self.unsqueeze(0).to_chats(include_state=include_state)
        if self.batch_dims > 1:
            return [row.to_chats(include_state=include_state) for row in self.unbind(0)]
        messages = []
        tool_calls = self.tool_calls
        complete = self.is_complete.tolist()
        for i, (role, content) in enumerate(zip(list(self.role), list(self.content))):
            if role == PAD_ROLE:
                continue
            message = {"role": role, "content": content}
            if tool_calls is not None and tool_calls[i] is not None:
                message["tool_calls"] = list(tool_calls[i])
            if include_state:
                message["is_complete"] = complete[i]
            messages.append(message)
        return messages

    def _last_is_incomplete(self) -> bool:
        """For a ``[n]`` History: whether the last non-padding message is unfinished."""
        roles = list(self.role)
        complete = self.is_complete.tolist()
        for role, done in zip(reversed(roles), reversed(complete)):
            if role != PAD_ROLE:
                return not done
        return False

    def apply_chat_template(
        self,
        tokenizer,
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        return_dict: bool = False,
        return_assistant_tokens_mask: bool = False,
        chat_template: str | None = None,
        padding: bool | str = False,
        return_tensors: str | None = None,
        **kwargs,
    ):
        """Render (and optionally tokenize) the conversations with the tokenizer's chat template.

        The result is exactly ``tokenizer.apply_chat_template(self.to_chats(), ...)`` with the same
        arguments: a string for a ``[n]`` History, a list for ``[B, n]``; token ids or a dict
        (``input_ids``, ``attention_mask``, ``assistant_masks``) when ``tokenize=True``.
        Differences from calling the tokenizer yourself: ``"<none>"`` padding messages are
        dropped, ``add_generation_prompt`` defaults to True (as in TorchRL), and a conversation
        whose last message is unfinished is rendered with ``continue_final_message=True`` (its
        assistant mask is the complete rendering's mask cut to the shorter sequence).
        """
        if self.batch_dims == 0:
            history, batched = self.unsqueeze(0), False
        elif self.batch_dims == 1:
            history, batched = self, False
        elif self.batch_dims == 2:
            history, batched = self, True
        else:
            raise ValueError(f"apply_chat_template expects a History of 0 to 2 batch dims, got {self.batch_size}")
        rows = history.unbind(0) if batched else [history]
        chats = [row.to_chats() for row in rows]
        incomplete = [row._last_is_incomplete() for row in rows]
        template_kwargs = dict(
            add_generation_prompt=add_generation_prompt,
            tokenize=tokenize,
            return_dict=return_dict,
            return_assistant_tokens_mask=return_assistant_tokens_mask,
            chat_template=chat_template,
            padding=padding,
            return_tensors=return_tensors,
            **kwargs,
        )
        if not any(incomplete):
            return tokenizer.apply_chat_template(chats if batched else chats[0], **template_kwargs)
        return _render_rows_with_unfinished(tokenizer, chats, incomplete, batched, template_kwargs)

    # ------------------------------------------------------------------ growth

    def append(self, history: History, *, inplace: bool = True, dim: int = -1) -> History:
        """Append one message per conversation (``history`` has one batch dim less) along ``dim``.

        ``history`` may also carry the message dim already (same number of batch dims). With
        ``inplace=True`` (TorchRL's default) ``self`` is updated and returned.
        """
        if history.batch_dims == self.batch_dims - 1:
            history = history.unsqueeze(dim)
        if history.batch_dims != self.batch_dims:
            raise ValueError(
                f"append: got a History of batch {history.batch_size} for a History of batch {self.batch_size}"
            )
        return self.extend(history, inplace=inplace, dim=dim)

    def extend(self, history: History, *, inplace: bool = True, dim: int = -1) -> History:
        """Concatenate ``history`` (same batch dims) along the message dim ``dim``."""
        if history.batch_dims != self.batch_dims:
            raise ValueError(
                f"extend: got a History of batch {history.batch_size} for a History of batch {self.batch_size}"
            )
        if (self.tool_calls is None) != (history.tool_calls is None):
            raise ValueError("extend/append: both Histories must carry tool_calls, or neither")
        joined = torch.cat([self, history], dim=dim)
        if not inplace:
            return joined
        # A tensorclass is a view over its tensordict: swapping it resizes self in place.
        self.__dict__["_tensordict"] = joined._tensordict
        return self


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI-style content blocks: keep the text parts
        return "".join(block.get("text", "") for block in content if isinstance(block, dict))
    raise ValueError(f"message content must be a string or a list of content blocks, got {type(content).__name__}")


def parse_chatml(text: str) -> list[dict]:
    """Message dicts (``role``, ``content``, ``is_complete``) of a rendered ChatML text; the
    parser behind :meth:`History.from_text`, without building a History (cheap per row)."""
    messages = []
    pos = 0
    while pos < len(text):
        start = text.find(_IM_START, pos)
        if start < 0 or text[pos:start].strip():
            junk = text[pos:] if start < 0 else text[pos:start]
            if not junk.strip():
                break
            raise ValueError(f"from_text: text outside a <|im_start|>...<|im_end|> block: {junk[:80]!r}")
        header_end = text.find("\n", start)
        if header_end < 0:  # "<|im_start|>assistant" with no newline yet: an open, empty turn
            role, body_start = text[start + len(_IM_START) :], len(text)
        else:
            role, body_start = text[start + len(_IM_START) : header_end], header_end + 1
        end = text.find(_IM_END, body_start)
        complete = end >= 0
        content = text[body_start:end] if complete else text[body_start:]
        if role == "user" and complete and (tool := _TOOL_RESPONSE.match(content)):
            role, content = "tool", tool.group(1)
        messages.append({"role": role, "content": content, "is_complete": complete})
        pos = end + len(_IM_END) if complete else len(text)
    if not messages:
        raise ValueError(f"from_text: no <|im_start|> message found in {text[:80]!r}")
    return messages


def _render_rows_with_unfinished(tokenizer, chats, incomplete, batched, template_kwargs):
    """Per-conversation rendering when some last messages are unfinished; same output layout."""
    kw = dict(template_kwargs)
    padding, return_tensors = kw.pop("padding"), kw.pop("return_tensors")
    want_mask = kw["return_assistant_tokens_mask"]
    results = []
    for chat, open_end in zip(chats, incomplete):
        if not open_end:
            results.append(tokenizer.apply_chat_template(chat, **kw))
            continue
        cont = dict(kw, add_generation_prompt=False, continue_final_message=True, return_assistant_tokens_mask=False)
        rendered = tokenizer.apply_chat_template(chat, **cont)
        if want_mask:
            # transformers refuses masks with continue_final_message: take the complete rendering's
            # mask and cut it; valid when the cut ids are a prefix of the complete ids, which holds
            # whenever an end-of-turn special token follows the content (ChatML, Qwen, Llama).
            full = tokenizer.apply_chat_template(chat, **dict(kw, add_generation_prompt=False))
            n = len(rendered["input_ids"])
            if list(full["input_ids"][:n]) != list(rendered["input_ids"]):
                raise ValueError("cannot derive the assistant mask of an unfinished message with this chat template")
            rendered["assistant_masks"] = list(full["assistant_masks"][:n])
        results.append(rendered)
    if not kw["tokenize"]:
        return results if batched else results[0]
    if kw["return_dict"]:
        merged = {key: [list(r[key]) for r in results] for key in results[0].keys()}
    else:
        merged = {"input_ids": [list(r) for r in results]}
    if padding or return_tensors:
        merged = _pad_dict(merged, tokenizer, return_tensors)
    if not batched and not return_tensors:
        merged = {key: rows[0] for key, rows in merged.items()}
    return merged if kw["return_dict"] else merged["input_ids"]


def _pad_dict(encoded: dict[str, list[list[int]]], tokenizer, return_tensors: str | None) -> dict:
    if return_tensors not in (None, "pt"):
        raise ValueError(f"return_tensors={return_tensors!r}: only 'pt' is supported for unfinished messages")
    length = max(len(ids) for ids in encoded["input_ids"])
    left = getattr(tokenizer, "padding_side", "right") == "left"
    out = {}
    for key, rows in encoded.items():
        value = tokenizer.pad_token_id if key == "input_ids" else 0
        padded = [([value] * (length - len(r)) + r) if left else (r + [value] * (length - len(r))) for r in rows]
        out[key] = torch.tensor(padded) if return_tensors == "pt" else padded
    return out
