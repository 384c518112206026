"""PolicyVersion: which weights version generated the tokens of each sample (seed 003).

The version is an integer the learner bumps at every weight publication; inference workers
load the new weights and report the version they served with. Contract with engine clients
(:class:`rlpost.policies.VLLMEngineClient` implementations):

- a client MAY expose ``last_policy_version: int``: the version that served its latest
  ``generate`` call. When one call is served by several workers, it must be the *oldest* of
  their versions. The remote client of the inference workers does this; LocalVLLMClient does
  not (its owner tells the tracker with ``set_version`` after loading weights).
- a completion MAY carry its own ``policy_version`` attribute; it wins over the client's.

The collector reads the version right after each engine call (:meth:`PolicyVersion.observe`)
and stamps each sample with the oldest version that generated any of its tokens
(:meth:`PolicyVersion.merge`): a multi-turn episode whose turns straddle a weight update is as
stale as its oldest turn.

Deviations from TorchRL's ``PolicyVersion`` transform: versions are integers only (no UUIDs),
the tracker learns the version from the engine instead of counting weight updates itself, and
as an env transform it keeps the *minimum* over an episode's steps under ``policy_version``
rather than the latest value. The collector does not need it as a transform (it stamps samples
itself); it is offered for envs used without the collector.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from tensordict import TensorDictBase

from rlpost.envs.transforms import Transform


class PolicyVersion(Transform):
    """Tracks the weights version that serves generation requests.

    Args:
        version: the version known before any engine call (0: the initial weights).
        key: the TensorDict key written when used as an env transform.

    Attributes:
        version: the latest version seen (reported by the engine or set by the owner).
    """

    def __init__(self, version: int = 0, *, key: str = "policy_version") -> None:
        super().__init__()
        self.version = int(version)
        self.key = key
        self.state_keys = (key,)

    # ------------------------------------------------------------------ the tracker

    def set_version(self, version: int) -> None:
        """The owner's word: the engine now serves ``version`` (e.g. after a local weight load)."""
        self.version = int(version)

    def increment_version(self) -> int:
        """Bump the version by one (TorchRL's name) and return it."""
        self.version += 1
        return self.version

    def observe(self, client: Any = None, completions: Iterable[Any] = (), reported: int | None = None) -> int:
        """The version that served the latest engine call; the tracker follows it.

        Precedence: the oldest ``policy_version`` attribute among ``completions``, then
        ``reported`` (a ``last_policy_version`` read right after the call), then the client's
        ``last_policy_version``, then the tracker's own version.
        """
        per_completion = [v for c in completions if (v := getattr(c, "policy_version", None)) is not None]
        if per_completion:
            served = min(int(v) for v in per_completion)
        elif reported is not None:
            served = int(reported)
        elif getattr(client, "last_policy_version", None) is not None:
            served = int(client.last_policy_version)
        else:
            return self.version
        self.version = served
        return served

    @staticmethod
    def merge(stamp: int | None, served: int) -> int:
        """A sample's stamp after one more turn served by ``served``: the oldest of the two."""
        return served if stamp is None else min(stamp, served)

    # ------------------------------------------------------------------ as an env transform

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        """``next[key]`` = min(``td[key]`` if present, the current version), int64 ``[B, 1]``."""
        num_envs = td.batch_size[0]
        current = torch.full((num_envs, 1), self.version, dtype=torch.int64)
        if self.key in td.keys():
            current = torch.minimum(td.get(self.key).view(num_envs, 1).to(torch.int64), current)
        next_td.set(self.key, current)
        return next_td

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])

    def __repr__(self) -> str:
        return f"PolicyVersion(version={self.version})"
