"""The service's inference workers resized (rlpost.serve.scaling) over stand-ins: a leaving worker
finishes its calls first; the bounds and keys `rlpost scale` is held to for a service."""

import asyncio
import types

import pytest

from rlpost.config import ServeConfig
from rlpost.serve.fairness import FairTurns
from rlpost.serve.scaling import fleet_report, scale_inference, take_scale_requests
from rlpost.service.mailbox import SERVICE_KEYS, RunControl, check_scale_request

pytestmark = pytest.mark.unit


class Fleet:
    def __init__(self, count):
        self.inference = [f"worker-{i}" for i in range(count)]
        self.log = []

    def add_inference(self):
        self.inference.append(f"worker-{len(self.inference)}")
        self.log.append(("added", len(self.inference) - 1))

    def remove_last_inference(self):
        self.log.append(("removed", len(self.inference) - 1))
        self.inference.pop()


def _service(count):
    fleet = Fleet(count)
    return types.SimpleNamespace(fleet=fleet, serving_workers=count, worker_turns={},
                                 calls=types.SimpleNamespace(worker_generations={}))  # fmt: skip


def test_workers_join_and_a_leaving_one_finishes_its_calls_first():
    async def main():
        service = _service(1)
        await scale_inference(service, 3)
        assert service.serving_workers == 3 and service.fleet.log == [("added", 1), ("added", 2)]
        turns = service.worker_turns[2] = FairTurns(1)
        release = asyncio.Event()

        async def a_sample_on_the_last_worker():
            async with turns.turn("alice"):
                await release.wait()

        running = asyncio.create_task(a_sample_on_the_last_worker())
        await asyncio.sleep(0)
        shrinking = asyncio.create_task(scale_inference(service, 1))
        await asyncio.sleep(0.3)
        assert service.serving_workers == 2 and ("removed", 2) not in service.fleet.log  # waits for the call
        release.set()
        await running
        await asyncio.wait_for(shrinking, 5)
        return service

    service = asyncio.run(main())
    assert service.fleet.log[-2:] == [("removed", 2), ("removed", 1)] and service.serving_workers == 1
    assert service.calls.worker_generations == {2: 1, 1: 1} and 2 not in service.worker_turns


def test_the_mailbox_request_resizes_and_the_report_says_so():
    control = RunControl(ServeConfig(inference_workers="1..3").scale_bounds(), keys=SERVICE_KEYS)
    control.request(inference=3)

    async def main():
        service = _service(1)
        task = asyncio.create_task(take_scale_requests(service, control.exchange, every_s=0.01))
        while control.fleet().get("inference_workers") != 3:
            await asyncio.sleep(0.01)
        task.cancel()
        return service

    service = asyncio.run(main())
    assert len(service.fleet.inference) == 3
    assert control.fleet() == {"requested": None, **fleet_report(service, 3)}


def test_a_service_is_scaled_in_its_range_and_by_its_workers_only():
    cfg = ServeConfig(inference_workers="2..4")
    assert (cfg.inference_workers, cfg.max_inference_workers) == (2, 4)
    assert cfg.scale_bounds() == {"inference": (2, 4)} and ServeConfig().scale_bounds() == {"inference": (1, None)}
    with pytest.raises(ValueError, match="max_inference_workers \\(1\\) is below inference_workers \\(2\\)"):
        ServeConfig(inference_workers=2, max_inference_workers=1)
    with pytest.raises(ValueError, match="outside the service's range 2..4 .*start it again with a wider range"):
        check_scale_request(cfg.scale_bounds(), {"inference": 5}, SERVICE_KEYS)
    with pytest.raises(ValueError, match="env_pools: not a scale key of this fleet \\(give inference=N\\)"):
        check_scale_request(cfg.scale_bounds(), {"env_pools": 2}, SERVICE_KEYS)
