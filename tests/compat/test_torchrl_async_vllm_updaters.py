"""TorchRL's AsyncVLLM and vLLMUpdaterV2 tests, and its prefix-cache tests, against rlpost.

TorchRL runs the updater tests on a CUDA-only engine (a 0.5B model in fp16); rlpost's AsyncVLLM
replicas are its inference workers, which run vLLM's CPU backend, so the ports run here on the
tiny model in fp32. One fleet of one replica serves every test that needs a live engine (started
with prefix caching on, as TorchRL's class fixture starts it); the sync ``vllm.LLM`` of the
sync/async comparison runs and stops before the fleet starts, so two engines never run at once.
The tests of argument handling (config extraction, errors, what reaches the replicas) start no
engine: their replicas are stand-ins that record what they are sent.

Deviation: rlpost leaves ``enable_prefix_caching`` unset unless it is given, so vLLM's default
(on for generative models) applies, where TorchRL turns it off; every replica resets its prefix
cache whenever its weights change (:func:`test_async_vllm_update_weights_resets_prefix_cache`
checks that on the live engine).
"""

from __future__ import annotations

import logging
import types

import pytest
import torch
from tensordict import TensorDict

from rlpost.actors.async_vllm import AsyncVLLM, make_async_vllm_engine
from rlpost.collect.weight_sync import RLvLLMEngine, vLLMUpdaterV2
from rlpost.data import Text
from rlpost.policies import TransformersWrapper, vLLMWrapper

pytestmark = [pytest.mark.compat, pytest.mark.timeout(600)]
# the tests on a live fleet (one replica, and a plain vllm.LLM before it: ~80 s of engine starts)
# run in make test-long; the pure ones, on stand-ins, in make test
FLEET = pytest.mark.long

# the fleet's engine settings, and the sync engine's for the comparison (fp32: exact log-probs)
ENGINE = dict(max_model_len=256, enforce_eager=True, dtype="float32", enable_prefix_caching=True)
GREEDY = {"temperature": 0.0, "max_new_tokens": 50, "top_p": 1.0, "top_k": 1}
PROMPTS = ["Hello, how are you?", "What is the capital of France?", "Explain quantum computing in simple terms."]


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster for this module (stopped after it when this fixture started it)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="rlpost-compat")
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def sync_greedy(tiny_model_path, tiny_tokenizer):
    """vLLMWrapper's greedy generations of PROMPTS on a plain ``vllm.LLM`` (TorchRL's sync engine),
    the engine stopped before the fleet starts: per prompt (text, tokens, log-probs)."""
    from vllm import LLM

    from rlpost.policies import shutdown_vllm_engine

    llm = LLM(model=str(tiny_model_path), kv_cache_memory_bytes=256 * 2**20, **ENGINE)
    try:
        results = [_generate(llm, tiny_tokenizer, prompt) for prompt in PROMPTS]
    finally:
        shutdown_vllm_engine(llm)
    return results


@pytest.fixture(scope="module")
def fleet(local_ray, tiny_model_path):
    """TorchRL's class fixture: ``AsyncVLLM.from_pretrained`` with one replica and prefix caching on."""
    fleet = AsyncVLLM.from_pretrained(str(tiny_model_path), num_devices=None, num_replicas=1, max_num_seqs=8,
                                      kv_cache_space_gb=0.25, num_cpus=0.5, verbose=False, **ENGINE)  # fmt: skip
    yield fleet
    fleet.shutdown()


def _generate(engine, tokenizer, prompt: str) -> tuple[str, list[int], torch.Tensor]:
    wrapper = vLLMWrapper(engine, tokenizer=tokenizer, input_mode="text", generate=True, return_log_probs=True,
                          generate_kwargs=GREEDY)  # fmt: skip
    out = wrapper(TensorDict({"text": Text(prompt=prompt)}, batch_size=[1]))
    tokens = out["tokens"].response[0]
    return out["text"].response[0], tokens.tolist(), out["log_probs"].response[0].flatten()


class StubReplica:
    """What the fleet calls on a replica, answering at once and recording the calls (no engine)."""

    def __init__(self, events: list[str], reset_result: bool = True):
        import ray

        def method(name, result):
            def remote(*args, **kwargs):
                events.append(name)
                return ray.put(result)

            return types.SimpleNamespace(remote=remote)

        self.get_version = method("get_version", 0)
        self.reset_prefix_cache = method("reset_prefix_cache", reset_result)


@pytest.fixture
def stub_replicas(local_ray, monkeypatch):
    """Replica starts stubbed: each records the keywords ``make_vllm_worker`` was given."""
    started: list[dict] = []

    def make_vllm_worker(model_name, **kwargs):
        started.append({"model": model_name, **kwargs})
        return StubReplica([])

    monkeypatch.setattr("rlpost.actors.vllm_workers.make_vllm_worker", make_vllm_worker)
    return started


def changed_model(path, seed: int):
    """The trainer's model, its weights moved away from the engine's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    return model


def serves(fleet, model, tokenizer) -> bool:
    """Whether the fleet's log-probs of a fixed sequence are ``model``'s (it serves its weights)."""
    ids = tokenizer("What is 2 + 5? <answer>7</answer>")["input_ids"]
    served = torch.tensor(fleet.get_engine_client().score([ids], temperature=1.0)[0][1:])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    computed = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    return torch.allclose(served, computed, atol=1e-3)


def cached_tokens(fleet, prompt_ids: list[int]) -> int:
    """How many prompt tokens the replica took from its prefix cache for one more request."""
    from vllm import SamplingParams

    out = fleet.generate(prompt_token_ids=prompt_ids, sampling_params=SamplingParams(max_tokens=1, temperature=0))
    return int(out.num_cached_tokens or 0)


# ----------------------------------------------------------------------------- no engine


def test_error_handling():
    """TestVLLMUpdaterV2WithAsyncVLLM.test_error_handling: an object that is not an engine."""

    class FakeEngine:
        pass

    with pytest.raises(TypeError, match="must implement RLvLLMEngine interface"):
        vLLMUpdaterV2(FakeEngine())


def test_config_extraction(tiny_model_path):
    """TestVLLMUpdaterV2WithAsyncVLLM.test_config_extraction: the fleet is an RLvLLMEngine and
    describes its weight group from its arguments (read before any replica starts)."""
    fleet = AsyncVLLM({"model": str(tiny_model_path), "tensor_parallel_size": 1})
    assert isinstance(fleet, RLvLLMEngine)
    assert fleet.get_tp_size() == 1
    address, port = fleet.get_master_address(), fleet.get_master_port()
    assert isinstance(address, str) and address
    assert isinstance(port, int) and port > 0 and fleet.get_master_port() == port  # one port, kept
    assert fleet.get_model_metadata() == {}  # TorchRL's: the trainer's model gives the metadata


def test_async_vllm_constructor_respects_engine_args_prefix_caching():
    """An explicit enable_prefix_caching survives construction, and the constructor's argument
    wins over engine_args (written into them, as TorchRL does). Unset, it stays unset: vLLM's
    default (test_async_vllm_prefix_caching_defaults_to_vllms, rlpost's deviation)."""
    from vllm import AsyncEngineArgs

    args = AsyncEngineArgs(model="/models/tiny", enable_prefix_caching=True)
    fleet = AsyncVLLM(args)
    assert fleet.engine_args is args and args.enable_prefix_caching is True
    assert fleet.engine_kwargs["enable_prefix_caching"] is True  # what the replicas start with

    args = AsyncEngineArgs(model="/models/tiny", enable_prefix_caching=None)
    fleet = AsyncVLLM(args)
    assert args.enable_prefix_caching is None and "enable_prefix_caching" not in fleet.engine_kwargs

    args = AsyncEngineArgs(model="/models/tiny", enable_prefix_caching=True)
    fleet = AsyncVLLM(args, enable_prefix_caching=False)
    assert args.enable_prefix_caching is False and fleet.engine_kwargs["enable_prefix_caching"] is False

    fleet = AsyncVLLM({"model": "/models/tiny"}, enable_prefix_caching=True)  # rlpost's dict form
    assert fleet.engine_args.enable_prefix_caching is True and fleet.engine_kwargs["enable_prefix_caching"] is True


def test_async_vllm_launch_preserves_prefix_caching(stub_replicas):
    """AsyncVLLM.launch keeps engine_args' prefix-caching opt-in, and every replica starts with it."""
    from vllm import AsyncEngineArgs

    args = AsyncEngineArgs(model="/models/tiny", enable_prefix_caching=True)
    fleet = AsyncVLLM.launch(args, num_replicas=2)
    assert fleet.engine_args.enable_prefix_caching is True and len(fleet.actors) == 2 and fleet._launched
    assert [start["enable_prefix_caching"] for start in stub_replicas] == [True, True]
    assert [start["index"] for start in stub_replicas] == [0, 1]


def test_async_vllm_prefix_caching_defaults_to_vllms(stub_replicas, tiny_model_path):
    """Deviation from test_async_vllm_prefix_caching_defaults_to_false: rlpost does not turn vLLM's
    prefix caching off. Unset, the replicas start without the argument, and vLLM turns it on for
    a generative model such as the tiny one; given, it reaches the replicas as given. (Safe with
    weight updates: test_async_vllm_update_weights_resets_prefix_cache.)"""
    from vllm import AsyncEngineArgs

    fleet = make_async_vllm_engine(model_name=str(tiny_model_path), verbose=False)
    assert fleet.engine_args.enable_prefix_caching is None and "enable_prefix_caching" not in stub_replicas[0]
    assert AsyncEngineArgs(model=str(tiny_model_path)).create_model_config().is_prefix_caching_supported
    for opted in (True, False):
        fleet = make_async_vllm_engine(model_name=str(tiny_model_path), enable_prefix_caching=opted, verbose=False)
        assert fleet.engine_args.enable_prefix_caching is opted and stub_replicas[-1]["enable_prefix_caching"] is opted


def test_async_vllm_reset_prefix_cache_fanout(local_ray, monkeypatch, caplog):
    """reset_prefix_cache reaches every replica once; a replica that could not drop every block is
    one warning, never an error; none when every replica did; no call when caching is off."""
    events: list[str] = []
    answers = iter([True, False, True, True, True, True])
    monkeypatch.setattr("rlpost.actors.vllm_workers.make_vllm_worker",
                        lambda model_name, **kwargs: StubReplica(events, next(answers)))  # fmt: skip
    fleet = AsyncVLLM({"model": "/models/tiny"}, num_replicas=3)
    for index in range(3):
        fleet.start_replica(index)
    with caplog.at_level(logging.WARNING, logger="rlpost"):
        fleet.reset_prefix_cache()
    assert events == ["reset_prefix_cache"] * 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "replica(s) [1]" in warnings[0]

    events.clear()
    caplog.clear()
    fleet = AsyncVLLM({"model": "/models/tiny"}, num_replicas=2)
    for index in range(2):
        fleet.start_replica(index)
    with caplog.at_level(logging.WARNING, logger="rlpost"):
        fleet.reset_prefix_cache()
    assert events == ["reset_prefix_cache"] * 2 and not caplog.records

    events.clear()
    off = AsyncVLLM({"model": "/models/tiny"}, enable_prefix_caching=False)
    off.start_replica(0)
    off.reset_prefix_cache()
    assert events == []


# ----------------------------------------------------------------------------- live engines


@FLEET
def test_sync_async_vllm_strict_equivalence(sync_greedy, fleet, tiny_tokenizer):
    """TestLogProbsComparison.test_sync_async_vllm_strict_equivalence: vLLMWrapper over a plain
    vllm.LLM and over the fleet give the same greedy text and tokens, and the same log-probs."""
    for prompt, (sync_text, sync_tokens, sync_log_probs) in zip(PROMPTS, sync_greedy):
        text, tokens, log_probs = _generate(fleet, tiny_tokenizer, prompt)
        assert text == sync_text, prompt
        assert tokens == sync_tokens and len(tokens) > 0, prompt
        torch.testing.assert_close(log_probs, sync_log_probs, rtol=1e-6, atol=1e-6, msg=prompt)


@FLEET
def test_async_vllm_specific_features(fleet):
    assert isinstance(fleet, AsyncVLLM)
    assert fleet.num_replicas == 1 and len(fleet.actors) == 1
    assert fleet._launched is True


@FLEET
def test_updater_v2_creation(fleet):
    """vLLMUpdaterV2 takes its group's address and port and the engine's metadata from the fleet."""
    updater = vLLMUpdaterV2(fleet)
    assert updater.get_tp_size() == 1
    assert updater.master_address == fleet.get_master_address()
    assert isinstance(updater.master_port, int) and updater.master_port == fleet.get_master_port()
    assert isinstance(updater.model_metadata, dict)
    assert updater.workers == fleet.actors


@FLEET
def test_prefix_cache_reset_after_update(fleet):
    """The prefix-caching opt-in reached the engine args, and reset_prefix_cache round-trips on
    the live replica: a prompt just cached is read from the cache no more after the reset."""
    assert fleet.engine_args.enable_prefix_caching is True
    prompt = list(range(3, 203))
    cached_tokens(fleet, prompt)
    assert cached_tokens(fleet, prompt) > 0
    fleet.reset_prefix_cache()
    assert cached_tokens(fleet, prompt) == 0


@FLEET
def test_weight_update_interface(fleet, tiny_model_path, tiny_tokenizer):
    """vLLMUpdaterV2.init(metadata) then push_weights_from_transformers(policy): the fleet serves
    the policy's weights."""
    model = changed_model(tiny_model_path, seed=0)
    policy = TransformersWrapper(model, tokenizer=tiny_tokenizer, input_mode="text", generate=False,
                                 return_log_probs=True)  # fmt: skip
    updater = vLLMUpdaterV2(fleet)
    metadata = vLLMUpdaterV2.get_model_metadata(policy)
    assert metadata == {name: (p.dtype, p.shape) for name, p in model.state_dict().items()}  # the model's names
    assert not serves(fleet, model, tiny_tokenizer)
    try:
        updater.init(metadata)
        version = updater.push_weights_from_transformers(policy)
        assert fleet.get_versions() == [version] and version >= 1
        assert serves(fleet, model, tiny_tokenizer)
    finally:
        updater.close()


@FLEET
def test_async_vllm_update_weights_resets_prefix_cache(fleet, tiny_model_path, tiny_tokenizer):
    """A weight update (the fleet's own, TorchRL's update_weights of (name, tensor) pairs) resets
    the replica's prefix cache before it serves again: the first request after it reads nothing
    from the cache, though the same prompt was cached just before."""
    model = changed_model(tiny_model_path, seed=1)
    prompt = list(range(5, 205))
    cached_tokens(fleet, prompt)
    assert cached_tokens(fleet, prompt) > 0
    before = fleet.get_versions()[0]
    fleet.init_weight_update_group()
    assert fleet.update_weights(iter(model.state_dict().items())) == before + 1
    assert fleet.get_versions() == [before + 1] and serves(fleet, model, tiny_tokenizer)
    assert cached_tokens(fleet, prompt) == 0
    assert cached_tokens(fleet, prompt) > 0  # caching goes on with the new weights
    with pytest.raises(RuntimeError, match="init_weight_update_group first"):
        AsyncVLLM({"model": "m"}).update_weights([])
