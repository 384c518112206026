"""``rlpost serve``: Ray (a local cluster, or the one at ``resources.address``), the fleet, the
HTTP server, until Ctrl-C or SIGTERM; then the server stops taking requests and the fleet stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

from rlpost.config import ServeConfig
from rlpost.serve.access import ApiKeys
from rlpost.serve.app import build_app
from rlpost.serve.fleet import NAMESPACE, ServiceFleet
from rlpost.serve.service import Service
from rlpost.serve.storage import Storage

log = logging.getLogger("rlpost")


def resolved_base_model(cfg: ServeConfig) -> str:
    """``base_model`` as the actors load it: an existing local folder as an absolute path."""
    path = Path(cfg.base_model).expanduser()
    return str(path.resolve()) if path.is_dir() else cfg.base_model


def local_model_names(cfg: ServeConfig) -> ServeConfig:
    """``cfg`` with a local base model's served name and tokenizer id made absolute, so that a
    client in another folder loads the same tokenizer."""
    base = resolved_base_model(cfg)
    if base == cfg.base_model or cfg.model_name is not None:
        return cfg
    return cfg.model_copy(update={"base_model": base, "tokenizer_id": cfg.tokenizer_id or base})


class RunningServer:
    """A started service: its fleet, its HTTP server and the URL it listens on."""

    def __init__(self, cfg: ServeConfig, keys: ApiKeys, fleet: ServiceFleet):
        import uvicorn

        self.cfg, self.fleet = cfg, fleet
        self.service = Service(cfg, fleet, Storage(cfg.storage_dir))
        config = uvicorn.Config(build_app(self.service, keys), host=cfg.host, port=cfg.port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=5)  # fmt: skip
        self.server = uvicorn.Server(config)

    @property
    def url(self) -> str:
        (sock,) = [s for server in self.server.servers for s in server.sockets][:1]
        host, port = sock.getsockname()[:2]
        return f"http://{host}:{port}"

    async def serve(self, on_ready: Callable[[str], None] | None = None) -> None:
        """Serve until :meth:`stop` (or a signal, when uvicorn installs its handlers)."""
        task = asyncio.get_running_loop().create_task(self.server.serve())
        while not self.server.started and not task.done():
            await asyncio.sleep(0.05)
        if self.server.started and on_ready is not None:
            on_ready(self.url)
        await task

    def stop(self) -> None:
        self.server.should_exit = True


def run_server(cfg: ServeConfig) -> int:
    """``rlpost serve``: returns the exit code once stopped (0)."""
    import ray

    logging.basicConfig(level=logging.INFO, format="%(asctime)s rlpost %(levelname)s %(message)s")
    keys = ApiKeys.load(cfg.api_keys_file)
    cfg = local_model_names(cfg)
    address = cfg.resources.address or os.environ.get("RAY_ADDRESS")
    from rlpost.runtime.ray_start import RUN_ENV_VARS

    env = {"env_vars": dict(RUN_ENV_VARS)}
    if address:
        ray.init(address=address, namespace=NAMESPACE, runtime_env=env, log_to_driver=True)
    else:
        ray.init(namespace=NAMESPACE, runtime_env=env, include_dashboard=False, log_to_driver=False)
    try:
        print(f"rlpost serve: starting the trainer and {cfg.inference_workers} inference worker(s) on "
              f"{cfg.base_model}", flush=True)  # fmt: skip
        fleet = ServiceFleet.start(cfg, resolved_base_model(cfg))
        try:
            running = RunningServer(cfg, keys, fleet)
            say = lambda url: print(  # noqa: E731
                f"rlpost serve: the Tinker API on {url} (TINKER_BASE_URL={url}); tenants: "
                f"{', '.join(sorted(keys.tenants))}; storage: {Path(cfg.storage_dir).resolve()}",
                flush=True,
            )
            asyncio.run(running.serve(on_ready=say))
        finally:
            print("rlpost serve: stopping the fleet", flush=True)
            fleet.stop()
    finally:
        ray.shutdown()
    return 0
