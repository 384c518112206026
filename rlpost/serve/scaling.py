"""The service's inference workers resized while it serves (``rlpost scale STORAGE_DIR inference=N``).

The operator's request goes to the service's mailbox (the ``control`` actor of
:mod:`rlpost.service.mailbox`, in namespace ``rlpost-serve``), which the server looks at every
few seconds (:func:`take_scale_requests`), reporting the workers serving. :func:`scale_inference`
then grows or shrinks the workers: a new one starts (its engine up) and takes new samples from
then on; the highest ones leaving stop taking new samples, finish the calls they have, then end.
Samplers' adapters reach a new worker on their first use there, as they reach a replaced one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rlpost")

DRAIN_POLL_S = 0.1  # a leaving worker's calls are looked at this often


async def scale_inference(service: Any, count: int) -> None:
    """Grow or shrink ``service``'s inference workers to ``count`` (at least one)."""
    fleet = service.fleet
    while len(fleet.inference) < count:
        await asyncio.to_thread(fleet.add_inference)
        service.serving_workers = len(fleet.inference)
        log.warning("serve: inference-%d joined; %d inference workers serve", len(fleet.inference) - 1,
                    len(fleet.inference))  # fmt: skip
    while len(fleet.inference) > max(1, count):
        index = len(fleet.inference) - 1
        service.serving_workers = index  # no new sample goes to it
        turns = service.worker_turns.get(index)
        while turns is not None and not turns.idle:
            await asyncio.sleep(DRAIN_POLL_S)
        await asyncio.to_thread(fleet.remove_last_inference)
        service.worker_turns.pop(index, None)
        generations = service.calls.worker_generations  # a later inference-<index> is a new worker:
        generations[index] = generations.get(index, 0) + 1  # no adapter sent to this one is on it
        log.warning("serve: inference-%d left; %d inference workers serve", index, len(fleet.inference))


def fleet_report(service: Any, target: int) -> dict[str, int]:
    """What the mailbox reports to ``rlpost scale``: the workers serving and wanted."""
    return {"inference_workers": service.serving_workers, "inference_workers_target": target,
            "inference_workers_vacant": 0}  # fmt: skip


async def take_scale_requests(service: Any, exchange: Callable[[dict[str, int]], dict[str, int]],
                              every_s: float = 2.0) -> None:  # fmt: skip
    """Every ``every_s``: report the workers to the mailbox (``exchange``, blocking: the control
    actor's call) and apply the request it hands over. Runs until cancelled."""
    target = len(service.fleet.inference)
    while True:
        try:
            requested = await asyncio.to_thread(exchange, fleet_report(service, target))
            if "inference" in requested:
                target = requested["inference"]
                log.warning("serve: an operator asked for %d inference workers (%d serve)", target,
                            service.serving_workers)  # fmt: skip
                await scale_inference(service, target)
                await asyncio.to_thread(exchange, fleet_report(service, target))
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 (logged; the next round tries again)
            log.exception("serve: resizing the inference workers failed")
        await asyncio.sleep(every_s)
