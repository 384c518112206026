"""The public pieces that start actors of their own, on a cluster without what they ask for (a GPU
on this CPU-only cluster): each fails within its placement_timeout_s, naming the resource and what
the cluster has, where it used to wait for ever (AsyncVLLM as TorchRL's GRPO script starts it,
num_devices=1) or until a call's 600 s timeout. And the same pieces asking for what the cluster
has are placed at once."""

from __future__ import annotations

import time

import pytest

from rlpost.runtime.placement import ResourcesUnavailable

pytestmark = pytest.mark.integration

WAIT_S = 1.5


def refused_within(start: float, error: ResourcesUnavailable, what: str) -> None:
    took = time.monotonic() - start
    assert WAIT_S <= took < WAIT_S + 5.0, took
    message = str(error)
    assert message.startswith(f"{what}: no node of the cluster took it within 2 s (placement_timeout_s)"), message
    assert "'GPU': 1.0}" in message and "the cluster has {'CPU': 2.0}" in message, message


def test_async_vllm_on_a_cluster_without_its_gpus_fails_naming_them(ray_cluster, tiny_model_path):
    from rlpost.torchrl.modules.llm import AsyncVLLM

    start = time.monotonic()
    with pytest.raises(ResourcesUnavailable) as refused:
        AsyncVLLM.from_pretrained(str(tiny_model_path), num_devices=1, num_replicas=1, placement_timeout_s=WAIT_S)
    refused_within(start, refused.value, f"AsyncVLLM ({tiny_model_path})")
    assert "replica 0 asks for {'CPU': 1.0, 'GPU': 1.0}" in str(refused.value)


def test_ray_replay_buffer_and_collector_asking_for_a_gpu_fail_naming_it(ray_cluster):
    from rlpost.torchrl.collectors.llm import RayLLMCollector
    from rlpost.torchrl.data import RayReplayBuffer

    start = time.monotonic()
    with pytest.raises(ResourcesUnavailable) as refused:
        RayReplayBuffer(remote_config={"num_cpus": 0, "num_gpus": 1}, placement_timeout_s=WAIT_S)
    refused_within(start, refused.value, "RayReplayBuffer")
    start = time.monotonic()
    with pytest.raises(ResourcesUnavailable) as refused:
        RayLLMCollector(env=None, policy=None, num_cpus=0, num_gpus=1, placement_timeout_s=WAIT_S)
    refused_within(start, refused.value, "RayLLMCollector")
    start = time.monotonic()
    buffer = RayReplayBuffer(placement_timeout_s=WAIT_S)  # what the cluster has: placed at once
    assert time.monotonic() - start < WAIT_S and len(buffer) == 0
