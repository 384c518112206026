"""What each Tinker API request does (:class:`Service`): sessions, models, samplers and their owners.

Every method takes the caller's tenant (from its API key) and acts only on what that tenant made:
a session, model, sampler, future or ``tinker://`` path of another tenant is answered as unknown.

Sessions, models, samplers, their ids and how a session ends: :mod:`rlpost.serve.sessions`. A
silent session's models are saved as ``tinker://<model>/weights/session-end`` before they go.

A model's requests (forward, forward_backward, optim_step, saves and loads) run in its
:class:`~rlpost.serve.futures.ModelQueue`, in the client's ``seq_id`` order; sampling runs at
once on the next inference worker. A sampler is an immutable adapter (or the base model): a
snapshot of a model's adapter or weights loaded from a path, sent to a worker the first time it
samples there.
"""

from __future__ import annotations

import itertools
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import torch

from rlpost.actors.adapters import MODEL_FILE, AdamParams, AdapterSpec, Datum
from rlpost.config import ServeConfig
from rlpost.record.metrics import ServiceMetrics
from rlpost.serve.fairness import Admission, FairTurns
from rlpost.serve.futures import Future, FutureStore, ModelQueue, RequestError, forget_finished
from rlpost.serve.recovery import ActorCalls
from rlpost.serve.sessions import Ended, Model, Sampler, Session, forget_ended, session_of, silent
from rlpost.serve.storage import Storage, WeightsPath, check_name, iso_time
from rlpost.serve.wire import (
    PROTOBUF,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
    model_input_tokens,
    sampling_params,
)

log = logging.getLogger("rlpost")

JSON = "application/json"
# the parity check's sequence: a snapshot's log-probs of it in the trainer, then in each engine
# that loads the snapshot, must agree (as a training run's sync_logprob_diff probe checks)
PROBE = list(range(3, 35))
_ADAM_FIELDS = {f for f in AdamParams.__dataclass_fields__}
# a sample whose worker lacks the adapter sends it again (the worker replaced, or its least recently
# used dropped) this many times in all
SAMPLE_ATTEMPTS = 3


def _json(value: dict[str, Any]) -> tuple[bytes, str]:
    return json.dumps(value).encode(), JSON


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...] = str) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise RequestError(f"{name}: missing or not a {getattr(kind, '__name__', kind)}")
    return value


class Service:
    """The Tinker API over a fleet (a trainer and inference workers); see the module docstring."""

    def __init__(self, cfg: ServeConfig, fleet: Any, storage: Storage, metrics: ServiceMetrics | None = None):
        self.cfg, self.fleet, self.storage, self.metrics = cfg, fleet, storage, metrics
        self.futures = FutureStore(keep_s=cfg.keep_results_s, long_poll_s=cfg.long_poll_s, observer=self._settled)
        self.sessions: dict[str, Session] = {}
        self.ended: dict[str, Ended] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}
        self._adapter_ids = itertools.count(1)
        self._next_worker = itertools.count()
        self.serving_workers = len(fleet.inference)  # new samples go to inference-0..n-1 (serve.scaling sets it)
        self._on_worker: dict[tuple[int, int], set[str]] = {}  # adapters given to (worker, its generation)
        self.calls = ActorCalls(fleet, cfg.call_timeout_s, on_new_trainer=self._put_models_back)
        self.trainer_turns = FairTurns(1, on_held=lambda tenant, s: self._busy(tenant, "trainer", s))
        self.worker_turns: dict[int, FairTurns] = {}
        self.admission = Admission(cfg.max_pending_per_tenant)
        self.last_logprob_diff: float | None = None  # the last parity check's (PROBE)

    # ------------------------------------------------------------------------------ calls

    async def _trainer(self, tenant: str, method: str, *args: Any, what: str, **kwargs: Any) -> Any:
        """A trainer call of ``tenant``'s, in its turn (:mod:`rlpost.serve.fairness`)."""
        async with self.trainer_turns.turn(tenant):
            return await self.calls.trainer(method, *args, what=what, **kwargs)

    async def _worker(self, tenant: str, index: int, method: str, *args: Any, what: str) -> Any:
        """An inference worker's call of ``tenant``'s, in its turn at that worker."""
        turns = self.worker_turns.get(index)
        if turns is None:
            turns = self.worker_turns[index] = FairTurns(1, on_held=lambda t, s: self._busy(t, f"inference-{index}", s))
        async with turns.turn(tenant):
            return await self.calls.worker(index, method, *args, what=what)

    async def _checkpoint(self, model: Model) -> None:
        """Keep ``model``'s adapter and optimizer state as a replaced trainer gets them back."""
        files = await self._trainer(model.tenant, "snapshot", model.adapter, with_optimizer=True, what="snapshot")
        model.checkpoint, model.replay = files, []
        await self._note_memory(model.tenant)

    async def _note_memory(self, tenant: str) -> None:
        """Where the trainer holds the models' adapters, as metrics."""
        if self.metrics is not None:
            self.metrics.trainer_adapters(await self._trainer(tenant, "memory", what="memory"))

    async def _put_models_back(self) -> None:
        """On a new trainer: every model from its snapshot, then the calls that changed it since
        replayed in order (:attr:`Model.replay`). Calls the trainer directly (the others wait
        until this is done)."""
        trainer = self.fleet.trainer
        for model in list(self.models.values()):
            if model.checkpoint is not None:
                ref = trainer.restore.remote(model.adapter, model.checkpoint, with_optimizer=True)
                await self.calls.wait(ref, "restore")
            for method, args, kwargs in model.replay:
                await self.calls.wait(getattr(trainer, method).remote(model.adapter, *args, **kwargs), "replay")
            log.info("serve: %s is back on the new trainer (%s replayed)", model.model_id,
                     ", ".join(method for method, _, _ in model.replay) or "nothing")  # fmt: skip

    async def _changed(self, model: Model, method: str, *args: Any, what: str, **kwargs: Any) -> Any:
        """A trainer call that changes ``model``'s state, recorded once it succeeded for a new
        trainer to replay until the next snapshot: a step taken between the call and the snapshot
        is then neither lost nor taken twice when the trainer is replaced in between."""
        result = await self._trainer(model.tenant, method, model.adapter, *args, what=what, **kwargs)
        model.replay.append((method, args, kwargs))
        return result

    def _future(self, tenant: str, kind: str, work: Callable[[], Awaitable[tuple[bytes, str]]]) -> Future:
        self.admission.check(tenant)
        future = self.futures.create(tenant, kind)
        self._accepted(tenant, kind)
        self.futures.run(future, work)
        return future

    def _accepted(self, tenant: str, kind: str) -> None:
        self.admission.started(tenant)
        self._queue_depth(tenant)
        if self.metrics is not None:
            self.metrics.count("serve_requests", tenant=tenant, kind=kind)
            self._state()

    def _settled(self, future: Future) -> None:
        self.admission.finished(future.tenant)
        self._queue_depth(future.tenant)
        if self.metrics is not None:
            if future.error is not None:
                self.metrics.count("serve_request_errors", tenant=future.tenant, kind=future.kind,
                                   category=future.category)  # fmt: skip
            self._state()

    def _state(self) -> None:
        self.metrics.state(sessions=len(self.sessions), models=len(self.models), samplers=len(self.samplers),
                           pending_requests=sum(self.admission.pending.values()))  # fmt: skip

    def _queue_depth(self, tenant: str) -> None:
        if self.metrics is not None:
            self.metrics.tenant_pending(tenant, self.admission.pending[tenant])

    def _busy(self, tenant: str, actor: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.count("serve_busy_seconds", seconds, tenant=tenant, actor=actor)

    def _tokens(self, key: str, tenant: str, count: int) -> None:
        if self.metrics is not None:
            self.metrics.count(key, count, tenant=tenant)

    # ------------------------------------------------------------------------ handshake

    def client_config(self) -> dict[str, Any]:
        return {"use_pyqwest_transport": False, "pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": True,
                "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False}  # fmt: skip

    def capabilities(self) -> dict[str, Any]:
        return {"supported_models": [{"model_name": self.cfg.served_name, "max_context_length":
                                      self.cfg.engine.max_model_len, "trainable": True, "sampleable": True}]}  # fmt: skip

    def create_session(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        session_id = f"s{uuid.uuid4().hex[:16]}"
        self.sessions[session_id] = Session(tenant)
        if self.metrics is not None:
            self.metrics.count("serve_requests", tenant=tenant, kind="create_session")
            self._state()
        return {"session_id": session_id}

    def session(self, tenant: str, session_id: Any) -> Session:
        """``tenant``'s session ``session_id``, marked as heard from; one that ended is answered 410."""
        session = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None or session.tenant != tenant:
            self._check_ended(tenant, session_id, "session_id")
            raise RequestError(f"session_id: no session {session_id!r}")
        session.seen()
        return session

    def model(self, tenant: str, model_id: Any) -> Model:
        model = self.models.get(model_id) if isinstance(model_id, str) else None
        session = self.sessions.get(session_of(model_id)) if model is not None else None
        if model is None or model.tenant != tenant or session is None:
            self._check_ended(tenant, model_id, "model_id")
            raise RequestError(f"model_id: no model {model_id!r}")
        session.seen()
        return model

    def sampler(self, tenant: str, sampler_id: Any) -> Sampler:
        sampler = self.samplers.get(sampler_id) if isinstance(sampler_id, str) else None
        session = self.sessions.get(session_of(sampler_id)) if sampler is not None else None
        if sampler is None or sampler.tenant != tenant or session is None:
            self._check_ended(tenant, sampler_id, "sampling_session_id")
            raise RequestError(f"sampling_session_id: no sampler {sampler_id!r}")
        session.seen()
        return sampler

    def _check_ended(self, tenant: str, object_id: Any, what: str) -> None:
        """410 for an id of ``tenant``'s session that ended (or of its models and samplers)."""
        ended = self.ended.get(session_of(object_id)) if isinstance(object_id, str) else None
        if ended is not None and ended.tenant == tenant:
            raise RequestError(f"{what}: {object_id} is gone: its session {ended.why}", status=410)

    # ------------------------------------------------------------------- session ends

    async def finish_session(self, tenant: str, session_id: Any) -> None:
        """The client is done with the session (``ServiceClient.close``): it ends. Finishing a
        session that already ended answers as the first finish did (the SDK's close is first-wins,
        and it retries a finish whose answer was slow: the retry must not fail)."""
        ended = self.ended.get(session_id) if isinstance(session_id, str) else None
        if ended is not None and ended.tenant == tenant:
            return
        self.session(tenant, session_id)
        await self.end_session(session_id, "was finished by its client", save=False)

    async def expire_silent(self) -> list[str]:
        """End every session silent for over ``session_timeout_s``; returns their ids."""
        forget_ended(self.ended, self.cfg.keep_results_s)
        expired = silent(self.sessions, self.cfg.session_timeout_s)
        for session_id in expired:
            await self.end_session(session_id, f"expired: nothing was heard from it for over "
                                               f"{self.cfg.session_timeout_s:.0f} s", save=True)  # fmt: skip
        return expired

    async def end_session(self, session_id: str, why: str, save: bool) -> None:
        """End ``session_id``: its models' waiting requests fail (``why``), then, once each one's
        running request is done, the model is saved (``save``) and leaves the trainer; its
        samplers go (the engines drop their adapters as least recently used)."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        self.ended[session_id] = Ended(session.tenant, why)
        models = [m for m in self.models.values() if session_of(m.model_id) == session_id]
        for model in models:
            model.queue.close(f"its session {why}")
        saved = [str(path) for model in models if (path := await self._drop(model, save)) is not None]
        for sampler_id in [s for s in self.samplers if session_of(s) == session_id]:
            del self.samplers[sampler_id]
        log.log(logging.WARNING if save else logging.INFO, "serve: session %s of %s %s; %d models ended%s",
                session_id, session.tenant, why, len(models), f", saved as {', '.join(saved)}" if saved else "")  # fmt: skip
        if models:
            await self._note_memory(session.tenant)
        if self.metrics is not None:
            self._state()

    # --------------------------------------------------------------------------- models

    def _check_base_model(self, name: Any) -> None:
        if name not in (None, self.cfg.served_name, self.cfg.base_model):
            raise RequestError(f"base_model: {name!r} is not served here; this server serves {self.cfg.served_name!r}")

    def _new_model(self, tenant: str, body: dict[str, Any]) -> tuple[Session, str, Future | None]:
        """``(session, the model id, the first future of a request sent again or None)`` of a request
        that makes a model: the SDK's ``<session>:train:<model_seq_id>``."""
        session_id = _field(body, "session_id")
        session = self.session(tenant, session_id)
        seq = _field(body, "model_seq_id", int)
        model_id = f"{session_id}:train:{seq}"
        if model_id in session.futures:
            return session, model_id, session.futures[model_id]
        self._check_base_model(body.get("base_model"))
        held = sum(1 for m in self.models.values() if m.tenant == tenant)
        if held >= self.cfg.max_models_per_tenant:
            raise RequestError(f"model_seq_id: this key's tenant holds {held} models, the most this server allows "
                               "(max_models_per_tenant); unload one first")  # fmt: skip
        return session, model_id, None

    def create_model(self, tenant: str, body: dict[str, Any]) -> Future:
        session, model_id, again = self._new_model(tenant, body)
        if again is not None:
            return again
        lora = body.get("lora_config") or {}
        if not isinstance(lora, dict):
            raise RequestError("lora_config: an object is expected")
        try:
            spec = AdapterSpec(**{k: v for k, v in lora.items() if k in AdapterSpec.__dataclass_fields__})
        except TypeError as exc:
            raise RequestError(f"lora_config: {exc}") from None
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise RequestError(f"optimizer_config.type: {optimizer!r}; this server trains with adamw only")

        async def work() -> tuple[bytes, str]:
            adapter = f"adapter-{next(self._adapter_ids)}"
            await self._trainer(tenant, "create", adapter, spec, what="create_model")
            self.storage.create_run(model_id, tenant, self.cfg.served_name, asdict(spec))
            await self._checkpoint(self._register(tenant, model_id, adapter, spec, ("create", (spec,), {})))
            return _json({"model_id": model_id, "type": "create_model"})

        future = session.futures[model_id] = self._future(tenant, "create_model", work)
        return future

    def _register(self, tenant: str, model_id: str, adapter: str, spec: AdapterSpec, made_by: tuple) -> Model:
        """A new model, its making (``made_by``: the trainer call, as replayed) its first replayed call."""
        queue = ModelQueue(self.futures, gap_timeout_s=self.cfg.gap_timeout_s)
        model = self.models[model_id] = Model(tenant, model_id, adapter, spec, queue, replay=[made_by])
        return model

    def _in_order(self, model: Model, seq: int, tenant: str, kind: str, work) -> Future:
        """Queue ``work`` as request ``seq`` of ``model`` (a number seen before: its first future)."""
        if seq in model.queue.by_seq:
            return model.queue.submit(seq, tenant, kind, work)
        self.admission.check(tenant, unblocks=seq == model.queue.next_seq)
        self._accepted(tenant, kind)  # first: one refused at once settles in submit, and the counts net to 0
        return model.queue.submit(seq, tenant, kind, work)

    def get_info(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        model = self.model(tenant, body.get("model_id"))
        tokenizer = self.cfg.tokenizer_id or self.cfg.served_name
        return {
            "model_id": model.model_id, "model_name": self.cfg.served_name, "is_lora": True,
            "lora_rank": model.spec.rank, "optimizer_config": {"type": "adamw"}, "type": "get_info",
            "model_data": {"arch": "lora", "model_name": self.cfg.served_name, "tokenizer_id": tokenizer},
        }  # fmt: skip

    def unload_model(self, tenant: str, body: dict[str, Any]) -> Future:
        model = self.model(tenant, body.get("model_id"))

        async def work() -> tuple[bytes, str]:
            model.queue.close()
            await self._drop(model)
            await self._note_memory(tenant)
            return _json({"model_id": model.model_id})

        return self._future(tenant, "unload_model", work)

    async def _drop(self, model: Model, save: bool = False) -> WeightsPath | None:
        """``model`` (its queue closed) leaves the service and the trainer once its running request is
        done; ``save``: its last snapshot is kept first as ``tinker://<model>/weights/session-end``."""
        await model.queue.idle()
        path = WeightsPath(model.model_id, "weights", "session-end") if save and model.checkpoint else None
        if path is not None:
            self.storage.save(path, model.tenant, model.checkpoint)
        del self.models[model.model_id]
        await self._trainer(model.tenant, "remove", model.adapter, what="remove")

    # ------------------------------------------------------------------------- training

    def forward_backward(self, tenant: str, body: bytes) -> Future:
        call = decode_forward_backward(body)
        model = self.model(tenant, call.model_id)
        kind = "forward" if call.forward_only else "forward_backward"

        async def work() -> tuple[bytes, str]:
            args = (call.data, call.loss_fn, call.loss_fn_config)
            if call.forward_only:
                result = await self._trainer(tenant, "forward_backward", model.adapter, *args, backward=False,
                                             what=kind)  # fmt: skip
            else:
                result = await self._changed(model, "forward_backward", *args, backward=True, what=kind)
            self._tokens("serve_tokens_trained", tenant, sum(len(d.tokens) for d in call.data))
            return encode_forward_backward_output(result["loss_fn_outputs"], result["metrics"]), PROTOBUF

        return self._in_order(model, call.seq_id, tenant, kind, work)

    def optim_step(self, tenant: str, body: dict[str, Any]) -> Future:
        model = self.model(tenant, body.get("model_id"))
        seq = _field(body, "seq_id", int)
        adam = body.get("adam_params")
        if not isinstance(adam, dict):
            raise RequestError("adam_params: missing (this server trains with adamw only)")
        try:
            params = AdamParams(**{k: float(v) for k, v in adam.items() if k in _ADAM_FIELDS})
        except (TypeError, ValueError) as exc:
            raise RequestError(f"adam_params: {exc}") from None
        if params.learning_rate < 0 or not 0 <= params.beta1 < 1 or not 0 <= params.beta2 < 1 or params.eps <= 0:
            raise RequestError(f"adam_params: need learning_rate >= 0, 0 <= beta1, beta2 < 1 and eps > 0, got {adam}")

        async def work() -> tuple[bytes, str]:
            metrics = await self._changed(model, "optim_step", params, what="optim_step")
            await self._checkpoint(model)
            return _json({"metrics": metrics, "type": "optim_step"})

        return self._in_order(model, seq, tenant, "optim_step", work)

    def save_weights(self, tenant: str, body: dict[str, Any]) -> Future:
        model = self.model(tenant, body.get("model_id"))
        path = WeightsPath(model.model_id, "weights", check_name(body.get("path")))
        overwrite = bool(body.get("overwrite", True))

        async def work() -> tuple[bytes, str]:
            files = await self._trainer(tenant, "snapshot", model.adapter, with_optimizer=True, what="save_weights")
            self.storage.save(path, tenant, files, overwrite=overwrite)
            return _json({"path": str(path), "type": "save_weights"})

        return self._in_order(model, _field(body, "seq_id", int), tenant, "save_weights", work)

    def save_weights_for_sampler(self, tenant: str, body: dict[str, Any]) -> Future:
        """Named (``path``): the adapter saved as ``tinker://<model>/sampler_weights/<name>``;
        ephemeral (``sampling_session_seq_id``): a sampler of the adapter as it is now."""
        model = self.model(tenant, body.get("model_id"))
        seq = _field(body, "seq_id", int)
        if body.get("path") is not None:
            path = WeightsPath(model.model_id, "sampler_weights", check_name(body["path"]))

            async def save_named() -> tuple[bytes, str]:
                files = await self._trainer(
                    tenant, "snapshot", model.adapter, with_optimizer=False, what="save_weights_for_sampler"
                )
                self.storage.save(path, tenant, files)
                return _json({"path": str(path), "type": "save_weights_for_sampler"})

            return self._in_order(model, seq, tenant, "save_weights_for_sampler", save_named)
        sampler_seq = _field(body, "sampling_session_seq_id", int)
        sampler_id = f"{model.model_id.split(':train:')[0]}:sample:{sampler_seq}"

        async def snapshot() -> tuple[bytes, str]:
            import ray

            config, tensors = await self._trainer(tenant, "adapter_state", model.adapter, what="snapshot")
            probe = None
            if self.cfg.parity_check:
                inputs = {"target_tokens": torch.tensor(PROBE[1:]), "weights": torch.zeros(len(PROBE) - 1)}
                result = await self._trainer(tenant, "forward_backward", model.adapter, [Datum(PROBE[:-1], inputs)],
                                             "cross_entropy", backward=False, what="snapshot")  # fmt: skip
                probe = result["loss_fn_outputs"][0]["logprobs"].tolist()
            adapter = f"{model.adapter}-s{next(self._adapter_ids)}"
            payload = (ray.put(config), ray.put(tensors))
            self.samplers[sampler_id] = Sampler(tenant, sampler_id, adapter, payload, probe=probe)
            return _json({"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})

        return self._in_order(model, seq, tenant, "save_weights_for_sampler", snapshot)

    def load_weights(self, tenant: str, body: dict[str, Any]) -> Future:
        """Into an existing model (``model_id``, ``seq_id``), or into a new one the SDK names
        ``<session>:train:<model_seq_id>`` (a training client made from a saved state)."""
        path = WeightsPath.parse(body.get("path"))
        with_optimizer = bool(body.get("optimizer", False))
        if body.get("model_id") is not None:
            model = self.model(tenant, body["model_id"])

            async def into_model() -> tuple[bytes, str]:
                files = self.storage.load(path, tenant)
                await self._changed(model, "restore", files, with_optimizer=with_optimizer, what="load_weights")
                await self._checkpoint(model)
                return _json({"path": str(path), "model_id": model.model_id, "type": "load_weights"})

            return self._in_order(model, _field(body, "seq_id", int), tenant, "load_weights", into_model)
        session, model_id, again = self._new_model(tenant, body)
        if again is not None:
            return again

        async def new_model() -> tuple[bytes, str]:
            files = self.storage.load(path, tenant)
            if MODEL_FILE not in files:
                raise RequestError(f"path: {path} holds no model this server saved")
            spec = AdapterSpec(**json.loads(files[MODEL_FILE])["lora"])
            adapter = f"adapter-{next(self._adapter_ids)}"
            await self._trainer(tenant, "restore", adapter, files, with_optimizer=with_optimizer, what="load_weights")
            self.storage.create_run(model_id, tenant, self.cfg.served_name, asdict(spec))
            made_by = ("restore", (files,), {"with_optimizer": with_optimizer})
            await self._checkpoint(self._register(tenant, model_id, adapter, spec, made_by))
            return _json({"path": str(path), "model_id": model_id, "type": "load_weights"})

        future = session.futures[model_id] = self._future(tenant, "load_weights", new_model)
        return future

    # ------------------------------------------------------------------------- sampling

    def create_sampling_session(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        import ray

        session_id = _field(body, "session_id")
        self.session(tenant, session_id)
        sampler_id = f"{session_id}:sample:{_field(body, 'sampling_session_seq_id', int)}"
        if sampler_id in self.samplers:
            return {"sampling_session_id": self.sampler(tenant, sampler_id).sampler_id}
        model_path = body.get("model_path")
        if model_path is None:
            self._check_base_model(body.get("base_model"))
            self.samplers[sampler_id] = Sampler(tenant, sampler_id, None)
            return {"sampling_session_id": sampler_id}
        path = WeightsPath.parse(model_path, "model_path")
        files = self.storage.load(path, tenant)
        from safetensors.torch import load

        config, tensors = json.loads(files["adapter_config.json"]), load(files["adapter_model.safetensors"])
        adapter = f"p{next(self._adapter_ids)}"
        payload = (ray.put(config), ray.put(tensors))
        self.samplers[sampler_id] = Sampler(tenant, sampler_id, adapter, payload, str(path))
        return {"sampling_session_id": sampler_id}

    def get_sampler(self, tenant: str, sampler_id: str) -> dict[str, Any]:
        sampler = self.sampler(tenant, sampler_id)
        return {"sampler_id": sampler.sampler_id, "base_model": self.cfg.served_name, "model_path": sampler.model_path}

    def asample(self, tenant: str, body: dict[str, Any]) -> tuple[Future, list[str]]:
        sampler = self.sampler(tenant, body.get("sampling_session_id"))
        seq = _field(body, "seq_id", int)
        n = _field(body, "num_samples", int)
        prompt = model_input_tokens("prompt", body.get("prompt"))
        params, prompt_logprobs = sampling_params(body, len(prompt), n, self.cfg.engine.max_model_len)
        ids = [f"{sampler.sampler_id}:{seq}:{i}" for i in range(n)]
        forget_finished(sampler.futures, self.cfg.keep_results_s)
        if seq in sampler.futures:
            return sampler.futures[seq], ids

        async def work() -> tuple[bytes, str]:
            result = await self._sample(sampler, prompt, n, params, prompt_logprobs)
            self._tokens("serve_tokens_sampled", tenant, sum(len(s["tokens"]) for s in result["sequences"]))
            return encode_sample_response(result, len(prompt)), PROTOBUF

        future = sampler.futures[seq] = self._future(tenant, "sample", work)
        return future, ids

    async def _sample(self, sampler: Sampler, prompt, n, params, prompt_logprobs) -> dict[str, Any]:
        """Sample on the next worker, sending it the sampler's adapter first where it has not got it
        (a replaced worker has none; one that dropped it, least recently used, says so)."""
        index = next(self._next_worker) % self.serving_workers
        for attempt in range(SAMPLE_ATTEMPTS):
            given = self._on_worker.setdefault((index, self.calls.worker_generations.get(index, 0)), set())
            try:
                if sampler.adapter is not None and sampler.adapter not in given:
                    # Ray hands the worker the payload's values
                    await self._worker(sampler.tenant, index, "add_adapter", sampler.adapter, *sampler.payload,
                                       what="sample (adapter)")  # fmt: skip
                    if sampler.probe is not None:
                        await self._check_parity(index, sampler)
                    given.add(sampler.adapter)
                return await self._worker(sampler.tenant, index, "sample", prompt, n, params, sampler.adapter,
                                          prompt_logprobs, what="sample")  # fmt: skip
            except KeyError:  # the worker dropped the adapter, or was replaced since it got it: send it again
                given.discard(sampler.adapter)
                if attempt == SAMPLE_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    async def _check_parity(self, index: int, sampler: Sampler) -> None:
        """The engine's log-probs of :data:`PROBE` under the adapter it just loaded against the
        trainer's when the snapshot was taken: their largest difference is a metric, and a
        warning above ``parity_warn`` (the engine would sample from another model)."""
        params = {"max_tokens": 1, "temperature": 1.0}
        result = await self._worker(sampler.tenant, index, "sample", PROBE, 1, params, sampler.adapter, 0,
                                    what="parity check")  # fmt: skip
        diff = max(abs(a - b) for a, b in zip(result["prompt_logprobs"][1:], sampler.probe))
        self.last_logprob_diff = diff
        if self.metrics is not None:
            self.metrics.state(logprob_diff=diff)
        if diff > self.cfg.parity_warn:
            log.warning("serve: inference-%d computes log-probs %.2g away from the trainer's for %s (above %g)",
                        index, diff, sampler.sampler_id, self.cfg.parity_warn)  # fmt: skip

    # -------------------------------------------------------------------------- futures

    async def retrieve(self, tenant: str, body: dict[str, Any]) -> tuple[bytes, str]:
        request_id = _field(body, "request_id")
        future = await self.futures.wait(request_id, tenant)
        if future is None:
            raise RequestError(f"request_id: no request {request_id!r}")
        if not future.done.is_set():
            return _json({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if future.error is not None:
            return _json({"error": future.error, "category": future.category})
        return future.payload, future.content_type

    # ------------------------------------------------------------------------------ REST

    def weights_info(self, tenant: str, body: dict[str, Any]) -> dict[str, Any]:
        path = WeightsPath.parse(body.get("tinker_path"), "tinker_path")
        run = self.storage.run(path.run_id, tenant)
        lora = run["lora"]
        return {"base_model": run["base_model"], "is_lora": True, "lora_rank": lora["rank"],
                "train_unembed": False, "train_mlp": lora["train_mlp"], "train_attn": lora["train_attn"]}  # fmt: skip

    def training_run(self, tenant: str, run_id: str) -> dict[str, Any]:
        run = self.storage.run(run_id, tenant)
        checkpoints = self.storage.checkpoints(run_id, tenant)
        last = {kind: [c for c in checkpoints if c["checkpoint_type"] == kind] for kind in ("training", "sampler")}
        return {
            "training_run_id": run_id, "base_model": run["base_model"], "model_owner": tenant, "is_lora": True,
            "lora_rank": run["lora"]["rank"], "corrupted": False, "last_request_time": iso_time(run["created"]),
            "last_checkpoint": last["training"][-1] if last["training"] else None,
            "last_sampler_checkpoint": last["sampler"][-1] if last["sampler"] else None,
        }  # fmt: skip

    def training_runs(self, tenant: str, limit: int, offset: int) -> dict[str, Any]:
        runs = self.storage.runs(tenant)
        page = [self.training_run(tenant, r["run_id"]) for r in runs[offset : offset + limit]]
        return {"training_runs": page, "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}

    def checkpoints(self, tenant: str, run_id: str) -> dict[str, Any]:
        return {"checkpoints": self.storage.checkpoints(run_id, tenant)}
