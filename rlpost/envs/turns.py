"""One more message at the end of a rendered conversation, in text or token ids, so that ChatEnv's
text and tokens modes and the IncrementalTokenizer never re-render a conversation whole.
"""

from __future__ import annotations

from typing import Any

import torch


class TurnRenderer:
    """Renders one more message at the end of an already rendered conversation (text or ids):
    the message's text is the difference between rendering ``[system, message]`` with a
    generation prompt and rendering ``[system]``; the end of an assistant turn is what follows
    the content when ``[system, assistant]`` is rendered. Both rely on the template rendering
    message by message (true of ChatML/Qwen, Llama and most templates); a template for which
    this does not hold raises ``ValueError``. Token ids of these pieces are encoded separately
    (``add_special_tokens=False``): exact when the pieces start and end at special tokens, as in
    ChatML.
    """

    _MARK = "\u2063rlpost-content\u2063"

    def __init__(self, tokenizer: Any, policy_role: str, template_kwargs: dict[str, Any]) -> None:
        self.tokenizer, self.policy_role, self.template_kwargs = tokenizer, policy_role, template_kwargs
        self._cache: dict[str, Any] = {}

    def _text(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **self.template_kwargs
        )

    def _suffix(self, message: dict, generation_prompt: bool) -> str:
        base_chat = [{"role": "system", "content": "s"}]
        base = self._text(base_chat, False)
        both = self._text(base_chat + [message], generation_prompt)
        if not both.startswith(base):
            raise ValueError("this chat template does not render message by message; use input_mode='history'")
        return both[len(base) :]

    def turn_end(self) -> str:
        """What the template writes after an assistant message's content (e.g. "<|im_end|>\\n")."""
        if "end" not in self._cache:
            rendered = self._suffix({"role": self.policy_role, "content": self._MARK}, False)
            self._cache["end"] = rendered[rendered.index(self._MARK) + len(self._MARK) :]
        return self._cache["end"]

    def strip_turn_end(self, text: str) -> str:
        """``text`` without a trailing end-of-turn marker (e.g. ``"<|im_end|>"``), if it has one."""
        marker = self.turn_end().strip()
        stripped = text.rstrip()
        return stripped[: -len(marker)] if marker and stripped.endswith(marker) else text

    def append_text(self, text: str, role: str, content: str) -> str:
        turn = self._suffix({"role": role, "content": content}, True)
        return close_with(text, self.turn_end()) + turn

    def append_tokens(self, ids: torch.Tensor, role: str, content: str) -> torch.Tensor:
        end_ids = self.tokenizer.encode(self.turn_end(), add_special_tokens=False)
        turn = self._suffix({"role": role, "content": content}, True)
        turn_ids = self.tokenizer.encode(turn, add_special_tokens=False)
        closed = close_with(ids.tolist(), end_ids)
        return torch.tensor(closed + turn_ids, dtype=torch.int64)


def close_with(seq: Any, end: Any) -> Any:
    """``seq`` followed by the part of ``end`` it does not already end with (str or list)."""
    for overlap in range(min(len(seq), len(end)), 0, -1):
        if seq[len(seq) - overlap :] == end[:overlap]:
            return seq + end[overlap:]
    return seq + end
