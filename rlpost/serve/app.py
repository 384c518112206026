"""The HTTP routes of the Tinker API (``/api/v1/...``), as the official SDK 0.38 calls them.

Every route but ``healthz`` needs an ``X-API-Key`` the service knows (401 otherwise, with a
message). A client's mistake is a 400 whose JSON body names the field (never an empty body: the
SDK takes an empty 400 for a proxy's and retries it); a request that reached the service but
failed later is reported through its future, as the SDK expects. A tenant over its bound of
pending requests gets 429 (the SDK waits and sends it again). 5xx answers are left to real
server faults, since the SDK retries them for minutes.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rlpost.serve.access import ApiKeys
from rlpost.serve.fairness import Busy
from rlpost.serve.futures import RequestError
from rlpost.serve.service import Service
from rlpost.serve.wire import BadRequest

log = logging.getLogger("rlpost")

PREFIX = "/api/v1"
MAX_DECOMPRESSED_BYTES = 1 << 30  # a zstd body may not grow past 1 GiB


def _future(future, **extra: Any) -> JSONResponse:
    return JSONResponse({"request_id": future.request_id, **extra})


def build_app(service: Service, keys: ApiKeys) -> Starlette:
    """The Starlette app serving ``service`` to the holders of ``keys``."""

    async def body_json(request: Request) -> dict[str, Any]:
        raw = await _body(request)
        try:
            value = json.loads(raw or b"{}")
        except ValueError:
            raise RequestError("body: not JSON") from None
        if not isinstance(value, dict):
            raise RequestError("body: a JSON object is expected")
        return value

    def route(path: str, handler, methods=("POST",)) -> Route:
        async def endpoint(request: Request) -> Response:
            tenant = keys.tenant(request.headers.get("x-api-key"))
            if tenant is None:
                missing = not request.headers.get("x-api-key")
                detail = "X-API-Key is missing" if missing else "X-API-Key is not a key of this service"
                return JSONResponse({"detail": detail}, status_code=401)
            try:
                return await handler(request, tenant)
            except (RequestError, BadRequest) as exc:  # 410: a session that ended (the SDK stops its heartbeat)
                return JSONResponse({"detail": str(exc)}, status_code=getattr(exc, "status", 400))
            except Busy as exc:  # the SDK backs off and sends it again
                return JSONResponse({"detail": str(exc)}, status_code=429, headers={"retry-after-ms": "1000"})

        return Route(PREFIX + path, endpoint, methods=list(methods))

    def answer(method):
        """A route whose JSON body goes to ``method(tenant, body)`` and whose result is the answer."""

        async def handler(request, tenant):
            return JSONResponse(method(tenant, await body_json(request)))

        return handler

    def future(method):
        """A route whose JSON body goes to ``method(tenant, body)``, answered with its future's id."""

        async def handler(request, tenant):
            return _future(method(tenant, await body_json(request)))

        return handler

    def by_path(method, name):
        """A route whose path names the object: ``method(tenant, path_params[name])``."""

        async def handler(request, tenant):
            return JSONResponse(method(tenant, request.path_params[name]))

        return handler

    async def client_config(request, tenant):
        return JSONResponse(service.client_config())

    async def heartbeat(request, tenant):
        service.session(tenant, (await body_json(request)).get("session_id"))
        return JSONResponse({"type": "session_heartbeat"})

    async def finish_session(request, tenant):
        await service.finish_session(tenant, request.path_params["session_id"])
        return JSONResponse({})

    async def telemetry(request, tenant):
        return JSONResponse({"status": "accepted"})

    async def capabilities(request, tenant):
        return JSONResponse(service.capabilities())

    async def forward_backward(request, tenant):  # a protobuf body
        return _future(service.forward_backward(tenant, await _body(request)))

    async def asample(request, tenant):
        future, ids = service.asample(tenant, await body_json(request))
        return _future(future, sample_sequence_ids=ids)

    async def retrieve_future(request, tenant):
        payload, content_type = await service.retrieve(tenant, await body_json(request))
        return Response(payload, media_type=content_type)

    async def training_runs(request, tenant):
        limit = _int_param(request, "limit", 20)
        return JSONResponse(service.training_runs(tenant, limit, _int_param(request, "offset", 0)))

    async def healthz(request):
        return JSONResponse({"status": "ok"})

    routes = [
        Route(PREFIX + "/healthz", healthz, methods=["GET"]),
        route("/client/config", client_config),
        route("/create_session", answer(service.create_session)),
        route("/session_heartbeat", heartbeat),
        route("/sessions/{session_id}/finish", finish_session),
        route("/telemetry", telemetry),
        route("/get_server_capabilities", capabilities, methods=("GET",)),
        route("/create_model", future(service.create_model)),
        route("/get_info", answer(service.get_info)),
        route("/unload_model", future(service.unload_model)),
        route("/forward_backward", forward_backward),
        route("/forward", forward_backward),
        route("/optim_step", future(service.optim_step)),
        route("/save_weights", future(service.save_weights)),
        route("/save_weights_for_sampler", future(service.save_weights_for_sampler)),
        route("/load_weights", future(service.load_weights)),
        route("/create_sampling_session", answer(service.create_sampling_session)),
        route("/samplers/{sampler_id:path}", by_path(service.get_sampler, "sampler_id"), methods=("GET",)),
        route("/asample", asample),
        route("/retrieve_future", retrieve_future),
        route("/weights_info", answer(service.weights_info)),
        route("/training_runs", training_runs, methods=("GET",)),
        route("/training_runs/{run_id}", by_path(service.training_run, "run_id"), methods=("GET",)),
        route("/training_runs/{run_id}/checkpoints", by_path(service.checkpoints, "run_id"), methods=("GET",)),
    ]
    return Starlette(routes=routes)


async def _body(request: Request) -> bytes:
    raw = await request.body()
    if request.headers.get("content-encoding", "").lower() == "zstd":
        import zstandard

        try:
            raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=MAX_DECOMPRESSED_BYTES)
        except zstandard.ZstdError as exc:
            raise RequestError(f"body: not a zstd frame ({exc})") from None
    return raw


def _int_param(request: Request, name: str, default: int) -> int:
    value = request.query_params.get(name)
    try:
        number = default if value is None else int(value)
    except ValueError:
        raise RequestError(f"{name}: {value!r} is not an integer") from None
    if number < 0:
        raise RequestError(f"{name}: must be >= 0")
    return number
