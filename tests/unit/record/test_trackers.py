import importlib.machinery
import importlib.util
import json
import logging
import sys
import types

import pytest

from rlpost.config import ConfigError, LoggingConfig, load_config
from rlpost.record.metrics import REQUIRED_KEYS, MetricsWriter, read_metrics
from rlpost.record.trackers import (
    IDS_FILE,
    MlflowTracker,
    WandbTracker,
    make_trackers,
    numeric_values,
    wandb_mode,
)

pytestmark = pytest.mark.unit


def record(step, reward, **extra):
    rec = {k: 0.5 for k in REQUIRED_KEYS}
    rec.update(step=step, policy_version=step, reward_mean=reward, loss=1.0 / step, sync_logprob_diff=None, **extra)
    return rec


def read_scalars(logdir):
    """{tag: [(step, value), ...]} as TensorBoard's own reader sees the event files in ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


class Recorder:
    """A tracker that keeps what it is given."""

    def __init__(self, name="recorder"):
        self.name, self.logged, self.closed = name, [], 0

    def log(self, metrics, step):
        self.logged.append((step, dict(metrics)))

    def close(self):
        self.closed += 1


# ------------------------------------------------------------------------------ values


def test_numeric_values_keep_numbers_under_their_names():
    import numpy as np
    import torch

    values = numeric_values(
        {
            "step": 3,
            "loss": 0.25,
            "stopped": True,
            "flag": False,
            "none": None,
            "nan": float("nan"),
            "inf": float("inf"),
            "text": "x",
            "list": [1, 2],
            "nested": {"a": 1},
            "tensor": torch.tensor(1.5),
            "np_int": np.int64(7),
            "np_bool": np.bool_(True),
            "vector": torch.ones(2),
        }
    )
    assert values == {
        "step": 3.0,
        "loss": 0.25,
        "stopped": 1.0,
        "flag": 0.0,
        "tensor": 1.5,
        "np_int": 7.0,
        "np_bool": 1.0,
    }
    assert all(type(v) is float for v in values.values())


# ------------------------------------------------------------------------------ TensorBoard


def test_tensorboard_reader_sees_every_numeric_key_at_its_step(tmp_path):
    trackers = make_trackers(LoggingConfig(), tmp_path, "run", first_step=1)
    assert [t.name for t in trackers] == ["tensorboard"]
    writer = MetricsWriter(tmp_path, trackers=trackers)
    for step in (1, 2, 3):
        writer.write(record(step, 0.1 * step, stopped=step == 3, note="text", eval_reward_mean=None))
    writer.close()
    scalars = read_scalars(tmp_path / "tensorboard")
    rows = read_metrics(tmp_path / "metrics.jsonl")
    numeric_keys = {k for r in rows for k, v in r.items() if isinstance(v, (int, float))}
    assert set(scalars) == numeric_keys  # every numeric key, same name; none of note/None ones
    assert "sync_logprob_diff" not in scalars and "note" not in scalars and "eval_reward_mean" not in scalars
    assert scalars["reward_mean"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, pytest.approx(0.3))]
    assert scalars["loss"] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert scalars["stopped"] == [(1, 0.0), (2, 0.0), (3, 1.0)]
    assert scalars["step"] == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_a_resumed_writer_purges_the_steps_after_the_checkpoint(tmp_path):
    crashed = MetricsWriter(tmp_path, trackers=make_trackers(LoggingConfig(), tmp_path, "run", first_step=1))
    for step in range(1, 6):  # checkpoint after step 3, then steps 4 and 5 before the crash
        crashed.write(record(step, 0.1 * step))
    crashed.close()
    resumed = MetricsWriter(tmp_path, trackers=make_trackers(LoggingConfig(), tmp_path, "run", first_step=4))
    for step in range(4, 7):
        resumed.write(record(step, 1.0 + step))
    resumed.close()
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one logdir, two files
    reward = read_scalars(tmp_path / "tensorboard")["reward_mean"]
    assert [s for s, _ in reward] == [1, 2, 3, 4, 5, 6]  # one value per step
    assert [v for _, v in reward] == pytest.approx([0.1, 0.2, 0.3, 5.0, 6.0, 7.0])  # the resumed run's from 4 on


# ------------------------------------------------------------------------------ config


def test_default_is_tensorboard_and_none_is_allowed():
    assert load_config(None).logging.trackers == ["tensorboard"]
    assert load_config(None, ["logging.trackers=[]"]).logging.trackers == []
    assert load_config(None, ["logging.trackers=tensorboard"]).logging.trackers == ["tensorboard"]


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_tracker_not_installed_is_a_config_error_naming_the_extra(monkeypatch, name):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == name else real(mod, *a))
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"logging.trackers=[tensorboard, {name}]"])
    message = str(err.value)
    assert "logging.trackers" in message
    assert f"tracker '{name}' needs the {name} package, which is not installed: pip install 'rlpost[{name}]'" in message


def test_tensorboard_not_installed_says_to_reinstall(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == "tensorboard" else real(mod, *a))
    with pytest.raises(ConfigError, match=r"pip install tensorboard \(a dependency of rlpost"):
        load_config(None)


def test_unknown_or_repeated_tracker_names_are_errors():
    with pytest.raises(ConfigError, match="unknown tracker 'tensorbord'; valid trackers: tensorboard, wandb, mlflow"):
        load_config(None, ["logging.trackers=[tensorbord]"])
    with pytest.raises(ConfigError, match="tracker tensorboard named more than once"):
        load_config(None, ["logging.trackers=[tensorboard, tensorboard]"])


# ------------------------------------------------------------------------------ failures


class Failing(Recorder):
    def __init__(self, fail_at):
        super().__init__("failing")
        self.fail_at = fail_at

    def log(self, metrics, step):
        if step >= self.fail_at:
            raise ConnectionError("server gone")
        super().log(metrics, step)


def test_a_failing_tracker_is_dropped_with_one_warning_and_the_others_go_on(tmp_path, caplog):
    failing, other = Failing(fail_at=2), Recorder()
    writer = MetricsWriter(tmp_path, trackers=[failing, other])
    with caplog.at_level(logging.WARNING, logger="rlpost"):
        for step in (1, 2, 3, 4):
            writer.write(record(step, 0.1 * step))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "tracker failing failed at step 2 (ConnectionError: server gone)" in warnings[0]
    assert [s for s, _ in failing.logged] == [1] and failing.closed == 1
    assert [s for s, _ in other.logged] == [1, 2, 3, 4]
    assert other.logged[3][1]["reward_mean"] == pytest.approx(0.4)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert writer.trackers == [other]
    writer.close()
    writer.close()
    assert other.closed == 1  # closed once; later writes reach the file only
    writer.write(record(5, 0.5))
    assert [s for s, _ in other.logged] == [1, 2, 3, 4]
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["step"] == 5


def test_required_keys_are_still_checked_before_anything_is_written(tmp_path):
    other = Recorder()
    rec = record(1, 0.1)
    del rec["loss"]
    with pytest.raises(ValueError, match=r"lacks required keys \['loss'\]"):
        MetricsWriter(tmp_path, trackers=[other]).write(rec)
    assert other.logged == [] and not (tmp_path / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------ wandb (a fake module)


def fake_module(name):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec finds it in sys.modules
    return module


class FakeWandbRun:
    def __init__(self, **kwargs):
        self.kwargs, self.defined, self.logged, self.finished = kwargs, [], [], 0

    def define_metric(self, name, **kwargs):
        self.defined.append((name, kwargs))

    def log(self, data):
        self.logged.append(dict(data))

    def finish(self):
        self.finished += 1


@pytest.fixture
def fake_wandb(monkeypatch):
    module = fake_module("wandb")
    module.runs = []

    def init(**kwargs):
        run = FakeWandbRun(**kwargs)
        module.runs.append(run)
        return run

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    return module


def test_wandb_mode_is_offline_unless_told_otherwise():
    assert wandb_mode({}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode({"WANDB_API_KEY": "k", "WANDB_MODE": "offline"}) == "offline"
    assert wandb_mode({"WANDB_MODE": "disabled"}) == "disabled"


def test_wandb_adapter_logs_records_against_step_and_resumes_the_same_run(tmp_path, fake_wandb, monkeypatch):
    cfg = load_config(None, ["logging.trackers=[wandb]"]).logging  # validates: the fake is importable
    writer = MetricsWriter(tmp_path, trackers=make_trackers(cfg, tmp_path, "my-run", first_step=1))
    writer.write(record(1, 0.25, stopped=False, note="x"))
    writer.close()
    run = fake_wandb.runs[0]
    run_id = json.loads((tmp_path / IDS_FILE).read_text())["wandb"]
    assert run.kwargs == {
        "project": "rlpost",
        "name": "my-run",
        "id": run_id,
        "resume": "allow",
        "dir": str(tmp_path),
        "mode": "offline",
    }
    assert run.defined == [("step", {}), ("*", {"step_metric": "step"})]
    assert run.logged == [numeric_values(record(1, 0.25, stopped=False))]
    assert run.logged[0]["step"] == 1 and run.logged[0]["stopped"] == 0.0 and "note" not in run.logged[0]
    assert run.finished == 1

    monkeypatch.setenv("WANDB_PROJECT", "team")
    monkeypatch.setenv("WANDB_API_KEY", "key")
    WandbTracker(tmp_path, "my-run")  # the resume: same id
    again = fake_wandb.runs[1].kwargs
    assert (again["id"], again["project"], again["mode"]) == (run_id, "team", "online")


def test_a_tracker_that_cannot_start_is_skipped_with_a_warning(tmp_path, fake_wandb, caplog):
    def broken_init(**kwargs):
        raise RuntimeError("no network")

    fake_wandb.init = broken_init
    with caplog.at_level(logging.WARNING, logger="rlpost"):
        trackers = make_trackers(LoggingConfig(trackers=["wandb", "tensorboard"]), tmp_path, "run")
    assert [t.name for t in trackers] == ["tensorboard"]
    assert "tracker wandb could not start (RuntimeError: no network)" in caplog.text
    for tracker in trackers:
        tracker.close()


# ------------------------------------------------------------------------------ MLflow (a fake module)


class FakeMlflowClient:
    instances: list["FakeMlflowClient"] = []
    experiments: dict[str, str] = {}
    runs: set[str] = set()

    def __init__(self, tracking_uri):
        self.tracking_uri, self.calls = tracking_uri, []
        FakeMlflowClient.instances.append(self)

    def get_experiment_by_name(self, name):
        self.calls.append(("get_experiment_by_name", name))
        found = self.experiments.get(name)
        return types.SimpleNamespace(experiment_id=found) if found else None

    def create_experiment(self, name, artifact_location=None):
        self.calls.append(("create_experiment", name, artifact_location))
        self.experiments[name] = "exp-1"
        return "exp-1"

    def create_run(self, experiment_id, run_name=None):
        self.calls.append(("create_run", experiment_id, run_name))
        self.runs.add("run-1")
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id="run-1"))

    def get_run(self, run_id):
        self.calls.append(("get_run", run_id))
        if run_id not in self.runs:
            raise LookupError(run_id)
        return types.SimpleNamespace()

    def update_run(self, run_id, status=None):
        self.calls.append(("update_run", run_id, status))

    def log_batch(self, run_id, metrics=()):
        self.calls.append(("log_batch", run_id, [(m.key, m.value, m.step) for m in metrics]))

    def set_terminated(self, run_id):
        self.calls.append(("set_terminated", run_id))


class FakeMetric:
    def __init__(self, key, value, timestamp, step):
        self.key, self.value, self.timestamp, self.step = key, value, timestamp, step


@pytest.fixture
def fake_mlflow(monkeypatch):
    module, entities = fake_module("mlflow"), fake_module("mlflow.entities")
    entities.Metric = FakeMetric
    module.MlflowClient, module.entities = FakeMlflowClient, entities
    monkeypatch.setattr(FakeMlflowClient, "instances", [])
    monkeypatch.setattr(FakeMlflowClient, "experiments", {})
    monkeypatch.setattr(FakeMlflowClient, "runs", set())
    monkeypatch.setitem(sys.modules, "mlflow", module)
    monkeypatch.setitem(sys.modules, "mlflow.entities", entities)
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    return module


def test_mlflow_adapter_uses_a_local_store_and_logs_batches(tmp_path, fake_mlflow):
    cfg = load_config(None, ["logging.trackers=[mlflow]"]).logging
    writer = MetricsWriter(tmp_path, trackers=make_trackers(cfg, tmp_path, "my-run"))
    writer.write(record(1, 0.25, note="x"))
    writer.write(record(2, 0.5))
    writer.close()
    (client,) = FakeMlflowClient.instances
    assert client.tracking_uri == f"sqlite:///{(tmp_path / 'mlruns' / 'mlflow.db').resolve()}"
    assert (tmp_path / "mlruns").is_dir()
    assert client.calls[:3] == [
        ("get_experiment_by_name", "rlpost"),
        ("create_experiment", "rlpost", (tmp_path / "mlruns" / "artifacts").resolve().as_uri()),
        ("create_run", "exp-1", "my-run"),
    ]
    batches = [c for c in client.calls if c[0] == "log_batch"]
    assert [b[1] for b in batches] == ["run-1", "run-1"]
    expected = numeric_values(record(2, 0.5))
    assert sorted(batches[1][2]) == sorted((k, v, 2) for k, v in expected.items())
    assert all(step == 1 for _, _, step in batches[0][2]) and ("note", "x", 1) not in batches[0][2]
    assert client.calls[-1] == ("set_terminated", "run-1")
    assert json.loads((tmp_path / IDS_FILE).read_text()) == {"mlflow": "run-1"}


def test_mlflow_resume_continues_the_run_and_respects_the_tracking_uri(tmp_path, fake_mlflow, monkeypatch):
    MlflowTracker(tmp_path, "my-run").close()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "rlpost")  # now exists: found, not created
    tracker = MlflowTracker(tmp_path, "my-run")
    client = FakeMlflowClient.instances[1]
    assert client.tracking_uri == "http://mlflow.example:5000"
    assert client.calls == [
        ("get_experiment_by_name", "rlpost"),
        ("get_run", "run-1"),
        ("update_run", "run-1", "RUNNING"),
    ]
    assert tracker.run_id == "run-1"


def test_mlflow_remembered_run_missing_from_the_store_starts_a_new_one(tmp_path, fake_mlflow):
    (tmp_path / IDS_FILE).write_text(json.dumps({"mlflow": "gone", "wandb": "abc"}))
    tracker = MlflowTracker(tmp_path, "my-run")
    assert tracker.run_id == "run-1"
    assert ("create_run", "exp-1", "my-run") in FakeMlflowClient.instances[0].calls
    assert json.loads((tmp_path / IDS_FILE).read_text()) == {"mlflow": "run-1", "wandb": "abc"}
