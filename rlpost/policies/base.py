"""LLMWrapperBase: the one interface every LLM policy in rlpost has (TorchRL's ``LLMWrapperBase``).

A wrapper reads a TensorDict of prompts (or full sequences) and writes the containers of
:mod:`rlpost.data.llm_data`::

    input_mode="history": ("history", "prompt") History [B, n]   -> ChatHistory under "history"
    input_mode="text":    ("text", "prompt") strings            -> Text under "text"
    input_mode="tokens":  ("tokens", "prompt") token ids        -> Tokens under "tokens"
    + "text" (Text), "masks" (Masks), "tokens" (Tokens), "log_probs" (LogProbs) as asked for.

``generate=True`` samples ``num_samples`` completions per prompt (output batch ``[B]``, or
``[B, num_samples]`` when ``num_samples`` is set) and returns the engine's log-probs of the
sampled tokens. ``generate=False`` scores given full sequences (``("history"|"text"|"tokens",
"full")``): ``log_probs.full[t] = log p(full[t] | full[:t])`` at the wrapper's temperature, so a
scoring twin (``get_new_version(generate=False)``) reproduces the generator's log-probs.

The base class does everything engine-independent (templates, tokenisation, layouts, masks);
a backend implements two methods on plain token-id lists:

- ``_generate_ids(prompt_ids, num_samples) -> list[list[Completion]]``
- ``_score_ids(full_ids, score_from) -> list[Tensor]`` (float32, length ``len(ids)``, 0 at
  position 0; positions before ``score_from`` may be left at 0)

Token ids returned by the engine are used as they are; generated text is decoded for display and
for the history but never re-tokenised: a decode/encode round trip does not give the same ids
back in general, and the log-probs belong to the engine's ids.

TorchRL's behaviour kept: ``in_keys``/``out_keys`` and ``input_key`` semantics, the output
flags chosen from the mode, ``max_tokens`` winning over ``max_new_tokens`` and ``n`` over
``num_return_sequences``, ``inplace`` (True updates the input, also a 0-d one; False and
"empty" hold the outputs only), 0-d and N-d batches, TorchRL's exception types and messages
(ValueError for bad arguments and missing keys, TypeError for a wrong input type). Deliberate
deviations: ``return_text`` /
``return_tokens`` / ``return_masks`` can turn outputs off; text inputs are tokenised with
``add_special_tokens=False`` (chat-rendered text carries its own markers); dense token ids
without a mask at ``attention_mask_key`` are read as they are (TorchRL drops every id equal to
the pad id, which with pad == EOS drops real EOS tokens too; a container flagged ``padded``
needs its mask); the output is richer than TorchRL's where TorchRL leaves fields None (e.g.
``tokens.prompt``/``full`` in text mode): every row has prompt, response and full; in generate
mode prompt positions are not scored (``log_probs.prompt`` is None, ``log_probs.full``
holds 0 there) and ``masks.all_assistant_mask`` covers this call's response tokens only
(earlier assistant turns of a multi-turn prompt have no behaviour log-prob; scoring a history
gives the template's full mask).

This file is over 500 lines on purpose: it is the single place where the layout contract of
:mod:`rlpost.data.llm_data` is produced, for every backend. Generation arguments live in
:mod:`rlpost.policies.generation`, the TensorDict reading helpers in :mod:`rlpost.policies.inputs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from tensordict import NestedKey, NonTensorData, TensorDict, TensorDictBase, lazy_stack

from rlpost.data.history import History, parse_chatml
from rlpost.data.llm_data import ChatHistory, LogProbs, Masks, Text, Tokens, pad_full, pad_rows
from rlpost.policies.batching import BatchQueue, batch_size_bounds
from rlpost.policies.categorical import CategoricalSequential
from rlpost.policies.generation import normalize_generate_kwargs, standard_names
from rlpost.policies.inputs import (
    as_conversations,
    check_prefixes,
    container_of,
    has_entry,
    is_lazy,
    join_key,
    masked_ids,
    padded_flag,
    peek,
    strings,
)

INPUT_MODES = ("history", "text", "tokens")
# Tokenizer arguments the wrapper decides itself (padding follows pad_output).
_WRAPPER_TOKENIZER_KWARGS = ("padding", "padding_side", "return_tensors", "return_attention_mask")


@dataclass
class Completion:
    """One sampled continuation, as an engine returns it (plain data: it crosses processes).

    ``token_ids`` include the EOS token when generation stopped on it (``finished=True``);
    ``logprobs`` are the processed log-probs of those tokens, or None when not requested.
    ``token_versions``: the policy version of the weights that sampled each token, when new
    weights arrived while the completion was generated (an inference worker's in-flight update:
    its tokens come from several versions); None when one version made them all (the version
    the call reports) or the engine does not label its weights.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    finished: bool
    token_versions: list[int] | None = None


@dataclass
class _Rows:
    """Per-row inputs after reading the TensorDict (lists of python ints)."""

    prompt_ids: list[list[int]] | None = None
    full_ids: list[list[int]] | None = None
    prompt_text: list[str] | None = None
    full_text: list[str] | None = None
    prompt_history: History | None = None
    full_assistant: list[list[int]] | None = None
    score_from: int = 0  # scoring: the first position whose log-prob is needed (score_assistant_only)


class LLMWrapperBase(CategoricalSequential):
    """Common constructor, validation, input reading and output layout of the LLM wrappers.

    Keyword Args:
        tokenizer: a transformers tokenizer (needed for history and text modes and to decode);
            each backend finds the model's own when it is omitted.
        input_mode: "history", "text" or "tokens".
        input_key: the key the main input is read from, as in TorchRL: defaults to
            ``(mode, "prompt")`` when generating and ``(mode, "full")`` when scoring. A bare
            value (a History, strings or token ids) at the mode's key, or at ``input_key``, is
            read as that main input.
        attention_mask_key: where a dense padded token input finds its mask (pad == EOS makes
            the mask impossible to infer from ids); defaults to ``("masks", "all_attention_mask")``.
        generate: True samples completions; False scores the given full sequences.
        generate_kwargs: max_new_tokens (backend name max_tokens), temperature, top_p, top_k,
            seed, n (num_return_sequences), do_sample...; see :func:`normalize_generate_kwargs`.
            Kept as ``self.generate_kwargs`` under the standard names (``max_tokens`` read back
            as ``max_new_tokens``, ``n`` as ``num_return_sequences``), as TorchRL's
            TransformersWrapper keeps them; ``self.generate_params`` adds the defaults.
        tokenizer_kwargs: extra keyword arguments for tokenizing text inputs (padding options
            are decided by the wrapper).
        pad_output: dense padded tensors (True) or lazy stacks of per-row tensors (False).
        inplace: True writes into the input TensorDict (default when ``num_samples`` is None);
            False (default with ``num_samples``) returns a new TensorDict of the outputs only;
            ``"empty"`` returns ``input.empty()`` (its type and batch size) holding the outputs.
        device: device the outputs are moved to (None: where they are made, the CPU).
        num_samples: completions per prompt; adds a trailing batch dim of that size.
        chat_template_name: a named template of :meth:`History.apply_chat_template`.
        chat_template: a Jinja template to use instead of the tokenizer's.
        return_log_probs: return LogProbs (default True; required when scoring).
        return_text, return_tokens, return_masks: return Text / Tokens / Masks; by default as
            TorchRL decides from the mode (text for "text" and "history", tokens and masks
            always). Turning them off saves work where a caller only needs log-probs.
        history_key, text_key, tokens_key, masks_key, log_probs_key: output keys.
        score_assistant_only: rlpost's addition (TorchRL has no such argument), for a loss that
            reads log-probs only where the input's ``masks.all_assistant_mask`` is True: when
            scoring, a backend may skip every position before the first assistant token of any
            row, whose log-probs are then 0 (an input without that mask is scored whole).
            TransformersWrapper applies its LM head and log-softmax from that position on only
            (``logits_to_keep``, as TRL scores the completion only), which on a large vocabulary
            is most of the cost of scoring a prompt. Default False: every position is scored,
            as in TorchRL.
        batching, min_batch_size, max_batch_size, batching_timeout: TorchRL's batching of
            concurrent calls: rows of calls made from several threads at once run in shared
            model calls (:mod:`rlpost.policies.batching` gives the rules). ``batching=True``
            alone means ``min_batch_size=1``: whoever calls first runs at once, and calls that
            arrive meanwhile run together next. A batch waits at most ``batching_timeout``
            seconds for ``min_batch_size`` rows. Inputs of more than one batch dimension are
            refused (ValueError), as in TorchRL.
        prefer_tokens: TorchRL's token-first generation: in "history" mode, prompt token ids
            already in the input at ``(tokens_key, "prompt")`` (or else ``(tokens_key, "full")``),
            as ChatEnv's ``with_tokenizer`` and IncrementalTokenizer keep them, are generated from
            as they are instead of rendering the history again (the ids a KV cache holds). The
            prompt text is then decoded from them.

    ``out_keys`` are, in TorchRL's order: text, masks, tokens, log_probs, history (those
    returned). The history is returned in "history" mode, also when scoring (the input's).
    """

    def __init__(
        self,
        *,
        tokenizer=None,
        input_mode: Literal["history", "text", "tokens"] | None = None,
        input_key: NestedKey | None = None,
        attention_mask_key: NestedKey | None = None,
        generate: bool = True,
        generate_kwargs: dict | None = None,
        tokenizer_kwargs: dict | None = None,
        pad_output: bool = False,
        inplace: bool | Literal["empty"] | None = None,
        device: torch.device | str | None = None,
        layout: torch.layout | None = None,
        num_samples: int | None = None,
        chat_template_name: str | None = None,
        chat_template: str | None = None,
        return_log_probs: bool | None = None,
        return_text: bool | None = None,
        return_tokens: bool | None = None,
        return_masks: bool | None = None,
        history_key: NestedKey = "history",
        text_key: NestedKey = "text",
        tokens_key: NestedKey = "tokens",
        masks_key: NestedKey = "masks",
        log_probs_key: NestedKey = "log_probs",
        batching: bool | None = None,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        batching_timeout: float = 10.0,
        prefer_tokens: bool = False,
        score_assistant_only: bool = False,
    ):
        super().__init__()
        # the constructor arguments, for get_new_version twins (input_key None follows input_mode)
        self._kwargs = {k: v for k, v in locals().items() if k not in ("self", "__class__", "generate_kwargs")}
        # input_mode not given: "history" (TorchRL's default), and TorchRL 0.9's text layout for
        # an input that holds bare strings under "text" and no history (_legacy_text_forward)
        self._reads_legacy_text = input_mode is None
        input_mode = "history" if input_mode is None else input_mode
        if input_mode not in INPUT_MODES:
            raise ValueError(f"input_mode must be one of 'history', 'text', 'tokens'. Got {input_mode!r}")
        if not isinstance(pad_output, bool):
            raise ValueError(f"pad_output must be a boolean, got {pad_output!r}")
        if input_mode in ("history", "text") and tokenizer is None:
            raise ValueError(f"input_mode={input_mode!r} needs a tokenizer")
        if layout not in (None, torch.strided):
            raise ValueError(f"layout={layout}: rlpost returns lazy stacks of strided tensors (pad_output=False)")
        self._min_batch_size, self._max_batch_size = batch_size_bounds(batching, min_batch_size, max_batch_size)
        self._batching_timeout = batching_timeout
        self._batch_queue = None
        if self.batching:
            self._batch_queue = BatchQueue(
                self._run_batch, min_batch_size=self._min_batch_size, max_batch_size=self._max_batch_size,
                timeout_s=batching_timeout,
            )  # fmt: skip
        if return_log_probs is False and not generate:
            raise ValueError("return_log_probs must be True when generate=False (scoring returns log-probs)")
        params, num_samples = normalize_generate_kwargs(generate_kwargs, num_samples)
        if not generate and num_samples is not None:
            raise ValueError("num_samples (or generate_kwargs n) needs generate=True")
        self._kwargs["num_samples"] = num_samples
        if inplace is None:
            inplace = num_samples is None
        if inplace in (True, "empty") and num_samples is not None:
            raise ValueError("inplace must be False (or None) when generating more than one sample")
        self.tokenizer = tokenizer
        self.input_mode = input_mode
        self.generate = generate
        # TorchRL's TransformersWrapper exposes the kwargs under the standard names (its tests read
        # generate_kwargs["max_new_tokens"] after passing max_tokens); generate_params adds the defaults
        self.generate_kwargs = standard_names(generate_kwargs)
        self.generate_params = params
        self.tokenizer_kwargs = dict(tokenizer_kwargs or {})
        self.pad_output = pad_output
        self.num_samples = num_samples
        self.return_log_probs = True if return_log_probs is None else bool(return_log_probs)
        self.return_text = input_mode in ("text", "history") if return_text is None else bool(return_text)
        self.return_tokens = True if return_tokens is None else bool(return_tokens)
        self.return_masks = True if return_masks is None else bool(return_masks)
        self.return_history = input_mode == "history"
        self.score_assistant_only = bool(score_assistant_only)
        self.prefer_tokens = bool(prefer_tokens)
        self.inplace = inplace
        self._device = torch.device(device) if device is not None else None
        self.layout = torch.strided if not pad_output else layout
        self.chat_template_name = chat_template_name
        self.chat_template = chat_template
        self.history_key, self.text_key, self.tokens_key = history_key, text_key, tokens_key
        self.masks_key, self.log_probs_key = masks_key, log_probs_key
        self.attention_mask_key = (
            attention_mask_key if attention_mask_key is not None else (masks_key, "all_attention_mask")
        )
        mode_key = {"history": history_key, "text": text_key, "tokens": tokens_key}[input_mode]
        part = "prompt" if generate else "full"
        self.input_key = input_key if input_key is not None else join_key(mode_key, part)
        # where the other parts (the prompt, when scoring) live: the input key's container
        self._container_key = container_of(self.input_key) if input_key is not None else mode_key
        self.in_keys = [self.input_key]
        self.out_keys = self._make_out_keys()

    # ------------------------------------------------------------------ public API

    @property
    def temperature(self) -> float:
        """Sampling temperature; scoring divides logits by it (1 when greedy)."""
        return float(self.generate_params["temperature"]) or 1.0

    def _engine(self) -> Any:
        """The model / engine client handed to the constructor (shared by twins)."""
        raise NotImplementedError

    def get_new_version(self, **overrides) -> LLMWrapperBase:
        """A twin on the same model with some constructor arguments changed.

        ``get_new_version(generate=False)`` gives the scoring twin of a generator (same
        tokenizer, temperature and keys). Settings tied to generation are dropped when switching
        to scoring unless given again: ``num_samples``, ``inplace`` and ``n`` (and
        ``pad_model_input`` when switching to generation); a changed
        ``input_mode`` or ``generate`` resets an ``input_key`` that was not given again.
        """
        kwargs = dict(self._kwargs, generate_kwargs=dict(self.generate_kwargs))
        if overrides.get("generate") is True and not self.generate and "pad_model_input" in kwargs:
            kwargs["pad_model_input"] = None  # a scoring setting (TransformersWrapper's)
        if overrides.get("generate") is False and self.generate:
            kwargs["num_samples"] = None
            kwargs["inplace"] = None
            for key in ("n", "num_return_sequences"):
                kwargs["generate_kwargs"].pop(key, None)
        if "generate_kwargs" in overrides:
            kwargs["generate_kwargs"] = {**kwargs["generate_kwargs"], **(overrides.pop("generate_kwargs") or {})}
            if {"n", "num_return_sequences"} & set(kwargs["generate_kwargs"]) and "num_samples" not in overrides:
                kwargs["num_samples"] = None
        if ({"input_mode", "generate"} & set(overrides)) and "input_key" not in overrides:
            kwargs["input_key"] = None
        unknown = set(overrides) - set(kwargs)
        if unknown:
            raise ValueError(f"get_new_version: unknown arguments {sorted(unknown)}")
        kwargs.update(overrides)
        return type(self)(self._engine(), **kwargs)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        if self.batching:
            return self._batched_forward(tensordict)
        return self._forward(tensordict)

    # ------------------------------------------------------------------ batching (TorchRL's)

    @property
    def batching(self) -> bool:
        """Whether concurrent calls are batched (``min_batch_size`` or ``max_batch_size`` set)."""
        return self._min_batch_size is not None or self._max_batch_size is not None

    def _batched_forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """The rows of ``tensordict`` through the batch queue; a 0-d input gives a 0-d output."""
        if tensordict.batch_dims > 1:
            raise ValueError(f"Batching not supported for batch_dims > 1: {tensordict.batch_dims}")
        single = tensordict.batch_dims == 0
        rows = [tensordict] if single else list(tensordict.unbind(0))
        if not rows:
            return self._forward(tensordict)
        results = self._batch_queue.submit(rows)
        return results[0] if single else lazy_stack(results)

    def _run_batch(self, rows: list[TensorDictBase]) -> list[TensorDictBase]:
        return list(self._forward(lazy_stack(rows)).unbind(0))

    def cleanup_batching(self, *, flush: bool = False) -> None:
        """Empty the batch queue: waiting callers get a ``CancelledError``, or with ``flush=True``
        the results of running their rows now. Nothing to do without batching."""
        if self._batch_queue is not None:
            self._batch_queue.cleanup(flush=flush)

    def get_batching_state(self) -> dict[str, Any]:
        """TorchRL's view of the batch queue (sizes, ``queue_size``, ``pending_futures``,
        ``lock_state``), or ``{"batching_enabled": False}``."""
        return self._batch_queue.state() if self._batch_queue is not None else {"batching_enabled": False}

    def _forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        if tensordict.ndim == 0:
            # a lazy stack of the one row (TorchRL's): writing into it writes into the row, so that
            # inplace=True updates a 0-d input, and [0] gives that same TensorDict back
            return self._forward(lazy_stack([tensordict]))[0]
        if tensordict.ndim > 1:
            shape = tensordict.shape
            out = self._forward(tensordict.reshape(-1))
            return out.reshape(*shape, *out.shape[1:])
        if self._is_legacy_text(tensordict):
            return self._legacy_text_forward(tensordict)
        rows = self._read_inputs(tensordict)
        if not self.generate and self.score_assistant_only:
            rows.score_from = self._first_assistant_position(tensordict)
        outputs = self._generate_outputs(rows) if self.generate else self._score_outputs(rows)
        if not self.generate and self.return_history:
            outputs[self.history_key] = self._scored_history(tensordict)
        if self._device is not None:
            outputs = {key: value.to(self._device) for key, value in outputs.items()}
        return self._write(tensordict, outputs)

    # ------------------------------------------------------------------ TorchRL 0.9's text layout

    def _is_legacy_text(self, td: TensorDictBase) -> bool:
        """A generating wrapper built without ``input_mode``, given what TorchRL 0.9's text envs
        hold (``LLMEnv(from_text=True)``: bare strings under ``"text"``, no history)."""
        if not (self._reads_legacy_text and self.generate) or has_entry(td, self.history_key):
            return False
        return has_entry(td, "text") and not isinstance(peek(td, "text"), Text)

    def _legacy_text_forward(self, td: TensorDictBase) -> TensorDictBase:
        """Generate from the strings under ``"text"`` and write TorchRL 0.9's flat outputs into
        ``td``: ``text_response`` (strings), ``tokens_response`` (padded ids) and, with
        log-probs, ``log_probs`` (the response's, padded with 0): the keys the legacy envs read
        their action from. Used by TorchRL's LLMCollector example, ``vLLMWrapper(llm)`` over
        ``LLMEnv.from_dataloader(from_text=True)``, which predates the input modes."""
        if getattr(self, "_legacy_twin", None) is None:
            self._legacy_twin = self.get_new_version(input_mode="text", inplace=False)
        prompts = td.get("text")
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        text = Text(prompt=prompts, batch_size=td.batch_size)
        out = self._legacy_twin(TensorDict(text=text, batch_size=td.batch_size))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        td.set("text_response", out.get((self.text_key, "response")))
        td.set("tokens_response", out.get((self.tokens_key, "response"), as_padded_tensor=True, padding_value=pad))
        if self.return_log_probs:
            td.set("log_probs", out.get((self.log_probs_key, "response"), as_padded_tensor=True, padding_value=0.0))
        return td

    # ------------------------------------------------------------------ backend hooks

    def _generate_ids(self, prompt_ids: list[list[int]], num_samples: int) -> list[list[Completion]]:
        raise NotImplementedError

    def _score_ids(self, full_ids: list[list[int]], score_from: int = 0) -> list[torch.Tensor]:
        raise NotImplementedError

    # ------------------------------------------------------------------ keys

    def _make_out_keys(self) -> list[NestedKey]:
        flags = [
            (self.return_text, self.text_key),
            (self.return_masks, self.masks_key),
            (self.return_tokens, self.tokens_key),
            (self.return_log_probs, self.log_probs_key),
            (self.return_history, self.history_key),
        ]
        return [key for wanted, key in flags if wanted]

    # ------------------------------------------------------------------ reading inputs

    @property
    def _main_part(self) -> str:
        return "prompt" if self.generate else "full"

    def _read_inputs(self, td: TensorDictBase) -> _Rows:
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

    def _read_history(self, td: TensorDictBase) -> _Rows:
        key = self._main_key(td, ChatHistory)
        if key is None:
            raise ValueError(self._missing(td))
        main = as_conversations(td.get(key), key, td.batch_dims)
        rows = _Rows()
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

    def _read_text(self, td: TensorDictBase) -> _Rows:
        key = self._main_key(td, Text)
        main = strings(td.get(key)) if key is not None else None
        if main is None:
            raise ValueError(self._missing(td))
        rows = _Rows()
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

    def _read_tokens(self, td: TensorDictBase) -> _Rows:
        key = self._main_key(td, Tokens)
        if key is None:
            raise ValueError(self._missing(td))
        main = self._token_rows(td, key, is_prompt=self.generate)
        rows = _Rows()
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

    # ------------------------------------------------------------------ outputs

    def _generate_outputs(self, rows: _Rows) -> dict[NestedKey, Any]:
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

    def _score_outputs(self, rows: _Rows) -> dict[NestedKey, Any]:
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
        """prompt / response / full Histories; the response is parsed from the decoded tokens.

        The decoded response is parsed together with the rendered prompt (ChatML), so a response
        that ends without EOS becomes an assistant message with ``is_complete=False``.
        """
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
        """TorchRL's ``inplace``: True writes into ``td``; "empty" into ``td.empty()`` (type and
        batch size kept); False into a new TensorDict, of batch ``[B, num_samples]`` with samples.
        Either of the last two holds the outputs only (the input's other entries are not copied)."""
        if self.inplace is True:
            result = td
        elif self.inplace == "empty":
            result = td.empty()
        else:
            result = TensorDict(batch_size=self._batch_shape(td.shape[0] * (self.num_samples or 1)))
        for key, value in outputs.items():
            result.set(key, value)
        return result


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
