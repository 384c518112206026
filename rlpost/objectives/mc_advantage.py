"""MCAdvantage: gather finished trajectories into per-prompt groups and attach GRPO advantages.

TorchRL's ``torchrl.objectives.llm.MCAdvantage``: Monte-Carlo, group-relative advantages for
GRPO, computed as data is written to a replay buffer. Completions of one prompt arrive one by
one, interleaved with other prompts, from any number of ``extend`` calls and writers; the
transform holds each prompt's trajectories until ``grpo_size`` of them have arrived, then
releases the whole group with ``advantage`` filled in, and only then is it written::

    rb = ReplayBuffer(storage=LazyStackStorage(1024), batch_size=64)
    rb.append_transform(MCAdvantage(grpo_size=4))
    collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=64, replay_buffer=rb)

Two ways in:

- :meth:`MCAdvantage.inv` (what a buffer calls on write, TorchRL's): a TensorDict of steps, 1-D
  (complete trajectories laid end to end, each ending with ``done``), 2-D ``[B, T]`` (each row
  complete trajectories) or more (flattened to 2-D). Each trajectory is filed under the value
  of ``prompt_key`` at its first step. The return is None while no group completes, else the
  steps of the completed groups stacked along dim 0 (a lazy stack), ``advantage`` set on every
  step in the reward's shape.
- :meth:`MCAdvantage.add` (rlpost's, used by LLMCollector's whole-episodes mode): an iterable of flat
  records (dicts or TensorDicts with a scalar reward), returning the completed groups as lists
  of shallow copies with ``advantage`` set.

Advantages. By default, as in TorchRL, a group's rewards are normalised over every reward value
of every step of its trajectories (one step per trajectory in a single-turn chat, so one reward
per completion); with ``trajectory_return="sum"|"max"|"mean"`` each trajectory is reduced to a
return first, the returns are normalised across the group and each trajectory's advantage is
broadcast to all its steps. The normalisation is :func:`rlpost.algo.group_advantages`.

Deliberate deviations from TorchRL:

- Scaling: ``(r - mean) / (std + eps)`` with Bessel's std and ``eps=1e-4`` (TorchRL divides by
  ``std.clamp_min(1e-6)``), and a group whose rewards are all equal gets exactly 0 (TorchRL
  divides a float residue by 1e-6, or gets NaN for a single value). ``scale="none"`` centres
  only (Dr.GRPO); there is no "batch" scale: groups complete one at a time, so a batch std
  would depend on how writes happen to be chunked (LLMCollector's whole-episodes mode rescales whole
  batches itself).
- ``filter_equal_rewards=True`` (DAPO dynamic sampling) drops a complete group whose rewards
  are all equal; it works in both modes, while TorchRL's ``keep_return_bounds`` (also offered)
  needs ``trajectory_return``.
- The group identity may be any hashable value (a string, an int, a tensor grouped by value, a
  list taken as a tuple); TorchRL accepts strings and tensors only.
- The ``prompt_key`` and ``rewards_key`` defaults depend on the way in: ``inv`` reads TorchRL's
  ``"query"`` and ``("next", "reward")``; ``add`` reads flat records, ``"prompt_id"`` and
  ``"reward"``. A key passed explicitly is used by both. ``reward_key`` is accepted as another
  name for ``rewards_key``.
- Calling the transform on a TensorDict (TorchRL's read path) returns it unchanged; calling it on
  anything else is :meth:`add`.
- A complete group comes out of ``inv`` as a lazy stack of step copies: the caller's
  TensorDicts are never modified.
- Oversampling (``candidate_group_size``, ``candidate_selection_min_size``,
  ``candidate_selector``) and cross-process sharing (``share_memory_``) are not offered:
  passing a candidate option other than its default raises ``NotImplementedError``. Several
  writers in one process are safe (the state is behind a lock); writers in several processes
  should write to one buffer (e.g. a Ray actor holding it).

Bad input raises before any state changes: a missing key (``KeyError`` naming it), a
trajectory whose last step is not done (``RuntimeError``), a non-finite reward or an
unhashable group identity (``ValueError``).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Hashable, Iterable
from typing import Any

import torch
from tensordict import TensorDictBase, is_non_tensor, is_tensor_collection, lazy_stack

from rlpost.algo import group_advantages

logger = logging.getLogger(__name__)

MC_ADVANTAGE_SCALES: tuple[str, ...] = ("group", "none")
TRAJECTORY_RETURNS: tuple[str, ...] = ("sum", "max", "mean")

# Defaults of each way in (see the module docstring).
_TRAJECTORY_PROMPT_KEY: Any = "query"
_TRAJECTORY_REWARDS_KEY: Any = ("next", "reward")
_RECORD_PROMPT_KEY: Any = "prompt_id"
_RECORD_REWARD_KEY: Any = "reward"

_STAT_NAMES: tuple[str, ...] = (
    "completed_trajectories",
    "completed_decisions",
    "trajectory_return_sum",
    "trajectory_return_max",
    "successful_trajectories",
    "completed_groups",
    "written_groups",
    "dropped_groups",
    "num_dropped_equal",
)


class MCAdvantage:
    """Group trajectories (or records) by prompt; release complete groups with advantages.

    Args:
        grpo_size: trajectories per prompt; a group is released when this many have arrived.
        prompt_key: key of the group identity (see the module docstring for its default).
        rewards_key: key of the rewards (see the module docstring for its default).
        advantage_key: key the advantage is written to.
        done_key: key of the done flag that ends a trajectory.
        verbose: log each completed group (prompt, rewards' mean and std).

    Keyword Args:
        trajectory_return: None (normalise every step's reward over the group) or ``"sum"``,
            ``"max"``, ``"mean"`` (normalise per-trajectory returns, broadcast to the steps).
            Needs ``grpo_size >= 2``.
        keep_return_bounds: exclusive ``(low, high)`` bounds on a group's mean return; a group
            outside them is dropped. Needs ``trajectory_return``.
        candidate_group_size, candidate_selection_min_size, candidate_selector: TorchRL's
            oversampling; only their defaults (None, or ``grpo_size``) are accepted.
        scale: ``"group"`` (divide by the group's std + eps) or ``"none"`` (centre only).
        eps: added to the std (see :func:`rlpost.algo.group_advantages`).
        filter_equal_rewards: drop (and count) complete groups whose rewards are all equal.
        reward_key: another name for ``rewards_key``.

    Attributes:
        queues: group identity -> trajectories waiting in its incomplete group (``inv``).
        completed_trajectories, completed_decisions: trajectories and steps taken by ``inv``.
        trajectory_return_sum, trajectory_return_max, successful_trajectories: returns of the
            trajectories taken by ``inv`` (with ``trajectory_return`` only; successful: > 0).
        completed_groups: groups that reached ``grpo_size`` (written or dropped).
        written_groups: groups released (``num_emitted_groups`` is the same count).
        dropped_groups: groups dropped by ``filter_equal_rewards`` or ``keep_return_bounds``.
        num_dropped_equal: groups dropped by ``filter_equal_rewards``.
    """

    def __init__(
        self,
        grpo_size: int,
        prompt_key: Any = None,
        rewards_key: Any = None,
        advantage_key: Any = "advantage",
        done_key: Any = ("next", "done"),
        verbose: bool = False,
        *,
        trajectory_return: str | None = None,
        keep_return_bounds: tuple[float, float] | None = None,
        candidate_group_size: int | None = None,
        candidate_selection_min_size: int | None = None,
        candidate_selector: Any = None,
        scale: str = "group",
        eps: float = 1e-4,
        filter_equal_rewards: bool = False,
        reward_key: Any = None,
    ) -> None:
        if isinstance(grpo_size, bool) or not isinstance(grpo_size, int) or grpo_size < 1:
            raise ValueError(f"grpo_size must be an int >= 1, got {grpo_size!r}")
        if scale not in MC_ADVANTAGE_SCALES:
            raise ValueError(f"MCAdvantage scale must be one of {MC_ADVANTAGE_SCALES}, got {scale!r}")
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps!r}")
        if reward_key is not None:
            if rewards_key is not None:
                raise TypeError("MCAdvantage takes rewards_key or reward_key (the same argument), not both")
            rewards_key = reward_key
        if trajectory_return not in (None, *TRAJECTORY_RETURNS):
            raise ValueError(
                f"trajectory_return must be one of {TRAJECTORY_RETURNS} or None, got {trajectory_return!r}"
            )
        if trajectory_return is not None and grpo_size < 2:
            raise ValueError(
                "trajectory_return needs grpo_size >= 2 (a group's std is undefined for one return), "
                f"got grpo_size={grpo_size}"
            )
        if keep_return_bounds is not None:
            if trajectory_return is None:
                raise ValueError("keep_return_bounds filters on trajectory returns: set trajectory_return too")
            if len(keep_return_bounds) != 2 or not keep_return_bounds[0] < keep_return_bounds[1]:
                raise ValueError(
                    f"keep_return_bounds must be an increasing (low, high) pair, got {keep_return_bounds!r}"
                )
            keep_return_bounds = (float(keep_return_bounds[0]), float(keep_return_bounds[1]))
        for name, value in (
            ("candidate_group_size", candidate_group_size),
            ("candidate_selection_min_size", candidate_selection_min_size),
        ):
            if value is not None and value != grpo_size:
                raise NotImplementedError(
                    f"MCAdvantage does not oversample: {name}={value!r} must be None or grpo_size ({grpo_size})"
                )
        if candidate_selector is not None:
            raise NotImplementedError("MCAdvantage does not oversample: candidate_selector must be None")

        self.grpo_size = grpo_size
        self.prompt_key = _TRAJECTORY_PROMPT_KEY if prompt_key is None else prompt_key
        self.rewards_key = _TRAJECTORY_REWARDS_KEY if rewards_key is None else rewards_key
        self.advantage_key = advantage_key
        self.done_key = done_key
        self.verbose = verbose
        self.trajectory_return = trajectory_return
        self.keep_return_bounds = keep_return_bounds
        self.candidate_group_size = grpo_size
        self.candidate_selection_min_size = grpo_size
        self.scale = scale
        self.eps = eps
        self.filter_equal_rewards = filter_equal_rewards
        self.in_keys = [self.prompt_key, self.rewards_key, self.done_key]
        self.out_keys = [self.advantage_key]
        self._record_prompt_key = _RECORD_PROMPT_KEY if prompt_key is None else prompt_key
        self._record_reward_key = _RECORD_REWARD_KEY if rewards_key is None else rewards_key
        self._lock = threading.RLock()
        # group -> trajectories (inv), and group -> [(record, reward)] (add); dicts keep
        # insertion order.
        self.queues: dict[Hashable, list[TensorDictBase]] = {}
        self._pending: dict[Hashable, list[tuple[Any, float]]] = {}
        self.reset_stats()

    # ------------------------------------------------------------------ state and statistics

    def reset_stats(self) -> None:
        """Zero the counters (the queues are kept)."""
        with self._lock:
            self.completed_trajectories = 0
            self.completed_decisions = 0
            self.trajectory_return_sum = 0.0
            self.trajectory_return_max = float("-inf")
            self.successful_trajectories = 0
            self.completed_groups = 0
            self.written_groups = 0
            self.dropped_groups = 0
            self.num_dropped_equal = 0

    def clear_queues(self) -> None:
        """Forget every incomplete group (the counters are kept)."""
        with self._lock:
            self.queues.clear()
            self._pending.clear()

    def get_stats(self) -> dict[str, float | int]:
        """The counters and the queue sizes, as a plain dict."""
        with self._lock:
            stats = {name: getattr(self, name) for name in _STAT_NAMES}
            stats.update(
                queued_groups=self.queued_groups,
                queued_trajectories=self.queued_trajectories,
                max_queued_trajectories_per_group=self.max_queued_trajectories_per_group,
                num_pending=self.num_pending,
            )
            return stats

    @property
    def num_emitted_groups(self) -> int:
        """Groups released so far, by either way in (``written_groups``)."""
        return self.written_groups

    @property
    def queued_groups(self) -> int:
        """Group identities with an incomplete group of trajectories (``inv``)."""
        return len(self.queues)

    @property
    def queued_trajectories(self) -> int:
        """Trajectories waiting in incomplete groups (``inv``)."""
        return sum(len(queue) for queue in self.queues.values())

    @property
    def max_queued_trajectories_per_group(self) -> int:
        """The largest number of trajectories waiting for one group (``inv``)."""
        return max((len(queue) for queue in self.queues.values()), default=0)

    @property
    def num_pending(self) -> int:
        """Records and trajectories waiting in incomplete groups (both ways in)."""
        return sum(len(members) for members in self._pending.values()) + self.queued_trajectories

    @property
    def num_pending_groups(self) -> int:
        """Incomplete groups (both ways in)."""
        return len(self._pending) + len(self.queues)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ the transform (TorchRL)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """The read path: data sampled from a buffer passes unchanged."""
        return tensordict

    def __call__(self, data: Any) -> Any:
        """A TensorDict: :meth:`forward` (unchanged). Anything else: :meth:`add`."""
        if isinstance(data, TensorDictBase):
            return self.forward(data)
        return self.add(data)

    def inv(self, tensordict: TensorDictBase) -> TensorDictBase | None:
        """The write path: file the trajectories of ``tensordict``; return the steps of the
        groups they complete (stacked along dim 0, ``advantage`` set), or None."""
        if not is_tensor_collection(tensordict):
            raise TypeError(f"MCAdvantage.inv expects a TensorDict of steps, got {type(tensordict).__name__}")
        # Read and check every trajectory before touching the queues: bad data raises and
        # leaves the state as it was.
        filed = []
        for traj in self._trajectories(tensordict):
            group = self._group_of(traj)
            filed.append((group, traj, self._trajectory_values(traj, group)[1]))
        released: list[TensorDictBase] = []
        with self._lock:
            for group, traj, value in filed:
                self._count_trajectory(traj, value)
                queue = self.queues.setdefault(group, [])
                queue.append(traj)
                if len(queue) == self.grpo_size:
                    del self.queues[group]
                    released.extend(self._score_trajectories(group, queue))
        if not released:
            return None
        return lazy_stack(released, 0)

    def _trajectories(self, tensordict: TensorDictBase) -> list[TensorDictBase]:
        return split_trajectories(tensordict, self.done_key, "MCAdvantage")

    def _group_of(self, traj: TensorDictBase) -> Hashable:
        return _hashable(_get(traj[0], self.prompt_key, "prompt_key"), self.prompt_key)

    def _step_rewards(self, traj: TensorDictBase, group: Hashable) -> list[torch.Tensor]:
        rewards = []
        for step in traj.unbind(0):
            reward = torch.as_tensor(_get(step, self.rewards_key, "rewards_key"))
            if reward.numel() == 0:
                raise ValueError(f"a step of prompt {group!r} has an empty reward under {self.rewards_key!r}")
            if not torch.isfinite(reward.to(torch.float64)).all():
                raise ValueError(f"reward of a step of prompt {group!r} is not finite: {reward.flatten().tolist()}")
            rewards.append(reward)
        return rewards

    def _trajectory_values(self, traj: TensorDictBase, group: Hashable) -> tuple[list[torch.Tensor], float]:
        """The trajectory's per-step rewards and its return (``trajectory_return``, else the sum)."""
        rewards = self._step_rewards(traj, group)
        values = torch.cat([r.reshape(-1).to(torch.float64) for r in rewards])
        if self.trajectory_return == "max":
            value = values.max()
        elif self.trajectory_return == "mean":
            value = values.mean()
        else:
            value = values.sum()
        return rewards, float(value)

    def _count_trajectory(self, traj: TensorDictBase, value: float) -> None:
        self.completed_trajectories += 1
        self.completed_decisions += traj.numel()
        if self.trajectory_return is not None:
            self.trajectory_return_sum += value
            self.trajectory_return_max = max(self.trajectory_return_max, value)
            self.successful_trajectories += int(value > 0.0)

    def _score_trajectories(self, group: Hashable, trajs: list[TensorDictBase]) -> list[TensorDictBase]:
        """The steps of a complete group with their advantages; [] when the group is dropped."""
        self.completed_groups += 1
        per_traj = [self._trajectory_values(traj, group) for traj in trajs]
        step_rewards = [rewards for rewards, _ in per_traj]
        if self.trajectory_return is not None:
            values = torch.tensor([value for _, value in per_traj], dtype=torch.float64)
        else:
            values = torch.cat([r.reshape(-1).to(torch.float64) for rewards in step_rewards for r in rewards])
        if self.filter_equal_rewards and bool((values == values[0]).all()):
            self.num_dropped_equal += 1
            self.dropped_groups += 1
            self._log_group(group, values, "dropped (all rewards equal)")
            return []
        if self.keep_return_bounds is not None:
            low, high = self.keep_return_bounds
            if not low < float(values.mean()) < high:
                self.dropped_groups += 1
                self._log_group(group, values, f"dropped (mean return outside ({low}, {high}))")
                return []
        advantages = group_advantages(values.unsqueeze(0), scale=self.scale, eps=self.eps)[0]
        steps_out: list[TensorDictBase] = []
        flat_position = 0
        for traj_index, (traj, rewards) in enumerate(zip(trajs, step_rewards)):
            for step, reward in zip(traj.unbind(0), rewards):
                if self.trajectory_return is not None:
                    advantage = advantages[traj_index].expand(reward.shape)
                else:
                    advantage = advantages[flat_position : flat_position + reward.numel()].reshape(reward.shape)
                    flat_position += reward.numel()
                dtype = reward.dtype if reward.is_floating_point() else torch.get_default_dtype()
                out = step.copy()
                out.set(self.advantage_key, advantage.to(dtype=dtype, device=reward.device).clone())
                steps_out.append(out)
        self.written_groups += 1
        self._log_group(group, values, f"released with {len(steps_out)} steps")
        return steps_out

    def _log_group(self, group: Hashable, values: torch.Tensor, what: str) -> None:
        if self.verbose:
            std = float(values.std()) if values.numel() > 1 else 0.0
            logger.info("MCAdvantage: group %r %s; rewards mean %.4g std %.4g", group, what, float(values.mean()), std)

    # ------------------------------------------------------------------ flat records (rlpost)

    def add(self, samples: Iterable[Any]) -> list[list[Any]]:
        """Take flat records; return the groups they complete, in completion order.

        A record is anything indexable by key with ``copy()`` and item assignment (a ``dict`` or
        a TensorDict) holding a group identity and a scalar reward. Each returned group holds
        ``grpo_size`` shallow copies of records of one prompt, in arrival order, with
        ``advantage`` set in the reward's form (a python float for a number, a floating tensor
        of the reward's shape for a one-element tensor). A prompt that receives more than
        ``grpo_size`` records starts a new group after the first is released.
        """
        # Read every record before touching the pending groups: a bad record raises and leaves
        # the state as it was, instead of losing groups that this call had already completed.
        keyed = []
        for sample in samples:
            prompt = _hashable(_get(sample, self._record_prompt_key, "prompt_key"), self._record_prompt_key)
            keyed.append((prompt, sample, self._record_reward(sample, prompt)))
        with self._lock:
            complete: list[tuple[Hashable, list[tuple[Any, float]]]] = []
            for prompt, sample, reward in keyed:
                members = self._pending.setdefault(prompt, [])
                members.append((sample, reward))
                if len(members) == self.grpo_size:
                    complete.append((prompt, self._pending.pop(prompt)))
            return self._score_records(complete)

    def _score_records(self, groups: list[tuple[Hashable, list[tuple[Any, float]]]]) -> list[list[Any]]:
        self.completed_groups += len(groups)
        if self.filter_equal_rewards:
            kept = [(p, g) for p, g in groups if len({reward for _, reward in g}) > 1]
            self.num_dropped_equal += len(groups) - len(kept)
            self.dropped_groups += len(groups) - len(kept)
            groups = kept
        if not groups:
            return []
        rewards_gn = torch.tensor([[r for _, r in g] for _, g in groups], dtype=torch.float64)
        advantages_gn = group_advantages(rewards_gn, scale=self.scale, eps=self.eps)
        scored = [
            [self._with_advantage(sample, float(a)) for (sample, _), a in zip(g, adv_n.tolist())]
            for (_, g), adv_n in zip(groups, advantages_gn)
        ]
        self.written_groups += len(scored)
        for (prompt, _), rewards_n in zip(groups, rewards_gn):
            self._log_group(prompt, rewards_n, "released")
        return scored

    def _with_advantage(self, sample: Any, advantage: float) -> Any:
        out = sample.copy()
        reward = sample[self._record_reward_key]
        if isinstance(reward, torch.Tensor):
            dtype = reward.dtype if reward.is_floating_point() else torch.get_default_dtype()
            out[self.advantage_key] = torch.full_like(reward, advantage, dtype=dtype)
        else:
            out[self.advantage_key] = advantage
        return out

    def _record_reward(self, sample: Any, prompt: Hashable) -> float:
        reward = _get(sample, self._record_reward_key, "rewards_key")
        if isinstance(reward, torch.Tensor):
            if reward.numel() != 1:
                raise ValueError(
                    f"reward of a sample of prompt {prompt!r} must be a scalar, got shape {tuple(reward.shape)}"
                )
            reward = reward.item()
        value = float(reward)
        if not math.isfinite(value):
            raise ValueError(f"reward of a sample of prompt {prompt!r} is not finite: {value}")
        return value

    def __repr__(self) -> str:
        return (
            f"MCAdvantage(grpo_size={self.grpo_size}, prompt_key={self.prompt_key!r}, "
            f"rewards_key={self.rewards_key!r}, advantage_key={self.advantage_key!r}, "
            f"trajectory_return={self.trajectory_return!r}, scale={self.scale!r})"
        )


_MISSING = object()


def split_trajectories(tensordict: TensorDictBase, done_key: Any, who: str) -> list[TensorDictBase]:
    """The complete trajectories of a write: a 1-D TensorDict of steps laid end to end (each
    trajectory ending with ``done``), 2-D ``[B, T]`` (each row such steps) or more (flattened to
    2-D). ``who`` names the transform in errors.

    Raises:
        ValueError: a TensorDict without a batch dimension.
        RuntimeError: steps after the last ``done`` (an unfinished trajectory).
    """
    if tensordict.ndim == 0:
        raise ValueError(
            f"{who}.inv needs steps along a batch dimension (got batch size []); a buffer's add() adds that "
            "dimension itself"
        )
    if tensordict.ndim > 2:
        tensordict = tensordict.flatten(0, -2)
    rows = tensordict.unbind(0) if tensordict.ndim == 2 else (tensordict,)
    pieces = []
    for steps in rows:
        num_steps = steps.shape[0]
        if num_steps == 0:
            continue
        done = torch.as_tensor(_get(steps, done_key, "done_key")).reshape(num_steps, -1).any(-1)
        ends = done.nonzero().flatten().tolist()
        if not ends or ends[-1] != num_steps - 1:
            raise RuntimeError(
                f"{who} expects complete trajectories: the last of {num_steps} steps written has {done_key!r} "
                "False (write trajectories once they are done)"
            )
        start = 0
        for end in ends:
            pieces.append(steps[start : end + 1])
            start = end + 1
    return pieces


def _get(sample: Any, key: Any, argument: str) -> Any:
    """``sample[key]``, with non-tensor TensorDict entries unwrapped to their python value."""
    try:
        value = sample.get(key, _MISSING) if is_tensor_collection(sample) else sample[key]
    except KeyError:
        value = _MISSING
    if value is _MISSING:
        raise KeyError(f"MCAdvantage: sample has no key {key!r} ({argument})")
    if is_non_tensor(value):
        return value.tolist()
    return value


def _hashable(prompt: Any, key: Any) -> Hashable:
    """A group identity: a tensor by value, a list as a tuple, any other value as it is."""
    if isinstance(prompt, torch.Tensor):
        return prompt.item() if prompt.numel() == 1 else tuple(prompt.flatten().tolist())
    if isinstance(prompt, list):
        prompt = tuple(prompt)
    try:
        hash(prompt)
    except TypeError:
        raise ValueError(f"prompt key {key!r} holds an unhashable {type(prompt).__name__}") from None
    return prompt
