"""TransformersWrapper: the LLM policy interface on a Hugging Face causal LM (the learner's view).

Generation (``model.generate`` on left-padded prompts) returns the *processed* log-probs of the
sampled tokens (after temperature / top-p / top-k), as vLLM's ``logprobs_mode="processed_logprobs"``.

Scoring is ``log_softmax(logits / T)`` in float32 (float64 for a float64 model; returned as
float32) at the next token, ``T`` the wrapper's temperature (1 when greedy), under the caller's
grad mode. Top-p / top-k are not applied when scoring (as in TorchRL and TRL), so scores equal
sampling log-probs only when those are off.

Chunked scoring (rlpost's): for a model whose logits are exactly its LM head over the final
norm's output (Llama, Mistral, Qwen2/3, Phi-3; plain ``nn.Linear`` head, tied or not, LoRA and
FSDP2 included), log-probs (and :meth:`~TransformersWrapper.log_probs_and_entropy`'s exact
entropies) come through :func:`rlpost.algo.chunked.chunked_token_logprobs`: the ``[tokens,
vocab]`` logits are never held whole, forward or backward. The hidden states are read by a hook
on the final norm during the model's own forward, so a sharded model gathers its weights as
always. Values and gradients equal the dense path's, which other models and ``get_dist`` use.

Sequence packing (rlpost's, on the chunked path): rows are laid end to end in bins as wide as the
longest row (:func:`rlpost.algo.packing.pack_lengths`), with position ids from 0 per row
(transformers builds the block mask from them without an attention mask; SDPA, eager, flash and
flex support it), so skewed lengths cost far fewer tokens. Outputs are the padded path's.
TorchRL's ``pad_model_input`` is the same choice from the other side; TorchRL packs on every
model, rlpost where the chunked path runs (elsewhere padded: same values, other cost).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch

from rlpost.algo.chunked import chunked_logprobs_and_entropy, chunked_token_logprobs, softmax_dtype
from rlpost.algo.packing import pack_lengths
from rlpost.policies.base import Completion, LLMWrapperBase

_STANDARD = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")
# TorchRL's common names that need another name (or nothing) in ``model.generate``.
_HF_NAMES = {"stop_sequences": "stop_strings", "logprobs": None, "skip_special_tokens": None}


class TransformersWrapper(LLMWrapperBase):
    """LLM wrapper around a ``transformers`` causal LM; see :class:`LLMWrapperBase` for the
    keyword arguments, inputs and outputs.

    Args:
        model: a ``PreTrainedModel`` (or a path, loaded with ``AutoModelForCausalLM`` in fp32).
        tokenizer: its tokenizer (or a path). Omitted: TorchRL's fallback, from the model's path
            or ``name_or_path``, else its ``get_tokenizer()`` (ValueError when none gives one).
        chunked_scoring: score through the LM head in chunks where the model allows it.
        score_chunk_tokens: tokens per chunk (None: as many as make 64 MB of float32 logits).
        pack_sequences: pack rows on the chunked path where the attention implementation
            supports it. None (default): pack, unless ``pad_model_input=True``.
        pad_model_input: TorchRL's name for the inverse choice, scoring only (a ValueError with
            ``generate=True``, as in TorchRL). ``self.pad_model_input`` reads back whether the
            model's input is padded (generation always pads).
    """

    def __init__(self, model, *, tokenizer=None, chunked_scoring: bool = True, score_chunk_tokens: int | None = None,
                 pack_sequences: bool | None = None, pad_model_input: bool | None = None, **kwargs):  # fmt: skip
        if score_chunk_tokens is not None and score_chunk_tokens < 1:
            raise ValueError(f"score_chunk_tokens must be >= 1, got {score_chunk_tokens}")
        if pad_model_input is not None and kwargs.get("generate", True):
            raise ValueError("pad_model_input is not supported when generate=True.")
        if pad_model_input is not None and pack_sequences is not None and pack_sequences == pad_model_input:
            raise ValueError(f"pack_sequences={pack_sequences} contradicts pad_model_input={pad_model_input}")
        self.chunked_scoring, self.score_chunk_tokens = chunked_scoring, score_chunk_tokens
        self.pack_sequences = (not pad_model_input) if pack_sequences is None else bool(pack_sequences)
        if isinstance(model, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
        if tokenizer is None:
            tokenizer = model_tokenizer(model)
        if isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        super().__init__(tokenizer=tokenizer, **kwargs)
        self._kwargs.update(  # for get_new_version
            chunked_scoring=chunked_scoring, score_chunk_tokens=score_chunk_tokens, pack_sequences=pack_sequences,
            pad_model_input=pad_model_input,
        )  # fmt: skip
        self.model = model

    @property
    def pad_model_input(self) -> bool:
        """Whether the model reads padded rows (TorchRL's flag): always when generating; when
        scoring, unless the rows are packed (:attr:`packs_sequences`)."""
        return self.generate or not self.packs_sequences

    def _engine(self):
        return self.model

    def _eos_ids(self) -> set[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}

    @torch.no_grad()
    def _generate_ids(self, prompt_ids: list[list[int]], num_samples: int) -> list[list[Completion]]:
        params = self.generate_params
        device = next(self.model.parameters()).device
        pad_id = self._pad_id()
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for i, ids in enumerate(prompt_ids):
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            attention[i, width - len(ids) :] = 1
        greedy = params["temperature"] == 0
        sampling = {} if greedy else {k: params[k] for k in ("temperature", "top_p", "top_k")}
        extra = {_HF_NAMES.get(k, k): v for k, v in params.items() if k not in _STANDARD and _HF_NAMES.get(k, k)}
        if "stop_strings" in extra:
            extra["tokenizer"] = self.tokenizer
        eos = sorted(self._eos_ids())
        with torch.random.fork_rng(devices=[]):
            if params["seed"] is not None:
                torch.manual_seed(params["seed"])
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                do_sample=not greedy,
                max_new_tokens=params["max_new_tokens"],
                num_return_sequences=num_samples,
                output_scores=self.return_log_probs,
                return_dict_in_generate=True,
                pad_token_id=pad_id,
                eos_token_id=eos,
                **sampling,
                **extra,
            )
        new_tokens = out.sequences[:, width:].cpu()
        logprobs = _sampled_logprobs(out.scores, new_tokens) if self.return_log_probs else None
        completions = [
            self._cut(new_tokens[i], None if logprobs is None else logprobs[i]) for i in range(len(new_tokens))
        ]
        return [completions[i * num_samples : (i + 1) * num_samples] for i in range(len(prompt_ids))]

    def _cut(self, tokens: torch.Tensor, logprobs: torch.Tensor | None) -> Completion:
        """Keep the tokens up to and including the first EOS: later ones are padding, which has
        the EOS id when pad == EOS (the first EOS is real and keeps its log-prob)."""
        ids = tokens.tolist()
        eos = self._eos_ids()
        end = next((t + 1 for t, tok in enumerate(ids) if tok in eos), None)
        length = len(ids) if end is None else end
        return Completion(
            token_ids=ids[:length],
            logprobs=None if logprobs is None else logprobs[:length].tolist(),
            finished=end is not None,
        )

    @property
    def scores_in_chunks(self) -> bool:
        """Whether scoring takes the chunked path (on, and a plain linear head over the final norm)."""
        return self.chunked_scoring and plain_head(self.model) is not None

    @property
    def packs_sequences(self) -> bool:
        """Whether scoring packs the rows (chunked path, packing on, attention keeps rows apart)."""
        config = getattr(_inner(self.model), "config", None)
        implementation = getattr(config, "_attn_implementation", None)
        return self.pack_sequences and self.scores_in_chunks and implementation in _PACKING_ATTENTION

    def _score_ids(self, full_ids: list[list[int]], score_from: int = 0) -> list[torch.Tensor]:
        start = max(score_from - 1, 0)  # the logits at start.. predict tokens start+1..
        if self.scores_in_chunks:
            return self._score_ids_chunked(full_ids, start)[0]
        logits, input_ids = self._forward_logits(full_ids, keep_from=start)
        logits = logits[:, :-1]
        logprobs = torch.log_softmax(logits.to(softmax_dtype(logits.dtype)) / self.temperature, dim=-1)
        next_lp = logprobs.gather(-1, input_ids[:, start + 1 :, None]).squeeze(-1).float()
        next_lp = torch.cat([next_lp.new_zeros((len(full_ids), start + 1)), next_lp], dim=1).cpu()
        return [next_lp[i, : len(ids)] for i, ids in enumerate(full_ids)]

    def log_probs_and_entropy(self, full_ids: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per row, each token's log-prob and the entropy of its whole next-token distribution
        (float32, ``len(row)``, 0 at position 0) at the wrapper's temperature, under the caller's
        grad mode (rlpost's: the exact entropy bonus of a loss)."""
        if self.scores_in_chunks:
            return self._score_ids_chunked(full_ids, 0, with_entropy=True)
        logits, input_ids = self._forward_logits(full_ids)
        logp = torch.log_softmax(logits[:, :-1].to(softmax_dtype(logits.dtype)) / self.temperature, dim=-1)
        next_lp = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(dim=-1)
        pad = torch.nn.functional.pad
        next_lp, entropy = pad(next_lp.float(), (1, 0)).cpu(), pad(entropy.float(), (1, 0)).cpu()
        return (
            [next_lp[i, : len(ids)] for i, ids in enumerate(full_ids)],
            [entropy[i, : len(ids)] for i, ids in enumerate(full_ids)],
        )

    def _score_ids_chunked(
        self, full_ids: list[list[int]], start: int, with_entropy: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Log-probs (and entropies) per row from the final hidden states through the LM head in
        chunks, positions ``start + 1`` on (0 before); rows packed or padded."""
        norm, head = plain_head(self.model)
        layout = self._packed_inputs(full_ids) if self.packs_sequences else self._padded_layout(full_ids)
        hidden = final_hidden_states(self.model, norm, layout.model_inputs())
        weight, bias = head.weight, head.bias  # read after the forward: a sharded model's are whole now
        if _is_sharded(weight):
            raise RuntimeError(
                "chunked scoring: the LM head's weight is still sharded after the model's forward; "
                "build the wrapper with chunked_scoring=False for this model"
            )
        # the hidden state at position p of a row predicts its token p + 1: positions start ..
        # len - 2 of each row, at (slot, offset + p) of the laid-out batch
        width = layout.input_ids.shape[1]
        counts = [max(len(ids) - 1 - start, 0) for ids in full_ids]
        flat = torch.cat([
            torch.arange(start, start + n) + slot * width + offset
            for n, slot, offset in zip(counts, layout.slots, layout.offsets)
        ]).to(hidden.device)  # fmt: skip
        scores = (chunked_logprobs_and_entropy if with_entropy else chunked_token_logprobs)(
            hidden.reshape(-1, hidden.shape[-1])[flat], weight, bias, layout.input_ids.reshape(-1)[flat + 1],
            temperature=self.temperature, chunk_tokens=self.score_chunk_tokens,
        )  # fmt: skip
        parts = scores if with_entropy else (scores,)
        rows = [_per_row(part.float(), counts, start, full_ids) for part in parts]
        return rows[0], (rows[1] if with_entropy else None)

    def _padded_layout(self, full_ids: list[list[int]]) -> _Layout:
        input_ids, attention = self._padded_inputs(full_ids)
        rows = range(len(full_ids))
        return _Layout(input_ids, attention_mask=attention, slots=list(rows), offsets=[0] * len(full_ids))

    def _packed_inputs(self, full_ids: list[list[int]]) -> _Layout:
        """The rows packed end to end in bins as wide as the longest row; each bin's free tail
        is padding with position ids of its own (a segment nothing reads)."""
        device = next(self.model.parameters()).device
        bins = pack_lengths([len(ids) for ids in full_ids])
        width = max(len(ids) for ids in full_ids)
        input_ids = torch.full((len(bins), width), self._pad_id(), dtype=torch.long)
        positions = torch.zeros((len(bins), width), dtype=torch.long)
        slots, offsets = [0] * len(full_ids), [0] * len(full_ids)
        for b, members in enumerate(bins):
            at = 0
            for i in members:
                n = len(full_ids[i])
                input_ids[b, at : at + n] = torch.tensor(full_ids[i])
                positions[b, at : at + n] = torch.arange(n)
                slots[i], offsets[i], at = b, at, at + n
            positions[b, at:] = torch.arange(width - at)
        return _Layout(input_ids.to(device), position_ids=positions.to(device), slots=slots, offsets=offsets)

    def _full_logits(self, tensordict) -> tuple[torch.Tensor, torch.Tensor]:
        """Tempered logits ``[B, T, V]`` with ``logits[:, t]`` predicting token ``t`` (row 0 holds
        zeros: no context), and the mask of real, predicted positions (for ``get_dist``)."""
        full_ids = self._read_inputs(tensordict).full_ids
        logits, _ = self._forward_logits(full_ids)
        shifted = torch.cat([torch.zeros_like(logits[:, :1]), logits[:, :-1]], dim=1)
        shifted = shifted.to(softmax_dtype(shifted.dtype)) / self.temperature  # float64 stays float64
        mask = torch.zeros(shifted.shape[:2], dtype=torch.bool)
        for i, ids in enumerate(full_ids):
            mask[i, 1 : len(ids)] = True
        return shifted, mask.to(shifted.device)

    def _forward_logits(self, full_ids: list[list[int]], keep_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward pass over right-padded rows: ``(logits [B, T - keep_from, V], input_ids
        [B, T])``, the logits of positions ``keep_from`` to ``T - 1`` (the LM head skips the
        others where the model takes ``logits_to_keep``)."""
        input_ids, attention = self._padded_inputs(full_ids)
        width = input_ids.shape[1]
        keep = {}
        if keep_from > 0 and _takes_logits_to_keep(self.model):
            keep["logits_to_keep"] = width - keep_from  # the last width - keep_from positions
        logits = self.model(input_ids=input_ids, attention_mask=attention, **keep).logits
        return logits[:, keep_from - width + logits.shape[1] :], input_ids

    def _padded_inputs(self, full_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask)`` ``[B, T]`` of right-padded rows on the model's device."""
        device = next(self.model.parameters()).device
        width = max(len(ids) for ids in full_ids)
        input_ids = torch.full((len(full_ids), width), self._pad_id(), dtype=torch.long)
        attention = torch.zeros((len(full_ids), width), dtype=torch.long)
        for i, ids in enumerate(full_ids):
            # right padding keeps position ids 0..len-1 without passing them explicitly
            input_ids[i, : len(ids)] = torch.tensor(ids)
            attention[i, : len(ids)] = 1
        return input_ids.to(device), attention.to(device)


# model types whose logits are exactly lm_head(final norm's output): no soft-capping or scaling
_PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3"})
# attention implementations that keep packed rows apart, given position ids and no attention mask
_PACKING_ATTENTION = frozenset({"sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"})


@dataclass
class _Layout:
    """A batch of rows as the model reads it: row ``i`` sits at ``input_ids[slots[i],
    offsets[i] : offsets[i] + len]``; padded (an attention mask) or packed (position ids)."""

    input_ids: torch.Tensor
    slots: list[int]
    offsets: list[int]
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None

    def model_inputs(self) -> dict[str, torch.Tensor]:
        inputs = {"input_ids": self.input_ids}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        return inputs


def _inner(model):
    """The transformers model (inside a peft wrapper too)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def plain_head(model) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """``(final norm, lm_head)`` when the model's logits are ``lm_head(final norm's output)``
    with a plain linear head; None otherwise (score densely)."""
    inner = _inner(model)
    if getattr(getattr(inner, "config", None), "model_type", None) not in _PLAIN_HEAD_MODEL_TYPES:
        return None
    head = inner.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return None  # e.g. an adapter on the head
    norm = getattr(inner.get_decoder(), "norm", None) if hasattr(inner, "get_decoder") else None
    return None if norm is None else (norm, head)


def final_hidden_states(model, norm: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The final norm's output ``[B, T, H]`` (with its graph), read by a hook during the model's
    own forward, which computes one position's logits only: FSDP2 gathers the root's weights
    (embedding, norm, head) in that forward and keeps them until the backward."""
    captured = []
    handle = norm.register_forward_hook(lambda _module, _args, output: captured.append(output))
    try:
        model(**inputs, logits_to_keep=1, use_cache=False)
    finally:
        handle.remove()
    return captured[-1]


def _is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _per_row(values: torch.Tensor, counts: list[int], start: int, full_ids: list[list[int]]) -> list[torch.Tensor]:
    """``values`` (each row's ``counts[i]`` predictions, rows in order) back to one tensor per
    row of ``len(row)``, zeros at positions 0 .. start, on the CPU."""
    values = values.cpu()
    pieces = torch.split(values, counts)
    return [torch.cat([values.new_zeros(len(ids) - n), piece]) for ids, n, piece in zip(full_ids, counts, pieces)]


def _takes_logits_to_keep(model) -> bool:
    """Whether the transformers model (inside a peft wrapper too) takes ``logits_to_keep``."""
    return "logits_to_keep" in inspect.signature(_inner(model).forward).parameters


def _name_or_path(model) -> str | None:
    """Where a Hugging Face model was loaded from (its tokenizer usually lives there too)."""
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return name or None


def model_tokenizer(model):
    """The tokenizer of a model given without one: loaded from its ``name_or_path``, else its
    ``get_tokenizer()``; a ValueError naming what was tried when neither gives one."""
    name = _name_or_path(model)
    if name is not None:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"TransformersWrapper: no tokenizer given, and none could be loaded from the model's "
                f"name_or_path {name!r} ({type(err).__name__}: {err}); pass tokenizer=..."
            ) from err
    if callable(getattr(model, "get_tokenizer", None)):
        return model.get_tokenizer()
    raise ValueError(
        "TransformersWrapper: no tokenizer given, and the model has neither a name_or_path to load one from "
        "nor a get_tokenizer(); pass tokenizer=AutoTokenizer.from_pretrained(...)"
    )


def _sampled_logprobs(scores: tuple[torch.Tensor, ...], tokens: torch.Tensor) -> torch.Tensor:
    """[N, T] log-probs of ``tokens`` under the processed per-step scores (float32)."""
    steps = [
        torch.log_softmax(step.float(), dim=-1).gather(-1, tokens[:, t, None].to(step.device)).squeeze(-1).cpu()
        for t, step in enumerate(scores)
    ]
    return torch.stack(steps, dim=1) if steps else torch.zeros(tokens.shape, dtype=torch.float32)
