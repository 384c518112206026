"""vLLMWrapper: the LLM policy interface on a vLLM engine (the inference workers' view).

The wrapper never touches ``vllm.LLM`` directly: it talks to an *engine client* with two
methods on plain data (:class:`VLLMEngineClient`)::

    generate(prompt_token_ids: list[list[int]], sampling: dict) -> list[list[Completion]]
    score(token_ids: list[list[int]], *, temperature: float) -> list[list[float]]

:class:`LocalVLLMClient` implements it on an in-process ``vllm.LLM``; a Ray inference-worker
handle that forwards the same calls gives identical results, because the arguments and results
are plain lists and dicts.

Engine requirements (:func:`make_vllm_engine` sets them): ``logprobs_mode="processed_logprobs"``
so that sampled-token log-probs are taken after temperature / top-p (the behaviour policy's;
vLLM's default raw log-probs are taken before, and a loss built on them would be off by the
temperature); ``max_logprobs=-1`` so that scoring at temperature != 1 can read the
full prompt distribution (vLLM's prompt log-probs skip the sampling processors, i.e. are always
at temperature 1, so the client renormalises ``log_softmax(lp / T)`` over the whole vocabulary --
exact, but heavy for large vocabularies; the Transformers wrapper is the cheap scorer there).
A plain ``vllm.LLM`` in raw mode is handled by :class:`vLLMWrapper` (re-scored or refused).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from rlpost.policies.base import Completion, LLMWrapperBase
from rlpost.policies.remote_client import RemoteVLLMClient, is_local_worker, is_remote_worker

log = logging.getLogger("rlpost")

_STANDARD = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")
# TorchRL's common names and their vLLM names (None: not a vLLM sampling option).
_VLLM_NAMES = {
    "stop_sequences": "stop", "num_beams": None, "length_penalty": None, "early_stopping": None, "logprobs": None,
}  # fmt: skip
# Sampling options that change the distribution beyond temperature / top-k / top-p.
_DISTRIBUTION_CHANGING = (
    "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "logit_bias", "bad_words",
    "allowed_token_ids", "logits_processors",
)  # fmt: skip


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

    ``lora_request``: the ``vllm.lora.request.LoRARequest`` every call generates and scores with
    (None: the base model); an inference worker that serves a LoRA adapter sets it at each update.
    ``run_engine(fn, *args, **kwargs)`` runs each call's engine work (None: in the calling
    thread); an inference worker whose engine runs in its process passes the function that runs
    it on the engine's own thread (:func:`make_vllm_engine`, ``in_process``).
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


class vLLMWrapper(LLMWrapperBase):
    """LLM wrapper around a vLLM engine; see :class:`LLMWrapperBase` for the keyword arguments,
    inputs and outputs.

    Args:
        model: a ``vllm.LLM`` (wrapped in :class:`LocalVLLMClient`), a worker of
            :func:`make_vllm_worker`, a fleet of them (``AsyncVLLM``), any
            :class:`VLLMEngineClient` (e.g. a remote inference worker's client), or a model path
            (an engine is made with :func:`make_vllm_engine`).
        tokenizer: the model's tokenizer (or a path); taken from the engine's
            ``get_tokenizer()`` when omitted.
        pad_model_input: TorchRL's argument, refused as TorchRL refuses it (ValueError when
            given): vLLM schedules its own batches.

    Log-probs are never silently wrong. vLLM's default ``logprobs_mode="raw_logprobs"`` returns
    log-probs *before* temperature / top-k / top-p, which are not the behaviour policy's when
    sampling changes the distribution. On such an engine (a plain ``vllm.LLM(model=...)``) the
    wrapper re-scores the sampled tokens under the processed distribution, which needs the full
    vocabulary per position (``max_logprobs=-1``; slow, since vLLM then returns every token's
    log-prob at every position), and otherwise refuses at construction with a ValueError naming
    ``logprobs_mode`` and the fix. Engines made by :func:`make_vllm_engine`
    return processed log-probs and need neither.

    Attributes:
        sampling_params: the ``vllm.SamplingParams`` a call uses (built on access).
    """

    def __init__(self, model, *, tokenizer=None, pad_model_input: bool | None = None, **kwargs):
        if pad_model_input is not None:
            raise ValueError("pad_model_input is not supported by vLLMWrapper.")
        if isinstance(model, (str, os.PathLike)):
            model = make_vllm_engine(model)
        client = _worker_client(model, tokenizer)
        if client is None:
            client = model if _is_client(model) else LocalVLLMClient(model)
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        if tokenizer is None and hasattr(client, "get_tokenizer"):
            tokenizer = client.get_tokenizer()
        super().__init__(tokenizer=tokenizer, **kwargs)
        self.client = client
        self.model = model
        self._rescore = self._check_logprobs_mode()

    def _engine(self):
        return self.client

    def _full_logits(self, tensordict):
        """vLLM returns log-probs of given tokens, never the logits: ``get_dist`` raises TorchRL's
        NotImplementedError (score with ``generate=False``, or use TransformersWrapper.get_dist)."""
        raise NotImplementedError(
            "vLLM does not return logits: get_dist needs a TransformersWrapper; "
            "vLLMWrapper(generate=False) returns the log-probs of given tokens"
        )

    @property
    def sampling_params(self):
        """The ``vllm.SamplingParams`` of a generation call (or of a scoring call's prefill)."""
        from vllm import SamplingParams

        sampling = dict(self._sampling())
        want = bool(sampling.pop("logprobs"))
        if not self.generate:
            sampling.update(max_tokens=1, n=1, prompt_logprobs=0)
        return SamplingParams(**sampling, logprobs=0 if want else None, detokenize=False)

    def _sampling(self) -> dict[str, Any]:
        params = self.generate_params
        sampling = {_VLLM_NAMES.get(k, k): v for k, v in params.items() if k not in _STANDARD and _VLLM_NAMES.get(k, k)}
        sampling.update(
            n=self.num_samples or 1,
            max_tokens=params["max_new_tokens"],
            temperature=params["temperature"],
            top_p=params["top_p"],
            top_k=params["top_k"],
            seed=params["seed"],
            logprobs=self.return_log_probs,
        )
        return sampling

    def _generate_ids(self, prompt_ids: list[list[int]], num_samples: int) -> list[list[Completion]]:
        sampling = self._sampling()
        sampling["n"] = num_samples
        completions = self.client.generate(prompt_ids, sampling)
        if self._rescore and self.return_log_probs:
            self._replace_raw_logprobs(prompt_ids, completions)
        return completions

    def _replace_raw_logprobs(self, prompt_ids: list[list[int]], completions: list[list[Completion]]) -> None:
        """Swap the engine's raw log-probs for the processed ones (see the class docstring)."""
        params = self.generate_params
        fulls, starts, flat = [], [], []
        for prompt, group in zip(prompt_ids, completions):
            for completion in group:
                fulls.append(list(prompt) + list(completion.token_ids))
                starts.append(len(prompt))
                flat.append(completion)
        scores = self.client.rescore(
            fulls, starts, temperature=params["temperature"], top_p=params["top_p"], top_k=params["top_k"]
        )
        for completion, row in zip(flat, scores):
            completion.logprobs = row

    def _score_ids(self, full_ids: list[list[int]], score_from: int = 0) -> list[torch.Tensor]:
        # vLLM returns every position's log-prob in one pass: score_from saves nothing here
        scores = self.client.score(full_ids, temperature=self.temperature)
        return [torch.tensor(s, dtype=torch.float32) for s in scores]

    def _check_logprobs_mode(self) -> bool:
        """Whether sampled-token log-probs must be re-scored; a ValueError when they would be
        wrong and cannot be fixed (see the class docstring)."""
        mode = getattr(self.client, "logprobs_mode", "processed_logprobs")
        if mode == "processed_logprobs":
            return False
        fix = (
            "create the engine with logprobs_mode='processed_logprobs' "
            "(vllm.LLM(model=..., logprobs_mode='processed_logprobs') or rlpost.policies.make_vllm_engine)"
        )
        if mode != "raw_logprobs":
            raise ValueError(f"vLLMWrapper needs log-probs, but this engine returns logprobs_mode={mode!r}: {fix}")
        params = self.generate_params
        full_vocab = self.client.max_logprobs == -1 or self.client.max_logprobs >= self.client.vocab_size
        if not self.generate:
            if not math.isclose(self.temperature, 1.0) and not full_vocab:
                raise ValueError(
                    f"scoring at temperature {self.temperature} reads the whole vocabulary per position, but this "
                    f"engine caps log-probs at max_logprobs={self.client.max_logprobs}: create it with max_logprobs=-1"
                )
            return False
        if not self.return_log_probs or _unprocessed(params):
            return False
        unsupported = _distribution_changing(params)
        if unsupported or not full_vocab:
            reason = (
                f"{unsupported} cannot be re-applied"
                if unsupported
                else f"re-scoring needs the whole vocabulary and the engine has max_logprobs={self.client.max_logprobs}"
            )
            raise ValueError(
                f"this vLLM engine returns raw log-probs (logprobs_mode='raw_logprobs', vLLM's default), which ignore "
                f"temperature={params['temperature']}, top_p={params['top_p']}, top_k={params['top_k']}: the "
                f"behaviour policy's log-probs would be wrong and {reason}. Fix: {fix}, or create it with "
                "max_logprobs=-1 so that vLLMWrapper can re-score the sampled tokens."
            )
        warnings.warn(
            "vLLMWrapper: the engine returns raw log-probs (logprobs_mode='raw_logprobs'); sampled tokens are "
            "re-scored under the processed distribution: one more prefill per call that returns the whole "
            "vocabulary at every position, which is slow (30x the generation time with the 448-token tiny "
            "model, far more with a real vocabulary). Use logprobs_mode='processed_logprobs' to avoid it.",
            stacklevel=3,
        )
        return True


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


def _unprocessed(params: dict[str, Any]) -> bool:
    """Whether sampling leaves the distribution as it is (raw log-probs are then the processed ones)."""
    greedy = params["temperature"] == 0
    plain = math.isclose(params["temperature"], 1.0) and params["top_p"] >= 1.0 and not params["top_k"]
    return (greedy or plain) and not _distribution_changing(params)


def _distribution_changing(params: dict[str, Any]) -> list[str]:
    """The options given that change the sampling distribution (neutral values do not count)."""
    neutral = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}
    return sorted(k for k in _DISTRIBUTION_CHANGING if params.get(k) not in (None, neutral.get(k)))


def _worker_client(model: Any, tokenizer: Any) -> Any:
    """The engine client of a worker from ``make_vllm_worker`` (a Ray actor or an in-process
    worker) or of a fleet of them (``AsyncVLLM``: anything with ``get_engine_client()``), or None
    for anything else."""
    if callable(getattr(model, "get_engine_client", None)):
        return model.get_engine_client()
    if is_local_worker(model):
        return model.client
    if not is_remote_worker(model):
        return None
    import ray

    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ray.get(model.get_model_path.remote(), timeout=600))
    return RemoteVLLMClient([model], tokenizer=tokenizer)


# rlpost's methods in vLLM's worker process (weight updates): pass as worker_extension_cls
WORKER_EXTENSION = "rlpost.policies.vllm_worker_ext.WeightSyncExtension"
# CPU backend: how long an engine's worker busy-polls for its next step after one ends (vLLM: 1 s)
SPIN_AFTER_WORK_S = 0.05


def make_vllm_engine(
    model_path: str | os.PathLike,
    *,
    dtype: str = "float32",
    enforce_eager: bool = True,
    max_model_len: int = 512,
    seed: int = 0,
    kv_cache_memory_bytes: int | None = 256 * 2**20,
    max_logprobs: int = -1,
    cpu_cores: Sequence[int] | None = None,
    in_process: bool = False,
    **engine_kwargs,
):
    """Create a ``vllm.LLM`` configured the way rlpost needs it.

    Always sets ``logprobs_mode="processed_logprobs"`` (another value is a ValueError), and
    ``max_logprobs=-1`` (tempered scoring reads full prompt distributions). ``dtype`` is float32
    by default so that inference log-probs match the fp32 learner. On the CPU backend:

    - the KV cache is ``kv_cache_memory_bytes`` (256 MiB holds ~250k tokens of the tiny model,
      and keeps one engine under 2 GB resident). vLLM's legacy ``VLLM_CPU_KVCACHE_SPACE``
      variable (whole GiB) overrides it when set in the environment; with
      ``kv_cache_memory_bytes=None`` it is set to 1 GiB unless already set.
    - chunked prefill is off (see the comment below); pass ``enable_chunked_prefill`` to override.
    - rlpost's worker extension is the default ``worker_extension_cls`` (weight updates), and
      through it the worker busy-polls for its next step for at most ``SPIN_AFTER_WORK_S`` after
      one ends instead of vLLM's 1 s, which burns a core beside whatever runs next (the learner
      of a sync step: its tiny-model step took 0.14 s against 0.13 s with the engine quiet).
    - ``cpu_cores``: the cores whose threads run the model (one torch thread each, bound to its
      core; :func:`engine_cpu_cores` picks them). None keeps vLLM's own choice, which on a node
      of N cores binds N-1 threads and leaves one core to the engine's scheduler process: on 2
      cores, one thread.

    The engine runs in child processes: create it under ``if __name__ == "__main__":`` in
    scripts and release it with :func:`shutdown_vllm_engine`. With ``in_process=True`` its engine
    core and model worker run in this process instead (vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
    for this engine only): no child process to start (on the CPU backend each one imports vLLM,
    ~15 s on 2 cores) or to compete with the model for the cores. On the CPU backend the calling
    thread then gets ``cpu_cores`` as its affinity and torch thread count, and must be the thread
    that generates with the engine: the OpenMP threads of its forward passes inherit them (they
    are confined to those cores rather than pinned one per core; another thread's forward passes
    would run on threads of its own). This process's ``torch.set_num_threads`` stays usable (vLLM
    disables it, rlpost restores it: it sets the calling thread's count only), and vLLM freezes
    the process's garbage-collected heap (``gc.freeze``), as it does in an engine process. One
    engine at a time runs in a process (vLLM keeps its parallel state in module globals, which an
    engine's shutdown tears down): while one does, another asked for in process gets processes
    of its own (logged).
    """
    from vllm import LLM
    from vllm.platforms import current_platform

    mode = engine_kwargs.pop("logprobs_mode", "processed_logprobs")
    if mode != "processed_logprobs":
        raise ValueError(f"rlpost needs logprobs_mode='processed_logprobs', got {mode!r}")
    if current_platform.is_cpu():
        if kv_cache_memory_bytes is None:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # vLLM 0.32 CPU trap: a seeded request whose prompt is prefilled in chunks crashes the
        # engine ("CPU Generator does not use offset") once a batch's prompts exceed
        # max_num_batched_tokens; without chunked prefill prompts are scheduled whole.
        engine_kwargs.setdefault("enable_chunked_prefill", False)
        if not engine_kwargs["enable_chunked_prefill"]:
            engine_kwargs.setdefault("max_num_batched_tokens", max(max_model_len, 4096))
    if kv_cache_memory_bytes is not None:
        engine_kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    binding = {}
    if in_process and len(_IN_PROCESS_ENGINES):
        log.info("another vLLM engine runs in this process: this one runs in processes of its own")
        in_process = False
    if in_process:
        binding["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if current_platform.is_cpu():
            _confine_this_thread(cpu_cores)
    elif cpu_cores is not None and current_platform.is_cpu():
        # read by the engine's processes as they start (they inherit this environment)
        binding["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(core) for core in cpu_cores)
    engine_kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
    set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it when it runs here
    try:
        with _vllm_environment(binding):
            llm = LLM(
                str(model_path),
                dtype=dtype,
                enforce_eager=enforce_eager,
                max_model_len=max_model_len,
                seed=seed,
                max_logprobs=max_logprobs,
                logprobs_mode="processed_logprobs",
                **engine_kwargs,
            )
    finally:
        torch.set_num_threads = set_num_threads
    if in_process:
        _IN_PROCESS_ENGINES.add(llm)
    if current_platform.is_cpu() and engine_kwargs.get("worker_extension_cls") == WORKER_EXTENSION and not in_process:
        llm.collective_rpc("rlpost_spin_after_work", timeout=60, args=(SPIN_AFTER_WORK_S,))
    return llm


def _confine_this_thread(cpu_cores: Sequence[int] | None) -> None:
    """In-process CPU engine: run its model on ``cpu_cores`` (None: vLLM's choice, all the
    process's cores but one, at least one) from this thread. vLLM binds an engine's model
    threads only when it starts them in a worker process of their own (through the OpenMP
    environment of that process); in this process the thread that will generate gets the cores
    as its affinity, which the OpenMP threads it starts inherit, and as its torch thread count.
    The threads are confined to those cores, not pinned one per core."""
    if cpu_cores is None:
        available = sorted(os.sched_getaffinity(0))
        cpu_cores = available[: max(1, len(available) - 1)]
    os.sched_setaffinity(0, cpu_cores)  # pid 0: the calling thread
    torch.set_num_threads(len(cpu_cores))


# engines made with in_process=True, until shut down (make_vllm_engine runs one at a time)
_IN_PROCESS_ENGINES: weakref.WeakSet = weakref.WeakSet()


def engine_cpu_cores(num_threads: int, index: int = 0) -> list[int]:
    """``num_threads`` cores of this process's CPU set for the threads of engine ``index`` on the
    node: engines 0, 1, ... take consecutive runs of cores, wrapping round when the node has
    fewer cores than their threads (they then share cores)."""
    cores = sorted(os.sched_getaffinity(0))
    if not 1 <= num_threads <= len(cores):
        raise ValueError(
            f"rollout.engine.cpu_threads={num_threads}: this process may run on {len(cores)} cores ({cores})"
        )
    return [cores[(index * num_threads + j) % len(cores)] for j in range(num_threads)]


@contextlib.contextmanager
def _vllm_environment(values: dict[str, str]):
    """Set environment variables for an engine's start, then restore what was there.

    An engine core started in this process freezes vLLM's view of the environment (its
    ``envs`` cache) as it was during the start; the cache is cleared before the start, so that
    this engine reads ``values``, and rebuilt from the restored environment after it, so that a
    later engine does not inherit them."""
    from vllm import envs

    was_cached = envs._is_envs_cache_enabled()
    envs.disable_envs_cache()
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
        if was_cached or envs._is_envs_cache_enabled():
            envs.disable_envs_cache()
            envs.enable_envs_cache()


def shutdown_vllm_engine(llm) -> None:
    """Stop a ``vllm.LLM``'s engine core and worker (their processes, or, in this process, their
    state) now instead of at garbage collection."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()
    _IN_PROCESS_ENGINES.discard(llm)


def _is_client(obj) -> bool:
    return callable(getattr(obj, "score", None)) and callable(getattr(obj, "generate", None)) and not _is_vllm_llm(obj)


def _is_vllm_llm(obj) -> bool:
    vllm = sys.modules.get("vllm")  # an LLM instance implies vllm is imported; never import it here
    return vllm is not None and isinstance(obj, vllm.LLM)


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
    """Each token's policy version from vLLM's weight-version spans (``CompletionOutput
    .weight_versions``, labelled by ``llm_engine.set_weight_version``); None where one version
    made every token (the call's own: nothing more to say, and 16k fewer ints to send back per
    batch) or the engine has no integer labels (weights nobody labelled say "default")."""
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
