"""TransformersWrapper: the LLM policy interface on a Hugging Face causal LM (the learner's view).

Generation uses ``model.generate`` on left-padded prompts and returns the *processed*
log-probs of the sampled tokens (``log_softmax`` of the scores after temperature / top-p /
top-k), i.e. the same quantity vLLM returns with ``logprobs_mode="processed_logprobs"``.

Scoring (``generate=False``) is one forward pass over right-padded full sequences:
``log_softmax(logits / T)`` in float32 (float64 for a float64 model; returned as float32),
gathered at the next token, where ``T`` is the wrapper's temperature (1 when greedy). Top-p /
top-k are not applied when scoring (as in TorchRL and TRL), so scores equal sampling log-probs
only when those are off. Scoring runs under the caller's grad mode: a loss can backpropagate
through ``log_probs``.

Chunked scoring (rlpost's; ``chunked_scoring=True`` by default): for a model whose logits are
exactly its LM head applied to the decoder's last hidden state (the Llama, Mistral, Qwen2/3 and
Phi-3 families, a plain ``nn.Linear`` head, tied or not, LoRA adapters included), the log-probs
come from the hidden states through :func:`rlpost.algo.chunked.chunked_token_logprobs`: the
``[tokens, vocabulary]`` logits are never held whole, in forward or backward, only
``score_chunk_tokens`` tokens' worth at a time. Values and gradients equal the dense path's.
Other models, and models sharded by FSDP2, are scored the dense way; so is ``get_dist``, which
needs every logit.
"""

from __future__ import annotations

import inspect

import torch

from rlpost.algo.chunked import chunked_token_logprobs, softmax_dtype
from rlpost.policies.base import Completion, LLMWrapperBase

_STANDARD = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")
# TorchRL's common names that need another name (or nothing) in ``model.generate``.
_HF_NAMES = {"stop_sequences": "stop_strings", "logprobs": None, "skip_special_tokens": None}


class TransformersWrapper(LLMWrapperBase):
    """LLM wrapper around a ``transformers`` causal LM; see :class:`LLMWrapperBase` for the
    keyword arguments, inputs and outputs.

    Args:
        model: a ``PreTrainedModel`` (or a path, loaded with ``AutoModelForCausalLM`` in fp32).
        tokenizer: its tokenizer (or a path); loaded from the model's ``name_or_path`` when
            omitted.
        chunked_scoring: score through the LM head in chunks where the model allows it (module
            docstring; rlpost's). False: always the dense path.
        score_chunk_tokens: tokens per chunk (None: as many as make 64 MB of float32 logits).
    """

    def __init__(self, model, *, tokenizer=None, chunked_scoring: bool = True, score_chunk_tokens: int | None = None,
                 **kwargs):  # fmt: skip
        if score_chunk_tokens is not None and score_chunk_tokens < 1:
            raise ValueError(f"score_chunk_tokens must be >= 1, got {score_chunk_tokens}")
        self.chunked_scoring, self.score_chunk_tokens = chunked_scoring, score_chunk_tokens
        if isinstance(model, str):
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        if tokenizer is None:
            tokenizer = _name_or_path(model)
            if tokenizer is None:
                raise ValueError(
                    "TransformersWrapper: no tokenizer given and the model has no name_or_path to load one "
                    "from; pass tokenizer=AutoTokenizer.from_pretrained(...)"
                )
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        super().__init__(tokenizer=tokenizer, **kwargs)
        self._kwargs.update(chunked_scoring=chunked_scoring, score_chunk_tokens=score_chunk_tokens)  # get_new_version
        self.model = model

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
        """Whether scoring takes the chunked path through the LM head (rlpost's): chunked
        scoring is on and the model's logits are a plain linear head over its decoder."""
        return self.chunked_scoring and _plain_head(self.model) is not None

    def _score_ids(self, full_ids: list[list[int]], score_from: int = 0) -> list[torch.Tensor]:
        start = max(score_from - 1, 0)  # the logits at start.. predict tokens start+1..
        head = _plain_head(self.model) if self.chunked_scoring else None
        if head is not None:
            return self._score_ids_chunked(full_ids, start, *head)
        logits, input_ids = self._forward_logits(full_ids, keep_from=start)
        logits = logits[:, :-1]
        logprobs = torch.log_softmax(logits.to(softmax_dtype(logits.dtype)) / self.temperature, dim=-1)
        next_lp = logprobs.gather(-1, input_ids[:, start + 1 :, None]).squeeze(-1).float()
        next_lp = torch.cat([next_lp.new_zeros((len(full_ids), start + 1)), next_lp], dim=1).cpu()
        return [next_lp[i, : len(ids)] for i, ids in enumerate(full_ids)]

    def _score_ids_chunked(self, full_ids: list[list[int]], start: int, decoder, head) -> list[torch.Tensor]:
        """:meth:`_score_ids` from the decoder's hidden states through ``head`` in chunks."""
        input_ids, attention = self._padded_inputs(full_ids)
        hidden = decoder(input_ids=input_ids, attention_mask=attention).last_hidden_state
        lengths = torch.tensor([len(ids) for ids in full_ids], device=input_ids.device)
        # hidden state p predicts token p + 1: positions start .. len - 2 of each row
        positions = torch.arange(input_ids.shape[1] - 1, device=input_ids.device)[None, :]
        predicting = (positions >= start) & (positions < lengths[:, None] - 1)
        logprobs = chunked_token_logprobs(
            hidden[:, :-1][predicting], head.weight, head.bias, input_ids[:, 1:][predicting],
            temperature=self.temperature, chunk_tokens=self.score_chunk_tokens,
        ).float()  # fmt: skip
        next_lp = torch.zeros(input_ids.shape, dtype=torch.float32, device=logprobs.device)
        next_lp = next_lp.index_put((torch.nn.functional.pad(predicting, (1, 0)),), logprobs).cpu()
        return [next_lp[i, : len(ids)] for i, ids in enumerate(full_ids)]

    def _full_logits(self, tensordict) -> tuple[torch.Tensor, torch.Tensor]:
        """Tempered logits ``[B, T, V]`` with ``logits[:, t]`` predicting token ``t`` (row 0 holds
        zeros: no context), and the mask of real, predicted positions (for ``get_dist``)."""
        full_ids = self._read_inputs(tensordict).full_ids
        logits, _ = self._forward_logits(full_ids)
        shifted = torch.cat([torch.zeros_like(logits[:, :1]), logits[:, :-1]], dim=1).float() / self.temperature
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


# model types whose logits are exactly lm_head(last hidden state): no soft-capping or scaling
_PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3"})


def _plain_head(model) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """``(decoder, lm_head)`` when the model's logits are ``lm_head(decoder(...).last_hidden_state)``
    with a plain linear head on whole (unsharded) weights; None otherwise (score densely)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(getattr(inner, "config", None), "model_type", None) not in _PLAIN_HEAD_MODEL_TYPES:
        return None
    head = inner.get_output_embeddings()
    if type(head) is not torch.nn.Linear or type(head.weight) is not torch.nn.Parameter:
        return None  # an adapter on the head, or a sharded (DTensor) weight
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else None
    if decoder is None or hasattr(inner, "unshard"):  # FSDP2-managed: its root forward gathers the weights
        return None
    return decoder, head


def _takes_logits_to_keep(model) -> bool:
    """Whether the transformers model (inside a peft wrapper too) takes ``logits_to_keep``."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(inner.forward).parameters


def _name_or_path(model) -> str | None:
    """Where a Hugging Face model was loaded from (its tokenizer usually lives there too)."""
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return name or None


def _sampled_logprobs(scores: tuple[torch.Tensor, ...], tokens: torch.Tensor) -> torch.Tensor:
    """[N, T] log-probs of ``tokens`` under the processed per-step scores (float32)."""
    steps = [
        torch.log_softmax(step.float(), dim=-1).gather(-1, tokens[:, t, None].to(step.device)).squeeze(-1).cpu()
        for t, step in enumerate(scores)
    ]
    return torch.stack(steps, dim=1) if steps else torch.zeros(tokens.shape, dtype=torch.float32)
