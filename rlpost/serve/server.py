"""``rlpost serve``: Ray (a local cluster, or the one at ``resources.address``), the fleet, the
HTTP server, until Ctrl-C or SIGTERM; then the server stops taking requests and the fleet stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from rlpost.config import ServeConfig
from rlpost.runtime.ray_start import RUN_ENV_VARS, local_metrics_url, use_ray_token_if_present
from rlpost.serve.access import ApiKeys
from rlpost.serve.app import build_app
from rlpost.serve.fleet import NAMESPACE, ServiceFleet
from rlpost.serve.scaling import take_scale_requests
from rlpost.serve.service import Service
from rlpost.serve.storage import Storage
from rlpost.service.mailbox import SERVICE_FILE

log = logging.getLogger("rlpost")

MAILBOX_TIMEOUT_S = 30.0  # one exchange with the control actor


def with_local_paths(cfg: ServeConfig) -> ServeConfig:
    """``cfg`` with a local base model as an absolute path (what the actors load), and, unless a
    ``model_name`` stands for it, as the served name and tokenizer id too, so that a client in
    another folder loads the same tokenizer."""
    path = Path(cfg.base_model).expanduser()
    if not path.is_dir():
        return cfg  # a hub name
    base = str(path.resolve())
    tokenizer = cfg.tokenizer_id or (base if cfg.model_name is None else None)
    return cfg.model_copy(update={"base_model": base, "tokenizer_id": tokenizer})


def _uvicorn_server(config):
    """A ``uvicorn.Server`` that stops on SIGINT and SIGTERM and remembers which came, without
    raising the signal again once stopped (uvicorn's own does, which would end this process before
    the fleet is stopped)."""
    import uvicorn

    class Server(uvicorn.Server):
        stopped_by: int | None = None

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return

            def stop(signum, frame):
                self.force_exit = self.should_exit  # a second signal: stop without waiting for requests
                self.should_exit, self.stopped_by = True, signum

            previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)

    return Server(config)


class RunningServer:
    """A started service: its fleet, its HTTP server and the URL it listens on."""

    def __init__(self, cfg: ServeConfig, keys: ApiKeys, fleet: ServiceFleet,
                 exchange: Callable[[dict[str, int]], dict[str, int]] | None = None):  # fmt: skip
        """``exchange``: the mailbox's (``rlpost scale``), :func:`rlpost.serve.scaling.take_scale_requests`."""
        import uvicorn

        from rlpost.record.metrics import ServiceMetrics

        self.cfg, self.fleet, self.exchange = cfg, fleet, exchange
        self.service = Service(cfg, fleet, Storage(cfg.storage_dir), ServiceMetrics())
        config = uvicorn.Config(build_app(self.service, keys), host=cfg.host, port=cfg.port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=5)  # fmt: skip
        self.server = _uvicorn_server(config)

    @property
    def url(self) -> str:
        (sock,) = [s for server in self.server.servers for s in server.sockets][:1]
        host, port = sock.getsockname()[:2]
        return f"http://{host}:{port}"

    async def serve(self, on_ready: Callable[[str], None] | None = None) -> None:
        """Serve until :meth:`stop` (or a signal, when uvicorn installs its handlers), ending the
        sessions that go silent meanwhile and taking operators' scale requests."""
        loop = asyncio.get_running_loop()
        task = loop.create_task(self.server.serve())
        chores = [loop.create_task(self._end_silent_sessions())]
        if self.exchange is not None:
            chores.append(loop.create_task(take_scale_requests(self.service, self.exchange)))
        try:
            while not self.server.started and not task.done():
                await asyncio.sleep(0.05)
            if self.server.started and on_ready is not None:
                on_ready(self.url)
            await task
        finally:
            for chore in chores:
                chore.cancel()

    async def _end_silent_sessions(self) -> None:
        every_s = min(30.0, self.cfg.session_timeout_s / 4)
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.service.expire_silent()
            except Exception:  # noqa: BLE001 (logged; the next round tries again)
                log.exception("serve: ending the silent sessions failed")

    def stop(self) -> None:
        self.server.should_exit = True


def _open_mailbox(cfg: ServeConfig) -> Callable[[dict[str, int]], dict[str, int]]:
    """The service's ``control`` actor, and its address in ``storage_dir`` (SERVICE_FILE), where
    ``rlpost scale STORAGE_DIR inference=N`` finds it; returns its exchange."""
    import json

    import ray

    from rlpost.service.mailbox import SERVICE_KEYS, start_control

    bounds = cfg.scale_bounds()
    control = start_control(bounds, keys=SERVICE_KEYS)
    storage = Path(cfg.storage_dir)
    storage.mkdir(parents=True, exist_ok=True)
    (storage / SERVICE_FILE).write_text(json.dumps({"address": ray.get_runtime_context().gcs_address,
                                                    "namespace": NAMESPACE, "bounds": bounds}))  # fmt: skip
    return lambda sizes: ray.get(control.exchange.remote(sizes), timeout=MAILBOX_TIMEOUT_S)


def run_server(cfg: ServeConfig) -> int:
    """``rlpost serve``: serve until Ctrl-C or SIGTERM, then stop the fleet; the exit code (0, or
    128 + the signal's number after a signal, as ``rlpost train`` exits)."""
    import ray

    logging.basicConfig(level=logging.INFO, format="%(asctime)s rlpost %(levelname)s %(message)s")
    keys = ApiKeys.load(cfg.api_keys_file)
    cfg = with_local_paths(cfg)
    address = cfg.resources.address or os.environ.get("RAY_ADDRESS")
    env = {"env_vars": dict(RUN_ENV_VARS)}
    if address:
        use_ray_token_if_present()
        ray.init(address=address, namespace=NAMESPACE, runtime_env=env, log_to_driver=True)
    else:
        ray.init(namespace=NAMESPACE, runtime_env=env, include_dashboard=False, log_to_driver=False)
    print(f"rlpost serve: Ray cluster {address or 'started here'}; metrics at {local_metrics_url()}", flush=True)
    stopped_by = None
    try:
        print(f"rlpost serve: starting the trainer and {cfg.inference_workers} inference worker(s) on "
              f"{cfg.base_model}", flush=True)  # fmt: skip
        fleet = ServiceFleet.start(cfg, cfg.base_model)
        try:
            running = RunningServer(cfg, keys, fleet, exchange=_open_mailbox(cfg))

            def say(url: str) -> None:
                print(f"rlpost serve: the Tinker API on {url} (TINKER_BASE_URL={url}); tenants: "
                      f"{', '.join(sorted(keys.tenants))}; storage: {Path(cfg.storage_dir).resolve()}", flush=True)  # fmt: skip

            asyncio.run(running.serve(on_ready=say))
            stopped_by = running.server.stopped_by
        finally:
            print("rlpost serve: stopping the fleet", flush=True)
            (Path(cfg.storage_dir) / SERVICE_FILE).unlink(missing_ok=True)
            fleet.stop()
    finally:
        ray.shutdown()
    if stopped_by is None:
        return 0
    print(f"rlpost serve: stopped by {signal.Signals(stopped_by).name}", flush=True)
    return 128 + stopped_by
