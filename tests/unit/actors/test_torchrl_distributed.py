"""Pure logic of TorchRL's distributed pieces: argument handling and clear errors (the real Ray
actors and vLLM replicas are tested in tests/integration/actors/test_async_vllm.py and
tests/integration/collect/test_ray_collector.py)."""

from __future__ import annotations

import pytest

from rlpost.actors.async_vllm import AsyncVLLM, _engine_kwargs, _prompt_list, make_async_vllm_engine
from rlpost.collect.weight_sync import VLLMWeightSyncScheme, engine_workers

pytestmark = pytest.mark.unit


def test_engine_arguments_come_from_a_dict_or_from_vllms_engine_args_fields_that_were_set():
    from vllm import AsyncEngineArgs

    args = AsyncEngineArgs(model="/models/tiny", max_model_len=256, seed=3)
    kwargs = _engine_kwargs(args)
    assert kwargs == {"model": "/models/tiny", "max_model_len": 256, "seed": 3}  # defaults left to vLLM
    assert _engine_kwargs({"model": "m", "kv_cache_space_gb": 0.25}) == {"model": "m", "kv_cache_space_gb": 0.25}
    with pytest.raises(ValueError, match="name no model"):
        _engine_kwargs({"max_model_len": 256})
    with pytest.raises(TypeError, match="AsyncEngineArgs or a dict"):
        _engine_kwargs("m")


def test_a_fleet_is_described_before_it_starts_and_refuses_what_it_does_not_do():
    fleet = AsyncVLLM({"model": "m", "tensor_parallel_size": 2}, num_replicas=3, enable_prefix_caching=True)
    assert (fleet.model_name, fleet.num_replicas, fleet.get_tp_size()) == ("m", 3, 2)
    assert fleet.engine_kwargs["enable_prefix_caching"] is True and fleet.actors == []
    assert fleet.get_master_port() == fleet.get_master_port() > 0  # one free port, kept
    with pytest.raises(ValueError, match="actor_class must be None"):
        AsyncVLLM({"model": "m"}, actor_class=object)
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        AsyncVLLM({"model": "m"}, num_replicas=0)
    with pytest.raises(ValueError, match="dtype='float32'"):
        make_async_vllm_engine(model_name="m", enable_fp32_output=True)
    with pytest.raises(ValueError, match="num_replicas"):
        make_async_vllm_engine(model_name="m", data_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be set to 2"):
        make_async_vllm_engine(model_name="m", num_devices=2, tensor_parallel_size=4)


def test_prompts_take_vllms_forms():
    assert _prompt_list("hi", None) == (True, ["hi"])
    assert _prompt_list(["a", "b"], None) == (False, ["a", "b"])
    assert _prompt_list(None, [1, 2]) == (True, [{"prompt_token_ids": [1, 2]}])
    assert _prompt_list(None, [[1], [2, 3]]) == (False, [{"prompt_token_ids": [1]}, {"prompt_token_ids": [2, 3]}])
    with pytest.raises(ValueError, match="not both"):
        _prompt_list(["a"], [[1]])
    with pytest.raises(ValueError, match="needs prompts"):
        _prompt_list(None, None)


def test_the_weight_sync_scheme_checks_its_arguments_and_its_sender_its_order():
    with pytest.raises(ValueError, match="strategy must be"):
        VLLMWeightSyncScheme(strategy="bytes")
    scheme = VLLMWeightSyncScheme(num_replicas=2, gpus_per_replica=1)
    assert scheme.master_address == "127.0.0.1" and scheme.trainer_device() is None  # no GPU here
    sender = scheme.create_sender()
    assert sender.version == 0
    with pytest.raises(RuntimeError, match="init_all_workers_group first"):
        sender.update_weights()
    with pytest.raises(ValueError, match="needs vllm_engine"):
        sender.init_all_workers_group({})

    class OneWorker:
        actors = ["replica"]

        def get_tp_size(self):
            return 1

    with pytest.raises(ValueError, match="num_replicas=2 and the engine has 1"):
        sender.init_all_workers_group({}, vllm_engine=OneWorker())
    with pytest.raises(TypeError, match="AsyncVLLM fleet or a make_vllm_worker worker"):
        engine_workers(object())
    receiver = scheme.create_receiver(OneWorker())
    assert receiver.poll_and_apply() is False


def test_a_ray_replay_buffer_builds_its_transforms_in_its_actor():
    from rlpost.data import RayReplayBuffer

    with pytest.raises(TypeError, match="transform_factory"):
        RayReplayBuffer(transform=lambda td: td)
