"""TorchRL's distributed inference pieces on a real local Ray cluster with real vLLM replicas:
AsyncVLLM (a fleet of rlpost's inference workers), vLLMWrapper generating through it, and
VLLMWeightSyncScheme sending a trainer's weights, through a replica's death and Ray's restart."""

import time

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def fleet(ray_cluster, tiny_model_path):
    from rlpost.torchrl.modules.llm.backends.vllm import AsyncVLLM

    fleet = AsyncVLLM.from_pretrained(str(tiny_model_path), num_replicas=1, max_model_len=256,
                                      kv_cache_space_gb=0.25, max_num_seqs=64, enforce_eager=True,
                                      dtype=torch.float32, num_cpus=0.5, verbose=False)  # fmt: skip
    yield fleet
    fleet.shutdown()


def changed_model(path):
    """The trainer's model, its weights moved away from the engine's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


class Collector:
    """Counts the version bumps the sender makes (what a registered collector receives)."""

    def __init__(self):
        self.increments = 0

    def increment_version(self):
        self.increments += 1


def sender_for(fleet, model, collector):
    from rlpost.torchrl.weight_update.llm import VLLMWeightSyncScheme, get_model_metadata

    scheme = VLLMWeightSyncScheme(master_address=fleet.get_master_address(), master_port=fleet.get_master_port(),
                                  gpus_per_replica=fleet.get_tp_size(), num_replicas=fleet.num_replicas,
                                  strategy="state_dict")  # fmt: skip
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.init_all_workers_group(get_model_metadata(model), vllm_engine=fleet)
    sender.register_collector(collector)
    return sender


def replica_matches(fleet, model) -> bool:
    """Whether the fleet scores a sampled completion as ``model`` does: it serves its weights."""
    from vllm import SamplingParams

    probe = fleet.generate(["What is 2 + 5?"], SamplingParams(max_tokens=6, temperature=1.0, seed=1))[0]
    ids = list(probe.prompt_token_ids) + list(probe.outputs[0].token_ids)
    served = torch.tensor(fleet.get_engine_client().score([ids], temperature=1.0)[0][1:])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    computed = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    return torch.allclose(served, computed, atol=1e-3)


def test_a_fleet_generates_vllms_outputs_and_serves_the_weights_its_sender_sends(fleet, tiny_model_path):
    from vllm import RequestOutput, SamplingParams

    from rlpost.torchrl.modules.llm import vLLMWrapper

    outputs = fleet.generate(["What is 3 + 4?", "What is 1 + 1?"], SamplingParams(max_tokens=8, temperature=0.0))
    assert [type(o) for o in outputs] == [RequestOutput, RequestOutput]
    one = fleet.generate(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=4, temperature=0))
    assert isinstance(one, RequestOutput) and list(one.prompt_token_ids) == [1, 2, 3]
    policy = vLLMWrapper(fleet, input_mode="tokens", return_log_probs=True)  # generates through the fleet
    assert policy.client is fleet.get_engine_client()

    model, collector = changed_model(tiny_model_path), Collector()
    assert not replica_matches(fleet, model)
    sender = sender_for(fleet, model, collector)
    version = sender.update_weights()
    assert fleet.get_versions() == [version] and collector.increments == 1
    assert replica_matches(fleet, model)
    sender.shutdown()


@pytest.mark.long  # a replica restarts: ~15 s more (the e2e scripts' test kills one mid-run too)
def test_a_killed_replica_restarts_requests_wait_and_the_next_update_brings_it_up_to_date(fleet, tiny_model_path):
    import ray
    from vllm import RequestOutput, SamplingParams

    model, collector = changed_model(tiny_model_path), Collector()
    sender = sender_for(fleet, model, collector)
    version = sender.update_weights()
    ray.kill(fleet.actors[0], no_restart=False)  # Ray restarts it
    again = fleet.generate(["What is 3 + 4?"], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert isinstance(again, RequestOutput) and fleet.get_versions() == [0]  # restarted on the base model
    assert sender.update_weights() == version + 1 and fleet.get_versions() == [version + 1]
    assert collector.increments == 2 and replica_matches(fleet, model)
    sender.shutdown()


def assert_dies(handle, within_s: float = 30.0) -> None:
    """The actor behind ``handle`` ends within ``within_s``: a call then raises RayActorError.
    ray.kill is asynchronous, so a call made right after it may still be served (seen once in a
    full suite run); the calls are retried until the actor is gone."""
    import ray

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.get_version.remote(), timeout=within_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.2)
    pytest.fail(f"the actor was still serving calls {within_s} s after it was killed")


def test_a_fleet_of_started_replicas_replaces_stops_and_resizes(ray_cluster, tiny_model_path):
    """How `rlpost train` builds its inference workers: the fleet starts replica i with the
    caller's starter (a stand-in actor here: the replicas' own behaviour is tested above) and
    start_replica(i) again puts a new actor in its place, killing the old one."""
    import ray

    from rlpost.actors.async_vllm import AsyncVLLM

    @ray.remote(num_cpus=0)
    class Replica:
        def __init__(self, index):
            self.index = index

        def get_version(self):
            return self.index

    started = []

    def start(index):
        started.append(index)
        return Replica.remote(index)

    fleet = AsyncVLLM.from_replica_starter(start, 2, str(tiny_model_path))
    assert fleet.actors == [] and started == [] and fleet.max_restarts == 0  # nothing starts by itself
    first = [fleet.start_replica(i) for i in range(2)]
    assert fleet.actors == first and ray.get([a.get_version.remote() for a in first], timeout=30) == [0, 1]
    client = fleet.get_engine_client()  # the fleet's load-balancing client over its replicas
    assert client.handles == first
    second = fleet.start_replica(1)
    assert fleet.actors == [first[0], second] and client.handles == [first[0], second] and started == [0, 1, 1]
    assert_dies(first[1])
    with pytest.raises(IndexError, match="no replica 2: the fleet has replicas 0..1"):
        fleet.start_replica(2)
    # resized: a third replica may start (its owner says when), in any order
    fleet.resize(4)
    fourth = fleet.start_replica(3)
    assert fleet.actors == [first[0], second, fourth] and client.handles == fleet.actors
    fleet.stop_replica(1)  # the client stops using it before it ends
    assert fleet.actors == [first[0], fourth] and client.handles == [first[0], fourth]
    assert_dies(second)
    fleet.resize(2)  # stops replica 3
    assert fleet.actors == [first[0]] and fleet.num_replicas == 2 and client.handles == [first[0]]
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        fleet.resize(0)
    fleet.shutdown()
    assert fleet.actors == []
