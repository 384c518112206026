"""Choosing the samples to train on: TopKRewardSelector (expert iteration) and
MCAdvantageSelector (a useful subset of an oversampled group).

Both read one value per trajectory and leave the choice to :mod:`rlpost.algo.selection`, the
same functions rlpost's env pools apply to their groups (``loss.type: sft`` keeps each group's
top-k; see :func:`rlpost.algo.top_k_above_median`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Literal

import torch
from tensordict import NestedKey, TensorDictBase, is_tensor_collection, lazy_stack

from rlpost.algo.selection import SELECTION_STRATEGIES, select_subset, top_k_above_median
from rlpost.objectives.grouping import get_entry, group_identity, split_trajectories

logger = logging.getLogger(__name__)


class TopKRewardSelector:
    """A replay-buffer write transform that keeps, for each prompt, the best of its
    trajectories (TorchRL's ``torchrl.data.llm.TopKRewardSelector``, expert iteration).

    Trajectories of one prompt (``prompt_key`` on their first step) are held until
    ``total_dialog_turns`` have arrived; then those whose reward (the mean of the trajectory's
    reward entries) is strictly above the group's median are released, best first, at most
    ``topk_size``; the rest are dropped (all of a group whose rewards are all equal). Use it with
    ``rb.append_transform(TopKRewardSelector(...))``.

    Deliberate deviations from TorchRL: the prompt may be any hashable value (TorchRL requires a
    string); a released group is a lazy stack of the selected trajectories' steps (TorchRL
    concatenates them), so that trajectories of different lengths need no padding; queues are
    behind a lock (several writer threads).
    """

    def __init__(
        self,
        total_dialog_turns: int,
        topk_size: int,
        prompt_key: NestedKey = ("text", "prompt"),
        rewards_key: NestedKey = ("next", "reward"),
        done_key: NestedKey = ("next", "done"),
        verbose: bool = True,
    ):
        if topk_size > total_dialog_turns:
            raise ValueError(
                f"topk_size must be smaller than or equal to total_dialog_turns, got topk_size={topk_size} and "
                f"total_dialog_turns={total_dialog_turns}"
            )
        if topk_size < 1:
            raise ValueError(f"topk_size must be >= 1, got {topk_size}")
        self.total_dialog_turns = total_dialog_turns
        self.topk_size = topk_size
        self.prompt_key, self.rewards_key, self.done_key = prompt_key, rewards_key, done_key
        self.in_keys = [prompt_key, rewards_key, done_key]
        self.verbose = verbose
        self.queues: dict = {}
        self._lock = threading.Lock()

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """The read path: sampled data passes unchanged."""
        return tensordict

    __call__ = forward

    def inv(self, tensordict: TensorDictBase) -> TensorDictBase | None:
        """The write path: file the trajectories of ``tensordict``; return the selected steps of
        the groups they complete (a lazy stack along dim 0), or None."""
        if not is_tensor_collection(tensordict):
            raise TypeError(f"TopKRewardSelector.inv expects a TensorDict of steps, got {type(tensordict).__name__}")
        filed = []
        for traj in split_trajectories(tensordict, self.done_key, "TopKRewardSelector"):
            prompt = group_identity(get_entry(traj[0], self.prompt_key, "prompt_key"), self.prompt_key)
            filed.append((prompt, traj, self._reward(traj)))
        released = []
        with self._lock:
            for prompt, traj, reward in filed:
                queue = self.queues.setdefault(prompt, deque())
                queue.append((traj, reward))
                if len(queue) == self.total_dialog_turns:
                    del self.queues[prompt]
                    released.extend(self._select(prompt, list(queue)))
        if not released:
            return None
        return lazy_stack([step for traj in released for step in traj.unbind(0)], 0)

    def _reward(self, traj: TensorDictBase) -> float:
        """The trajectory's reward: the mean over its reward entries (every step, every value)."""
        values = [
            torch.as_tensor(get_entry(step, self.rewards_key, "rewards_key")).float().reshape(-1) for step in traj
        ]
        return float(torch.cat(values).mean())

    def _select(self, prompt, members: list[tuple[TensorDictBase, float]]) -> list[TensorDictBase]:
        rewards = [reward for _, reward in members]
        chosen = top_k_above_median(rewards, self.topk_size)
        if self.verbose:
            logger.info("top-%d of %r: rewards %s, kept %s", self.topk_size, prompt, rewards, chosen)
        return [members[i][0] for i in chosen]

    def __repr__(self) -> str:
        return f"TopKRewardSelector(total_dialog_turns={self.total_dialog_turns}, topk_size={self.topk_size})"


class MCAdvantageSelector:
    """Chooses ``group_size`` of a group's oversampled candidates (TorchRL's
    ``MCAdvantageSelector``, the ``candidate_selector`` of :class:`~rlpost.objectives.MCAdvantage`).

    Args:
        strategy: ``"balanced"`` (the subset whose mean return is closest to the middle of
            ``keep_return_bounds``), ``"first"`` or ``"uniform"`` (spread over the sorted
            returns); see :func:`rlpost.algo.select_subset`.
        max_combinations: the most subsets ``"balanced"`` scores exactly; beyond, greedy swaps.
        in_keys: the candidates' entries it reads; the first holds one value per candidate.

    Override :meth:`select` for a choice of your own.
    """

    def __init__(
        self,
        strategy: Literal["first", "uniform", "balanced"] = "balanced",
        *,
        max_combinations: int = 100_000,
        in_keys: list[NestedKey] | None = None,
    ) -> None:
        if strategy not in SELECTION_STRATEGIES:
            raise ValueError(f"strategy must be one of 'first', 'uniform' or 'balanced', got {strategy!r}.")
        if max_combinations < 1:
            raise ValueError(f"max_combinations must be strictly positive, got {max_combinations}.")
        if in_keys is not None and not in_keys:
            raise ValueError("in_keys must contain at least one key.")
        self.strategy = strategy
        self.max_combinations = int(max_combinations)
        self.in_keys = list(in_keys) if in_keys is not None else ["return"]

    def select(
        self,
        candidates: TensorDictBase,
        *,
        group_size: int,
        keep_return_bounds: tuple[float, float] | None = None,
    ) -> list[int] | None:
        """The indices of the ``group_size`` candidates to keep, or None to drop the group (no
        subset has its mean return strictly inside ``keep_return_bounds``). ``ValueError``: fewer
        candidates than ``group_size``, or not one value per candidate."""
        key = self.in_keys[0]
        values = candidates.get(key)
        if values.numel() != candidates.numel():
            raise ValueError(
                f"MCAdvantageSelector's strategies need one value per candidate under {key!r}, got shape "
                f"{tuple(values.shape)} for {candidates.numel()} candidates"
            )
        values = [float(v) for v in values.detach().reshape(-1).cpu()]
        return select_subset(values, group_size, self.strategy, keep_return_bounds, self.max_combinations)

    def __repr__(self) -> str:
        return f"MCAdvantageSelector(strategy={self.strategy!r}, max_combinations={self.max_combinations})"


__all__ = ["MCAdvantageSelector", "TopKRewardSelector"]
