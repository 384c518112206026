"""Whether the cluster gave an actor a place: a bounded wait for resources it may never have.

Trap: an actor that asks for what no node has stays PENDING_CREATION for ever and every call
into it waits (an autoscaler only logs it). So the public pieces that start actors of their own
(AsyncVLLM, RayReplayBuffer, RayLLMCollector) wait here at most ``placement_timeout_s``, then fail
naming each actor still waiting, what it asks for and what the cluster has. An actor is placed
once Ray started its process (a pid), whether or not its constructor returned.
"""

from __future__ import annotations

import time
from typing import Any

from rlpost.runtime.actors import actor_record

PLACEMENT_TIMEOUT_S = 120.0  # the default bound of a public piece's wait for its actors' resources
POLL_S = 0.1


class ResourcesUnavailable(RuntimeError):
    """The cluster gave no place to an actor within the wait: no node has what it asks for."""


def placed(handle: Any) -> bool:
    """Whether Ray started a process for the actor ``handle`` (or it ended: its death is its
    callers' news), from the actor's record in Ray's control store (none yet: not placed). An
    object that is no actor handle (an in-process stand-in) needs no place."""
    if not hasattr(handle, "_actor_id"):
        return True
    record = actor_record(handle)
    return bool(record.get("Pid")) or record.get("State") in ("DEAD", "ALIVE")


def wait_until_placed(actors: dict[str, tuple[Any, dict[str, float]]], timeout_s: float, what: str) -> None:
    """Wait until every actor of ``actors`` (name -> (handle, what it asks for, e.g. ``{"GPU":
    1.0}``)) is placed, at most ``timeout_s``; raises ResourcesUnavailable naming those still
    waiting, their asks, and the cluster's resources (in all, and free now)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        waiting = {name: asks for name, (handle, asks) in actors.items() if not placed(handle)}
        if not waiting:
            return
        if time.monotonic() >= deadline:
            asked = "; ".join(f"{name} asks for {_resources(asks)}" for name, asks in waiting.items())
            raise ResourcesUnavailable(
                f"{what}: no node of the cluster took it within {timeout_s:.0f} s (placement_timeout_s): "
                f"{asked}; the cluster has {_resources(ray.cluster_resources())}, "
                f"{_resources(ray.available_resources())} of it free. Add a node with these resources, ask for "
                "less, or raise placement_timeout_s while an autoscaler adds nodes"
            )
        time.sleep(POLL_S)


def asks_of(options: dict[str, Any]) -> dict[str, float]:
    """What an actor started with Ray's actor ``options`` asks for (Ray's default: one CPU)."""
    asks = {"CPU": options.get("num_cpus", 1), "GPU": options.get("num_gpus", 0), **options.get("resources", {})}
    return {name: float(amount) for name, amount in asks.items() if amount}


def _resources(amounts: dict[str, float]) -> str:
    """The resources a person reads (CPU, GPU, memory and custom ones; not Ray's per-node and
    per-bundle bookkeeping entries)."""
    shown = {
        name: round(amount, 2)
        for name, amount in amounts.items()
        if amount
        and not name.startswith(("node:", "bundle_group_", "object_store_memory", "memory"))
        and "_group_" not in name
    }
    return str(shown or {})
