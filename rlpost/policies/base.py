"""LLMWrapperBase: the one interface every LLM policy in rlpost has (TorchRL's ``LLMWrapperBase``).

A wrapper reads a TensorDict of prompts (or full sequences) and writes the containers of
:mod:`rlpost.data.llm_data`::

    input_mode="history": ("history", "prompt") History [B, n]   -> ChatHistory under "history"
    input_mode="text":    ("text", "prompt") strings            -> Text under "text"
    input_mode="tokens":  ("tokens", "prompt") token ids        -> Tokens under "tokens"
    + "text" (Text), "masks" (Masks), "tokens" (Tokens), "log_probs" (LogProbs) as asked for.

``generate=True`` samples completions (batch ``[B]``, or ``[B, num_samples]``) with the engine's
log-probs; ``generate=False`` scores full sequences: ``log_probs.full[t] = log p(full[t] |
full[:t])`` at the wrapper's temperature, so ``get_new_version(generate=False)`` reproduces the
generator's log-probs. A backend implements two methods on token-id lists:

- ``_generate_ids(prompt_ids, num_samples) -> list[list[Completion]]``
- ``_score_ids(full_ids, score_from) -> list[Tensor]`` (float32, length ``len(ids)``, 0 at
  position 0; positions before ``score_from`` may be left at 0)

Trap: the engine's token ids are used as they are; generated text is decoded but never
re-tokenised (a decode/encode round trip changes ids, and the log-probs belong to the engine's).

TorchRL's behaviour kept: key semantics, output flags from the mode, ``max_tokens`` over
``max_new_tokens`` and ``n`` over ``num_return_sequences``, ``inplace``, 0-d and N-d batches,
exception types and messages. Deliberate deviations: ``return_text`` / ``return_tokens`` /
``return_masks`` can turn outputs off; text inputs are tokenised with ``add_special_tokens=False``
(chat-rendered text carries its own markers); dense ids without a mask at ``attention_mask_key``
are read as they are (TorchRL drops every id equal to the pad id, which with pad == EOS drops
real EOS tokens; a container flagged ``padded`` needs its mask); every row has prompt, response
and full where TorchRL leaves fields None; in generate mode prompt positions are not scored
(``log_probs.prompt`` None, ``log_probs.full`` 0 there) and ``masks.all_assistant_mask`` covers
this call's response only (earlier assistant turns have no behaviour log-prob; scoring a
history gives the template's full mask).

The one producer of :mod:`rlpost.data.llm_data`'s layout for every backend, with
:mod:`~rlpost.policies.wrapper_inputs`, :mod:`~rlpost.policies.wrapper_outputs`,
:mod:`~rlpost.policies.generation` and :mod:`~rlpost.policies.inputs`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase, lazy_stack

from rlpost.data.llm_data import Text
from rlpost.policies.batching import BatchQueue, batch_size_bounds
from rlpost.policies.categorical import CategoricalSequential
from rlpost.policies.generation import Completion, normalize_generate_kwargs, standard_names
from rlpost.policies.inputs import container_of, has_entry, join_key, peek
from rlpost.policies.wrapper_inputs import InputReader, decode_rows
from rlpost.policies.wrapper_outputs import OutputWriter

__all__ = ["INPUT_MODES", "Completion", "LLMWrapperBase", "decode_rows"]

INPUT_MODES = ("history", "text", "tokens")


class LLMWrapperBase(InputReader, OutputWriter, CategoricalSequential):
    """Common constructor, validation, input reading and output layout of the LLM wrappers.

    Keyword Args:
        tokenizer: a transformers tokenizer (needed for history and text modes and to decode);
            each backend finds the model's own when it is omitted.
        input_mode: "history", "text" or "tokens".
        input_key: defaults to ``(mode, "prompt")`` when generating, ``(mode, "full")`` when
            scoring; a bare value (History, strings, ids) at the mode's key is read as the input.
        attention_mask_key: where a dense padded token input finds its mask (pad == EOS makes
            it impossible to infer from ids).
        generate_kwargs: see :func:`normalize_generate_kwargs`; kept as ``self.generate_kwargs``
            under the standard names (``max_tokens`` read back as ``max_new_tokens``, ``n`` as
            ``num_return_sequences``) as TorchRL's TransformersWrapper does;
            ``self.generate_params`` adds the defaults.
        tokenizer_kwargs: for tokenizing text inputs (the wrapper decides padding).
        pad_output: dense padded tensors, or lazy stacks of per-row tensors.
        inplace: True writes into the input (default without ``num_samples``); False returns
            the outputs only; ``"empty"`` returns ``input.empty()`` holding them.
        num_samples: completions per prompt; adds a trailing batch dim.
        device: where outputs are moved (None: left on the CPU). chat_template_name /
            chat_template: a named template / a Jinja template instead of the tokenizer's.
        return_log_probs: required when scoring. return_text, return_tokens, return_masks:
            default as TorchRL decides from the mode; off saves work for log-probs-only callers.
        score_assistant_only: rlpost's addition: when scoring, a backend may skip every
            position before the first assistant token of any row (log-probs 0 there; an input
            without ``masks.all_assistant_mask`` is scored whole). TransformersWrapper then
            applies its LM head from there on (``logits_to_keep``, as TRL scores the completion
            only): most of a prompt's scoring cost on a large vocabulary. Default as TorchRL.
        batching, min_batch_size, max_batch_size, batching_timeout: TorchRL's batching of
            concurrent calls (:mod:`rlpost.policies.batching`). ``batching=True`` alone means
            ``min_batch_size=1``: the first caller runs at once, later arrivals together next. A
            batch waits at most ``batching_timeout`` s; inputs of >1 batch dim are refused.
        prefer_tokens: TorchRL's token-first generation: in "history" mode, prompt ids already
            at ``(tokens_key, "prompt")`` (else ``"full"``), as ChatEnv's ``with_tokenizer``
            keeps them, are generated from as they are (the ids a KV cache holds) instead of
            re-rendering the history; the prompt text is decoded from them.

    ``out_keys``, in TorchRL's order: text, masks, tokens, log_probs, history (those returned;
    history in "history" mode, also when scoring).
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

        Switching to scoring drops ``num_samples``, ``inplace`` and ``n`` unless given again (to
        generation: ``pad_model_input``); a changed ``input_mode`` or ``generate`` resets an
        ``input_key`` not given again.
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
        """Generate from the strings under ``"text"`` and write TorchRL 0.9's flat outputs
        (``text_response``, padded ``tokens_response`` and ``log_probs``): what the legacy envs
        read (TorchRL's LLMCollector example, ``vLLMWrapper(llm)`` over ``LLMEnv.from_dataloader``)."""
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
