"""TorchRL's distributed inference pieces on a real local Ray cluster with real vLLM replicas:
AsyncVLLM (a fleet of rlpost's inference workers), vLLMWrapper generating through it, and
VLLMWeightSyncScheme sending a trainer's weights, through a replica's death and Ray's restart."""

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_a_fleet_generates_takes_weights_and_survives_a_killed_replica(ray_cluster, tiny_model_path):
    import ray
    from transformers import AutoModelForCausalLM
    from vllm import RequestOutput, SamplingParams

    from rlpost.torchrl.modules.llm import vLLMWrapper
    from rlpost.torchrl.modules.llm.backends.vllm import AsyncVLLM
    from rlpost.torchrl.weight_update.llm import VLLMWeightSyncScheme, get_model_metadata

    fleet = AsyncVLLM.from_pretrained(str(tiny_model_path), num_replicas=1, max_model_len=256,
                                      kv_cache_space_gb=0.25, max_num_seqs=64, enforce_eager=True,
                                      dtype=torch.float32, num_cpus=0.5, verbose=False)  # fmt: skip
    try:
        greedy = SamplingParams(max_tokens=8, temperature=0.0)
        outputs = fleet.generate(["What is 3 + 4?", "What is 1 + 1?"], greedy)
        assert [type(o) for o in outputs] == [RequestOutput, RequestOutput]
        one = fleet.generate(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=4, temperature=0))
        assert isinstance(one, RequestOutput) and list(one.prompt_token_ids) == [1, 2, 3]

        # the trainer's model, changed: what the sender sends must be what the replicas then compute
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(0)
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        scheme = VLLMWeightSyncScheme(master_address=fleet.get_master_address(), master_port=fleet.get_master_port(),
                                      gpus_per_replica=fleet.get_tp_size(), num_replicas=fleet.num_replicas,
                                      strategy="state_dict")  # fmt: skip
        sender = scheme.create_sender()
        sender.register_model(model)
        sender.init_all_workers_group(get_model_metadata(model), vllm_engine=fleet)

        class Counter:
            increments = 0

            def increment_version(self):
                Counter.increments += 1

        sender.register_collector(Counter())
        assert sender.update_weights() == 1 and fleet.get_versions() == [1] and Counter.increments == 1

        policy = vLLMWrapper(fleet, input_mode="tokens", return_log_probs=True)  # generates through the fleet
        assert policy.client is fleet.get_engine_client()
        probe = fleet.generate(["What is 2 + 5?"], SamplingParams(max_tokens=6, temperature=1.0, seed=1))[0]
        ids = list(probe.prompt_token_ids) + list(probe.outputs[0].token_ids)

        def replica_matches_the_trainer() -> bool:
            served = torch.tensor(policy.client.score([ids], temperature=1.0)[0][1:])
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            computed = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
            return torch.allclose(served, computed, atol=1e-3)

        assert replica_matches_the_trainer()

        # a replica killed: Ray restarts it; requests wait for it; the next update re-forms the group
        ray.kill(fleet.actors[0], no_restart=False)
        again = fleet.generate(["What is 3 + 4?"], greedy)[0]
        assert isinstance(again, RequestOutput) and fleet.get_versions() == [0]  # restarted on the base model
        assert sender.update_weights() == 2 and fleet.get_versions() == [2] and Counter.increments == 2
        assert replica_matches_the_trainer()
        sender.shutdown()
    finally:
        fleet.shutdown()
