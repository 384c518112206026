"""A learner's checkpoints: the ``run_dir/checkpoints/step_<N>`` folders, written and read.

A single learner's folder holds the model (float32 masters) and tokenizer in HF format and
``trainer_state.pt`` (:data:`TRAINER_STATE`: optimizer, scheduler, step, version, torch RNG
states); a learner group's holds the consolidated model and the trainer state in
``torch.distributed.checkpoint`` shards (:data:`TRAINER_SHARDS`, with :data:`TRAINER_META`); a
LoRA learner's holds the adapter in peft's format (with ``model.lora.save_merged`` also the
merged model in ``merged/``). Each may hold the controller's ``rollout_state.pkl``.
:class:`Checkpointer` does the I/O; the :class:`~rlpost.actors.learner.core.Learner` owns the
step and version it saves and loads.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlpost.actors import sharding
from rlpost.policies import lora
from rlpost.record.run_dir import latest_checkpoint, list_checkpoints
from rlpost.runtime.liveness import progress

if TYPE_CHECKING:
    from rlpost.config import LoraConfig

TRAINER_STATE = "trainer_state.pt"
TRAINER_SHARDS = "trainer_state"  # a learner group's: torch.distributed.checkpoint shards
TRAINER_META = "trainer_meta.pt"  # beside them: scheduler, step, version, RNG
ROLLOUT_STATE = "rollout_state.pkl"  # the controller's part: buffer groups, env-pool positions
_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)")  # how Rust's std::io::Error shows an errno


class CheckpointWriteError(OSError):
    """A checkpoint could not be written because of an I/O error (disk full, quota, permissions).

    Raised once nothing of the failed write is left and every earlier checkpoint is intact;
    ``errno`` is the cause's, the message names the folder, the cause and the checkpoint to resume from.
    """


@dataclass
class Checkpointer:
    """Writes and reads the checkpoints of one learner (or of one rank of a learner group: every
    rank calls save and load). ``model``: with LoRA peft's wrapper, in a group this rank's shards;
    ``keep``: ``trainer.keep_checkpoints``; ``architecture``: the model's own class name before
    sharding renamed it (a group's consolidated model is saved under it).
    """

    model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    lora_config: LoraConfig | None
    keep: int
    trust_remote_code: bool = False
    sharded: bool = False
    rank: int = 0
    architecture: str | None = None

    def save(self, run_dir: str | Path, step: int, rollout_state: dict | None = None, *, version: int) -> Path:
        """Write ``run_dir/checkpoints/step_<step>`` atomically; keep the last ``keep_checkpoints``.

        ``rollout_state``: the controller's buffer groups and env-pool positions, taken together.
        Written beside its place and renamed in (:func:`move_into_place`): a crash never leaves a
        half-written ``step_<N>``; older checkpoints are pruned only after. An I/O error (also
        wrapped by torch or safetensors) removes the temporary folder and raises
        :class:`CheckpointWriteError`; any other error removes it and propagates as is.
        """
        if self.sharded:
            return self._save_sharded_checkpoint(run_dir, step, rollout_state, version)
        root = Path(run_dir) / "checkpoints"
        final = root / f"step_{int(step)}"
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
        except OSError as err:
            raise write_error(final, err) from err
        try:
            self._write_checkpoint_files(tmp, step, version, rollout_state)
            aside = move_into_place(tmp, final)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            cause = os_error_behind(err) if isinstance(err, Exception) else None
            if cause is None:
                raise
            raise write_error(final, cause) from err
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        prune_checkpoints(root, self.keep)
        return final

    def _write_checkpoint_files(self, folder: Path, step: int, version: int, rollout_state: dict | None) -> None:
        """Trap: ``trainer_state.pt`` goes through a Python file object: torch.save to a path writes
        from C++ and on a full disk raises a RuntimeError without the errno; this way the OSError
        stays in ``__context__`` for :func:`os_error_behind`."""
        self.model.save_pretrained(folder)  # with LoRA: the adapter (adapter_config.json, adapter_model.safetensors)
        progress()
        self.tokenizer.save_pretrained(folder)
        if self.lora_config is not None and self.lora_config.save_merged:
            lora.save_merged(self.model, folder / lora.MERGED_FOLDER)
            self.tokenizer.save_pretrained(folder / lora.MERGED_FOLDER)
        with open(folder / TRAINER_STATE, "wb") as f:
            torch.save(self._trainer_state(step, version), f)
        if rollout_state is not None:
            # pickle: the groups are rlpost dataclasses; the file is this run's own output
            (folder / ROLLOUT_STATE).write_bytes(pickle.dumps(rollout_state))

    def _trainer_state(self, step: int, version: int) -> dict:
        return {**self._trainer_meta(step, version), "optimizer": self.optimizer.state_dict()}

    def _trainer_meta(self, step: int, version: int) -> dict:
        return {
            "step": int(step),
            "version": version,
            "scheduler": self.scheduler.state_dict(),
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }

    def _save_sharded_checkpoint(
        self, run_dir: str | Path, step: int, rollout_state: dict | None, version: int
    ) -> Path:
        """:meth:`save` of a learner group (every rank must see ``run_dir``): rank 0 writes the
        consolidated HF model and the tokenizer, each rank its shards of the float32 masters and
        AdamW's state (any number of ranks, or a single learner, can load it); rank 0 moves the
        folder into place once every rank wrote its part."""
        root = Path(run_dir) / "checkpoints"
        final = root / f"step_{int(step)}"
        tmp, made = None, None
        if self.rank == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
                tmp = tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root)
            except OSError as err:
                made = err
        tmp = sharding.broadcast_from_rank0(tmp)
        if tmp is None:
            raise write_error(final, made) if made is not None else RuntimeError(f"rank 0 could not create {final}")
        tmp, failure = Path(tmp), None
        try:
            self._write_sharded_checkpoint_files(tmp, step, version, rollout_state)
        except Exception as err:
            failure = err
        failed = [(rank, text) for rank, text in enumerate(sharding.all_gather_objects(failure and repr(failure)))
                  if text]  # fmt: skip
        if failed:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if failure is None:
                rank, text = failed[0]
                raise RuntimeError(f"checkpoint {final} was not written: learner rank {rank} failed: {text}")
            cause = os_error_behind(failure)
            raise (write_error(final, cause) if cause is not None else failure) from failure
        if self.rank == 0:
            aside = move_into_place(tmp, final)
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)
            prune_checkpoints(root, self.keep)
        sharding.all_gather_objects(None)  # every rank returns once the checkpoint is in place
        return final

    def _write_sharded_checkpoint_files(
        self, folder: Path, step: int, version: int, rollout_state: dict | None
    ) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder / TRAINER_SHARDS))
        whole = {}  # gathered tensor by tensor; rank 0 keeps them for the consolidated model
        for name, tensor in self.model.state_dict().items():
            full = sharding.full_tensor(tensor.detach())
            if self.rank == 0:
                whole[name] = full.float().cpu()
        if self.rank != 0:
            return
        self.model.save_pretrained(folder, state_dict=whole)
        progress()
        _name_architecture(folder, self.architecture)
        self.tokenizer.save_pretrained(folder)
        with open(folder / TRAINER_META, "wb") as f:
            torch.save(self._trainer_meta(step, version), f)
        if rollout_state is not None:
            (folder / ROLLOUT_STATE).write_bytes(pickle.dumps(rollout_state))

    def load(self, path: str | Path) -> dict:
        """Restore weights, optimizer, scheduler and RNG from a ``step_<N>`` folder in place (the
        optimizer keeps pointing at the same parameters); returns ``step``, ``version`` and
        ``rollout_state`` (None when absent)."""
        from transformers import AutoModelForCausalLM

        path = Path(path)
        if (path / TRAINER_SHARDS).is_dir():  # written by a learner group: any number of ranks loads it
            return self._load_sharded_checkpoint(path)
        if not (path / TRAINER_STATE).is_file():
            raise FileNotFoundError(f"{path} is not a learner checkpoint (no {TRAINER_STATE} or {TRAINER_SHARDS}/)")
        if lora.is_adapter_checkpoint(path) or self.lora_config is not None:
            return self._load_adapter_checkpoint(path)
        saved = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, trust_remote_code=self.trust_remote_code
        )
        state = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)
        if self.sharded:  # a single learner's checkpoint, spread over this group's shards
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            set_state_dict(self.model, self.optimizer, model_state_dict=saved.state_dict(),
                           optim_state_dict=self._optimizer_state_by_name(state["optimizer"]),
                           options=StateDictOptions(full_state_dict=True))  # fmt: skip
        else:
            self.model.load_state_dict(saved.state_dict())
            self.optimizer.load_state_dict(state["optimizer"])
        return self._restore_meta(state, path)

    def _load_adapter_checkpoint(self, path: Path) -> dict:
        """:meth:`load` of a LoRA learner: the adapter's weights and its optimizer."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        if self.lora_config is None:
            raise ValueError(
                f"{path} holds a LoRA adapter (its run set model.lora); resume it with the same model.lora section"
            )
        if not lora.is_adapter_checkpoint(path):
            raise ValueError(f"{path} holds a whole model, not a LoRA adapter: its run did not set model.lora")
        saved = load_file(path / lora.ADAPTER_WEIGHTS)
        expected = dict(lora.adapter_tensors(self.model))
        if set(saved) != set(expected) or any(saved[k].shape != expected[k].shape for k in saved):
            raise ValueError(
                f"{path}: its adapter does not fit model.lora (rank {self.lora_config.rank}, target_modules "
                f"{self.lora_config.target_modules}); resume with the model.lora section of the run that wrote it"
            )
        set_peft_model_state_dict(self.model, saved)
        state = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        return self._restore_meta(state, path)

    def _load_sharded_checkpoint(self, path: Path) -> dict:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        with warnings.catch_warnings():  # a single learner reads the shards in one process, as meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path / TRAINER_SHARDS), no_dist=not self.sharded)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])  # fmt: skip
        return self._restore_meta(torch.load(path / TRAINER_META, map_location="cpu", weights_only=True), path)

    def _optimizer_state_by_name(self, saved: dict) -> dict:
        """A single learner's ``optimizer.state_dict()`` (parameters by index) keyed by
        parameter name instead, as ``set_state_dict`` takes a whole optimizer state."""
        names = [name for name, _ in self.model.named_parameters()]
        indices = [i for group in saved["param_groups"] for i in group["params"]]
        if len(indices) != len(names):
            raise ValueError(f"the checkpoint's optimizer has {len(indices)} parameters, the model {len(names)}")
        name_of = dict(zip(indices, names))
        return {
            "state": {name_of[i]: value for i, value in saved["state"].items()},
            "param_groups": [{**g, "params": [name_of[i] for i in g["params"]]} for g in saved["param_groups"]],
        }

    def _restore_meta(self, state: dict, path: Path) -> dict:
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng_cpu"])
        if state["rng_cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])
        step, version = int(state["step"]), int(state["version"])
        rollout = path / ROLLOUT_STATE
        rollout_state = pickle.loads(rollout.read_bytes()) if rollout.is_file() else None
        return {"step": step, "version": version, "rollout_state": rollout_state}


def _name_architecture(folder: Path, architecture: str) -> None:
    """Write the model's own class name into ``config.json``'s ``architectures`` (a sharded model
    saves under FSDP's wrapper class name, which vLLM would not know)."""
    import json

    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = [architecture]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def prune_checkpoints(root: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints of ``root`` (a run's ``checkpoints/``)."""
    for old in list_checkpoints(root.parent)[:-keep]:
        shutil.rmtree(old)


def move_into_place(tmp: Path, final: Path) -> Path | None:
    """Rename the complete ``tmp`` to ``final``; returns the old ``final`` renamed aside (the
    caller deletes it), or None. Trap: ``os.replace`` cannot replace a non-empty folder, and
    deleting the old one first would leave no ``step_<N>`` if the rename then failed; so it is
    renamed aside, and back on failure (a crash between the renames leaves ``.old-step_<N>-*``).
    """
    if not final.exists():
        os.replace(tmp, final)
        return None
    aside = final.with_name(f".old-{final.name}-{os.getpid()}-{time.time_ns()}")
    os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(aside, final)
        raise
    return aside


def os_error_behind(err: BaseException) -> OSError | None:
    """The OSError that made a checkpoint write fail, or None when ``err`` is no I/O error. Trap:
    C++ and Rust writers raise no OSError (torch.save into a Python file: a RuntimeError whose
    ``__context__`` is the OSError; safetensors: SafetensorError("... (os error 28)")), so this
    follows the exception chain and reads an ``(os error N)`` code from a message."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError):
            return err
        match = _OS_ERROR_CODE.search(str(err))
        if match:
            code = int(match.group(1))
            return OSError(code, f"{type(err).__name__}: {err}")
        err = err.__cause__ or err.__context__
    return None


def write_error(final: Path, cause: OSError) -> CheckpointWriteError:
    """The CheckpointWriteError for ``final``, naming the cause and the checkpoint to resume from."""
    reason = os.strerror(cause.errno).lower() if cause.errno else type(cause).__name__
    latest = latest_checkpoint(final.parent.parent)
    intact = f"the latest intact checkpoint is {latest}" if latest else "there is no earlier checkpoint"
    hint = ""
    if cause.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = f" (free space on the disk of {final.parent}: every save needs room for one more checkpoint)"
    message = (
        f"could not write checkpoint {final}: {reason}{hint}; its partial copy was removed and {intact}. Cause: {cause}"
    )
    # (errno, message): OSError keeps errno in its args, so it survives pickling (a Ray actor's error)
    return CheckpointWriteError(cause.errno, message) if cause.errno else CheckpointWriteError(message)
