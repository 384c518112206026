"""The version of the policy weights, as TorchRL's ``PolicyVersion`` transform: a tracker that
stamps the version on every reset and step (and that rlpost's collector follows)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import torch
from tensordict import NonTensorData, TensorDictBase

from rlpost.envs.td_rows import NestedKey, as_key
from rlpost.envs.transforms import Transform


@dataclass
class VersionChange:
    """One change of a :class:`PolicyVersion`'s version."""

    timestamp: datetime
    old_version: str | int | None
    new_version: str | int


class PolicyVersion(Transform):
    """The version of the policy weights: a tracker, and the transform that stamps it on the data.

    TorchRL's ``PolicyVersion``: ``version_type`` ``int`` / ``"int"`` (a counter from 0) or
    ``str`` / ``"uuid"`` (a UUID4 string per version); ``increment_version()`` returns the new
    version (TorchRL: None); changes are recorded in ``version_history``. Every reset and step
    writes the current version under ``key``, int64 ``[B]`` (UUIDs: a non-tensor entry).

    For rlpost's collector (integer versions only) it also follows the version the engine
    reports (:meth:`observe`, :meth:`set_version`) and merges an episode's turns' versions
    (:meth:`merge`; see :mod:`rlpost.collect.policy_version`). An int given as ``version_type``
    is the starting version of an integer tracker (``PolicyVersion(3)``: rlpost's earlier API).
    """

    def __init__(
        self,
        version_type: type | Literal["uuid", "int"] | int = int,
        *,
        version: str | int | None = None,
        key: NestedKey = "policy_version",
    ) -> None:
        super().__init__()
        if isinstance(version_type, int) and not isinstance(version_type, bool):
            version, version_type = version_type, int
        if version_type in (int, "int"):
            self._kind = "int"
        elif version_type in (str, "uuid"):
            self._kind = "uuid"
        else:
            raise ValueError(f"Invalid version type: {version_type!r} (use int, 'int', str or 'uuid')")
        self.version_type = version_type
        self.key = as_key(key)
        self.state_keys = (self.key,)
        self.version_history: list[VersionChange] = []
        self._current_version: str | int | None = None
        if version is None:
            version = 0 if self._kind == "int" else str(uuid.uuid4())
        self._change(self._checked(version))

    # ------------------------------------------------------------------ the version

    @property
    def version(self) -> str | int:
        """The current version."""
        return self._current_version

    @version.setter
    def version(self, value: str | int) -> None:
        self._change(self._checked(value))

    def _checked(self, value: Any) -> str | int:
        if self._kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"an integer PolicyVersion needs int versions, got {value!r}")
            return int(value)
        return str(value)

    def _change(self, value: str | int) -> None:
        old, self._current_version = self._current_version, value
        self.version_history.append(VersionChange(timestamp=datetime.now(), old_version=old, new_version=value))

    def increment_version(self) -> str | int:
        """Move to the next version (+1, or a new UUID) and return it."""
        self._change(self._current_version + 1 if self._kind == "int" else str(uuid.uuid4()))
        return self._current_version

    def set_version(self, version: int | str) -> None:
        """The owner's word: the engine now serves ``version`` (e.g. after a local weight load)."""
        if version != self._current_version:
            self.version = version

    # ------------------------------------------------------------------ rlpost's collector

    def observe(self, client: Any = None, completions: Iterable[Any] = (), reported: int | None = None) -> int:
        """The version that served the latest engine call; the tracker follows it.

        Precedence: the oldest ``policy_version`` attribute among ``completions``, then
        ``reported`` (a ``last_policy_version`` read right after the call), then the client's
        ``last_policy_version``, then the tracker's own version. Integer trackers only.
        """
        if self._kind != "int":
            raise ValueError(
                "PolicyVersion(version_type='uuid') cannot follow the integer versions an inference engine "
                "reports: rlpost's collector needs PolicyVersion(version_type=int)"
            )
        per_completion = [v for c in completions if (v := getattr(c, "policy_version", None)) is not None]
        if per_completion:
            served = min(int(v) for v in per_completion)
        elif reported is not None:
            served = int(reported)
        elif getattr(client, "last_policy_version", None) is not None:
            served = int(client.last_policy_version)
        else:
            return self._current_version
        self.set_version(served)
        return served

    @staticmethod
    def merge(stamp: int | None, served: int) -> int:
        """A sample's stamp after one more turn served by ``served``: the oldest of the two."""
        return served if stamp is None else min(stamp, served)

    # ------------------------------------------------------------------ as an env transform

    def on_reset(self, td: TensorDictBase, reset_td: TensorDictBase) -> TensorDictBase:
        return self._stamp(reset_td)

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        return self._stamp(next_td)

    # TorchRL's hook names, which its tests call directly: ``_step(td, next_td)`` stamps
    # ``next_td``, ``_reset(td, reset_td)`` stamps ``reset_td``; both return what they stamped.
    def _step(self, tensordict: TensorDictBase | None, next_tensordict: TensorDictBase) -> TensorDictBase:
        return self._stamp(next_tensordict)

    def _reset(self, tensordict: TensorDictBase | None, tensordict_reset: TensorDictBase) -> TensorDictBase:
        return self._stamp(tensordict_reset)

    def _stamp(self, td: TensorDictBase) -> TensorDictBase:
        if self._kind == "int":
            kwargs = {"device": td.device} if td.device is not None else {}
            td.set(self.key, torch.full(td.batch_size, self._current_version, dtype=torch.int64, **kwargs))
        elif td.batch_dims == 0:
            td.set(self.key, NonTensorData(self._current_version))
        else:
            td.set(self.key, NonTensorData(self._current_version).expand(td.batch_size))
        return td

    def state_dict(self) -> dict[str, Any]:
        return {"version": self._current_version, "version_type": self._kind}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        kind = state.get("version_type", "int")
        if kind != self._kind:
            raise ValueError(f"PolicyVersion state has version_type={kind!r}, this tracker is {self._kind!r}")
        self.set_version(state["version"])

    def __repr__(self) -> str:
        return f"PolicyVersion(version_type={self._kind!r}, version={self._current_version!r})"
