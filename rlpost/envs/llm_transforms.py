"""Transforms of TorchRL's LLM stack: :class:`Tokenizer`, :class:`TemplateTransform` and
:class:`AddThinkingPrompt`.

Besides rlpost's hooks they have ``inv(td)``: TorchRL's inverse pass on a step's input before the
base env sees it (e.g. decoding the policy's tokens into the text action an
:class:`~rlpost.envs.llm_env.LLMEnv` concatenates). The envs of :mod:`rlpost.envs.llm_env` run it
(last transform first, as TorchRL's ``Compose.inv``); a TransformedEnv of a
:class:`~rlpost.envs.chat.ChatEnv` does not. They take a ``[B]`` batch, or the ``[]`` one of a
batch-less LLMEnv.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from tensordict import TensorDictBase

from rlpost.data import ChatHistory, History
from rlpost.envs.errors import EnvInputError
from rlpost.envs.td_rows import (
    NestedKey,
    as_keys,
    batch_value,
    has_key,
    object_rows,
    replace_last,
    stack_rows,
    tensor_rows,
)
from rlpost.envs.transforms import Transform


def _parent_device(transform: Transform) -> torch.device | None:
    parent = getattr(transform, "parent", None)
    return getattr(parent, "device", None) if parent is not None else None


# ---------------------------------------------------------------------------- Tokenizer


class Tokenizer(Transform):
    """Tokenize text entries into token ids (and decode token actions back into text).

    TorchRL's ``Tokenizer`` transform: after a reset and each step, each ``in_keys`` entry (a
    string per row) becomes token ids under ``out_keys``, the attention mask beside it
    (``out_key``'s last part replaced by ``"attention_mask"``); a batch is tokenized in one call
    and padded as the tokenizer pads. The inverse pass decodes each ``out_keys_inv`` entry into
    ``in_keys_inv`` (e.g. the policy's ``"tokens_response"`` into an LLMEnv's
    ``"text_response"``). ``tokenizer``: a Hugging Face tokenizer, hub name or path;
    ``use_raw_nontensor`` is accepted for TorchRL compatibility; ``missing_tolerance=False``
    makes a missing entry raise :class:`~rlpost.envs.errors.EnvInputError` (TorchRL:
    ``KeyError``); ``call_before_reset`` tokenizes the reset input instead of its output.

    Deliberate deviations from TorchRL: the tokenizer is required (TorchRL downloads
    ``bert-base-uncased`` when none is given); a batch tokenized with ``padding=False`` whose
    rows differ in length gives a jagged nested tensor (TorchRL's tokenizer call fails);
    token rows of different lengths are decoded as they are (TorchRL pads them with 0 first);
    no per-transform specs.
    """

    def __init__(
        self,
        in_keys: Sequence[NestedKey] | None = None,
        out_keys: Sequence[NestedKey] | None = None,
        in_keys_inv: Sequence[NestedKey] | None = None,
        out_keys_inv: Sequence[NestedKey] | None = None,
        *,
        tokenizer: Any = None,
        use_raw_nontensor: bool = False,
        additional_tokens: list[str] | None = None,
        skip_special_tokens: bool = True,
        add_special_tokens: bool = False,
        padding: bool = True,
        max_length: int | None = None,
        return_attention_mask: bool = True,
        missing_tolerance: bool = True,
        call_before_reset: bool = False,
    ) -> None:
        super().__init__()
        if tokenizer is None:
            raise ValueError(
                "Tokenizer needs a tokenizer= (a Hugging Face tokenizer, or a hub name or local path to load one)"
            )
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.in_keys, self.out_keys = as_keys(in_keys), as_keys(out_keys if out_keys is not None else in_keys)
        self.in_keys_inv = as_keys(in_keys_inv)
        self.out_keys_inv = as_keys(out_keys_inv if out_keys_inv is not None else in_keys_inv)
        for name, ins, outs in (("in_keys/out_keys", self.in_keys, self.out_keys),
                                ("in_keys_inv/out_keys_inv", self.in_keys_inv, self.out_keys_inv)):  # fmt: skip
            if len(ins) != len(outs):
                raise ValueError(f"Tokenizer {name} must have the same length, got {ins} and {outs}")
        if max_length is not None and max_length < 1:
            raise ValueError(f"Tokenizer max_length must be >= 1 or None, got {max_length}")
        self.tokenizer = tokenizer
        self.use_raw_nontensor = use_raw_nontensor
        self.skip_special_tokens, self.add_special_tokens = skip_special_tokens, add_special_tokens
        self.padding, self.max_length = padding, max_length
        self.return_attention_mask = return_attention_mask
        self.missing_tolerance = missing_tolerance
        self.call_before_reset = call_before_reset
        if additional_tokens:
            self.tokenizer.add_tokens(list(additional_tokens))

    @property
    def state_keys(self) -> tuple:
        """The token entries (and masks) are observations: carried into each step's next root."""
        keys = []
        for out_key in self.out_keys:
            keys.append(out_key)
            if self.return_attention_mask:
                keys.append(replace_last(out_key, "attention_mask"))
        return tuple(keys)

    # ------------------------------------------------------------------ hooks

    def reset_preprocess(self, td: TensorDictBase) -> TensorDictBase:
        if self.call_before_reset:
            self._tokenize_entries(td, tolerant=True)
        return td

    def on_reset(self, td: TensorDictBase, reset_td: TensorDictBase) -> TensorDictBase:
        if not self.call_before_reset:
            self._tokenize_entries(reset_td, tolerant=self.missing_tolerance)
        return reset_td

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        self._tokenize_entries(next_td, tolerant=self.missing_tolerance)
        return next_td

    def inv(self, td: TensorDictBase) -> TensorDictBase:
        """Decode each ``out_keys_inv`` entry (token ids per row) into ``in_keys_inv``."""
        for text_key, tokens_key in zip(self.in_keys_inv, self.out_keys_inv):
            if not has_key(td, tokens_key):
                if not self.missing_tolerance:
                    raise EnvInputError(
                        f"Tokenizer: no {tokens_key!r} to decode into {text_key!r}; "
                        f"the step input has keys {sorted(map(str, td.keys(include_nested=True)))}"
                    )
                continue
            td.set(text_key, batch_value([self.decode(ids) for ids in tensor_rows(td, tokens_key)], td))
        return td

    # ------------------------------------------------------------------ tokenizer calls

    def _tokenize_entries(self, td: TensorDictBase, *, tolerant: bool) -> None:
        for in_key, out_key in zip(self.in_keys, self.out_keys):
            mask_key = replace_last(out_key, "attention_mask")
            if not has_key(td, in_key):
                if not tolerant:
                    raise EnvInputError(
                        f"Tokenizer: no {in_key!r} to tokenize into {out_key!r}; "
                        f"the TensorDict has keys {sorted(map(str, td.keys(include_nested=True)))}"
                    )
                if self.return_attention_mask and has_key(td, out_key) and not has_key(td, mask_key):
                    td.set(mask_key, torch.ones_like(td.get(out_key), dtype=torch.int64))
                continue
            texts = object_rows(td, in_key)
            if not all(isinstance(text, str) for text in texts):
                kinds = sorted({type(text).__name__ for text in texts})
                raise EnvInputError(f"Tokenizer: {in_key!r} must hold strings, got {kinds}")
            ids, mask = self.encode(texts[0]) if td.batch_dims == 0 else self.encode(texts)
            td.set(out_key, ids)
            if self.return_attention_mask:
                td.set(mask_key, mask)

    def encode(self, text: str | list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and attention mask of one string (``[L]``) or a batch (``[B, L]``)."""
        kwargs: dict[str, Any] = {"add_special_tokens": self.add_special_tokens}
        if self.max_length is not None:
            kwargs.update(padding="max_length", max_length=self.max_length)
        if isinstance(text, str):
            out = self.tokenizer(text, return_tensors="pt", return_attention_mask=True, **kwargs)
            ids, mask = out["input_ids"][0].to(torch.int64), out["attention_mask"][0].to(torch.int64)
        elif self.padding or self.max_length is not None:
            kwargs.setdefault("padding", True)
            out = self.tokenizer(list(text), return_tensors="pt", return_attention_mask=True, **kwargs)
            ids, mask = out["input_ids"].to(torch.int64), out["attention_mask"].to(torch.int64)
        else:
            rows = [torch.as_tensor(self.tokenizer.encode(t, **kwargs), dtype=torch.int64) for t in text]
            ids, mask = stack_rows(rows), stack_rows([torch.ones_like(row) for row in rows])
        device = _parent_device(self)
        if device is not None:
            ids, mask = ids.to(device), mask.to(device)
        return ids, mask

    def decode(self, ids: torch.Tensor) -> str:
        """One row of ids as text."""
        values = ids.reshape(-1).tolist()
        return self.tokenizer.decode(values, skip_special_tokens=self.skip_special_tokens)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(in_keys={self.in_keys}, out_keys={self.out_keys}, in_keys_inv={self.in_keys_inv}, "
            f"out_keys_inv={self.out_keys_inv})"
        )


# ---------------------------------------------------------------------------- TemplateTransform


class TemplateTransform(Transform):
    """Render conversations through a chat template into the prompt text a policy reads.

    TorchRL's ``TemplateTransform(tokenizer, chat_template=None)``: after a reset and each step
    the ``"message"`` entry (a History, message dicts, or a string read as one user message) is
    rendered with a generation prompt and written back; the inverse pass cuts the ``"action"``
    entry, a rendered completion, down to the text of its last assistant turn. rlpost's keywords
    name those entries and ``add_generation_prompt``.

    Deliberate deviations from TorchRL: the assistant header and end-of-turn marker that the
    inverse pass cuts at are read from the template (TorchRL hard-codes Llama 3's
    ``<|start_header_id|>assistant<|end_header_id|>`` and ``<|eot_id|>``), and a plain string
    renders as a user message (TorchRL passes it to ``apply_chat_template`` as is, which fails).
    A missing entry raises :class:`~rlpost.envs.errors.EnvInputError` naming the key.
    """

    _MARK = "\u2063rlpost-template\u2063"

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None = None,
        *,
        in_keys: Sequence[NestedKey] | None = None,
        out_keys: Sequence[NestedKey] | None = None,
        in_keys_inv: Sequence[NestedKey] | None = None,
        out_keys_inv: Sequence[NestedKey] | None = None,
        add_generation_prompt: bool = True,
    ) -> None:
        super().__init__()
        if tokenizer is None:
            raise ValueError("TemplateTransform needs a tokenizer (its chat template renders the conversations)")
        if chat_template is None:
            try:
                chat_template = tokenizer.get_chat_template()
            except (ValueError, AttributeError) as exc:
                raise ValueError(
                    f"TemplateTransform: the tokenizer has no chat template; pass chat_template= ({exc})"
                ) from exc
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.in_keys = as_keys(in_keys if in_keys is not None else ["message"])
        self.out_keys = as_keys(out_keys if out_keys is not None else self.in_keys)
        self.in_keys_inv = as_keys(in_keys_inv if in_keys_inv is not None else ["action"])
        self.out_keys_inv = as_keys(out_keys_inv if out_keys_inv is not None else self.in_keys_inv)
        if len(self.in_keys) != len(self.out_keys) or len(self.in_keys_inv) != len(self.out_keys_inv):
            raise ValueError(
                "TemplateTransform: in_keys/out_keys (and in_keys_inv/out_keys_inv) must have the same length"
            )
        self.add_generation_prompt = add_generation_prompt
        self._markers: tuple[str, str] | None = None

    def on_reset(self, td: TensorDictBase, reset_td: TensorDictBase) -> TensorDictBase:
        return self._render_entries(reset_td)

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        return self._render_entries(next_td)

    def inv(self, td: TensorDictBase) -> TensorDictBase:
        """Each ``in_keys_inv`` completion cut to its last assistant turn, under ``out_keys_inv``."""
        for in_key, out_key in zip(self.in_keys_inv, self.out_keys_inv):
            texts = self._entry(td, in_key, "completion")
            if not all(isinstance(text, str) for text in texts):
                raise EnvInputError(f"TemplateTransform: {in_key!r} must hold strings (rendered completions)")
            td.set(out_key, batch_value([self.last_assistant_turn(text) for text in texts], td))
        return td

    def render(self, conversation: Any) -> str:
        """One conversation (History, message dicts or a string) rendered with the template."""
        chat = _as_chat(conversation)
        return self.tokenizer.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=self.add_generation_prompt, chat_template=self.chat_template
        )

    def last_assistant_turn(self, text: str) -> str:
        """The text after the last assistant header of ``text``, up to its end-of-turn marker."""
        header, end = self._template_markers()
        if header and header in text:
            text = text[text.rindex(header) + len(header) :]
        if end and end in text:
            text = text[: text.index(end)]
        return text

    def _template_markers(self) -> tuple[str, str]:
        """(assistant header, end-of-turn marker) as the template writes them."""
        if self._markers is None:
            user = [{"role": "user", "content": "x"}]

            def text(chat, generation_prompt):
                return self.tokenizer.apply_chat_template(
                    chat, tokenize=False, add_generation_prompt=generation_prompt, chat_template=self.chat_template
                )

            base, with_prompt = text(user, False), text(user, True)
            header = with_prompt[len(base) :] if with_prompt.startswith(base) else ""
            rendered = text(user + [{"role": "assistant", "content": self._MARK}], False)
            end = rendered[rendered.index(self._MARK) + len(self._MARK) :].strip() if self._MARK in rendered else ""
            self._markers = (header, end)
        return self._markers

    def _render_entries(self, td: TensorDictBase) -> TensorDictBase:
        for in_key, out_key in zip(self.in_keys, self.out_keys):
            value = td.get(in_key) if has_key(td, in_key) else None
            if isinstance(value, History):
                chats = value.to_chats() if td.batch_dims else [value.to_chats()]
            elif isinstance(value, ChatHistory):
                raise EnvInputError(
                    f"TemplateTransform: {in_key!r} holds a ChatHistory; name one of its Histories, "
                    f"e.g. in_keys=[({in_key!r}, 'prompt')]"
                )
            else:
                chats = self._entry(td, in_key, "conversation")
            td.set(out_key, batch_value([self.render(chat) for chat in chats], td))
        return td

    def _entry(self, td: TensorDictBase, key: NestedKey, what: str) -> list:
        if not has_key(td, key):
            raise EnvInputError(
                f"TemplateTransform needs the {what} under {key!r}; the TensorDict has keys "
                f"{sorted(map(str, td.keys(include_nested=True)))}"
            )
        return object_rows(td, key)

    def __repr__(self) -> str:
        return f"TemplateTransform(in_keys={self.in_keys}, out_keys={self.out_keys}, in_keys_inv={self.in_keys_inv})"


def _as_chat(conversation: Any) -> list[dict]:
    if isinstance(conversation, History):
        return conversation.to_chats()
    if isinstance(conversation, str):
        return [{"role": "user", "content": conversation}]
    if isinstance(conversation, dict):
        return [conversation]
    if isinstance(conversation, (list, tuple)) and all(isinstance(m, dict) for m in conversation):
        return list(conversation)
    raise EnvInputError(
        f"TemplateTransform renders a History, a list of message dicts or a string, got {type(conversation).__name__}"
    )


# ---------------------------------------------------------------------------- AddThinkingPrompt


class AddThinkingPrompt(Transform):
    """Ask the model to think again: edit or extend the conversation when ``cond`` holds.

    TorchRL's ``AddThinkingPrompt``, for a ChatEnv in history mode (else
    :class:`~rlpost.envs.errors.EnvInputError` at the first reset or step). After each step,
    ``cond(next_row) -> bool`` is called with each row's ``next``; where it holds:

    - ``edit_last_turn=True`` (``role="assistant"`` only): the last message becomes an
      assistant message whose last ``<answer>...</answer>`` block (with a trailing
      ``<|im_end|>``) is replaced by the prompt, or, without an answer block, that ends with
      ``"\\n\\n" + prompt``;
    - otherwise a ``role`` message holding the prompt is appended;
    - ``undo_done``: the done flags of that row are cleared (the episode goes on);
    - ``zero_reward`` (default: ``edit_last_turn``): its rewards are set to 0.

    ``prompt`` defaults to ``DEFAULT_PROMPTS_EG[0]`` (``egocentric``: the prompt speaks as the
    assistant, default ``role == "assistant"``) or ``DEFAULT_PROMPTS_COG[0]``; ``random_prompt``
    draws it from that list at each use.

    Deliberate deviation from TorchRL: when the edited message ends with ``<|im_end|>`` after
    its answer block, the answer is replaced and the marker kept; TorchRL's current code keeps
    the answer there and appends the prompt after it (its fallback branch), which contradicts
    its own description.
    """

    DEFAULT_PROMPTS_EG = [
        "But wait, let me think about this more carefully...",
        "Actually, let me reconsider this...",
        "But we can do better. Let me think about it step by step...",
        "Wait, I need to double-check my reasoning...",
        "Actually, let me think about it more carefully...",
        "It looks like I made a mistake. Let me think about it step by step...",
    ]
    DEFAULT_PROMPTS_COG = [
        "But wait, think about this more carefully...",
        "Actually, reconsider this...",
        "But we can do better. Let's think about it step by step...",
        "Wait, you need to double-check your reasoning...",
        "Actually, think about it more carefully...",
        "It looks like you made a mistake. Can you see what went wrong? Let's think about it step by step...",
    ]
    EOS_MARKER = "<|im_end|>"
    _ANSWER = re.compile(r"<answer>.*?</answer>(?:\s*<\|im_end\|>)?", re.DOTALL)

    def __init__(
        self,
        cond: Callable[[TensorDictBase], Any],
        prompt: str | None = None,
        random_prompt: bool = False,
        role: Literal["user", "assistant"] = "assistant",
        edit_last_turn: bool = True,
        zero_reward: bool | None = None,
        undo_done: bool = True,
        egocentric: bool | None = None,
    ) -> None:
        super().__init__()
        if not callable(cond):
            raise ValueError(f"AddThinkingPrompt cond must be callable (next_row -> bool), got {type(cond).__name__}")
        if edit_last_turn and role != "assistant":
            raise ValueError("edit_last_turn can only be used with role='assistant'")
        self.cond, self.role = cond, role
        self.egocentric = role == "assistant" if egocentric is None else egocentric
        if prompt is None:
            prompt = self.DEFAULT_PROMPTS_EG[0] if self.egocentric else self.DEFAULT_PROMPTS_COG[0]
        self._prompt, self.random_prompt = prompt, random_prompt
        self.edit_last_turn = edit_last_turn
        self.zero_reward = edit_last_turn if zero_reward is None else zero_reward
        self.undo_done = undo_done

    @property
    def prompt(self) -> str:
        if self.random_prompt:
            return random.choice(self.DEFAULT_PROMPTS_EG if self.egocentric else self.DEFAULT_PROMPTS_COG)
        return self._prompt

    def _check_env(self) -> Any:
        parent = self.parent
        if parent is None:
            raise EnvInputError("AddThinkingPrompt is not attached to an env: use env.append_transform(...)")
        mode = getattr(parent.base_env, "input_mode", None)
        if mode != "history":
            raise EnvInputError(
                f"AddThinkingPrompt edits the conversation history: it needs a ChatEnv with input_mode='history', "
                f"but {type(parent.base_env).__name__} has input_mode={mode!r}"
            )
        return parent

    def on_reset(self, td: TensorDictBase, reset_td: TensorDictBase) -> TensorDictBase:
        self._check_env()
        return reset_td

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        env = self._check_env()
        chat = next_td.get("history", None)
        if not isinstance(chat, ChatHistory) or chat.prompt is None:
            raise EnvInputError("AddThinkingPrompt needs the next prompt under ('history', 'prompt')")
        rows = chat.prompt.to_chats(include_state=True)
        changed = False
        for i in range(len(rows)):
            if not bool(self.cond(next_td[i])):
                continue
            changed = True
            if self.edit_last_turn:
                last = rows[i][-1] if rows[i] else {"content": ""}
                rows[i] = rows[i][:-1] + [{"role": "assistant", "content": self.replace_answer(last["content"])}]
            else:
                rows[i] = rows[i] + [{"role": self.role, "content": self.prompt}]
            if self.undo_done:
                self._fill_row(next_td, env.done_keys, i, False)
            if self.zero_reward:
                self._fill_row(next_td, env.reward_keys, i, 0)
        if changed:
            next_td.set("history", ChatHistory(prompt=History.from_chats(rows), batch_size=next_td.batch_size))
        return next_td

    @staticmethod
    def _fill_row(next_td: TensorDictBase, keys: Iterable[NestedKey], row: int, value: Any) -> None:
        for key in keys:
            if has_key(next_td, key):
                tensor = next_td.get(key).clone()
                tensor[row] = value
                next_td.set(key, tensor)

    def replace_answer(self, content: str) -> str:
        """``content`` with its last answer block replaced by the prompt (see the class doc)."""
        prompt = self.prompt
        matches = list(self._ANSWER.finditer(content))
        if not matches:
            return content.rstrip() + "\n\n" + prompt
        start, end = matches[-1].span()
        marker = self.EOS_MARKER if matches[-1].group(0).endswith(self.EOS_MARKER) else ""
        return (content[:start] + prompt + marker + content[end:]).rstrip()

    def __repr__(self) -> str:
        return (
            f"AddThinkingPrompt(role={self.role!r}, edit_last_turn={self.edit_last_turn}, "
            f"zero_reward={self.zero_reward}, undo_done={self.undo_done})"
        )
