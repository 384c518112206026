"""How ``History.apply_chat_template`` renders: conversations in, strings / ids / TensorDicts out.

Every conversation is rendered by the tokenizer's ``apply_chat_template`` (one batched call when
no conversation needs special treatment), so that rlpost and transformers never disagree on a
prompt. A conversation is *open* when its last message is unfinished or the caller asked for
``continue_final_message``: it is rendered on its own with ``continue_final_message=True``, and
its assistant mask, which transformers refuses to compute then, is the complete rendering's mask
cut to the open rendering's length (valid when the cut ids are a prefix of the complete ids,
which holds whenever an end-of-turn special token follows the content: ChatML, Qwen, Llama).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict, lazy_stack


@dataclass
class RenderRequest:
    """The resolved arguments of one ``apply_chat_template`` call (see ``History``)."""

    tokenizer: Any
    chat_template: str | None
    add_generation_prompt: bool
    continue_final_message: bool
    tokenize: bool
    padding: bool | str
    truncation: bool | str
    return_dict: bool
    return_assistant_tokens_mask: bool
    template_kwargs: dict = field(default_factory=dict)

    def render(self, history):
        """Render a History of any batch dims (0-d and 1-d: one conversation)."""
        if history.batch_dims <= 1:
            single = history.unsqueeze(0) if history.batch_dims == 0 else history
            return self._conversations([single], batched=False)
        if history.batch_dims == 2:
            return self._conversations(list(history.unbind(0)), batched=True)
        parts = [self.render(sub) for sub in history.unbind(0)]
        return lazy_stack(parts) if self.tokenize and self.return_dict and not self.padding else parts

    # -------------------------------------------------------------- one level of conversations

    def _conversations(self, rows: list, *, batched: bool):
        chats = [row.to_chats() for row in rows]
        if any(len(chat) == 0 for chat in chats):
            raise ValueError("apply_chat_template: a conversation holds only '<none>' padding messages")
        open_rows = [self.continue_final_message or row._last_is_incomplete() for row in rows]
        if not self.tokenize:
            texts = self._texts(chats, open_rows)
            return texts if batched else texts[0]
        encoded = self._encodings(chats, open_rows)
        if self.padding:
            out = self._pad(encoded)
            if not self.return_dict:
                out = out["input_ids"]
            return out if batched else out[0]
        tensors = [{key: torch.as_tensor(value) for key, value in row.items()} for row in encoded]
        if self.return_dict:
            tds = [TensorDict(row, batch_size=[]) for row in tensors]
            return lazy_stack(tds) if batched else tds[0]
        ids = [row["input_ids"] for row in tensors]
        return ids if batched else ids[0]

    def _call(self, conversation, *, open_row: bool = False, **overrides):
        kwargs = dict(
            chat_template=self.chat_template,
            add_generation_prompt=self.add_generation_prompt and not open_row,
            continue_final_message=open_row,
            truncation=self.truncation,
            **self.template_kwargs,
        )
        kwargs.update(overrides)
        return self.tokenizer.apply_chat_template(conversation, **kwargs)

    def _texts(self, chats: list[list[dict]], open_rows: list[bool]) -> list[str]:
        if not any(open_rows):
            return list(self._call(chats, tokenize=False))
        return [self._call(chat, open_row=is_open, tokenize=False) for chat, is_open in zip(chats, open_rows)]

    def _encodings(self, chats: list[list[dict]], open_rows: list[bool]) -> list[dict[str, list]]:
        """Per conversation: ``input_ids``, ``attention_mask`` (and ``assistant_masks``) as lists."""
        want_mask = self.return_assistant_tokens_mask
        tokenized = dict(tokenize=True, return_dict=True, return_tensors=None, padding=False)
        if not any(open_rows):
            batch = self._call(chats, return_assistant_tokens_mask=want_mask, **tokenized)
            return [{key: list(values[i]) for key, values in batch.items()} for i in range(len(chats))]
        rows = []
        for chat, is_open in zip(chats, open_rows):
            mask_here = want_mask and not is_open
            encoded = dict(self._call(chat, open_row=is_open, return_assistant_tokens_mask=mask_here, **tokenized))
            if want_mask and is_open:
                complete = self._call(
                    chat, open_row=False, add_generation_prompt=False, return_assistant_tokens_mask=True, **tokenized
                )
                encoded["assistant_masks"] = _cut_mask(complete, encoded["input_ids"])
            rows.append({key: list(value) for key, value in encoded.items()})
        return rows

    def _pad(self, encoded: list[dict[str, list]]) -> TensorDict:
        """Dense ``[B, L]`` tensors padded as the tokenizer pads: its side, its pad id, 0 in masks."""
        max_length = self.template_kwargs.get("max_length") if self.padding == "max_length" else None
        length = max([len(row["input_ids"]) for row in encoded] + [max_length or 0])
        left = getattr(self.tokenizer, "padding_side", "right") == "left"
        pad_id = getattr(self.tokenizer, "pad_token_id", None)
        if pad_id is None:
            raise ValueError("padding needs a tokenizer with a pad token (tokenizer.pad_token_id is None)")
        out = {}
        for key in encoded[0]:
            value = pad_id if key == "input_ids" else 0
            rows = []
            for row in encoded:
                fill = [value] * (length - len(row[key]))
                rows.append(fill + row[key] if left else row[key] + fill)
            out[key] = torch.tensor(rows)
        return TensorDict(out, batch_size=[len(encoded)])


def _cut_mask(complete, cut_ids: list[int]) -> list[int]:
    n = len(cut_ids)
    if list(complete["input_ids"][:n]) != list(cut_ids):
        raise ValueError("cannot derive the assistant mask of an unfinished message with this chat template")
    return list(complete["assistant_masks"][:n])
