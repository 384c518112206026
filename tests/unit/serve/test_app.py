"""The HTTP layer over a stand-in trainer (pure request handling): keys, error bodies, zstd bodies,
futures read twice. The real actors and the real SDK: tests/integration/serve/."""

import json

import pytest
import torch

pytestmark = pytest.mark.unit

starlette_testclient = pytest.importorskip("starlette.testclient")
tinker = pytest.importorskip("tinker", reason="the tinker SDK is in the dev extra")
from tinker import types  # noqa: E402
from tinker.proto import request_conv, response_conv  # noqa: E402

from rlpost.config import ServeConfig  # noqa: E402
from rlpost.serve.access import ApiKeys  # noqa: E402
from rlpost.serve.app import build_app  # noqa: E402
from rlpost.serve.service import Service  # noqa: E402
from rlpost.serve.storage import Storage  # noqa: E402

KEY = "tml-alice-0123456789"
BOB = "tml-bob-0123456789"


class Remote:
    """``actor.method.remote(...)`` over a plain object, answering an awaitable as Ray does."""

    def __init__(self, target):
        self.target = target

    def __getattr__(self, name):
        method = getattr(self.target, name)

        class Call:
            @staticmethod
            def remote(*args, **kwargs):
                async def run():
                    return method(*args, **kwargs)

                return run()

        return Call


class Trainer:
    def __init__(self):
        self.calls = []
        self.steps = 0
        self.lost_at_snapshot = None  # the snapshot after this many steps finds the trainer lost

    def create(self, adapter, spec):
        self.calls.append(("create", adapter, spec.rank))

    def remove(self, adapter):
        self.calls.append(("remove", adapter))

    def restore(self, adapter, files, with_optimizer):
        self.calls.append(("restore", adapter, files["adapter_model.safetensors"]))
        self.steps = int(files["steps"])

    def optim_step(self, adapter, params):
        self.calls.append(("optim_step", adapter))
        self.steps += 1
        return {"step:max": float(self.steps)}

    def snapshot(self, adapter, with_optimizer):
        if self.steps == self.lost_at_snapshot:
            import ray

            raise ray.exceptions.RayActorError()  # the trainer died between the step and its snapshot
        return {"adapter_model.safetensors": b"weights of " + adapter.encode(), "steps": str(self.steps).encode()}

    def forward_backward(self, adapter, data, loss_fn, config, backward=True):
        self.calls.append(("forward_backward", adapter, [d.tokens for d in data], loss_fn, backward))
        return {"loss_fn_outputs": [{"logprobs": -torch.ones(len(d.tokens))} for d in data],
                "metrics": {"loss:sum": float(sum(len(d.tokens) for d in data))}}  # fmt: skip


class Fleet:
    def __init__(self):
        self.trainer_object = Trainer()
        self.trainer = Remote(self.trainer_object)
        self.inference = []

    def restart_trainer(self):
        self.trainer_object = Trainer()
        self.trainer = Remote(self.trainer_object)


@pytest.fixture
def client(tmp_path):
    cfg = ServeConfig(storage_dir=str(tmp_path), long_poll_s=2, max_models_per_tenant=2)
    fleet = Fleet()
    service = Service(cfg, fleet, Storage(tmp_path))
    app = build_app(service, ApiKeys({KEY: "alice", BOB: "bob"}))
    with starlette_testclient.TestClient(app, headers={"X-API-Key": KEY}) as http:
        http.fleet, http.service = fleet, service
        yield http


def _post(http, path, body):
    return http.post(f"/api/v1/{path}", json=body)


def _result(http, request_id):
    return http.post("/api/v1/retrieve_future", json={"request_id": request_id})


def test_keys_are_required_and_errors_name_the_field(client):
    assert client.get("/api/v1/healthz", headers={"X-API-Key": ""}).json() == {"status": "ok"}
    missing = client.post("/api/v1/create_session", json={}, headers={"X-API-Key": ""})
    assert missing.status_code == 401 and missing.json() == {"detail": "X-API-Key is missing"}
    unknown = client.post("/api/v1/create_session", json={}, headers={"X-API-Key": "tml-mallory-0123456789"})
    assert unknown.status_code == 401 and "not a key of this service" in unknown.json()["detail"]
    bad = _post(client, "get_info", {"model_id": "s:train:0"})
    assert bad.status_code == 400 and bad.json() == {"detail": "model_id: no model 's:train:0'"}
    assert int(bad.headers["content-length"]) > 0  # an empty 400 reads as a proxy's to the SDK
    garbage = client.post("/api/v1/create_session", content=b"{not json", headers={"Content-Type": "application/json"})
    assert garbage.status_code == 400 and garbage.json() == {"detail": "body: not JSON"}


def test_a_model_trains_through_a_zstd_body_and_a_result_reads_twice(client):
    import zstandard

    session = _post(client, "create_session", {}).json()["session_id"]
    created = _post(client, "create_model", {"session_id": session, "model_seq_id": 0, "lora_config": {"rank": 4}})
    model_id = json.loads(_result(client, created.json()["request_id"]).content)["model_id"]
    assert model_id == f"{session}:train:0"
    info = _post(client, "get_info", {"model_id": model_id}).json()
    assert info["lora_rank"] == 4 and info["model_data"]["model_name"] == "models/tiny-model"

    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]})  # fmt: skip
    request = types.ForwardBackwardRequest(
        model_id=model_id, seq_id=1, forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="ppo")
    )
    body = zstandard.ZstdCompressor().compress(
        request_conv.forward_backward_request_to_proto(request).SerializeToString()
    )
    posted = client.post("/api/v1/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf",
                                                                            "Content-Encoding": "zstd"})  # fmt: skip
    request_id = posted.json()["request_id"]
    first, second = _result(client, request_id), _result(client, request_id)
    assert first.headers["content-type"] == "application/x-protobuf" and first.content == second.content
    output = response_conv.deserialize_forward_backward_output(first.content)
    assert output.metrics == {"loss:sum": 3.0} and output.loss_fn_outputs[0]["logprobs"].tolist() == [-1.0] * 3
    assert client.fleet.trainer_object.calls[-1] == ("forward_backward", "adapter-1", [[5, 6, 7]], "ppo", True)

    unknown = _result(client, "req-made-up")
    assert unknown.status_code == 400 and "no request 'req-made-up'" in unknown.json()["detail"]


def _new_model(http, seq=0):
    """A new session of alice's and a model in it: (session id, model id)."""
    session = _post(http, "create_session", {}).json()["session_id"]
    created = _post(http, "create_model", {"session_id": session, "model_seq_id": seq, "lora_config": {"rank": 4}})
    return session, json.loads(_result(http, created.json()["request_id"]).content)["model_id"]


def test_a_finished_session_takes_its_models_and_tells_its_client_so(client, tmp_path):
    session, model_id = _new_model(client)
    assert client.post(f"/api/v1/sessions/{session}/finish", json={"reason": {"type": "ok"}}).status_code == 200
    gone = _post(client, "get_info", {"model_id": model_id})
    assert gone.status_code == 410 and "its session was finished by its client" in gone.json()["detail"]
    beat = _post(client, "session_heartbeat", {"session_id": session})  # 410 stops the SDK's heartbeat
    assert beat.status_code == 410
    assert ("remove", "adapter-1") in client.fleet.trainer_object.calls and not client.service.models
    assert not list(tmp_path.rglob("session-end*"))  # the client said it was done: nothing kept
    again = client.post(f"/api/v1/sessions/{session}/finish", json={"reason": {"type": "error"}})
    assert again.status_code == 200  # the SDK retries a slow finish: first-wins, not an error
    assert "was finished by its client" in _post(client, "get_info", {"model_id": model_id}).json()["detail"]
    other = client.post(f"/api/v1/sessions/{session}/finish", json={}, headers={"X-API-Key": BOB})
    assert other.status_code == 400 and "no session" in other.json()["detail"]  # bob learns nothing of it


def test_a_silent_session_expires_with_its_models_saved_for_their_tenant_only(client):
    from rlpost.serve.storage import WeightsPath

    service = client.service
    silent, silent_model = _new_model(client)
    heard, heard_model = _new_model(client)
    service.sessions[silent].last_seen -= service.cfg.session_timeout_s + 1
    assert client.portal.call(service.expire_silent) == [silent]
    gone = _post(client, "get_info", {"model_id": silent_model})
    assert gone.status_code == 410 and "expired: nothing was heard from it for over 600 s" in gone.json()["detail"]
    saved = WeightsPath(silent_model, "weights", "session-end")
    assert service.storage.load(saved, "alice") == {"adapter_model.safetensors": b"weights of adapter-1",
                                                    "steps": b"0"}  # fmt: skip
    with pytest.raises(Exception, match="no"):
        service.storage.load(saved, "bob")
    assert _post(client, "get_info", {"model_id": heard_model}).status_code == 200
    assert client.portal.call(service.expire_silent) == []  # the other one was heard from


def test_a_tenant_holds_at_most_max_models_per_tenant(client):
    _new_model(client)
    session, _ = _new_model(client)
    refused = _post(client, "create_model", {"session_id": session, "model_seq_id": 5, "lora_config": {"rank": 4}})
    assert refused.status_code == 400 and "max_models_per_tenant" in refused.json()["detail"]


def test_a_trainer_lost_between_a_step_and_its_snapshot_gets_the_step_replayed_once(client):
    """The new trainer gets the model's last snapshot and every call that changed it since, in
    order: the forward_backward and the optim_step that the lost snapshot would have covered. The
    step is neither lost nor taken twice (the client's step count says 2 after 2 steps)."""
    _, model_id = _new_model(client)
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]})  # fmt: skip
    adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    client.fleet.trainer_object.lost_at_snapshot = 2
    for seq in (1, 3):
        request = types.ForwardBackwardRequest(
            model_id=model_id, seq_id=seq, forward_backward_input=types.ForwardBackwardInput(data=[datum],
                                                                                             loss_fn="cross_entropy"))  # fmt: skip
        body = request_conv.forward_backward_request_to_proto(request).SerializeToString()
        posted = client.post(
            "/api/v1/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"}
        )
        assert _result(client, posted.json()["request_id"]).status_code == 200
        stepped = _post(client, "optim_step", {"model_id": model_id, "seq_id": seq + 1, "adam_params": adam})
        result = json.loads(_result(client, stepped.json()["request_id"]).content)
        assert result["metrics"]["step:max"] == (seq + 1) / 2, result
    new = client.fleet.trainer_object  # the snapshot after step 1, then the calls since it, once
    assert [c[0] for c in new.calls] == ["restore", "forward_backward", "optim_step"] and new.steps == 2
