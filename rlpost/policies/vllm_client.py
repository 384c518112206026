"""The engine client of :class:`~rlpost.policies.vllm_wrapper.vLLMWrapper`: its interface
(:class:`VLLMEngineClient`), its in-process implementation on a ``vllm.LLM``
(:class:`LocalVLLMClient`) and the log-prob arithmetic they share with the wrapper."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

import torch

from rlpost.policies.generation import Completion
from rlpost.policies.vllm_engine import shutdown_vllm_engine

log = logging.getLogger("rlpost")


class VLLMEngineClient(Protocol):
    """What :class:`vLLMWrapper` needs from an engine; arguments and results are plain data."""

    def generate(self, prompt_token_ids: list[list[int]], sampling: dict[str, Any]) -> list[list[Completion]]:
        """``sampling``: vLLM ``SamplingParams`` fields (``n``, ``max_tokens``, ``temperature``,
        ``top_p``, ``top_k``, ``seed``, ``logprobs`` as a bool, extras). One list of ``n``
        completions per prompt, in prompt order."""
        ...

    def score(self, token_ids: list[list[int]], *, temperature: float) -> list[list[float]]:
        """Per sequence, ``log p(ids[t] | ids[:t])`` at ``temperature`` for every ``t``, with 0.0
        at ``t = 0``."""
        ...


class LocalVLLMClient:
    """:class:`VLLMEngineClient` on an in-process ``vllm.LLM``.

    ``lora_request``: the LoRARequest every call uses (None: the base model; a LoRA worker sets
    it at each update). ``run_engine(fn, ...)`` runs each call's engine work (None: in the
    calling thread; an in-process engine's worker runs it on the engine's own thread).
    """

    def __init__(self, llm, *, run_engine: Callable[..., Any] | None = None):
        self.llm = llm
        self.lora_request = None
        self._run_engine = run_engine
        self._warned_cut = False  # completions cut by the engine's max_model_len: said once

    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    @property
    def logprobs_mode(self) -> str:
        """What the engine's sampled-token log-probs are (vLLM's ``logprobs_mode``)."""
        return str(self.llm.llm_engine.model_config.logprobs_mode)

    @property
    def max_logprobs(self) -> int:
        """The engine's cap on log-probs per position (-1: the whole vocabulary)."""
        return int(self.llm.llm_engine.model_config.max_logprobs)

    @property
    def vocab_size(self) -> int:
        return int(self.llm.llm_engine.model_config.get_vocab_size())

    def rescore(
        self, token_ids: list[list[int]], starts: list[int], *, temperature: float, top_p: float, top_k: int
    ) -> list[list[float]]:
        """Processed log-probs of ``ids[start:]`` in each sequence: ``log_softmax`` of the
        logits after temperature, top-k and top-p, vLLM's sampler's order and rules (one
        full-vocabulary prefill; needs ``max_logprobs=-1``)."""
        outputs = self._on_engine(self._prompt_logprobs, token_ids, full_vocab=True)
        processing = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        return [
            _prompt_scores(ids, out.prompt_logprobs, self.vocab_size, start=start, **processing)[start:]
            for ids, start, out in zip(token_ids, starts, outputs)
        ]

    def _prompt_logprobs(self, token_ids: list[list[int]], *, full_vocab: bool) -> list:
        """One prefill per sequence returning its prompt log-probs: the whole vocabulary per
        position, or only the given tokens'."""
        from vllm import SamplingParams

        params = SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=-1 if full_vocab else 0, detokenize=False
        )
        return self.llm.generate(_token_prompts(token_ids), params, use_tqdm=False, lora_request=self.lora_request)

    def generate(self, prompt_token_ids: list[list[int]], sampling: dict[str, Any], *,
                 between_steps: Callable[[], None] | None = None) -> list[list[Completion]]:  # fmt: skip
        """See :class:`VLLMEngineClient`. ``between_steps``: called after each engine step while
        requests are still running (an inference worker switches weights there, so running
        requests go on with the new weights instead of draining first)."""
        return self._on_engine(self._generate, prompt_token_ids, sampling, between_steps)

    def _on_engine(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._run_engine is None:
            return fn(*args, **kwargs)
        return self._run_engine(fn, *args, **kwargs)

    def _generate(self, prompt_token_ids: list[list[int]], sampling: dict[str, Any],
                  between_steps: Callable[[], None] | None) -> list[list[Completion]]:  # fmt: skip
        from vllm import SamplingParams

        sampling = dict(sampling)
        want_logprobs = bool(sampling.pop("logprobs", True))
        params = SamplingParams(**sampling, logprobs=0 if want_logprobs else None, detokenize=False)
        prompts = _token_prompts(prompt_token_ids)
        if between_steps is None:
            outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        else:
            outputs = self._run_steps(prompts, params, between_steps)
        completions = [[_completion(c, want_logprobs) for c in request.outputs] for request in outputs]
        cut = cut_by_model_len(prompt_token_ids, completions, params.max_tokens)
        if cut is not None and not self._warned_cut:
            self._warned_cut = True
            log.warning(
                "a completion stopped at %d tokens, short of max_tokens=%d: its %d-token prompt filled the engine's "
                "max_model_len=%d; raise rollout.engine.max_model_len (said once)",
                cut[1], params.max_tokens, cut[0], self.llm.llm_engine.model_config.max_model_len,
            )  # fmt: skip
        return completions

    def _run_steps(self, prompts: list[dict], params, between_steps: Callable[[], None]) -> list:
        """``llm.generate``'s engine loop, calling ``between_steps`` after each step; the
        finished outputs in prompt order."""
        engine = self.llm.llm_engine
        internal_ids = self.llm.enqueue(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        finished = []
        try:
            while engine.has_unfinished_requests():
                finished += [output for output in engine.step() if output.finished]
                if engine.has_unfinished_requests():
                    between_steps()
        except BaseException:
            engine.abort_request(internal_ids, internal=True)  # leave no request behind
            raise
        # as llm.generate: outputs carry the external ids, numbered in the order they were added
        return sorted(finished, key=lambda output: int(output.request_id))

    def sample(self, prompt: list[int], num_samples: int, params: dict[str, Any], *, lora_request: Any = None,
               prompt_logprobs: int | None = None) -> dict[str, Any]:  # fmt: skip
        """``num_samples`` completions of one prompt: ``{"sequences": [{"tokens", "logprobs",
        "stop_reason"}], "prompt_logprobs": [...] | None, "topk_prompt_logprobs": [...] | None}``.

        ``params``: vLLM ``SamplingParams`` keywords (``max_tokens``, ``temperature``, ``top_p``,
        ``top_k``, ``seed``, ``stop`` as strings, ``stop_token_ids``). ``prompt_logprobs``: None
        (none), 0 (each prompt token's own log-prob, None at position 0) or k > 0 (also the k
        likeliest tokens per position as ``(token, log-prob)`` pairs). ``stop_reason`` is
        ``"stop"`` (a stop token or string, or the end of sequence) or ``"length"``.
        """
        return self._on_engine(self._sample, prompt, num_samples, dict(params), lora_request, prompt_logprobs)

    def _sample(self, prompt: list[int], num_samples: int, params: dict[str, Any], lora_request: Any,
                prompt_logprobs: int | None) -> dict[str, Any]:  # fmt: skip
        from vllm import SamplingParams

        sampling = SamplingParams(n=num_samples, logprobs=0, prompt_logprobs=prompt_logprobs,
                                  detokenize=bool(params.get("stop")), **params)  # fmt: skip
        (output,) = self.llm.generate(_token_prompts([prompt]), sampling, use_tqdm=False, lora_request=lora_request)
        sequences = [
            {
                "tokens": list(c.token_ids),
                "logprobs": [position[t].logprob for t, position in zip(c.token_ids, c.logprobs)],
                "stop_reason": "length" if c.finish_reason == "length" else "stop",
            }
            for c in output.outputs
        ]
        own = topk = None
        if prompt_logprobs is not None:
            positions = output.prompt_logprobs or [None] * len(prompt)
            own = [None] + [float(p[t].logprob) for t, p in zip(prompt[1:], positions[1:])]
            if prompt_logprobs > 0:
                topk = [None] + [_likeliest(position, prompt_logprobs) for position in positions[1:]]
        return {"sequences": sequences, "prompt_logprobs": own, "topk_prompt_logprobs": topk}

    def score(self, token_ids: list[list[int]], *, temperature: float) -> list[list[float]]:
        # prompt log-probs skip the sampling processors: at T != 1 they are renormalised over the
        # whole vocabulary (exact, see processed_logprobs)
        outputs = self._on_engine(self._prompt_logprobs, token_ids, full_vocab=not math.isclose(temperature, 1.0))
        return [
            _prompt_scores(ids, out.prompt_logprobs, self.vocab_size, temperature=temperature)
            for ids, out in zip(token_ids, outputs)
        ]

    def shutdown(self) -> None:
        """Stop the engine's child processes (vLLM 0.32: ``llm_engine.engine_core.shutdown()``)."""
        shutdown_vllm_engine(self.llm)


def processed_logprobs(raw: torch.Tensor, *, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """``log_softmax`` over the vocabulary after vLLM's sampling processors, from raw log-probs.

    Raw log-probs are ``logits - logsumexp(logits)``; dividing them by the temperature shifts
    every logit by the same constant, so the tempered softmax is exact. Then, as vLLM's sampler:
    top-k keeps the logits >= the k-th largest; top-p sorts ascending, drops the tokens whose
    cumulative probability is <= 1 - p, and always keeps the largest; the rest get -inf.
    """
    logits = raw.float() / (temperature or 1.0)
    if top_k and 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[-1] = False
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.log_softmax(logits, dim=-1)


def _likeliest(position: dict, k: int) -> list[tuple[int, float]]:
    """The ``k`` likeliest ``(token, log-prob)`` of one position's vLLM log-probs."""
    pairs = [(int(token), float(logprob.logprob)) for token, logprob in position.items()]
    return sorted(pairs, key=lambda pair: -pair[1])[:k]


def _token_prompts(token_ids: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": list(ids)} for ids in token_ids]


def cut_by_model_len(
    prompt_token_ids: list[list[int]], completions: list[list[Completion]], max_tokens: int | None
) -> tuple[int, int] | None:
    """``(prompt tokens, completion tokens)`` of a completion that ended unfinished before
    ``max_tokens``: the engine's context (``max_model_len``) was full. None when there is none."""
    if max_tokens is None:
        return None
    for prompt, group in zip(prompt_token_ids, completions):
        for completion in group:
            if not completion.finished and len(completion.token_ids) < max_tokens:
                return len(prompt), len(completion.token_ids)
    return None


def _completion(output, want_logprobs: bool) -> Completion:
    ids = list(output.token_ids)
    logprobs = None
    if want_logprobs:
        logprobs = [position[tok].logprob for tok, position in zip(ids, output.logprobs)]
    return Completion(token_ids=ids, logprobs=logprobs, finished=output.finish_reason == "stop",
                      token_versions=_token_versions(output, len(ids)))  # fmt: skip


def _token_versions(output, num_tokens: int) -> list[int] | None:
    """Each token's policy version from vLLM's ``weight_versions`` spans; None where one version
    made every token (16k fewer ints per batch) or the labels are not integers ("default")."""
    spans = getattr(output, "weight_versions", None)
    if not spans or len(spans) == 1 or not all(span.version.isdigit() for span in spans):
        return None
    versions = [int(spans[0].version)] * num_tokens
    for span in spans:
        versions[span.start : span.end] = [int(span.version)] * (span.end - span.start)
    return versions


def _dense(position: dict, vocab: int) -> torch.Tensor:
    """A vocabulary-sized tensor of the log-probs vLLM returned for one position (-inf elsewhere)."""
    dense = torch.full((vocab,), float("-inf"))
    dense[torch.tensor(list(position.keys()))] = torch.tensor([lp.logprob for lp in position.values()])
    return dense


def _prompt_scores(
    ids: list[int],
    prompt_logprobs,
    vocab_size: int,
    *,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    start: int = 1,
) -> list[float]:
    """``log p(ids[t] | ids[:t])`` for ``t >= start`` (0.0 before) from vLLM's prompt log-probs:
    the engine's values when sampling leaves the distribution as it is, else re-processed from
    the whole vocabulary with :func:`processed_logprobs`."""
    plain = math.isclose(temperature, 1.0) and top_p >= 1.0 and not top_k
    scores = [0.0] * max(start, 1)
    for tok, position in zip(ids[len(scores) :], prompt_logprobs[len(scores) :]):
        if plain:
            scores.append(position[tok].logprob)
            continue
        processed = processed_logprobs(_dense(position, vocab_size), temperature=temperature, top_p=top_p, top_k=top_k)
        scores.append(float(processed[tok]))
    return scores
