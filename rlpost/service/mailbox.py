"""A running job's mailbox: how ``rlpost scale`` (or :func:`scale_run`) reaches its driver.

The driver starts one small actor per run, ``control`` in Ray namespace ``rlpost-<run_name>``.
An operator's request is checked and left there; the supervisor takes it at its next health
check (every few seconds while the loop waits) and reports the fleet's sizes back::

    rlpost scale runs/r1 inference=3 env_pools=2  ->  control.request(inference=3, env_pools=2)
    supervisor (health check)  ->  control.exchange(fleet) -> {"inference": 3, "env_pools": 2}
                               ->  resize the inference fleet, then the env pools

A request the config does not allow (:func:`check_scale_request`) is refused at once, naming the
bound; nothing about the run changes. With the load policy on (``rollout.autoscale``) a count
pins the role; ``KEY=auto`` (:data:`AUTO`) hands it back to the policy.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

CONTROL_ACTOR = "control"
SCALE_KEYS = ("inference", "env_pools")  # what `rlpost scale` changes: KEY=N
SERVICE_KEYS = ("inference",)  # what it changes of `rlpost serve`
# each key's words in messages, and the config keys that bound it
_ROLE = {
    "inference": ("inference worker", "rollout.num_inference_workers / rollout.max_inference_workers"),
    "env_pools": ("env pool", "rollout.num_env_pools / rollout.max_env_pools: the prompt stream's shards"),
}
Bounds = dict[str, tuple[int, int | None]]  # scale key -> (least, most; None: no bound)
AUTO = "auto"  # `rlpost scale RUN_DIR inference=auto`: the load policy sizes the role again (releases a pin)


def check_scale_request(bounds: Bounds, request: dict[str, int | str], keys: tuple[str, ...] = SCALE_KEYS,
                        auto_keys: tuple[str, ...] | None = None) -> None:  # fmt: skip
    """ValueError naming the key and its bound for an unknown key, nothing asked, fewer than one,
    or a count outside ``bounds`` (``RolloutConfig.scale_bounds``; a key missing there is unbounded).
    ``keys``: the keys this fleet has (``rlpost serve``'s: inference only); ``auto_keys``: those its
    load policy sizes, the only ones :data:`AUTO` may name (None: not known here, so any)."""
    if not request:
        raise ValueError("nothing to change: give inference=N and/or env_pools=M")
    for key, count in request.items():
        if key not in keys:
            raise ValueError(f"{key}: not a scale key of this fleet (give {' and/or '.join(f'{k}=N' for k in keys)})")
        role, config_keys = _ROLE[key]
        if count == AUTO:
            if auto_keys is not None and key not in auto_keys:
                raise ValueError(f"{key}={AUTO}: the run's load policy does not size its {role}s (rollout.autoscale."
                                 f"enabled and a range {config_keys.split(':')[0]}); give a number")  # fmt: skip
            continue
        if isinstance(count, bool) or not isinstance(count, int):
            raise ValueError(f"{key}: a whole number of {role}s, got {count!r}")
        if count < 1:
            raise ValueError(f"{key}={count}: a run needs at least one {role}")
        low, high = bounds.get(key, (1, None))
        if count < low or (high is not None and count > high):
            top = "" if high is None else f"..{high}"
            if keys == SERVICE_KEYS:
                raise ValueError(f"{key}={count} is outside the service's range {low}{top} (inference_workers / "
                                 "max_inference_workers); start it again with a wider range to go beyond it")  # fmt: skip
            raise ValueError(
                f"{key}={count} is outside the run's range {low}{top} ({config_keys}); "
                "resume the run with a wider range to go beyond it"
            )


class RunControl:
    """The mailbox (a Ray actor in a run; a plain object in tests): the request waiting, and the
    fleet's sizes as the driver last reported them."""

    def __init__(self, bounds: Bounds, keys: tuple[str, ...] = SCALE_KEYS, auto_keys: tuple[str, ...] = ()):
        self.bounds = {key: tuple(value) for key, value in bounds.items()}
        self.keys, self.auto_keys = tuple(keys), tuple(auto_keys)
        self.requested: dict[str, int] = {}
        self.sizes: dict[str, int] = {}

    def request(self, **counts: int) -> dict[str, Any]:
        """Leave a request (ValueError when not allowed); a later one for a key replaces one not
        taken yet. Returns the fleet as last reported."""
        check_scale_request(self.bounds, counts, self.keys, self.auto_keys)
        self.requested.update(counts)
        return {"requested": dict(self.requested), **self.sizes}

    def exchange(self, sizes: dict[str, int]) -> dict[str, int]:
        """The driver's side: report the fleet's ``sizes`` and take the waiting request (empty: none)."""
        self.sizes = dict(sizes)
        requested, self.requested = self.requested, {}
        return requested

    def fleet(self) -> dict[str, Any]:
        """The fleet as last reported, and a request not taken yet (None: none)."""
        return {"requested": dict(self.requested) or None, **self.sizes}


def start_control(bounds: Bounds, keys: tuple[str, ...] = SCALE_KEYS, auto_keys: tuple[str, ...] = (),
                  **options: Any):  # fmt: skip
    """The run's ``control`` actor (no CPU; ``options`` go to Ray's actor options)."""
    from rlpost.runtime.liveness import remote_class

    remote = remote_class(RunControl).options(name=CONTROL_ACTOR, num_cpus=0, max_restarts=0, **options)
    return remote.remote(bounds, keys, auto_keys)


def _control(namespace: str):
    """The ``control`` actor of the run in Ray ``namespace`` (LookupError: no run there)."""
    import ray

    try:
        return ray.get_actor(CONTROL_ACTOR, namespace=namespace)
    except ValueError:
        raise LookupError(f"no running rlpost run in Ray namespace {namespace!r}") from None


def scale_run(namespace: str, inference: int | str | None = None, env_pools: int | str | None = None, *,
              timeout_s: float = 30.0) -> dict[str, Any]:  # fmt: skip
    """Ask the run in Ray ``namespace`` of the connected cluster for ``inference`` workers and/or
    ``env_pools`` (None: unchanged; AUTO: back to the load policy). Returns the fleet as last reported (the change happens at the
    next health check). LookupError: no run there; ValueError: the request is not allowed."""
    import ray

    counts = {k: v for k, v in (("inference", inference), ("env_pools", env_pools)) if v is not None}
    try:
        return ray.get(_control(namespace).request.remote(**counts), timeout=timeout_s)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, ValueError):  # refused: the message names the bound
            raise ValueError(str(exc.cause)) from None
        raise


def run_fleet(namespace: str, *, timeout_s: float = 30.0) -> dict[str, Any]:
    """The fleet of the run in Ray ``namespace`` as it last reported it (LookupError: no run)."""
    import ray

    return ray.get(_control(namespace).fleet.remote(), timeout=timeout_s)


def parse_scale_request(changes: list[str]) -> dict[str, int | str]:
    """The counts asked for by ``key=value`` words (a value ``auto``: :data:`AUTO`); ValueError
    naming a bad word (or none given)."""
    asked: dict[str, int | str] = {}
    for word in changes:
        key, sep, value = word.partition("=")
        if not sep or key not in SCALE_KEYS:
            raise ValueError(f"{word!r}: give inference=N and/or env_pools=M (the workers the run should have)")
        if value == AUTO:
            asked[key] = AUTO
            continue
        try:
            asked[key] = int(value)
        except ValueError:
            raise ValueError(f"{key}={value!r}: a whole number") from None
    if not asked:
        raise ValueError("nothing to change: give inference=N and/or env_pools=M")
    return asked


SERVICE_FILE = "rlpost-serve.json"  # in a service's storage_dir: its Ray address, namespace and scale bounds


def run_namespace(run_dir: Path) -> tuple[str, str, Bounds]:
    """(Ray address, Ray namespace, scale bounds) of the run in ``run_dir``, from its config.yaml
    and the ``ray_address`` file its driver writes, or of the service whose storage folder it is
    (its SERVICE_FILE); LookupError naming what is missing."""
    import json

    from rlpost.config import load_config

    if (run_dir / SERVICE_FILE).is_file():
        service = json.loads((run_dir / SERVICE_FILE).read_text())
        return service["address"], service["namespace"], {k: tuple(v) for k, v in service["bounds"].items()}
    if not (run_dir / "config.yaml").is_file():
        raise LookupError(f"{run_dir}: not a run directory (no config.yaml) nor a service's storage folder "
                          f"(no {SERVICE_FILE})")  # fmt: skip
    cfg = load_config(run_dir / "config.yaml")
    address_file = run_dir / "ray_address"
    if not address_file.is_file():
        raise LookupError(f"{run_dir}: the run never started (no ray_address file)")
    name = cfg.logging.run_name or run_dir.name
    return address_file.read_text().strip(), f"rlpost-{name}", cfg.rollout.scale_bounds()


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """LookupError when nothing listens at Ray's GCS ``address``: connecting would only wait."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError):
        raise LookupError(f"the run's Ray cluster at {address} does not answer: the run is not running") from None


def wait_for_fleet(namespace: str, request: dict[str, int], wait_s: float, *, poll_s: float = 2.0) -> dict[str, Any]:
    """Poll the run's fleet until it has what ``request`` asked for and no other request waits,
    at most ``wait_s``; returns the last report (the caller compares)."""
    deadline = time.monotonic() + wait_s
    fleet = run_fleet(namespace)
    while time.monotonic() < deadline and not fleet_reached(fleet, request):
        time.sleep(poll_s)
        fleet = run_fleet(namespace)
    return fleet


# scale key -> (the serving count, the wanted count, the vacant count) in a fleet report
FLEET_KEYS = {
    "inference": ("inference_workers", "inference_workers_target", "inference_workers_vacant"),
    "env_pools": ("env_pools", "env_pools_target", "env_pools_vacant"),
}


def fleet_reached(fleet: dict[str, Any], request: dict[str, int]) -> bool:
    """Whether ``fleet`` (a report of the run's mailbox) serves every count of ``request``."""
    if fleet.get("requested"):
        return False
    counts = {key: n for key, n in request.items() if n != AUTO}  # a release is reached once taken
    return all(fleet.get(FLEET_KEYS[key][0]) == n == fleet.get(FLEET_KEYS[key][1]) for key, n in counts.items())


def describe_fleet(fleet: dict[str, Any], key: str = "inference") -> str:
    """``2 serving of 3 wanted, 1 waiting for room in the cluster`` for role ``key`` of a mailbox
    report or a metrics line."""
    serving, wanted, vacant = FLEET_KEYS[key]
    if serving not in fleet:
        return "not reported yet"
    text = f"{fleet[serving]} serving of {fleet.get(wanted, '?')} wanted"
    if fleet.get(vacant):
        text += f", {fleet[vacant]} waiting for room in the cluster"
    return text


def fleet_lines(fleet: dict[str, Any]) -> list[str]:
    """``inference workers: 2 serving of 3 wanted, ...`` for each role ``fleet`` reports."""
    return [f"{_ROLE[key][0]}s: {describe_fleet(fleet, key)}" for key in SCALE_KEYS if FLEET_KEYS[key][0] in fleet]


def describe_request(request: dict[str, int | str]) -> str:
    """``3 inference workers and 2 env pools`` (``inference workers by load``) for a scale request."""
    return " and ".join(f"{_ROLE[key][0]}s by load" if n == AUTO else f"{n} {_ROLE[key][0]}s"
                        for key, n in request.items())  # fmt: skip
