"""`rlpost serve` driven by the official tinker SDK (0.38): a real trainer and vLLM engine on a local
Ray cluster, the tiny model, real HTTP. What a client sees: training, sampling, ordering, saving and
resuming, access and bad requests."""

import asyncio
import os
import threading

import pytest
import torch

pytestmark = pytest.mark.integration

tinker = pytest.importorskip("tinker", reason="the tinker SDK is in the dev extra")
from tinker import types  # noqa: E402

ALICE, BOB = "tml-alice-0123456789", "tml-bob-0123456789ab"
# the engine's sampled log-probs against the trainer's forward on the same tokens (float32, CPU)
LOGPROB_BOUND = 1e-4
CLIENTS: list = []  # every client the tests make: closed before the servers stop


@pytest.fixture(scope="module")
def service(ray_cluster, tiny_model_path, tmp_path_factory):
    from rlpost.config import ServeConfig
    from rlpost.serve.access import ApiKeys
    from rlpost.serve.fleet import ServiceFleet
    from rlpost.serve.server import RunningServer

    os.environ["TINKER_TELEMETRY"] = "0"
    cfg = ServeConfig(
        base_model=str(tiny_model_path), port=0, storage_dir=str(tmp_path_factory.mktemp("storage")), long_poll_s=5,
        gap_timeout_s=20, engine={"max_model_len": 256},
        resources={"trainer": {"num_cpus": 0.5}, "inference": {"num_cpus": 0.5}},
    )  # fmt: skip
    keys = ApiKeys({ALICE: "alice", BOB: "bob"})
    fleet = ServiceFleet.start(cfg, str(tiny_model_path), name_prefix="sdk-")
    servers = []

    def start_server():
        running = RunningServer(cfg, keys, fleet)
        ready = threading.Event()
        thread = threading.Thread(target=lambda: asyncio.run(running.serve(lambda url: ready.set())), daemon=True)
        thread.start()
        assert ready.wait(60), "the HTTP server did not start"
        servers.append((running, thread))
        return running

    first = start_server()
    yield first, start_server
    for client in CLIENTS:  # end their sessions while the servers answer: the SDK's heartbeats stop
        client.close("success").result(timeout=30)
    CLIENTS.clear()
    for running, thread in servers:
        running.stop()
        thread.join(10)
    fleet.stop()


def _client(running, key=ALICE):
    client = tinker.ServiceClient(base_url=running.url, api_key=key)
    CLIENTS.append(client)
    return client


def _datum(tokens, weights=None):
    weights = [1.0] * (len(tokens) - 1) if weights is None else weights
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})  # fmt: skip


@pytest.fixture(scope="module")
def tokens(service):
    running, _ = service
    training = _client(running).create_lora_training_client(base_model=running.cfg.served_name, rank=8).result()
    return training.get_tokenizer().encode("What is 3 + 4? 7")


def test_sft_lowers_the_loss_and_sampled_log_probs_match_forward(service, tokens):
    running, _ = service
    service_client = _client(running)
    training = service_client.create_lora_training_client(base_model=running.cfg.served_name, rank=8, seed=0).result()
    assert training.get_info().lora_rank == 8
    losses = []
    for _ in range(5):
        result = training.forward_backward([_datum(tokens)], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        losses.append(result.metrics["loss:sum"])
    assert losses[-1] < 0.8 * losses[0] and min(losses[1:]) < losses[0], losses

    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokens[:5])
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    sampled = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
    assert len(sampled.sequences) == 2 and all(len(s.tokens) == len(s.logprobs) for s in sampled.sequences)
    sequence = sampled.sequences[0]
    full = tokens[:5] + sequence.tokens
    forward = training.forward([_datum(full)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert max(abs(a - b) for a, b in zip(forward[4:], sequence.logprobs)) < LOGPROB_BOUND
    assert running.service.last_logprob_diff < LOGPROB_BOUND  # the parity check when the engine loaded it
    prompt_logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert prompt_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(prompt_logprobs[1:], forward)) < LOGPROB_BOUND


def test_a_custom_loss_and_an_rl_step(service, tokens):
    running, _ = service
    training = _client(running).create_lora_training_client(base_model=running.cfg.served_name, rank=4).result()

    def mean_nll(data, logprobs_list):
        loss = torch.stack([-lp.mean() for lp in logprobs_list]).mean()
        return loss, {"mean_nll": loss.item()}

    custom = training.forward_backward_custom([_datum(tokens)], mean_nll).result()
    assert custom.metrics["mean_nll"] > 0
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = tokens[:4]
    sampled = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=3,
                             sampling_params=types.SamplingParams(max_tokens=5)).result()  # fmt: skip
    data = []
    for i, sequence in enumerate(sampled.sequences):
        full = prompt + sequence.tokens
        n = len(full) - 1
        advantage = [0.0] * (len(prompt) - 1) + [float(i - 1)] * len(sequence.tokens)
        logprobs = [0.0] * (len(prompt) - 1) + list(sequence.logprobs)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
            "target_tokens": full[1:], "logprobs": logprobs[:n], "advantages": advantage[:n]}))  # fmt: skip
    rl = training.forward_backward(data, "importance_sampling").result()
    # on-policy: every ratio is 1, so the loss is minus the sum of the advantages, here 0 +- rounding
    assert rl.metrics["loss:sum"] == pytest.approx(-sum(sum(d.loss_fn_inputs["advantages"].data) for d in data),
                                                   abs=1e-3)  # fmt: skip
    assert training.optim_step(types.AdamParams(learning_rate=1e-3)).result() is not None


def test_requests_run_in_the_order_the_client_numbered_them(service, tokens):
    """optim_step (seq 2) posted before the forward_backward (seq 1) it follows: the server waits
    for 1, so the step applies its gradient and a forward (seq 3) sees the lower loss."""
    import httpx
    from tinker.proto import request_conv

    running, _ = service
    training = _client(running).create_lora_training_client(base_model=running.cfg.served_name, rank=8).result()
    model_id = training.model_id
    headers = {"X-API-Key": ALICE}

    def fb(seq, forward_only=False):
        request = types.ForwardBackwardRequest(model_id=model_id, seq_id=seq, forward_backward_input=types.
                                               ForwardBackwardInput(data=[_datum(tokens)], loss_fn="cross_entropy"))  # fmt: skip
        message = request_conv.forward_backward_request_to_proto(request)
        message.forward_only = forward_only
        return httpx.post(f"{running.url}/api/v1/forward_backward", content=message.SerializeToString(),
                          headers={**headers, "Content-Type": "application/x-protobuf"}).json()["request_id"]  # fmt: skip

    adam = {"learning_rate": 0.05, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0}
    step = httpx.post(f"{running.url}/api/v1/optim_step", headers=headers,
                      json={"model_id": model_id, "seq_id": 2, "adam_params": adam}).json()["request_id"]  # fmt: skip
    first = fb(1)
    after = fb(3, forward_only=True)
    again = httpx.post(f"{running.url}/api/v1/optim_step", headers=headers,
                       json={"model_id": model_id, "seq_id": 2, "adam_params": adam}).json()["request_id"]  # fmt: skip
    assert again == step  # a retried number is the same request, never a second step

    def loss(request_id):
        from tinker.proto import response_conv

        response = httpx.post(f"{running.url}/api/v1/retrieve_future", headers=headers, json={"request_id": request_id},
                              timeout=30)  # fmt: skip
        return response_conv.deserialize_forward_backward_output(response.content).metrics["loss:sum"]

    before_loss, after_loss = loss(first), loss(after)
    assert after_loss < before_loss - 1.0


def test_saved_state_resumes_with_its_optimizer_on_a_restarted_server(service, tokens):
    running, start_server = service
    client = _client(running)
    training = client.create_lora_training_client(base_model=running.cfg.served_name, rank=8).result()
    adam = types.AdamParams(learning_rate=1e-2)
    training.forward_backward([_datum(tokens)], "cross_entropy").result()
    training.optim_step(adam).result()
    path = training.save_state("after-1").result().path
    assert path == f"tinker://{training.model_id}/weights/after-1"
    at_save = training.forward([_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    training.forward_backward([_datum(tokens)], "cross_entropy").result()
    training.optim_step(adam).result()
    expected = training.forward([_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()

    restarted = start_server()  # a new service over the same storage folder: nothing in memory
    rest = tinker.RestClient(base_url=restarted.url, api_key=ALICE)
    listed = rest.list_checkpoints(training.model_id).result()
    assert [c.tinker_path for c in listed.checkpoints] == [path]
    capabilities = rest.get_server_capabilities().result()
    assert [m.model_name for m in capabilities.supported_models] == [running.cfg.served_name]
    weights_only = _client(restarted).create_training_client_from_state(path).result()
    again = weights_only.forward([_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert again == pytest.approx(at_save, abs=1e-6)
    resumed = _client(restarted).create_training_client_from_state_with_optimizer(path).result()
    resumed.forward_backward([_datum(tokens)], "cross_entropy").result()
    resumed.optim_step(adam).result()
    got = resumed.forward([_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert got == pytest.approx(expected, abs=1e-5)


def test_keys_tenants_and_bad_requests(service, tokens):
    running, _ = service
    with pytest.raises(tinker.AuthenticationError, match="not a key of this service"):
        _client(running, key="tml-nobody-0123456789").create_lora_training_client(
            base_model=running.cfg.served_name, rank=8).result()  # fmt: skip
    alice = _client(running).create_lora_training_client(base_model=running.cfg.served_name, rank=8).result()
    path = alice.save_weights_for_sampler("mine").result().path

    bob = _client(running, key=BOB)
    with pytest.raises(tinker.BadRequestError, match="no sampler|no run|no weights"):
        bob.create_sampling_client(model_path=path, base_model=running.cfg.served_name).result()
    with pytest.raises(tinker.RequestFailedError, match="unknown loss 'dpo'") as failed:
        alice.forward_backward([_datum(tokens)], "dpo").result()
    assert failed.value.category == "user"
    with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
        alice.forward_backward([_datum([1, 2, 10**6])], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="600 tokens, over the model's 512"):
        alice.forward_backward([_datum([5] * 601)], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="base_model: 'Qwen/Qwen3-8B' is not served here"):
        _client(running).create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8).result()
    assert alice.forward([_datum(tokens)], "cross_entropy").result().metrics["loss:sum"] > 0  # still serving


def test_a_closed_client_finishes_its_session_and_its_model_leaves_the_trainer(service, tokens):
    import json
    import urllib.error
    import urllib.request

    running, _ = service
    with _client(running) as client:
        training = client.create_lora_training_client(base_model=running.cfg.served_name, rank=8).result()
        training.forward_backward([_datum(tokens)], "cross_entropy").result()
        model_id = training.model_id
        assert model_id in running.service.models
    assert model_id not in running.service.models  # the SDK's close finished the session
    request = urllib.request.Request(f"{running.url}/api/v1/get_info", data=json.dumps({"model_id": model_id}).encode(),
                                     headers={"X-API-Key": ALICE, "Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as gone:
        urllib.request.urlopen(request, timeout=30)
    assert gone.value.code == 410 and "was finished by its client" in gone.value.read().decode()


def _pid(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def test_a_tenant_over_its_bound_is_told_to_try_again_and_the_sdk_does(service, tokens):
    """With one pending request allowed, the optim_step the SDK sends while its forward_backward runs
    is answered 429; the SDK waits and sends it again, and the step is applied once."""
    running, _ = service
    admission = running.service.admission
    training = _client(running).create_lora_training_client(base_model=running.cfg.served_name, rank=8).result()
    limit, admission.limit = admission.limit, 1
    try:
        refused = admission.refused["alice"]
        first = training.forward_backward([_datum(tokens)], "cross_entropy")
        second = training.forward_backward([_datum(tokens)], "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=1e-2))
        losses = [first.result().metrics["loss:sum"], second.result().metrics["loss:sum"]]
        assert step.result() is not None and admission.refused["alice"] > refused
    finally:
        admission.limit = limit
    assert losses[0] == pytest.approx(losses[1])  # both before the step
    after = training.forward([_datum(tokens)], "cross_entropy").result().metrics["loss:sum"]
    assert after < losses[0]


@pytest.mark.long  # two replacements (~20 s): make test-long
def test_a_killed_trainer_and_engine_are_replaced_without_losing_or_repeating_a_step(service, tokens):
    """SIGKILL of the trainer with a gradient pending, then of the engine: the client's calls only
    take longer, and its model ends where an undisturbed run of the same calls ends."""
    import signal

    running, _ = service
    fleet = running.fleet
    adam = types.AdamParams(learning_rate=5e-3)

    def run(kill_after_first_step):
        training = _client(running).create_lora_training_client(base_model=running.cfg.served_name, rank=8,
                                                                 seed=7).result()  # fmt: skip
        training.forward_backward([_datum(tokens)], "cross_entropy").result()
        training.optim_step(adam).result()
        training.forward_backward([_datum(tokens)], "cross_entropy").result()  # a gradient waiting for its step
        if kill_after_first_step:
            os.kill(_pid(fleet.trainer), signal.SIGKILL)
        training.optim_step(adam).result()
        training.forward_backward([_datum(tokens)], "cross_entropy").result()
        training.optim_step(adam).result()
        return training, training.forward([_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]

    _, undisturbed = run(False)
    restarts = fleet.restarts["trainer"]
    training, disturbed = run(True)
    assert fleet.restarts["trainer"] == restarts + 1
    assert disturbed.tolist() == pytest.approx(undisturbed.tolist(), abs=1e-5)

    sampler = training.save_weights_and_get_sampling_client().result()
    os.kill(_pid(fleet.inference[0]), signal.SIGKILL)
    sample = sampler.sample(types.ModelInput.from_ints(tokens[:4]), 1, types.SamplingParams(max_tokens=3)).result()
    assert len(sample.sequences[0].tokens) == 3 and fleet.restarts["inference"] >= 1
    assert running.service.last_logprob_diff < LOGPROB_BOUND  # the new engine serves the same adapter
