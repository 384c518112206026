"""TorchRL's weight-update pieces against rlpost: vLLMUpdater built from a model's metadata, a
collector that finds its worker, and make_vllm_worker's engine serving the pushed weights.

TorchRL's pattern::

    updater = vLLMUpdater(master_address=None, master_port=None,
                          model_metadata=vLLMUpdater.get_model_metadata(train_model))
    collector = LLMCollector(env, policy=vLLMWrapper(worker, ...), weight_updater=updater, ...)
    collector.update_policy_weights_(train_model.state_dict())

The engine test checks values: after a push, the worker's log-probs of a fixed sequence are the
trained model's (fp32, the same tolerance as the wrappers' tests), not the initial model's.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rlpost.actors.vllm_workers import make_vllm_worker
from rlpost.collect import LLMCollector, vLLMUpdater
from rlpost.collect.weight_update import WorkerTimeout
from rlpost.policies import TransformersWrapper, vLLMWrapper
from rlpost.transport import WeightSyncError
from rlpost.transport.weight_bus import BusSpec, TorchWeightReceiver

pytestmark = pytest.mark.compat

TOLERANCE = 1e-3  # fp32 engine vs fp32 transformers, as in the wrappers' tests


class BusWorker:
    """The weight side of an in-process worker (no engine): joins the bus, receives, counts."""

    def __init__(self, version: int = 0, stall_s: float = 0.0):
        self.version, self.receiver, self.weights, self.stall_s = version, None, {}, stall_s

    def join_bus(self, spec: dict, rank: int) -> int:
        self.receiver = TorchWeightReceiver(BusSpec(**spec), rank)
        return rank

    def update_weights(self, timeout_s: float) -> dict:
        import time

        time.sleep(self.stall_s)  # a worker too busy to answer in time
        version, tensors = self.receiver.receive(timeout_s)
        self.weights = {name: tensor.clone() for name, tensor in tensors.items()}
        self.version = version
        return {"version": version, "receive_s": 0.0, "load_s": 0.0}

    def get_version(self) -> int:
        return self.version


def test_updater_from_model_metadata_checks_every_push():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    metadata = vLLMUpdater.get_model_metadata(model)
    assert metadata == {
        "0.weight": (torch.float32, torch.Size([3, 4])),
        "0.bias": (torch.float32, torch.Size([3])),
        "1.weight": (torch.float32, torch.Size([2, 3])),
        "1.bias": (torch.float32, torch.Size([2])),
    }
    worker = BusWorker()
    updater = vLLMUpdater([worker], master_address=None, master_port=None, model_metadata=metadata, vllm_tp_size=1,
                          backend="gloo", timeout_s=30)  # fmt: skip
    try:
        assert updater.push_weights(TensorDict.from_module(model)) == 1  # TorchRL pushes a TensorDict of params
        assert worker.version == 1 and torch.equal(worker.weights["1.weight"], model[1].weight.detach())
        names = r"missing \['0.bias', '0.weight', '1.bias', '1.weight'\], unexpected \['bias', 'weight'\]"
        with pytest.raises(ValueError, match=names):
            updater.push_weights(model[0].state_dict())  # a submodule's names lack the "0." prefix
        with pytest.raises(ValueError, match="other shape"):
            updater.push_weights({**model.state_dict(), "1.bias": torch.zeros(5)})
        assert worker.version == 1  # a refused push sends nothing
    finally:
        updater.close()


def test_a_worker_that_does_not_answer_is_a_bounded_bus_failure_and_set_workers_recovers():
    slow, fast = BusWorker(stall_s=5.0), BusWorker()
    updater = vLLMUpdater([fast, slow], backend="gloo", timeout_s=2)
    model = torch.nn.Linear(2, 2)
    try:
        with pytest.raises(WeightSyncError) as failure:
            updater.push_weights(model)
        assert isinstance(failure.value, TimeoutError) or failure.value.peers == [2]
        replacement = BusWorker()
        updater.set_workers([fast, replacement])  # the bus's next generation, without the slow one
        assert updater.publisher.generation == 1
        assert updater.push_weights(model, version=1) == 1
        assert fast.version == replacement.version == 1
        assert torch.equal(replacement.weights["weight"], model.weight.detach())
    finally:
        updater.close()
    assert issubclass(WorkerTimeout, WeightSyncError) and issubclass(WorkerTimeout, TimeoutError)


def test_the_collector_finds_its_worker_and_the_engine_serves_the_pushed_weights(tiny_model_path, hf_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlpost.envs import ArithmeticEnv

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    trained = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    worker = make_vllm_worker(str(tiny_model_path), make_ray_worker=False, max_model_len=256, kv_cache_space_gb=0.25,
                              enforce_eager=True, seed=0)  # fmt: skip
    try:
        scorer = vLLMWrapper(worker, tokenizer=tokenizer, input_mode="tokens", generate=False, return_log_probs=True)
        updater = vLLMUpdater(master_address=None, master_port=None,
                              model_metadata=vLLMUpdater.get_model_metadata(trained))  # fmt: skip
        env = ArithmeticEnv(num_envs=2, tokenizer=tokenizer)
        collector = LLMCollector(env, policy=scorer, dialog_turns_per_batch=2, weight_updater=updater,
                                 track_policy_version=True)  # fmt: skip
        texts = ("What is 2 + 3? <answer>5</answer>", "7 * 6 = 42")
        rows = [torch.tensor(tokenizer(text)["input_ids"]) for text in texts]

        def engine_scores() -> list[torch.Tensor]:
            out = scorer(TensorDict(tokens=torch.nested.as_nested_tensor(rows), batch_size=[len(rows)]))
            return list(out.get(("log_probs", "full"), as_list=True))

        def model_scores(model) -> list[torch.Tensor]:
            wrapper = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate=False)
            with torch.no_grad():
                out = wrapper(TensorDict(tokens=torch.nested.as_nested_tensor(rows), batch_size=[len(rows)]))
            return list(out.get(("log_probs", "full"), as_list=True))

        before = engine_scores()
        for got, want in zip(before, model_scores(hf_model)):
            assert (got - want).abs().max().item() <= TOLERANCE
        with torch.no_grad():  # a "training step": every weight moves
            for param in trained.parameters():
                param.add_(0.02 * torch.randn_like(param))
        collector.update_policy_weights_(trained.state_dict())
        assert collector.policy_version == 1 and updater.version == 1 and worker.version == 1
        after, want_after = engine_scores(), model_scores(trained)
        for got, want, old in zip(after, want_after, before):
            assert (got - want).abs().max().item() <= TOLERANCE
            assert (got - old).abs().max().item() > 10 * TOLERANCE  # the weights did change what it serves
        updater.close()
    finally:
        worker.shutdown()
