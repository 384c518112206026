"""TorchRL's ``WandbLogger`` (``torchrl.record.loggers.wandb``), as TorchRL's GRPO and
expert-iteration scripts use it, writing through rlpost's wandb tracker.

wandb is an optional extra (``rlpost[wandb]``) that the dev extra installs. Most tests here use
the stand-in module of the tracker's own tests (tests/unit/test_trackers.py), which records each
call, so that they can assert what rlpost's :class:`~rlpost.record.trackers.WandbTracker` hands to wandb;
the last one runs the real wandb, offline (there is no network here), and reads its run's files.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys
import types

import pytest
import torch
from tensordict import TensorDict

from rlpost.record.trackers import IDS_FILE

pytestmark = pytest.mark.compat


class FakeConfig(dict):
    def update(self, values, allow_val_change=False):
        super().update(values)


class FakeRun:
    def __init__(self, **kwargs):
        self.kwargs, self.defined, self.logged, self.finished = kwargs, [], [], 0
        self.config = FakeConfig()
        self.id = kwargs.get("id")

    def define_metric(self, name, **kwargs):
        self.defined.append((name, kwargs))

    def log(self, data, step=None):
        self.logged.append((dict(data), step))

    def finish(self):
        self.finished += 1


class FakeTable:
    def __init__(self, columns, data):
        self.columns, self.data = columns, data


@pytest.fixture
def fake_wandb(monkeypatch):
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    module.runs = []
    module.Table = FakeTable

    def init(**kwargs):
        module.runs.append(FakeRun(**kwargs))
        return module.runs[-1]

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_DIR", "WANDB_TAGS", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(var, raising=False)
    return module


def test_grpo_scripts_logger_writes_scalars_through_the_tracker(fake_wandb, tmp_path):
    """grpo-sync.py: ``WandbLogger(project="grpo-sync", exp_name=...)`` then ``log_metrics(metrics,
    step=global_step)``; here offline, in ``save_dir``. The scalar lands in the run the tracker
    opened, against the tracker's ``step`` axis."""
    from rlpost.torchrl.record.loggers.wandb import WandbLogger

    logger = WandbLogger(exp_name="grpo-sync-gsm8k-tiny", offline=True, save_dir=str(tmp_path), project="grpo-sync")
    (run,) = fake_wandb.runs
    assert logger.experiment is run
    assert run.kwargs == {
        "project": "grpo-sync",
        "name": "grpo-sync-gsm8k-tiny",
        "id": logger.id,
        "resume": "allow",
        "dir": str(tmp_path),
        "mode": "offline",
    }
    assert json.loads((tmp_path / IDS_FILE).read_text()) == {"wandb": logger.id}  # where the tracker keeps it
    assert run.defined == [("step", {}), ("*", {"step_metric": "step"})]
    assert "WANDB_MODE" not in os.environ and "WANDB_PROJECT" not in os.environ  # set for the init only

    logger.log_scalar("loss", 0.5, step=3)
    returned = logger.log_metrics({"train/reward": torch.tensor(1.5), "train/steps": 2, "train/hist": torch.ones(2)}, 7)
    assert returned == {"train/reward": 1.5, "train/steps": 2, "train/hist": [1.0, 1.0]}
    assert run.logged[0] == ({"loss": 0.5, "step": 3}, None)
    assert run.logged[1] == ({"train/reward": 1.5, "train/steps": 2.0, "step": 7}, None)
    assert run.logged[2] == ({"train/hist": [1.0, 1.0], "step": 7}, None)  # not a number: straight to the run

    logger.log_str("history", "<|im_start|>user ...", step=7)
    assert run.logged[3] == ({"history": "<|im_start|>user ...", "step": 7}, None)
    logger.log_str("history", "no step")
    table = run.logged[4][0]["history"]
    assert isinstance(table, FakeTable) and table.data == [["no step"]]

    logger.log_hparams({"lr": 1e-5, "model": {"name": "tiny"}})
    assert run.config["lr"] == 1e-5 and run.config["model"] == {"name": "tiny"}
    assert "python" in run.config["env"] and "torch" in run.config["env"]["packages"]  # log_env_packages

    logger.experiment.finish()  # what the scripts' _finish_wandb_logger calls
    assert run.finished == 1


def test_steps_count_per_metric_group_when_not_given(fake_wandb, tmp_path):
    from rlpost.torchrl.record.loggers.wandb import WandbLogger

    logger = WandbLogger("exp", offline=True, save_dir=tmp_path, log_env_packages=False)
    run = fake_wandb.runs[0]
    logger.log_scalar("train/loss", 1.0)
    logger.log_scalar("train/loss", 0.9)
    logger.log_scalar("eval/score", 0.1)
    logger.log_scalar("train/loss", 0.8, step=10)
    logger.log_scalar("train/loss", 0.7)
    assert [row["step"] for row, _ in run.logged] == [0, 1, 0, 10, 11]
    logger.log_metrics(TensorDict({"a": {"b": torch.tensor(2.0)}}, []), step=4, keys_sep=".")
    assert run.logged[-1] == ({"a.b": 2.0, "step": 4}, None)
    logger.log_scalar("x", 3.0, step=9, override_global_step=True)  # wandb's own step
    assert run.logged[-1] == ({"x": 3.0}, 9)
    assert run.config == {}


def test_a_new_logger_is_a_new_run_unless_given_the_id(fake_wandb, tmp_path):
    """TorchRL's WandbLogger starts a new wandb run each time (``id`` resumes one); rlpost's tracker
    would continue the run it remembers in save_dir, so the logger gives it a new id."""
    from rlpost.torchrl.record.loggers.wandb import WandbLogger

    first = WandbLogger("exp", offline=True, save_dir=tmp_path, log_env_packages=False)
    second = WandbLogger("exp", offline=True, save_dir=tmp_path, log_env_packages=False)
    assert first.id != second.id
    resumed = WandbLogger("exp", offline=True, save_dir=tmp_path, id=first.id, log_env_packages=False)
    assert fake_wandb.runs[-1].kwargs["id"] == first.id == resumed.experiment.id


def test_online_only_with_a_key_and_init_arguments(fake_wandb, tmp_path, monkeypatch):
    from rlpost.torchrl.record.loggers.wandb import WandbLogger

    WandbLogger("exp", save_dir=tmp_path, log_env_packages=False)  # offline=False, no API key: the tracker's offline
    assert fake_wandb.runs[-1].kwargs["mode"] == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "key")
    WandbLogger("exp", log_dir=tmp_path, log_env_packages=False, tags=["grpo", "tiny"], group="g", config={"k": 1})
    run = fake_wandb.runs[-1]
    assert run.kwargs["mode"] == "online" and run.kwargs["project"] == "rlpost"
    assert run.kwargs["tags"] == ["grpo", "tiny"] and run.kwargs["group"] == "g"
    assert run.config == {"k": 1}
    assert "WANDB_TAGS" not in os.environ
    with pytest.raises(ValueError, match="Both cannot be specified"):
        WandbLogger("exp", save_dir=tmp_path, log_dir=tmp_path)
    with pytest.raises(TypeError, match="takes no \\['settings'\\]"):
        WandbLogger("exp", save_dir=tmp_path, settings=object())


def test_without_wandb_the_error_says_what_to_install(monkeypatch, tmp_path):
    from rlpost.torchrl.record.loggers.wandb import WandbLogger

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ImportError, match=r"rlpost\[wandb\]"):
        WandbLogger("exp", offline=True, save_dir=tmp_path)


def test_one_class_at_torchrls_paths():
    import rlpost.torchrl.record as record
    import rlpost.torchrl.record.loggers as loggers
    from rlpost.record.loggers import WandbLogger
    from rlpost.torchrl.record.loggers.wandb import WandbLogger as FromScripts

    assert FromScripts is WandbLogger is loggers.WandbLogger is record.WandbLogger


def test_a_real_offline_wandb_run_holds_what_the_logger_logged(tmp_path, monkeypatch):
    """The real wandb (the dev extra installs it), offline as it is here: the run's files are under
    ``save_dir/wandb/``, named after the id the tracker keeps in ``trackers.json``, and its log
    holds the metrics' keys and values (wandb's history records are protobuf with JSON values)."""
    pytest.importorskip("wandb", reason="wandb is the optional extra rlpost[wandb]; the dev extra installs it")
    from rlpost.torchrl.record.loggers.wandb import WandbLogger

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(exp_name="grpo-offline", offline=True, save_dir=str(tmp_path), project="rlpost-tests")
    logger.log_scalar("reward", 0.625, step=1)
    logger.log_metrics({"reward": 0.875, "kl_to_ref": 0.0312}, step=2)
    logger.experiment.finish()
    # finish() returns once the run's exit is recorded; wandb's service process writes the run's
    # file on its own and may still hold it unflushed (seen in CI: only the 7-byte header).
    # teardown() waits for the service to end, which flushes every file it writes.
    import wandb

    wandb.teardown()

    run_id = json.loads((tmp_path / IDS_FILE).read_text())["wandb"]
    (log,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    data = log.read_bytes()
    for expected in (b"reward", b"0.625", b"0.875", b"kl_to_ref", b"0.0312"):
        assert expected in data, expected
