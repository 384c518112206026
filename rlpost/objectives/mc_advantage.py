"""MCAdvantage: gather completed trajectories into per-prompt groups and attach advantages.

The seed name (TorchRL ``torchrl.objectives.llm.MCAdvantage``): Monte-Carlo, group-relative
advantages for GRPO. Completions of one prompt arrive one by one, interleaved with other prompts
and in any order; a group is emitted once ``grpo_size`` of them have arrived, each member carrying
``advantage`` computed from the group's rewards by :func:`rlpost.algo.group_advantages`.

Optional DAPO dynamic sampling (Yu et al. 2025, arXiv:2503.14476): with
``filter_equal_rewards=True`` a complete group whose rewards are all equal (zero advantage, no
learning signal) is dropped and counted in ``num_dropped_equal`` rather than emitted.

Deliberate choices:

- Plain python, no TensorDict machinery: a sample is anything indexable by key with ``copy()``
  and item assignment (a ``dict`` or a ``TensorDict``), so the env pool, the buffer and tests all
  use it the same way. Emitted samples are shallow copies; the caller's samples are not mutated.
- ``advantage`` has the reward's form: a python float for a number, a floating tensor of the
  reward's shape for a one-element tensor reward (e.g. shape [1] in TorchRL's layout).
- Only ``scale="group"`` and ``scale="none"`` are offered: groups complete one at a time, so a
  "batch" std would depend on how arrivals happen to be chunked. Batch scaling belongs where
  the training batch is known.
- A non-finite or non-scalar reward raises ``ValueError`` when the sample arrives (it would
  poison its whole group).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from typing import Any

import torch

from rlpost.algo import group_advantages

MC_ADVANTAGE_SCALES: tuple[str, ...] = ("group", "none")


class MCAdvantage:
    """Group samples by prompt; emit each complete group with ``advantage`` filled in.

    Args:
        grpo_size: completions per prompt; a group is emitted when this many have arrived.
        prompt_key: key of the prompt identity in a sample (any hashable value, or a tensor
            whose values identify the prompt).
        reward_key: key of the scalar reward.
        advantage_key: key the advantage is written to.
        scale: "group" (divide by the group's std + eps) or "none" (Dr.GRPO: centre only).
        eps: added to the std (see :func:`rlpost.algo.group_advantages`).
        filter_equal_rewards: drop (and count) groups whose rewards are all equal (DAPO).

    Attributes:
        num_emitted_groups: groups returned so far.
        num_dropped_equal: groups dropped by the DAPO filter so far.
    """

    def __init__(
        self,
        grpo_size: int,
        *,
        prompt_key: Any = "prompt_id",
        reward_key: Any = "reward",
        advantage_key: Any = "advantage",
        scale: str = "group",
        eps: float = 1e-4,
        filter_equal_rewards: bool = False,
    ) -> None:
        if isinstance(grpo_size, bool) or not isinstance(grpo_size, int) or grpo_size < 1:
            raise ValueError(f"grpo_size must be an int >= 1, got {grpo_size!r}")
        if scale not in MC_ADVANTAGE_SCALES:
            raise ValueError(
                f"MCAdvantage scale must be one of {MC_ADVANTAGE_SCALES}, got {scale!r}"
            )
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps!r}")
        self.grpo_size = grpo_size
        self.prompt_key = prompt_key
        self.reward_key = reward_key
        self.advantage_key = advantage_key
        self.scale = scale
        self.eps = eps
        self.filter_equal_rewards = filter_equal_rewards
        self.num_emitted_groups = 0
        self.num_dropped_equal = 0
        # prompt -> [(sample, reward as float)] in arrival order; dicts keep insertion order.
        self._pending: dict[Hashable, list[tuple[Any, float]]] = {}

    @property
    def num_pending(self) -> int:
        """Samples waiting in incomplete groups."""
        return sum(len(members) for members in self._pending.values())

    @property
    def num_pending_groups(self) -> int:
        """Prompts with an incomplete group."""
        return len(self._pending)

    def add(self, samples: Iterable[Any]) -> list[list[Any]]:
        """Take new samples; return the groups they complete, in completion order.

        Each returned group holds ``grpo_size`` shallow copies of samples of one prompt, in
        arrival order, with ``advantage`` set. A prompt that receives more than ``grpo_size``
        samples starts a new group after the first is emitted.
        """
        # Read every sample before touching the pending groups: a bad sample raises and leaves
        # the state as it was, instead of losing groups that this call had already completed.
        keyed = []
        for sample in samples:
            prompt = self._prompt_of(sample)
            keyed.append((prompt, sample, self._reward_of(sample, prompt)))
        complete: list[list[tuple[Any, float]]] = []
        for prompt, sample, reward in keyed:
            members = self._pending.setdefault(prompt, [])
            members.append((sample, reward))
            if len(members) == self.grpo_size:
                complete.append(self._pending.pop(prompt))
        return self._score(complete)

    __call__ = add

    def _score(self, groups: list[list[tuple[Any, float]]]) -> list[list[Any]]:
        if self.filter_equal_rewards:
            kept = [g for g in groups if len({reward for _, reward in g}) > 1]
            self.num_dropped_equal += len(groups) - len(kept)
            groups = kept
        if not groups:
            return []
        rewards_gn = torch.tensor([[r for _, r in g] for g in groups], dtype=torch.float64)
        advantages_gn = group_advantages(rewards_gn, scale=self.scale, eps=self.eps)
        scored = [
            [self._with_advantage(sample, float(a)) for (sample, _), a in zip(g, adv_n.tolist())]
            for g, adv_n in zip(groups, advantages_gn)
        ]
        self.num_emitted_groups += len(scored)
        return scored

    def _with_advantage(self, sample: Any, advantage: float) -> Any:
        out = sample.copy()
        reward = sample[self.reward_key]
        if isinstance(reward, torch.Tensor):
            dtype = reward.dtype if reward.is_floating_point() else torch.get_default_dtype()
            out[self.advantage_key] = torch.full_like(reward, advantage, dtype=dtype)
        else:
            out[self.advantage_key] = advantage
        return out

    def _prompt_of(self, sample: Any) -> Hashable:
        prompt = _get(sample, self.prompt_key)
        if isinstance(prompt, torch.Tensor):
            return prompt.item() if prompt.numel() == 1 else tuple(prompt.flatten().tolist())
        if isinstance(prompt, list):
            return tuple(prompt)
        if not isinstance(prompt, Hashable):
            raise ValueError(
                f"prompt key {self.prompt_key!r} holds an unhashable {type(prompt).__name__}"
            )
        return prompt

    def _reward_of(self, sample: Any, prompt: Hashable) -> float:
        reward = _get(sample, self.reward_key)
        if isinstance(reward, torch.Tensor):
            if reward.numel() != 1:
                raise ValueError(
                    f"reward of a sample of prompt {prompt!r} must be a scalar, "
                    f"got shape {tuple(reward.shape)}"
                )
            reward = reward.item()
        value = float(reward)
        if not math.isfinite(value):
            raise ValueError(f"reward of a sample of prompt {prompt!r} is not finite: {value}")
        return value


def _get(sample: Any, key: Any) -> Any:
    try:
        return sample[key]
    except KeyError as err:
        raise KeyError(f"MCAdvantage: sample has no key {key!r}") from err
