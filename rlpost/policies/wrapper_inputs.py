"""How an LLM wrapper reads its input TensorDict into per-row token ids, texts and histories
(the input half of :class:`rlpost.policies.base.LLMWrapperBase`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import NestedKey, TensorDictBase

from rlpost.data.history import History
from rlpost.data.llm_data import ChatHistory, Text, Tokens
from rlpost.policies.inputs import (
    as_conversations,
    check_prefixes,
    has_entry,
    is_lazy,
    join_key,
    masked_ids,
    padded_flag,
    peek,
    strings,
)

# Tokenizer arguments the wrapper decides itself (padding follows pad_output).
_WRAPPER_TOKENIZER_KWARGS = ("padding", "padding_side", "return_tensors", "return_attention_mask")


@dataclass
class Rows:
    """Per-row inputs after reading the TensorDict (lists of python ints)."""

    prompt_ids: list[list[int]] | None = None
    full_ids: list[list[int]] | None = None
    prompt_text: list[str] | None = None
    full_text: list[str] | None = None
    prompt_history: History | None = None
    full_assistant: list[list[int]] | None = None
    score_from: int = 0  # scoring: the first position whose log-prob is needed (score_assistant_only)


class InputReader:
    """Mixin of :class:`~rlpost.policies.base.LLMWrapperBase`: reads the input of each mode
    (history, text, tokens) into :class:`Rows`; the attributes it reads are the wrapper's."""

    @property
    def _main_part(self) -> str:
        return "prompt" if self.generate else "full"

    def _read_inputs(self, td: TensorDictBase) -> Rows:
        reader = {"history": self._read_history, "text": self._read_text, "tokens": self._read_tokens}
        return reader[self.input_mode](td)

    def _missing(self, td: TensorDictBase) -> str:
        what = (
            "scoring (generate=False) needs the full sequence" if not self.generate else "generation needs the prompt"
        )
        return (
            f"Expected {self.input_key!r} key for {self.input_mode} input mode: {type(self).__name__} {what}; "
            f"the input has keys {sorted(map(str, td.keys(True, True)))}"
        )

    def _main_key(self, td: TensorDictBase, container_cls: type) -> NestedKey | None:
        """Where the main input is: ``input_key``; else a bare value at the container key (a
        History, strings or ids instead of a ChatHistory/Text/Tokens, which TorchRL's tutorial
        passes); ``input_key`` pointing at a container means that container's main part."""
        if has_entry(td, self.input_key):
            value = peek(td, self.input_key)
            if not isinstance(value, container_cls):
                return self.input_key
            key = join_key(self.input_key, self._main_part)
            return key if has_entry(td, key) else None
        if self.input_key != self._container_key and has_entry(td, self._container_key):
            if not isinstance(peek(td, self._container_key), container_cls):
                return self._container_key
        return None

    def _side_key(self, td: TensorDictBase, part: str, container_cls: type) -> NestedKey | None:
        """Where another part of the input's container is (the prompt, when scoring), if given."""
        key = join_key(self._container_key, part)
        if has_entry(td, key) and isinstance(peek(td, self._container_key), container_cls):
            return key
        return None

    def _read_history(self, td: TensorDictBase) -> Rows:
        key = self._main_key(td, ChatHistory)
        if key is None:
            raise ValueError(self._missing(td))
        main = as_conversations(td.get(key), key, td.batch_dims)
        rows = Rows()
        if self.generate:
            ids = self._given_prompt_ids(td) if self.prefer_tokens else None
            if ids is None:
                texts, ids, _ = self._render(main, add_generation_prompt=True, masks=False)
            else:
                texts = decode_rows(self.tokenizer, ids)
            rows.prompt_history, rows.prompt_text, rows.prompt_ids = main, texts, ids
            return rows
        texts, ids, assistant = self._render(main, add_generation_prompt=False)
        rows.full_text, rows.full_ids, rows.full_assistant = texts, ids, assistant
        prompt_key = self._side_key(td, "prompt", ChatHistory)
        if prompt_key is not None:
            prompt = as_conversations(td.get(prompt_key), prompt_key, td.batch_dims)
            rows.prompt_text, rows.prompt_ids, _ = self._render(prompt, add_generation_prompt=True, masks=False)
            check_prefixes(rows.prompt_ids, rows.full_ids, "history.prompt", "history.full")
        return rows

    def _given_prompt_ids(self, td: TensorDictBase) -> list[list[int]] | None:
        """``prefer_tokens``: the prompt ids the input already holds (``tokens.prompt``, else
        ``tokens.full``, TorchRL's order), or None when it holds neither."""
        for part in ("prompt", "full"):
            key = join_key(self.tokens_key, part)
            if has_entry(td, key):
                # no attention mask: the one in the input, if any, is of an earlier turn's tokens
                return self._token_rows(td, key, is_prompt=True, container_key=self.tokens_key, with_mask=False)
        return None

    def _scored_history(self, td: TensorDictBase) -> ChatHistory:
        """The history a scoring call returns: the input's ChatHistory as it is, or a bare
        History as ``ChatHistory(full=...)`` (TorchRL's)."""
        container = td.get(self._container_key, None)
        if isinstance(container, ChatHistory):
            return container
        full = as_conversations(td.get(self._main_key(td, ChatHistory)), self.input_key, td.batch_dims)
        return ChatHistory(full=full, batch_size=td.batch_size)

    def _render(self, history: History, *, add_generation_prompt: bool, masks: bool | None = None):
        kw = dict(add_generation_prompt=add_generation_prompt, chat_template=self.chat_template)
        if self.chat_template_name is not None:
            kw["chat_template_name"] = self.chat_template_name
        texts = history.apply_chat_template(self.tokenizer, **kw)
        if self.return_masks if masks is None else masks:
            enc = history.apply_chat_template(
                self.tokenizer, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kw
            )
            ids = [t.tolist() for t in enc.get("input_ids", as_list=True)]
            return texts, ids, [t.tolist() for t in enc.get("assistant_masks", as_list=True)]
        return texts, self._encode(texts), None

    def _encode(self, texts: list[str]) -> list[list[int]]:
        extra = {k: v for k, v in self.tokenizer_kwargs.items() if k not in _WRAPPER_TOKENIZER_KWARGS}
        extra.setdefault("add_special_tokens", False)
        return [list(x) for x in self.tokenizer(list(texts), **extra)["input_ids"]]

    def _read_text(self, td: TensorDictBase) -> Rows:
        key = self._main_key(td, Text)
        main = strings(td.get(key)) if key is not None else None
        if main is None:
            raise ValueError(self._missing(td))
        rows = Rows()
        if self.generate:
            rows.prompt_text, rows.prompt_ids = main, self._encode(main)
            return rows
        rows.full_text, rows.full_ids = main, self._encode(main)
        prompt_key = self._side_key(td, "prompt", Text)
        if prompt_key is not None:
            prompt = strings(td.get(prompt_key))
            rows.prompt_text, rows.prompt_ids = prompt, self._encode(prompt)
            check_prefixes(rows.prompt_ids, rows.full_ids, "text.prompt", "text.full")
        return rows

    def _read_tokens(self, td: TensorDictBase) -> Rows:
        key = self._main_key(td, Tokens)
        if key is None:
            raise ValueError(self._missing(td))
        main = self._token_rows(td, key, is_prompt=self.generate)
        rows = Rows()
        if self.generate:
            rows.prompt_ids = main
            return rows
        rows.full_ids = main
        prompt_key = self._side_key(td, "prompt", Tokens)
        if prompt_key is not None:
            prompt = self._token_rows(td, prompt_key, is_prompt=True)
            check_prefixes(prompt, main, "tokens.prompt", "tokens.full")
            rows.prompt_ids = prompt
        return rows

    def _token_rows(
        self, td: TensorDictBase, key: NestedKey, *, is_prompt: bool, container_key: NestedKey | None = None,
        with_mask: bool = True,
    ) -> list[list[int]]:  # fmt: skip
        """Token ids of each row, cut by the attention mask when one is found at
        ``attention_mask_key``. Lazy stacks are read row by row: their rows may be ragged, or
        the padded rows of a dense batch (a 0-d input, or TorchRL's ``to_lazystack(0)``).
        ``container_key``: the Tokens container ``key`` is in (default: the input's);
        ``with_mask=False`` reads the ids without a mask."""
        container_key = self._container_key if container_key is None else container_key
        container = peek(td, container_key) if has_entry(td, container_key) else None
        has_mask = with_mask and has_entry(td, self.attention_mask_key)
        if is_lazy(td) or is_lazy(container):
            ids = td.get(key, as_list=True)
            masks = td.get(self.attention_mask_key, as_list=True) if has_mask else [None] * len(ids)
            return [masked_ids(row, mask, key, is_prompt) for row, mask in zip(ids, masks)]
        value = td.get(key)
        if getattr(value, "is_nested", False):
            return [t.tolist() for t in value.unbind(0)]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"Expected token ids (a tensor) at {key!r}, got {type(value).__name__}")
        padded = padded_flag(container.padded) if isinstance(container, Tokens) else None
        if not has_mask and padded:
            raise ValueError(
                f"{key!r} is padded but no attention mask was found at {self.attention_mask_key!r}: "
                "with pad token == EOS the padding cannot be told from real EOS tokens"
            )
        if not has_mask:
            return value.tolist()
        return [masked_ids(row, mask, key, is_prompt) for row, mask in zip(value, td.get(self.attention_mask_key))]


def decode_rows(tokenizer, rows: list[list[int]]) -> list[str]:
    """``tokenizer.batch_decode(rows, skip_special_tokens=False)``, in one call to the Rust
    tokenizer where that returns the same strings: a fast tokenizer whose decoding no class
    overrides and that adds no clean-up of its own. transformers' ``batch_decode`` first walks
    every id in Python, a third of the text's cost on a batch of 512 completions."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(tokenizer)
    plain = (
        isinstance(tokenizer, TokenizersBackend)
        and cls._decode is TokenizersBackend._decode
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls.batch_decode is PreTrainedTokenizerBase.batch_decode
        and not tokenizer.clean_up_tokenization_spaces
    )
    if not plain:
        return tokenizer.batch_decode(rows, skip_special_tokens=False)
    return tokenizer.backend_tokenizer.decode_batch(rows, skip_special_tokens=False)
