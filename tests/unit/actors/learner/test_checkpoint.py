"""The learner's checkpoint I/O (rlpost.actors.learner.checkpoint).

Its pure parts on folders and errors: moving a folder into place, pruning to the newest N, the
error a failed write raises. Then Learner.save_checkpoint when the disk fills up:
CheckpointWriteError, no temporary folder left, every earlier checkpoint intact (a step saved
again included).

The learners here are real, built from a micro Qwen2 model made in a few seconds (not the tiny
model, which takes minutes to build). One test fills a real filesystem: a small tmpfs mounted in a
child process under ``unshare --user --mount``. The others make the writers fail with
monkeypatch, to reach each step of the write quickly.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from rlpost.actors.learner import Learner, LearnerSettings, checkpoint
from rlpost.actors.learner.checkpoint import (
    CheckpointWriteError,
    move_into_place,
    os_error_behind,
    prune_checkpoints,
    write_error,
)
from rlpost.config import JobConfig

pytestmark = pytest.mark.unit


def disk_full() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def failing(error: Exception):
    """A stand-in for a writer (torch.save) that fails with ``error``."""

    def write(*args, **kwargs):
        raise error

    return write


def make_micro_model(folder: Path) -> Path:
    """A random 2-layer Qwen2 LM (about 80k parameters) and a word-level tokenizer, saved to ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(62)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="<eos>")
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory) -> Path:
    return make_micro_model(tmp_path_factory.mktemp("micro-model"))


def make_learner(model: Path, keep: int = 2) -> Learner:
    """A real Learner whose optimizer has state (one step on made-up gradients), so that
    trainer_state.pt holds the AdamW moments, as it does during a run."""
    cfg = JobConfig.model_validate({"model": {"name_or_path": str(model)}, "trainer": {"keep_checkpoints": keep}})
    learner = Learner(LearnerSettings.from_job(cfg))
    for param in learner.model.parameters():
        param.grad = torch.full_like(param, 0.01)
    learner.optimizer.step()
    learner.optimizer.zero_grad(set_to_none=True)
    return learner


def file_digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def entries(run_dir: Path) -> list[str]:
    """Everything in run_dir/checkpoints, hidden temporary folders included."""
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


# ------------------------------------------------------------------ folders and errors


def folder_with(path: Path, text: str) -> Path:
    """A folder at ``path`` holding one file, ``marker``, with ``text``."""
    path.mkdir(parents=True)
    (path / "marker").write_text(text)
    return path


def test_a_folder_moves_into_a_free_place_and_leaves_nothing_aside(tmp_path):
    tmp = folder_with(tmp_path / ".tmp-step_3-abc", "new")
    assert move_into_place(tmp, tmp_path / "step_3") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3"]
    assert (tmp_path / "step_3" / "marker").read_text() == "new"


def test_a_folder_takes_the_place_of_an_old_one_which_is_renamed_aside(tmp_path):
    final = folder_with(tmp_path / "step_3", "old")
    tmp = folder_with(tmp_path / ".tmp-step_3-abc", "new")
    aside = move_into_place(tmp, final)
    assert aside.parent == tmp_path and aside.name.startswith(f".old-step_3-{os.getpid()}-")
    assert (aside / "marker").read_text() == "old"  # for the caller to delete
    assert (final / "marker").read_text() == "new" and not tmp.exists()


def test_the_old_folder_is_renamed_back_when_the_new_one_cannot_take_its_place(tmp_path, monkeypatch):
    final = folder_with(tmp_path / "step_3", "old")
    tmp = folder_with(tmp_path / ".tmp-step_3-abc", "new")
    real_rename = os.rename

    def rename(src, dst):
        if Path(src) == tmp:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(src))
        real_rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", rename)
    with pytest.raises(OSError, match="Input/output error"):
        move_into_place(tmp, final)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-step_3-abc", "step_3"]
    assert (final / "marker").read_text() == "old"


def test_pruning_keeps_the_newest_checkpoints_by_step_number(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step_1", "step_2", "step_9", "step_10", ".tmp-step_11-abc", "notes"):
        folder_with(root / name, name)
    prune_checkpoints(root, 2)
    # step_10 is newer than step_9 (not by name); what is no step_<N> folder stays
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step_11-abc", "notes", "step_10", "step_9"]
    prune_checkpoints(root, 5)  # fewer than keep: nothing goes
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step_11-abc", "notes", "step_10", "step_9"]


def test_the_write_error_names_the_cause_the_checkpoint_to_resume_from_and_room_on_a_full_disk(tmp_path):
    root = tmp_path / "checkpoints"
    folder_with(root / "step_2", "kept")
    full = write_error(root / "step_4", disk_full())
    assert isinstance(full, CheckpointWriteError) and full.errno == errno.ENOSPC
    assert str(full) == (  # OSError's form with an errno: "[Errno N] message"
        f"[Errno 28] could not write checkpoint {root / 'step_4'}: no space left on device (free space on the disk of "
        f"{root}: every save needs room for one more checkpoint); its partial copy was removed and the latest "
        f"intact checkpoint is {root / 'step_2'}. Cause: [Errno 28] No space left on device"
    )
    denied = write_error(root / "step_4", OSError(errno.EACCES, os.strerror(errno.EACCES)))
    assert denied.errno == errno.EACCES
    assert str(denied).startswith(f"[Errno 13] could not write checkpoint {root / 'step_4'}: permission denied; its")
    first = write_error(tmp_path / "elsewhere" / "checkpoints" / "step_1", OSError("no errno"))
    assert first.errno is None
    assert str(first).startswith(
        f"could not write checkpoint {tmp_path / 'elsewhere' / 'checkpoints' / 'step_1'}: "
        "OSError; its partial copy was removed and there is no earlier checkpoint"
    )


# ------------------------------------------------------------------ writers made to fail


def test_disk_full_keeps_earlier_checkpoints_and_leaves_no_temporary_folder(micro_model, tmp_path, monkeypatch):
    learner = make_learner(micro_model, keep=1)
    learner.save_checkpoint(tmp_path, 1)
    learner.save_checkpoint(tmp_path, 2)  # keep=1: step_1 is pruned
    before = file_digests(tmp_path / "checkpoints" / "step_2")
    monkeypatch.setattr(torch, "save", failing(disk_full()))
    with pytest.raises(CheckpointWriteError) as info:
        learner.save_checkpoint(tmp_path, 3, rollout_state={"step": 3})
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert f"could not write checkpoint {tmp_path / 'checkpoints' / 'step_3'}: no space left on device" in message
    assert f"the latest intact checkpoint is {tmp_path / 'checkpoints' / 'step_2'}" in message
    assert isinstance(info.value.__cause__, OSError)
    assert entries(tmp_path) == ["step_2"]  # not pruned, no .tmp-step_3-*
    assert file_digests(tmp_path / "checkpoints" / "step_2") == before


def test_saving_a_step_again_keeps_the_old_folder_when_the_write_fails(micro_model, tmp_path, monkeypatch):
    learner = make_learner(micro_model)
    learner.save_checkpoint(tmp_path, 1, rollout_state={"step": 1})
    before = file_digests(tmp_path / "checkpoints" / "step_1")
    monkeypatch.setattr(torch, "save", failing(disk_full()))
    with pytest.raises(CheckpointWriteError, match="no space left on device") as info:
        learner.save_checkpoint(tmp_path, 1, rollout_state={"step": 1, "more": True})
    assert f"the latest intact checkpoint is {tmp_path / 'checkpoints' / 'step_1'}" in str(info.value)
    assert entries(tmp_path) == ["step_1"]
    assert file_digests(tmp_path / "checkpoints" / "step_1") == before
    assert learner.load_checkpoint(tmp_path / "checkpoints" / "step_1")["rollout_state"] == {"step": 1}


def test_saving_a_step_again_restores_the_old_folder_when_the_rename_fails(micro_model, tmp_path, monkeypatch):
    learner = make_learner(micro_model)
    learner.save_checkpoint(tmp_path, 1)
    before = file_digests(tmp_path / "checkpoints" / "step_1")
    real_rename = os.rename

    def rename(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(src))
        real_rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", rename)
    with pytest.raises(CheckpointWriteError, match="input/output error"):
        learner.save_checkpoint(tmp_path, 1)
    assert entries(tmp_path) == ["step_1"]  # the old one renamed back, the new one removed
    assert file_digests(tmp_path / "checkpoints" / "step_1") == before


def test_saving_a_step_again_replaces_it(micro_model, tmp_path):
    learner = make_learner(micro_model)
    learner.save_checkpoint(tmp_path, 1, rollout_state={"take": 1})
    learner.save_checkpoint(tmp_path, 1, rollout_state={"take": 2})
    assert entries(tmp_path) == ["step_1"]  # the old folder, renamed aside, is gone
    assert learner.load_checkpoint(tmp_path / "checkpoints" / "step_1")["rollout_state"] == {"take": 2}


def test_the_first_checkpoint_failing_says_there_is_no_earlier_one(micro_model, tmp_path, monkeypatch):
    learner = make_learner(micro_model)
    monkeypatch.setattr(torch, "save", failing(disk_full()))
    with pytest.raises(CheckpointWriteError, match="there is no earlier checkpoint"):
        learner.save_checkpoint(tmp_path, 1)
    assert entries(tmp_path) == []


def test_other_errors_propagate_as_they_are_and_leave_nothing(micro_model, tmp_path, monkeypatch):
    learner = make_learner(micro_model)
    monkeypatch.setattr(torch, "save", failing(ValueError("a bug, not the disk")))
    with pytest.raises(ValueError, match="a bug, not the disk"):
        learner.save_checkpoint(tmp_path, 1)
    assert entries(tmp_path) == []


def test_the_os_error_is_found_behind_the_errors_of_cpp_and_rust_writers():
    # torch.save into a Python file: a RuntimeError raised while handling the file's OSError
    try:
        try:
            raise disk_full()
        except OSError:
            # implicit chaining on purpose: that is how the C++ writer's error arrives
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904
    except RuntimeError as err:
        assert os_error_behind(err).errno == errno.ENOSPC
    # safetensors: the errno only in the message
    rust = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert os_error_behind(rust).errno == errno.ENOSPC
    assert os_error_behind(ValueError("no I/O here")) is None


def test_the_error_keeps_its_errno_across_pickling():
    """Ray pickles an actor's exception to hand it to the driver."""
    error = write_error(Path("/nowhere/checkpoints/step_3"), disk_full())
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, CheckpointWriteError) and copy.errno == errno.ENOSPC and str(copy) == str(error)


# ------------------------------------------------------------------ a real full filesystem

# Runs inside the new mount namespace, with a tmpfs of DISK_MB mounted on argv[1]. Saves step_1,
# then fills the disk to leave a given number of bytes free and tries again; prints one JSON line.
CHILD = textwrap.dedent("""
    import json, os, sys, traceback
    from pathlib import Path
    sys.path.insert(0, os.path.dirname(sys.argv[3]))
    from test_checkpoint import file_digests, make_learner
    from rlpost.actors.learner import CheckpointWriteError

    disk, run_dir = Path(sys.argv[1]), Path(sys.argv[1]) / "run"
    learner = make_learner(Path(sys.argv[2]))
    first = learner.save_checkpoint(run_dir, 1, rollout_state={"step": 1})
    report = {"digests": file_digests(first), "sizes": {p.name: p.stat().st_size for p in first.iterdir()}}

    def fill_to(free_bytes):
        filler = disk / "filler"
        filler.unlink(missing_ok=True)
        st = os.statvfs(disk)
        filler.write_bytes(b"x" * max(0, st.f_bavail * st.f_frsize - free_bytes))

    def attempt(name, step, free_bytes):
        fill_to(free_bytes)
        try:
            learner.save_checkpoint(run_dir, step, rollout_state={"step": step})
            outcome = {"raised": None}
        except CheckpointWriteError as err:
            frames = traceback.extract_tb(err.__cause__.__traceback__)
            outcome = {"raised": "CheckpointWriteError", "errno": err.errno, "message": str(err),
                       "cause": f"{type(err.__cause__).__name__}: {err.__cause__}",
                       "writing": [f.line for f in frames if f.name == "_write_checkpoint_files"]}
        outcome["entries"] = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        outcome["step_1"] = file_digests(run_dir / "checkpoints" / "step_1")
        report[name] = outcome

    weights, state = (report["sizes"][n] for n in ("model.safetensors", "trainer_state.pt"))
    attempt("weights_do_not_fit", 2, weights // 2)
    attempt("trainer_state_does_not_fit", 2, weights + 200_000 + state // 2)
    attempt("step_1_again", 1, weights + 200_000 + state // 2)
    (disk / "filler").unlink()
    report["loaded"] = learner.load_checkpoint(run_dir / "checkpoints" / "step_1")["rollout_state"]
    print(json.dumps(report))
""")
DISK_MB = 4


def _mount_namespace_problem() -> str | None:
    """Why a tmpfs cannot be mounted in a user + mount namespace here, or None when it can."""
    if shutil.which("unshare") is None:
        return "no `unshare` command (util-linux) on this machine"
    with tempfile.TemporaryDirectory() as where:
        probe = subprocess.run(
            [
                "unshare",
                "--user",
                "--map-root-user",
                "--mount",
                "mount",
                "-t",
                "tmpfs",
                "-o",
                "size=1m",
                "tmpfs",
                where,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    if probe.returncode != 0:
        return f"`unshare --user --map-root-user --mount mount -t tmpfs` failed: {probe.stderr.strip()}"
    return None


def test_a_real_full_disk(micro_model, tmp_path):
    problem = _mount_namespace_problem()
    if problem:
        pytest.skip(f"needs unprivileged user and mount namespaces to mount a small tmpfs: {problem}")
    disk = tmp_path / "disk"
    disk.mkdir()
    mount_then_run = 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"'
    command = [
        "unshare",
        "--user",
        "--map-root-user",
        "--mount",
        "sh",
        "-c",
        mount_then_run,
        "sh",
        f"{DISK_MB}m",
        str(disk),
        sys.executable,
        "-c",
        CHILD,
        str(disk),
        str(micro_model),
        __file__,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert sum(report["sizes"].values()) < DISK_MB * 2**20 / 2  # step_1 fits, with room for the filler

    latest = str(disk / "run" / "checkpoints" / "step_1")
    for name, writer in [
        ("weights_do_not_fit", "self.model.save_pretrained"),
        ("trainer_state_does_not_fit", "trainer_state"),
        ("step_1_again", "trainer_state"),
    ]:
        outcome = report[name]
        assert outcome["raised"] == "CheckpointWriteError", (name, outcome)
        assert outcome["errno"] == errno.ENOSPC, (name, outcome)
        assert "no space left on device" in outcome["message"], (name, outcome)
        assert f"the latest intact checkpoint is {latest}" in outcome["message"], (name, outcome)
        assert writer.lower() in outcome["writing"][0].lower(), (name, outcome)  # the writer out of space
        assert outcome["entries"] == ["step_1"], (name, outcome)  # no .tmp-*, no .old-*
        assert outcome["step_1"] == report["digests"], name
    assert report["loaded"] == {"step": 1}
