"""A running job's mailbox: how ``rlpost scale`` (or :func:`scale_run`) reaches its driver.

The driver starts one small actor per run, ``control`` in the run's Ray namespace
(``rlpost-<run_name>``). An operator's request is checked and left there; the supervisor takes
it at its next health check (every few seconds while the loop waits on the pools or the buffer)
and reports the fleet's sizes back, so the request's answer says what the run has now::

    rlpost scale runs/r1 inference=3       ->  control.request(inference=3)
    supervisor (health check)              ->  control.exchange(fleet) -> 3 -> resize the fleet

Requests outside what the config allows (:func:`check_scale_request`) are refused at once with a
message naming the bound; nothing about the run changes.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

CONTROL_ACTOR = "control"
SCALE_KEYS = ("inference", "env_pools")


def check_scale_request(bounds: tuple[int, int | None], inference: int) -> None:
    """Raise ValueError naming the bound when ``inference`` workers are not allowed: fewer than
    one, or outside ``bounds`` (rollout.num_inference_workers's range, when it gives one)."""
    low, high = bounds
    if isinstance(inference, bool) or not isinstance(inference, int):
        raise ValueError(f"inference: a whole number of workers, got {inference!r}")
    if inference < 1:
        raise ValueError(f"inference={inference}: a run needs at least one inference worker")
    if inference < low or (high is not None and inference > high):
        top = "" if high is None else f"..{high}"
        raise ValueError(
            f"inference={inference} is outside the run's range {low}{top} (rollout.num_inference_workers / "
            "rollout.max_inference_workers); resume the run with a wider range to go beyond it"
        )


class RunControl:
    """The mailbox (a Ray actor in a run; a plain object in tests): the last request waiting,
    and the fleet's sizes as the driver last reported them."""

    def __init__(self, bounds: tuple[int, int | None]):
        self.bounds = tuple(bounds)
        self.requested: int | None = None
        self.sizes: dict[str, int] = {}

    def request(self, inference: int) -> dict[str, Any]:
        """Leave a request for ``inference`` workers (ValueError when not allowed; a later
        request replaces one not taken yet). Returns the fleet as last reported."""
        check_scale_request(self.bounds, inference)
        self.requested = inference
        return {"requested": inference, **self.sizes}

    def exchange(self, sizes: dict[str, int]) -> int | None:
        """The driver's side: report the fleet's ``sizes`` and take the waiting request (None)."""
        self.sizes = dict(sizes)
        requested, self.requested = self.requested, None
        return requested

    def fleet(self) -> dict[str, Any]:
        """The fleet as last reported, and a request not taken yet."""
        return {"requested": self.requested, **self.sizes}


def start_control(bounds: tuple[int, int | None], **options: Any):
    """The run's ``control`` actor (no CPU; ``options`` go to Ray's actor options)."""
    import ray

    remote = ray.remote(RunControl).options(name=CONTROL_ACTOR, num_cpus=0, max_restarts=0, **options)
    return remote.remote(bounds)


def _control(namespace: str):
    """The ``control`` actor of the run in Ray ``namespace`` (LookupError: no run there)."""
    import ray

    try:
        return ray.get_actor(CONTROL_ACTOR, namespace=namespace)
    except ValueError:
        raise LookupError(f"no running rlpost run in Ray namespace {namespace!r}") from None


def scale_run(namespace: str, inference: int, *, timeout_s: float = 30.0) -> dict[str, Any]:
    """Ask the run in Ray ``namespace`` (``rlpost-<run_name>``) of the cluster this process is
    connected to (``ray.init``) for ``inference`` workers. Returns the fleet as the run last
    reported it (the change happens at its next health check). Raises LookupError when no run
    is there, ValueError when the request is not allowed."""
    import ray

    try:
        return ray.get(_control(namespace).request.remote(inference), timeout=timeout_s)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, ValueError):  # refused: the message names the bound
            raise ValueError(str(exc.cause)) from None
        raise


def run_fleet(namespace: str, *, timeout_s: float = 30.0) -> dict[str, Any]:
    """The fleet of the run in Ray ``namespace`` as it last reported it (LookupError: no run)."""
    import ray

    return ray.get(_control(namespace).fleet.remote(), timeout=timeout_s)


def parse_scale_request(changes: list[str]) -> int:
    """The inference workers asked for by ``key=value`` words (``inference=N``). Raises
    ValueError naming the bad word: an unknown key, a value that is not a whole number, or
    ``env_pools`` (a running job's env pools are not resized: resume it with
    rollout.num_env_pools=M)."""
    asked: dict[str, str] = {}
    for word in changes:
        key, sep, value = word.partition("=")
        if not sep or key not in SCALE_KEYS:
            raise ValueError(f"{word!r}: give inference=N (the inference workers the run should have)")
        asked[key] = value
    if "env_pools" in asked:
        raise ValueError(
            "env_pools: a running job's env pools are not resized (each owns a share of the prompt stream); "
            "stop it and resume with rollout.num_env_pools=M"
        )
    if "inference" not in asked:
        raise ValueError("nothing to change: give inference=N")
    try:
        return int(asked["inference"])
    except ValueError:
        raise ValueError(f"inference={asked['inference']!r}: a whole number of workers") from None


def run_namespace(run_dir: Path) -> tuple[str, str, tuple[int, int | None]]:
    """(Ray address, Ray namespace, scale bounds) of the run in ``run_dir``, from its
    config.yaml and the ``ray_address`` file its driver writes. Raises LookupError naming what
    is missing."""
    from rlpost.config import load_config

    if not (run_dir / "config.yaml").is_file():
        raise LookupError(f"{run_dir}: not a run directory (no config.yaml)")
    cfg = load_config(run_dir / "config.yaml")
    address_file = run_dir / "ray_address"
    if not address_file.is_file():
        raise LookupError(f"{run_dir}: the run never started (no ray_address file)")
    name = cfg.logging.run_name or run_dir.name
    return address_file.read_text().strip(), f"rlpost-{name}", cfg.rollout.inference_worker_bounds()


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Raise LookupError when nothing listens at Ray's GCS ``address`` (host:port): the run's
    cluster is gone, and connecting to it would only wait."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError):
        raise LookupError(f"the run's Ray cluster at {address} does not answer: the run is not running") from None


def wait_for_fleet(namespace: str, inference: int, wait_s: float, *, poll_s: float = 2.0) -> dict[str, Any]:
    """Poll the run's fleet until ``inference`` workers serve and no other request waits, at
    most ``wait_s``; returns the last report (the caller compares)."""
    deadline = time.monotonic() + wait_s
    fleet = run_fleet(namespace)
    while time.monotonic() < deadline and not fleet_reached(fleet, inference):
        time.sleep(poll_s)
        fleet = run_fleet(namespace)
    return fleet


def fleet_reached(fleet: dict[str, Any], inference: int) -> bool:
    return fleet.get("requested") is None and fleet.get("inference_workers") == inference == fleet.get(
        "inference_workers_target"
    )


def describe_fleet(fleet: dict[str, Any]) -> str:
    """``2 serving of 3 wanted, 1 waiting for room``, from a report of the run's mailbox or a metrics line."""
    if "inference_workers" not in fleet:
        return "not reported yet"
    text = f"{fleet['inference_workers']} serving of {fleet.get('inference_workers_target', '?')} wanted"
    if fleet.get("inference_workers_vacant"):
        text += f", {fleet['inference_workers_vacant']} waiting for room in the cluster"
    return text
