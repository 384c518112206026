"""Starting Ray for a run (a local cluster with its dashboard, or a connection to a cluster), and
the runtime env every process of a run gets."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from rlpost.config import JobConfig

log = logging.getLogger("rlpost")

# Set for every process of a run (its Ray runtime_env); resources.env_vars may override them.
# TOKENIZERS_PARALLELISM: off (it warns after a fork; the actors already run in parallel).
# THP_MEM_ALLOC_ENABLE: torch puts CPU tensors >= 2 MB on transparent huge pages; read once at a
#   process's start (vLLM forks its engines), so it must be in the actors' environment from the
#   start. Without it a vLLM CPU weight reload faults in every 4 KB page: on the 0.5B-shaped model
#   a reload took 3.0 s instead of 2.3 s (first 5.3 s vs 3.6 s), for 50 MB more resident memory.
RUN_ENV_VARS = {"TOKENIZERS_PARALLELISM": "false", "THP_MEM_ALLOC_ENABLE": "1"}


def run_env_vars(cfg: JobConfig) -> dict[str, str]:
    """The environment variables of every process of the run: :data:`RUN_ENV_VARS` with
    ``resources.env_vars`` over them, and PYTHONHASHSEED (``resources.python_hash_seed``)."""
    return {**RUN_ENV_VARS, **cfg.resources.env_vars, "PYTHONHASHSEED": str(cfg.resources.python_hash_seed)}


# what a script's Ray workers get from the driver's environment when it has them (credentials and
# caches of the hubs a run reads from and logs to)
PROPAGATED_ENV_VARS = ("WANDB_API_KEY", "HF_TOKEN", "HF_HOME")

# gitignore patterns never uploaded with the working dir (`rlpost submit`, merge_ray_runtime_env).
# No trailing slash: the pattern matches the folder itself, so Ray's packer skips it whole instead
# of walking every file of .venv.
WORKING_DIR_EXCLUDES = (".git", ".venv", "venv", ".cache", "runs", "__pycache__", "*.egg-info", ".pytest_cache",
                        "*.pyc", "/build", "/dist")  # fmt: skip


def get_ray_default_runtime_env() -> dict:
    """TorchRL's ``get_ray_default_runtime_env``: the runtime env every upload of a working dir
    starts from, ``{"excludes": [...]}`` (what ``rlpost submit`` leaves out)."""
    return {"excludes": list(WORKING_DIR_EXCLUDES)}


def merge_ray_runtime_env(ray_init_config: dict) -> dict:
    """TorchRL's ``merge_ray_runtime_env``: complete a script's ``ray.init(**ray_init_config)``
    arguments (in place, returned) with rlpost submit's excludes after the script's own, and
    :data:`RUN_ENV_VARS` and the driver's :data:`PROPAGATED_ENV_VARS`; the script's values win."""
    runtime_env = dict(ray_init_config.get("runtime_env") or {})
    excludes = list(runtime_env.get("excludes") or [])
    defaults = get_ray_default_runtime_env()["excludes"]
    runtime_env["excludes"] = excludes + [path for path in defaults if path not in excludes]
    env_vars = {**RUN_ENV_VARS, **{key: os.environ[key] for key in PROPAGATED_ENV_VARS if os.environ.get(key)}}
    runtime_env["env_vars"] = env_vars | dict(runtime_env.get("env_vars") or {})
    ray_init_config["runtime_env"] = runtime_env
    return ray_init_config


def init_ray(cfg: JobConfig) -> bool:
    """Start Ray for the run (once, before any actor), or connect to ``resources.address`` (else
    RAY_ADDRESS), in the namespace ``rlpost-<run_name>``, and print one line saying where to watch
    the run (:func:`_ray_start_line`). True when this call started or connected Ray (the caller
    shuts it down); False when Ray was already up (nothing started or printed). With
    ``logging.dashboard`` a local run passes ``include_dashboard=None``: Ray starts the dashboard
    on 127.0.0.1:``logging.dashboard_port`` when it can, else runs without it (a warning says so)."""
    import ray

    namespace = f"rlpost-{cfg.logging.run_name}"
    address = cfg.resources.address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return False
    env = {"env_vars": run_env_vars(cfg)}
    if address:
        use_ray_token_if_present()
        context = ray.init(address=address, namespace=namespace, runtime_env=env, log_to_driver=True)
        print(_ray_start_line(namespace, _http_url(context.dashboard_url), None, cluster=address), flush=True)
        return True
    if cfg.logging.dashboard:
        context = ray.init(namespace=namespace, runtime_env=env, include_dashboard=None, dashboard_host="127.0.0.1",
                           dashboard_port=cfg.logging.dashboard_port, log_to_driver=False)  # fmt: skip
        dashboard = _http_url(context.dashboard_url)
        if dashboard is None:
            why = _why_no_dashboard(context.dashboard_url)
            log.warning("Ray's dashboard did not start (%s); the run goes on without it", why)
    else:
        ray.init(namespace=namespace, runtime_env=env, include_dashboard=False, log_to_driver=False)
        dashboard = None
    print(_ray_start_line(namespace, dashboard, local_metrics_url()), flush=True)
    return True


def _http_url(address: str | None) -> str | None:
    """The dashboard address Ray reports (``host:port``, or a URL when RAY_OVERRIDE_DASHBOARD_URL
    sets one) as an http URL; None when Ray reports none (no dashboard, or a minimal install)."""
    if not address:
        return None
    return address if "://" in address else f"http://{address}"


def _why_no_dashboard(reported: str | None) -> str:
    """Why a local dashboard did not start: Ray reports "" when its packages are missing and None
    when its process could not start (Ray logged why just before)."""
    if reported == "":
        try:
            import ray.dashboard.optional_deps  # noqa: F401
        except ImportError as exc:
            return f"its packages are missing: {exc}; pip install 'ray[default]'"
        return "Ray runs without its web UI here"
    return "see Ray's error above: the port taken, or the dashboard process failing"


def local_metrics_url() -> str | None:
    """The Prometheus endpoint of this driver's Ray node, where the run's ``rlpost_*`` gauges are
    exported (Ray picks its port); None when Ray does not report one."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("MetricsExportPort"):
            return f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"
    return None


def _ray_start_line(namespace: str, dashboard: str | None, metrics: str | None, cluster: str | None = None) -> str:
    """The line ``rlpost train`` prints once Ray is up, e.g. ``rlpost: Ray dashboard at
    http://127.0.0.1:8265 (namespace rlpost-r1); metrics at http://127.0.0.1:50123/metrics``;
    with token authentication (RAY_AUTH_MODE=token) it says where the login token comes from."""
    head = f"Ray dashboard at {dashboard}" if dashboard is not None else "no Ray dashboard"
    parts = ([f"Ray cluster at {cluster}"] if cluster else []) + [f"{head} (namespace {namespace})"]
    if metrics is not None:
        parts.append(f"metrics at {metrics}")
    if dashboard is not None and os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        parts.append("dashboard login: the token `ray get-auth-token` prints")
    return "rlpost: " + "; ".join(parts)


def use_ray_token_if_present() -> None:
    """Authenticate to an existing cluster the way Ray's CLI does. Trap: Ray 2.60 clusters use
    token auth by default, but a driver only sends a token with RAY_AUTH_MODE=token: turn it on
    when unset and a token exists (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token)."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    token_path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if os.environ.get("RAY_AUTH_TOKEN") or token_path.is_file():
        os.environ["RAY_AUTH_MODE"] = "token"
        # Ray caches its config at import (vLLM imports Ray early): re-read it, as Ray's CLI does
        from ray._raylet import Config

        Config.initialize("")
