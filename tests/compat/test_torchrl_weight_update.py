"""TorchRL's weight-update pieces against rlpost: vLLMUpdater built from a model's metadata, a
collector that finds its worker, and make_vllm_worker's engine serving the pushed weights.

TorchRL's pattern::

    updater = vLLMUpdater(master_address=None, master_port=None,
                          model_metadata=vLLMUpdater.get_model_metadata(train_model))
    collector = LLMCollector(env, policy=vLLMWrapper(worker, ...), weight_updater=updater, ...)
    collector.update_policy_weights_(train_model.state_dict())

The engine test checks values: after a push, the worker's log-probs of a fixed sequence are the
trained model's (fp32, the same tolerance as the wrappers' tests), not the initial model's.

A peft model (TorchRL's GRPO scripts train with LoRA: rank 8, alpha 16, every linear layer) is
taken by every public path, ``vLLMUpdater`` (through the collector), ``vLLMUpdaterV2`` and
``VLLMWeightSyncScheme``'s sender, as TorchRL's are: they send its merged weights under the base
model's names, and the engine then serves the merged model; unlike TorchRL's updaters, which
``merge_and_unload()`` the live model, the trained model is left as it was. Both engine tests
share one in-process worker.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rlpost.actors.vllm_workers import make_vllm_worker
from rlpost.collect import LLMCollector, vLLMUpdater
from rlpost.collect.weight_sync import VLLMWeightSyncScheme, get_model_metadata, vLLMUpdaterV2
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


class LocalBusWorker(BusWorker):
    """A BusWorker that passes for an in-process worker of make_vllm_worker (vLLMUpdaterV2 takes one)."""

    client = None


@pytest.fixture(scope="module")
def tiny_worker(tiny_model_path):
    """An in-process worker of make_vllm_worker on the tiny model (the engine tests' one engine)."""
    worker = make_vllm_worker(str(tiny_model_path), make_ray_worker=False, max_model_len=256, kv_cache_space_gb=0.25,
                              enforce_eager=True, seed=0)  # fmt: skip
    yield worker
    worker.shutdown()


def torchrl_lora(model, seed: int):
    """``model`` with TorchRL's default LoRA (``get_hf_model`` in its GRPO utilities: rank 8, alpha
    16, every linear layer, no dropout, fp32 adapters), its adapter moved away from zero."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM", inference_mode=False, init_lora_weights=True)  # fmt: skip
    model = get_peft_model(model, config, autocast_adapter_dtype=True).eval()
    move_adapter(model, seed)
    return model


def move_adapter(model, seed: int) -> None:
    """A "training step" on the adapter only: every LoRA B moves (the base stays frozen)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def unchanged(model, before: dict[str, torch.Tensor]) -> bool:
    """The peft model holds the same tensors under the same (peft's) names as ``before``."""
    after = model.state_dict()
    return list(after) == list(before) and all(torch.equal(after[name], t) for name, t in before.items())


def test_every_public_path_sends_a_peft_models_merged_weights_and_leaves_it_unchanged(tiny_tokenizer):
    """vLLMUpdater, vLLMUpdaterV2 and VLLMWeightSyncScheme's sender, given a peft model (or its
    TransformersWrapper), send what TorchRL's scheme sends: ``merge_and_unload()``'s state_dict,
    names and values, checked against ``get_model_metadata`` of the peft model."""
    import copy

    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    model = torchrl_lora(Qwen2ForCausalLM(config), seed=0)
    metadata = get_model_metadata(model)
    policy = TransformersWrapper(model, tokenizer=tiny_tokenizer, input_mode="tokens", generate=False)

    pushes = iter(range(1, 100))

    def sent_by(push, worker: BusWorker) -> None:
        move_adapter(model, seed=next(pushes))  # a training step: each push sends another adapter
        before = snapshot(model)
        want = copy.deepcopy(model).merge_and_unload().state_dict()  # TorchRL's scheme's weights
        push()
        assert unchanged(model, before)
        assert list(worker.weights) == list(want) == list(metadata)  # the base model's names, all of them
        for name, tensor in want.items():
            assert torch.allclose(worker.weights[name], tensor, atol=1e-6), name

    worker = BusWorker()
    v1 = vLLMUpdater([worker], model_metadata=metadata, backend="gloo", timeout_s=30)
    try:
        sent_by(lambda: v1.push_weights(policy), worker)
        sent_by(lambda: v1.push_weights(model), worker)
    finally:
        v1.close()
    worker = LocalBusWorker()
    v2 = vLLMUpdaterV2(worker, model_metadata=metadata, backend="gloo", timeout_s=30)
    try:
        sent_by(lambda: v2.push_weights_from_transformers(policy), worker)
    finally:
        v2.close()
    worker = BusWorker()
    sender = VLLMWeightSyncScheme(num_replicas=1, strategy="state_dict", backend="gloo", timeout_s=30).create_sender()
    sender.register_model(model)
    sender.init_all_workers_group(metadata, vllm_engine=worker)
    try:
        sent_by(sender.update_weights, worker)
        sent_by(lambda: sender.update_weights(model), worker)
        assert sender.version == worker.version == 2
    finally:
        sender.shutdown()


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


def test_the_collector_finds_its_worker_and_the_engine_serves_the_pushed_weights(tiny_model_path, hf_model,
                                                                                 tiny_worker):  # fmt: skip
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlpost.envs import ArithmeticEnv

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    trained = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    worker = tiny_worker
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


def test_the_engine_serves_a_peft_models_merged_weights_through_every_public_path(tiny_model_path, tiny_tokenizer,
                                                                                 tiny_worker):  # fmt: skip
    """A TorchRL-shaped LoRA model sent by the collector's vLLMUpdater, by vLLMUpdaterV2 and by
    VLLMWeightSyncScheme's sender: after each, the engine scores a fixed sequence as the peft
    model does (its adapter applied), and the peft model is the one it was."""
    from transformers import AutoModelForCausalLM

    from rlpost.envs import ArithmeticEnv

    model = torchrl_lora(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32), seed=1)
    policy = TransformersWrapper(model, tokenizer=tiny_tokenizer, input_mode="tokens", generate=False,
                                 return_log_probs=True)  # fmt: skip
    scorer = vLLMWrapper(tiny_worker, tokenizer=tiny_tokenizer, input_mode="tokens", generate=False,
                         return_log_probs=True)  # fmt: skip
    rows = [torch.tensor(tiny_tokenizer(text)["input_ids"]) for text in ("What is 2 + 3? <answer>5</answer>", "7 * 6")]
    tokens = TensorDict(tokens=torch.nested.as_nested_tensor(rows), batch_size=[len(rows)])

    def scores(wrapper) -> list[torch.Tensor]:
        with torch.no_grad():
            return list(wrapper(tokens.clone()).get(("log_probs", "full"), as_list=True))

    def engine_serves_the_adapter_after(push, seed: int) -> None:
        move_adapter(model, seed)  # a training step: the engine still serves the weights before it
        served_before, before = scores(scorer), snapshot(model)
        push()
        assert unchanged(model, before)  # no merge_and_unload on the trained model
        for got, want, old in zip(scores(scorer), scores(policy), served_before):
            assert (got - want).abs().max().item() <= TOLERANCE
            assert (got - old).abs().max().item() > 10 * TOLERANCE

    # TorchRL's collector pattern: the updater pushes the TransformersWrapper it is given
    metadata = vLLMUpdater.get_model_metadata(policy)
    assert not any("lora_" in name or name.startswith("base_model.") for name in metadata)
    updater = vLLMUpdater(master_address=None, master_port=None, model_metadata=metadata)
    collector = LLMCollector(ArithmeticEnv(num_envs=2, tokenizer=tiny_tokenizer), policy=scorer,
                             dialog_turns_per_batch=2, weight_updater=updater)  # fmt: skip
    try:
        engine_serves_the_adapter_after(lambda: collector.update_policy_weights_(policy), seed=2)
    finally:
        updater.close()
    v2 = vLLMUpdaterV2(tiny_worker)
    try:
        v2.init(metadata)
        engine_serves_the_adapter_after(lambda: v2.push_weights_from_transformers(policy), seed=3)
    finally:
        v2.close()
    sender = VLLMWeightSyncScheme(num_replicas=1, strategy="state_dict").create_sender()  # the GRPO scripts' way
    sender.register_model(model)
    sender.init_all_workers_group(get_model_metadata(model), vllm_engine=tiny_worker)
    try:
        engine_serves_the_adapter_after(sender.update_weights, seed=4)
        assert tiny_worker.get_version() == sender.version
    finally:
        sender.shutdown()
