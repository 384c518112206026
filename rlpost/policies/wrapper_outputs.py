"""How an LLM wrapper lays out what its backend returned: the containers of
:mod:`rlpost.data.llm_data`, padded or as lazy stacks (the output half of
:class:`rlpost.policies.base.LLMWrapperBase`)."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import NestedKey, NonTensorData, TensorDict, TensorDictBase, lazy_stack

from rlpost.data.history import History, parse_chatml
from rlpost.data.llm_data import ChatHistory, LogProbs, Masks, Text, Tokens, pad_full, pad_rows
from rlpost.policies.generation import Completion
from rlpost.policies.inputs import has_entry, is_lazy, join_key, peek
from rlpost.policies.wrapper_inputs import Rows, decode_rows


class OutputWriter:
    """Mixin of :class:`~rlpost.policies.base.LLMWrapperBase`: turns the backend's completions or
    scores into the output containers and writes them (TorchRL's ``inplace``)."""

    def _generate_outputs(self, rows: Rows) -> dict[NestedKey, Any]:
        k = self.num_samples or 1
        completions = self._generate_ids(rows.prompt_ids, k)
        flat = [c for group in completions for c in group]
        if len(completions) != len(rows.prompt_ids) or any(len(g) != k for g in completions):
            counts = [len(g) for g in completions]
            raise RuntimeError(f"engine returned {counts} completions for {len(rows.prompt_ids)} prompts x {k}")
        repeat = lambda xs: None if xs is None else [x for x in xs for _ in range(k)]  # noqa: E731
        prompt_ids = repeat(rows.prompt_ids)
        response_ids = [c.token_ids for c in flat]
        split = [len(p) for p in prompt_ids]
        full_ids = [p + r for p, r in zip(prompt_ids, response_ids)]
        out: dict[NestedKey, Any] = {}
        need_text = self.return_text or self.input_mode == "history"
        response_text = decode_rows(self.tokenizer, response_ids) if need_text else None
        if need_text and rows.prompt_text is None:
            rows.prompt_text = decode_rows(self.tokenizer, rows.prompt_ids)
        prompt_text = repeat(rows.prompt_text)
        if self.return_log_probs:
            full_lp = _rows_tensor([[0.0] * s + _logprobs(c) for s, c in zip(split, flat)], torch.float32)
            response_lp = [lp[s:] for lp, s in zip(full_lp, split)]
            out[self.log_probs_key] = self._pack(LogProbs, 0.0, None, response_lp, full_lp, split)
        if self.return_tokens:
            full_t = _rows_tensor(full_ids, torch.long)
            prompt_t, response_t = [t[:s] for t, s in zip(full_t, split)], [t[s:] for t, s in zip(full_t, split)]
            out[self.tokens_key] = self._pack(Tokens, self._pad_id(), prompt_t, response_t, full_t, split)
        if self.return_masks:
            # Only this call's tokens: earlier assistant turns inside the prompt have no behaviour
            # log-prob here (log_probs.full is 0 there), so a loss must not count them.
            assist = _after_split(split, [len(f) for f in full_ids])
            out[self.masks_key] = self._pack_masks(full_ids, assist, split)
        if self.return_text:
            full_text = [p + r for p, r in zip(prompt_text, response_text)]
            out[self.text_key] = self._text(prompt_text, response_text, full_text)
        if self.input_mode == "history":
            out[self.history_key] = self._chat_history(rows.prompt_history, prompt_text, response_text, k)
        return out

    def _score_outputs(self, rows: Rows) -> dict[NestedKey, Any]:
        full_ids = rows.full_ids
        # score_from passed only when set: a backend written for _score_ids(full_ids) still works
        full_lp = self._score_ids(full_ids, rows.score_from) if rows.score_from else self._score_ids(full_ids)
        for ids, lp in zip(full_ids, full_lp):
            if lp.shape != (len(ids),):
                raise RuntimeError(f"backend scored {tuple(lp.shape)} log-probs for a sequence of {len(ids)} tokens")
        split = [len(p) for p in rows.prompt_ids] if rows.prompt_ids is not None else None

        def parts(xs):  # (prompt, response) rows when the split is known
            if split is None:
                return None, None
            return [x[:s] for x, s in zip(xs, split)], [x[s:] for x, s in zip(xs, split)]

        out: dict[NestedKey, Any] = {}
        out[self.log_probs_key] = self._pack(LogProbs, 0.0, *parts(full_lp), full_lp, split)
        if self.return_tokens:
            full_t = _rows_tensor(full_ids, torch.long)
            out[self.tokens_key] = self._pack(Tokens, self._pad_id(), *parts(full_t), full_t, split)
        if self.return_masks:
            if rows.full_assistant is not None:
                assist = [torch.tensor(a, dtype=torch.bool) for a in rows.full_assistant]
            elif split is not None:
                assist = _after_split(split, [len(ids) for ids in full_ids])
            else:
                assist = None
            out[self.masks_key] = self._pack_masks(full_ids, assist, split)
        if self.return_text:
            full_text = rows.full_text or decode_rows(self.tokenizer, full_ids)
            prompt_text = rows.prompt_text
            response_text = None
            if prompt_text is not None and all(f.startswith(p) for f, p in zip(full_text, prompt_text)):
                response_text = [f[len(p) :] for f, p in zip(full_text, prompt_text)]
            out[self.text_key] = self._text(prompt_text, response_text, full_text)
        return out

    def _first_assistant_position(self, td: TensorDictBase) -> int:
        """The first position any row's assistant mask covers; 0 (score every position) when
        the input has no such mask or it covers nothing."""
        key = join_key(self.masks_key, "all_assistant_mask")
        if not has_entry(td, key):
            return 0
        masks = td.get(key, as_list=True) if is_lazy(td) or is_lazy(peek(td, self.masks_key)) else td.get(key)
        firsts = [int(row.nonzero()[0, 0]) for row in masks if bool(row.any())]
        return min(firsts, default=0)

    def _pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return 0 if pad is None else int(pad)

    def _batch_shape(self, n_rows: int) -> list[int]:
        return [n_rows // self.num_samples, self.num_samples] if self.num_samples else [n_rows]

    def _pack(self, cls, value, prompt, response, full, split):
        """Build ``cls(prompt, response, full, padded)`` in the layout ``pad_output`` asks for."""
        fields = {"prompt": prompt, "response": response, "full": full}
        if self.pad_output:
            sides = {"prompt": "left", "response": "right"}
            dense = {k: pad_rows(v, sides[k], value) for k, v in fields.items() if v is not None and k in sides}
            dense["full"] = pad_full(full, split, value)
            return cls(**dense, padded=True, batch_size=[len(full)]).reshape(self._batch_shape(len(full)))
        return self._ragged(cls, fields)

    def _ragged(self, cls, fields: dict[str, list[torch.Tensor] | None]):
        """A lazy stack of per-row tensors; built from plain TensorDicts because constructing one
        tensorclass per row costs ~10x more (it showed in the rollout benchmark)."""
        present = {k: v for k, v in fields.items() if v is not None}
        n = len(next(iter(present.values())))
        unpadded = NonTensorData(False)  # one immutable flag shared by every row: 3x cheaper
        scalar = torch.Size([])  # a given batch size skips inferring one: 40% cheaper per row
        # _new_unsafe: tensordict's constructor without its per-entry checks (the entries are
        # tensors this method made, of a batch size it gives): a third of the wrapper's cost
        rows = [
            TensorDict._new_unsafe({**{k: v[i] for k, v in present.items()}, "padded": unpadded}, batch_size=scalar)
            for i in range(n)
        ]
        k = self.num_samples
        if k:  # [prompts, samples]: a lazy stack of each prompt's samples (cheaper than a reshape)
            return cls._from_tensordict(lazy_stack([lazy_stack(rows[i : i + k]) for i in range(0, n, k)]))
        return cls._from_tensordict(lazy_stack(rows))

    def _pack_masks(self, full_ids, assist, split) -> Masks:
        attention = _after_split([0] * len(full_ids), [len(ids) for ids in full_ids])
        fields = {"all_attention_mask": attention, "all_assistant_mask": assist}
        if not self.pad_output:
            return self._ragged(Masks, fields)
        n = len(full_ids)
        return Masks(
            all_attention_mask=pad_full(attention, split, False),
            all_assistant_mask=None if assist is None else pad_full(assist, split, False),
            padded=True,
            batch_size=[n],
        ).reshape(self._batch_shape(n))

    def _text(self, prompt, response, full) -> Text:
        n = len(full)
        text = Text(prompt=prompt, response=response, full=full, padded=self.pad_output, batch_size=[n])
        return text.reshape(self._batch_shape(n))

    def _chat_history(self, prompt: History, prompt_text, response_text, k: int) -> ChatHistory:
        """prompt / response / full Histories; the decoded response is parsed with the rendered
        prompt, so one that ends without EOS is an assistant message with ``is_complete=False``."""
        prompt_chats = [chat for chat in prompt.to_chats(include_state=True) for _ in range(k)]
        responses = []
        for chat, p_text, r_text in zip(prompt_chats, prompt_text, response_text):
            parsed = parse_chatml(p_text + r_text)
            responses.append(parsed[len(chat) :] or [{"role": "assistant", "content": "", "is_complete": False}])
        shape = self._batch_shape(len(responses))
        prompt_h = prompt if not self.num_samples else prompt.unsqueeze(1).expand(*shape, prompt.shape[-1])
        response_h = History.from_chats(responses)
        full_h = History.from_chats([chat + resp for chat, resp in zip(prompt_chats, responses)])
        if self.num_samples:
            response_h = response_h.reshape(*shape, response_h.shape[-1])
            full_h = full_h.reshape(*shape, full_h.shape[-1])
        return ChatHistory(prompt=prompt_h, response=response_h, full=full_h, batch_size=shape)

    # ------------------------------------------------------------------ writing

    def _write(self, td: TensorDictBase, outputs: dict[NestedKey, Any]) -> TensorDictBase:
        """TorchRL's ``inplace``: True writes into ``td``; "empty" into ``td.empty()``; False into a
        new TensorDict (``[B, num_samples]`` with samples); the last two hold the outputs only."""
        if self.inplace is True:
            result = td
        elif self.inplace == "empty":
            result = td.empty()
        else:
            result = TensorDict(batch_size=self._batch_shape(td.shape[0] * (self.num_samples or 1)))
        for key, value in outputs.items():
            result.set(key, value)
        return result


def _logprobs(completion: Completion) -> list[float]:
    if completion.logprobs is None:
        raise RuntimeError("the engine returned no log-probs although return_log_probs=True")
    return list(completion.logprobs)


def _rows_tensor(rows: list[list], dtype: torch.dtype) -> list[torch.Tensor]:
    """One tensor per row. Converted in one call (per-row ``torch.tensor`` dominated the wrapper's
    overhead) and cloned per row, so that a row sent alone does not carry the batch's storage."""
    flat = torch.tensor([x for row in rows for x in row], dtype=dtype)
    return [part.clone() for part in flat.split([len(row) for row in rows])]


def _after_split(split: list[int], lengths: list[int]) -> list[torch.Tensor]:
    """Per row, a bool mask of ``lengths[i]`` that is True from position ``split[i]`` on (built
    in one call for the whole batch, cloned per row like :func:`_rows_tensor`)."""
    counts = torch.tensor([n for s, length in zip(split, lengths) for n in (s, length - s)])
    values = torch.tensor([False, True]).repeat(len(lengths))
    flat = torch.repeat_interleave(values, counts)
    return [part.clone() for part in flat.split(lengths)]
