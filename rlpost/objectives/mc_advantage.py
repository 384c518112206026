"""MCAdvantage: gather finished trajectories into per-prompt groups and attach GRPO advantages.

TorchRL's ``torchrl.objectives.llm.MCAdvantage``: Monte-Carlo, group-relative GRPO advantages,
computed as data is written to a replay buffer. Completions of one prompt arrive interleaved with
other prompts, from any number of ``extend`` calls and writers; each prompt's trajectories are
held until ``grpo_size`` have arrived, then the group is released (and written) with
``advantage`` filled in::

    rb = ReplayBuffer(storage=LazyStackStorage(1024), batch_size=64)
    rb.append_transform(MCAdvantage(grpo_size=4))
    collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=64, replay_buffer=rb)

Two ways in: :meth:`MCAdvantage.inv` (TorchRL's, a buffer's write) takes TensorDicts of steps;
:meth:`MCAdvantage.add` (rlpost's, LLMCollector's whole-episodes mode) takes flat records.

Advantages (:func:`rlpost.algo.group_advantages`): by default, as in TorchRL, a group's rewards
are normalised over every reward of every step of its trajectories (one per completion in a
single-turn chat); with ``trajectory_return="sum"|"max"|"mean"`` each trajectory is reduced to a
return, the returns are normalised across the group and each advantage broadcast to the
trajectory's steps.

Dynamic sampling and oversampling (``trajectory_return`` only, as in TorchRL): a group is useful
when its mean return is strictly inside ``keep_return_bounds`` (and, with
``filter_equal_rewards``, its returns are not all equal). With ``candidate_group_size >
grpo_size`` a group gathers up to that many candidates: from ``candidate_selection_min_size`` on,
each arrival asks ``candidate_selector`` for ``grpo_size`` of them; a useful choice is released at
once (the others discarded), else the group waits, and is dropped when ``candidate_group_size``
candidates gave no useful choice. The selector gets a TensorDict of batch ``[num_candidates]``
with ``"return"`` (float64) and ``"trajectories"`` (lazily stacked steps), the entries in its
``in_keys``.

Several writers: threads of one process are safe (the state is behind a lock); for several processes see
:mod:`rlpost.objectives.mc_advantage_state` (``share_memory_``); across Ray actors use
:class:`~rlpost.objectives.RayMCAdvantage` or a :class:`~rlpost.data.RayReplayBuffer` built with
``transform_factory=MCAdvantage``.

Deliberate deviations from TorchRL:

- Scaling: ``(r - mean) / (std + eps)`` with Bessel's std and ``eps=1e-4`` (TorchRL divides by
  ``std.clamp_min(1e-6)``), and a group whose rewards are all equal gets exactly 0 (TorchRL
  divides a float residue by 1e-6, or gets NaN for a single value). ``scale="none"`` centres
  only (Dr.GRPO); there is no "batch" scale: groups complete one at a time, so a batch std
  would depend on how writes happen to be chunked (LLMCollector's whole-episodes mode rescales whole
  batches itself).
- ``filter_equal_rewards=True`` (DAPO dynamic sampling) drops a complete group whose rewards
  are all equal; it works in both modes, while TorchRL's ``keep_return_bounds`` (also offered)
  needs ``trajectory_return``. With oversampling it is part of "useful": a selected subset
  whose returns are all equal is not released (the selector is not told of it).
- The counters of candidate selection (``selected_trajectories``, ``unselected_trajectories``,
  ``rescued_groups``) count released groups only; TorchRL also counts a selection that its
  bounds check then rejects.
- A selector's answer is checked: ``grpo_size`` distinct candidate indices, or None.
- The group identity may be any hashable value (a string, an int, a tensor grouped by value, a
  list taken as a tuple); TorchRL accepts strings and tensors only.
- The ``prompt_key`` and ``rewards_key`` defaults depend on the way in: ``inv`` reads TorchRL's
  ``"query"`` and ``("next", "reward")``; ``add`` reads flat records, ``"prompt_id"`` and
  ``"reward"``. A key passed explicitly is used by both. ``reward_key`` is accepted as another
  name for ``rewards_key``. ``add`` does not oversample (its records have no trajectories).
- Calling the transform on a TensorDict (TorchRL's read path) returns it unchanged; calling it on
  anything else is :meth:`add`.
- A complete group comes out of ``inv`` as a lazy stack of step copies: the caller's
  TensorDicts are never modified.
- :meth:`MCAdvantage.close` (rlpost's) takes shared state back into the process and stops the
  manager that ``share_memory_`` started. rlpost's ReplayBuffer has no ``share()``: call
  ``share_memory_`` yourself before handing the transform to other processes.

Bad input raises before any state changes: a missing key (``KeyError`` naming it), a
trajectory whose last step is not done (``RuntimeError``), a non-finite reward or an
unhashable group identity (``ValueError``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Iterable
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection, lazy_stack

from rlpost.algo import group_advantages
from rlpost.algo.selection import mean_in_bounds
from rlpost.objectives.grouping import GroupingTransform, get_entry, group_identity, split_trajectories
from rlpost.objectives.mc_advantage_state import LOCAL_QUEUES_ENV, MCAdvantageState  # noqa: F401  (re-exported)
from rlpost.objectives.selection import MCAdvantageSelector

logger = logging.getLogger(__name__)

MC_ADVANTAGE_SCALES: tuple[str, ...] = ("group", "none")
TRAJECTORY_RETURNS: tuple[str, ...] = ("sum", "max", "mean")

# Defaults of each way in (see the module docstring).
_TRAJECTORY_PROMPT_KEY: Any = "query"
_TRAJECTORY_REWARDS_KEY: Any = ("next", "reward")
_RECORD_PROMPT_KEY: Any = "prompt_id"
_RECORD_REWARD_KEY: Any = "reward"

_ALL_EQUAL = "all rewards equal"


class MCAdvantage(MCAdvantageState, GroupingTransform):
    """Group trajectories (or records) by prompt; release complete groups with advantages.

    Args (module docstring for the modes; ``prompt_key``/``rewards_key`` defaults depend on the
    way in):
        verbose: log each completed group (prompt, rewards' mean and std).
        trajectory_return: needs ``grpo_size >= 2``.
        keep_return_bounds: exclusive ``(low, high)`` bounds on a group's mean return.
        candidate_group_size: default ``grpo_size``; more needs ``trajectory_return``.
        candidate_selection_min_size: between ``grpo_size`` (default) and ``candidate_group_size``.
        candidate_selector: ``select(candidates, *, group_size, keep_return_bounds)`` -> candidate
            indices or None; default :class:`~rlpost.objectives.MCAdvantageSelector`.
        scale: ``"group"`` (divide by the group's std + eps) or ``"none"`` (centre only).
        reward_key: another name for ``rewards_key``.

    Attributes:
        queues: group identity -> trajectories waiting in its incomplete group (``inv``).
        completed_trajectories, completed_decisions: trajectories and steps taken by ``inv``.
        trajectory_return_sum, trajectory_return_max, successful_trajectories: returns of the
            trajectories taken by ``inv`` (with ``trajectory_return`` only; successful: > 0).
        completed_groups: groups released or dropped.
        written_groups: groups released (``num_emitted_groups`` is the same count).
        dropped_groups: groups dropped by ``filter_equal_rewards`` or ``keep_return_bounds``.
        num_dropped_equal: groups dropped by ``filter_equal_rewards``.
        selected_trajectories, unselected_trajectories: candidates released, and discarded, with
            the groups released after a selection (``trajectory_return`` only).
        rescued_groups: released groups whose first ``grpo_size`` candidates were not useful.
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
        _check_count("grpo_size", grpo_size)
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
                raise ValueError(
                    "keep_return_bounds (dynamic sampling) filters on trajectory returns: set trajectory_return too"
                )
            if len(keep_return_bounds) != 2 or not keep_return_bounds[0] < keep_return_bounds[1]:
                raise ValueError(
                    f"keep_return_bounds must be an increasing (low, high) pair, got {keep_return_bounds!r}"
                )
            keep_return_bounds = (float(keep_return_bounds[0]), float(keep_return_bounds[1]))
        self.grpo_size = grpo_size
        self.trajectory_return = trajectory_return
        self._set_candidates(candidate_group_size, candidate_selection_min_size, candidate_selector)
        self.prompt_key = _TRAJECTORY_PROMPT_KEY if prompt_key is None else prompt_key
        self.rewards_key = _TRAJECTORY_REWARDS_KEY if rewards_key is None else rewards_key
        self.advantage_key = advantage_key
        self.done_key = done_key
        self.verbose = verbose
        self.keep_return_bounds = keep_return_bounds
        self.scale = scale
        self.eps = eps
        self.filter_equal_rewards = filter_equal_rewards
        self.in_keys = [self.prompt_key, self.rewards_key, self.done_key]
        self.out_keys = [self.advantage_key]
        self._record_prompt_key = _RECORD_PROMPT_KEY if prompt_key is None else prompt_key
        self._record_reward_key = _RECORD_REWARD_KEY if rewards_key is None else rewards_key
        self._init_state()

    def _set_candidates(self, group_size: int | None, min_size: int | None, selector: Any) -> None:
        group_size = self.grpo_size if group_size is None else _check_count("candidate_group_size", group_size)
        if group_size < self.grpo_size:
            raise ValueError(
                f"candidate_group_size must be >= grpo_size, got candidate_group_size={group_size} and "
                f"grpo_size={self.grpo_size}"
            )
        if group_size > self.grpo_size and self.trajectory_return is None:
            raise ValueError(
                "candidate_group_size > grpo_size needs trajectory_return: candidates are selected by their return"
            )
        min_size = self.grpo_size if min_size is None else _check_count("candidate_selection_min_size", min_size)
        if not self.grpo_size <= min_size <= group_size:
            raise ValueError(
                f"candidate_selection_min_size must be between grpo_size ({self.grpo_size}) and "
                f"candidate_group_size ({group_size}), got {min_size}"
            )
        if selector is None:
            selector = MCAdvantageSelector()
        elif not callable(getattr(selector, "select", None)):
            raise TypeError(f"candidate_selector needs a select() method, got {type(selector).__name__}")
        self.candidate_group_size = group_size
        self.candidate_selection_min_size = min_size
        self.candidate_selector = selector

    # ------------------------------------------------------------------ the transform (TorchRL)

    def inv(self, tensordict: TensorDictBase) -> TensorDictBase | None:
        """The write path. ``tensordict``: steps, 1-D (complete trajectories end to end, each ending
        with ``done``), 2-D ``[B, T]`` (rows of complete trajectories) or more (flattened to 2-D);
        each trajectory is filed under ``prompt_key`` at its first step. Returns None, or the
        completed groups' steps lazily stacked along dim 0 with ``advantage`` in the reward's
        shape."""
        if not is_tensor_collection(tensordict):
            raise TypeError(f"MCAdvantage.inv expects a TensorDict of steps, got {type(tensordict).__name__}")
        # Read and check every trajectory before touching the queues: bad data raises and
        # leaves the state as it was.
        filed = []
        for traj in split_trajectories(tensordict, self.done_key, "MCAdvantage"):
            group = group_identity(get_entry(traj[0], self.prompt_key, "prompt_key"), self.prompt_key)
            filed.append((group, traj, self._trajectory_values(traj, group)[1]))
        released: list[TensorDictBase] = []
        with self._lock:
            for group, traj, value in filed:
                self._count_trajectory(traj, value)
                released.extend(self._decide(group, self.queues.append(group, traj)))
        if not released:
            return None
        return lazy_stack(released, 0)

    def _step_rewards(self, traj: TensorDictBase, group: Hashable) -> list[torch.Tensor]:
        rewards = []
        for step in traj.unbind(0):
            reward = torch.as_tensor(get_entry(step, self.rewards_key, "rewards_key"))
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

    def _decide(self, group: Hashable, trajs: list[TensorDictBase]) -> list[TensorDictBase]:
        """``group``'s queue has just grown to ``trajs``: release the group (the steps returned,
        advantages set), drop it or let it wait (both return [])."""
        if self.trajectory_return is None:
            if len(trajs) < self.grpo_size:
                return []
            self.queues.pop(group)
            return self._release_by_steps(group, trajs)
        if len(trajs) < self.candidate_selection_min_size:
            return []
        per_traj = [self._trajectory_values(traj, group) for traj in trajs]
        values = [value for _, value in per_traj]
        chosen = self._choose(trajs, values)
        if chosen is None:
            if len(trajs) >= self.candidate_group_size:
                self.queues.pop(group)
                reason = self._why_not_useful(values) or f"no useful {self.grpo_size} of {len(trajs)} candidates"
                self._count_dropped(group, values, reason)
            return []
        self.queues.pop(group)
        self.completed_groups += 1
        self.written_groups += 1
        self.selected_trajectories += len(chosen)
        self.unselected_trajectories += len(trajs) - len(chosen)
        self.rescued_groups += int(len(trajs) > self.grpo_size and bool(self._why_not_useful(values[: self.grpo_size])))
        returns = torch.tensor([values[i] for i in chosen], dtype=torch.float64)
        advantages = group_advantages(returns.unsqueeze(0), scale=self.scale, eps=self.eps)[0]
        pairs = [(advantages[k].expand(r.shape), r) for k, i in enumerate(chosen) for r in per_traj[i][0]]
        self._log_group(group, returns, f"released ({len(chosen)} of {len(trajs)} candidates)")
        return self._steps_with_advantages([trajs[i] for i in chosen], pairs)

    def _choose(self, trajs: list[TensorDictBase], values: list[float]) -> list[int] | None:
        """The candidates the selector keeps, if they make a useful group; else None."""
        candidates = TensorDict(
            {"return": torch.tensor(values, dtype=torch.float64), "trajectories": lazy_stack(trajs, 0)},
            batch_size=[len(trajs)],
        )
        in_keys = getattr(self.candidate_selector, "in_keys", None)
        if in_keys is not None:
            candidates = candidates.select(*in_keys, strict=True)
        chosen = self.candidate_selector.select(
            candidates, group_size=self.grpo_size, keep_return_bounds=self.keep_return_bounds
        )
        if chosen is None:
            return None
        chosen = [int(i) for i in chosen]
        if (
            len(chosen) != self.grpo_size
            or len(set(chosen)) != len(chosen)
            or not all(0 <= i < len(trajs) for i in chosen)
        ):
            raise ValueError(
                f"{type(self.candidate_selector).__name__}.select must return {self.grpo_size} distinct indices of "
                f"the {len(trajs)} candidates, or None; got {chosen}"
            )
        return None if self._why_not_useful([values[i] for i in chosen]) else chosen

    def _why_not_useful(self, values: list[float]) -> str:
        """Why a group with these returns (or step rewards) is dropped; "" when it is not."""
        if self.filter_equal_rewards and all(value == values[0] for value in values):
            return _ALL_EQUAL
        if not mean_in_bounds(values, range(len(values)), self.keep_return_bounds):
            return f"mean return outside {self.keep_return_bounds}"
        return ""

    def _count_dropped(self, group: Hashable, values: list[float], reason: str) -> None:
        self.completed_groups += 1
        self.dropped_groups += 1
        self.num_dropped_equal += int(reason == _ALL_EQUAL)
        self._log_group(group, torch.tensor(values, dtype=torch.float64), f"dropped ({reason})")

    def _release_by_steps(self, group: Hashable, trajs: list[TensorDictBase]) -> list[TensorDictBase]:
        """A complete group without ``trajectory_return``: every step's rewards normalised together."""
        step_rewards = [reward for traj in trajs for reward in self._step_rewards(traj, group)]
        values = torch.cat([r.reshape(-1).to(torch.float64) for r in step_rewards])
        reason = self._why_not_useful(values.tolist())
        if reason:
            self._count_dropped(group, values.tolist(), reason)
            return []
        advantages = group_advantages(values.unsqueeze(0), scale=self.scale, eps=self.eps)[0]
        pairs, position = [], 0
        for reward in step_rewards:
            pairs.append((advantages[position : position + reward.numel()].reshape(reward.shape), reward))
            position += reward.numel()
        self.completed_groups += 1
        self.written_groups += 1
        self._log_group(group, values, f"released with {len(pairs)} steps")
        return self._steps_with_advantages(trajs, pairs)

    def _steps_with_advantages(
        self, trajs: list[TensorDictBase], pairs: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[TensorDictBase]:
        """Copies of the steps of ``trajs`` with ``advantage`` set; ``pairs`` holds each step's
        (advantage shaped as its reward, reward), in step order."""
        steps = [step for traj in trajs for step in traj.unbind(0)]
        assert len(steps) == len(pairs), "one (advantage, reward) pair per step"
        out = []
        for step, (advantage, reward) in zip(steps, pairs):
            dtype = reward.dtype if reward.is_floating_point() else torch.get_default_dtype()
            copy = step.copy()
            copy.set(self.advantage_key, advantage.to(dtype=dtype, device=reward.device).clone())
            out.append(copy)
        return out

    def _log_group(self, group: Hashable, values: torch.Tensor, what: str) -> None:
        if self.verbose:
            std = float(values.std()) if values.numel() > 1 else 0.0
            logger.info("MCAdvantage: group %r %s; rewards mean %.4g std %.4g", group, what, float(values.mean()), std)

    # ------------------------------------------------------------------ flat records (rlpost)

    def add(self, samples: Iterable[Any]) -> list[list[Any]]:
        """Take flat records (a ``dict`` or TensorDict with a group identity and a scalar reward);
        return the groups they complete, in completion order: ``grpo_size`` shallow copies each,
        in arrival order, ``advantage`` in the reward's form (a float, or a floating tensor of the
        reward's shape). More than ``grpo_size`` records of a prompt start a new group.
        """
        if self.candidate_group_size > self.grpo_size:
            raise NotImplementedError(
                "MCAdvantage.add does not oversample (candidate_group_size > grpo_size selects trajectories: use inv)"
            )
        # Read every record before touching the pending groups: a bad record raises and leaves
        # the state as it was, instead of losing groups that this call had already completed.
        keyed = []
        for sample in samples:
            prompt = group_identity(get_entry(sample, self._record_prompt_key, "prompt_key"), self._record_prompt_key)
            keyed.append((prompt, sample, self._record_reward(sample, prompt)))
        with self._lock:
            complete: list[tuple[Hashable, list[tuple[Any, float]]]] = []
            for prompt, sample, reward in keyed:
                if len(self._pending.append(prompt, (sample, reward))) == self.grpo_size:
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
        reward = get_entry(sample, self._record_reward_key, "rewards_key")
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
        candidates = ""
        if self.candidate_group_size > self.grpo_size:
            candidates = (
                f", candidate_group_size={self.candidate_group_size}, "
                f"candidate_selection_min_size={self.candidate_selection_min_size}"
            )
        return (
            f"MCAdvantage(grpo_size={self.grpo_size}, prompt_key={self.prompt_key!r}, "
            f"rewards_key={self.rewards_key!r}, advantage_key={self.advantage_key!r}, "
            f"trajectory_return={self.trajectory_return!r}, scale={self.scale!r}{candidates})"
        )


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value
