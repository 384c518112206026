"""A learned reward beside the task's rule: :class:`RewardModelReward` and the ``reward`` actor's client.

When an episode ends (``done`` on its step), :class:`RewardModelReward` sends its conversation,
``[user prompt, final response]``, to a scorer and sets that step's reward to::

    reward = rule_weight * rule + weight * score        (rule: what the transforms before it gave)

Earlier steps get the scaled rule part only (one score per episode, on its final response). Both
parts go under ``next["reward_parts"]`` (``rule``, ``reward_model``), summed per episode by the
collector and reported as ``reward_part/<part>``. Trap: append it after every other reward and
done transform (``make_env`` does), so it sees the step's whole rule reward and final ``done``.
The scorer's failures by kind (e.g. a judge reply without a verdict, scored 0) are counted in
``errors`` (the env's ``reward_errors``), the first of each logged.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch
from tensordict import TensorDictBase

from rlpost.envs.chat import as_list
from rlpost.envs.transforms import Transform, set_reward_part
from rlpost.transport.named_actor import NamedActorClient

logger = logging.getLogger(__name__)

RULE_PART, MODEL_PART = "rule", "reward_model"


class RewardModelReward(Transform):
    """``reward = rule_weight * reward + weight * scorer.score(...)`` on the step an episode ends.

    ``scorer``: ``score(conversations, answers) -> result`` with ``scores`` (one float per
    conversation) and ``errors`` (failures by kind): :class:`RemoteRewardModel`, or
    ``rlpost.actors.reward.RewardModel`` in-process. ``row_key``: the dataset row, whose prompt
    column is the user's prompt and ``answer`` the reference shown to a judge.
    """

    def __init__(self, scorer: Any, *, weight: float = 1.0, rule_weight: float = 1.0, row_key: str = "row") -> None:
        super().__init__()
        self.scorer, self.weight, self.rule_weight, self.row_key = scorer, float(weight), float(rule_weight), row_key
        self.errors: Counter = Counter()

    def on_step(self, td: TensorDictBase, next_td: TensorDictBase) -> TensorDictBase:
        num_envs = td.batch_size[0]
        reward = next_td.get("reward")
        rule = reward.view(-1).tolist()
        ended = [i for i, done in enumerate(next_td.get("done").view(-1).tolist()) if done]
        scores = [0.0] * num_envs
        if ended:
            for i, score in zip(ended, self._score(td, ended)):
                scores[i] = score
        combined = [self.rule_weight * r + self.weight * s for r, s in zip(rule, scores)]
        next_td.set("reward", torch.tensor(combined, dtype=reward.dtype, device=reward.device).view_as(reward))
        set_reward_part(next_td, RULE_PART, rule)
        set_reward_part(next_td, MODEL_PART, scores)
        return next_td

    def _score(self, td: TensorDictBase, rows: list[int]) -> list[float]:
        num_envs = td.batch_size[0]
        if self.row_key not in td.keys():
            raise ValueError(f"{type(self).__name__} needs the dataset row under {self.row_key!r} in the step input")
        data_rows = as_list(td.get(self.row_key), num_envs)
        responses = self._chat_env().last_responses(td)
        primer = getattr(self._env(), "primer", None)
        prompt_column = getattr(primer, "prompt_column", None) or "question"
        answer_column = getattr(primer, "answer_column", None) or "answer"
        conversations, answers = [], []
        for i in rows:
            row = data_rows[i] if isinstance(data_rows[i], dict) else {}
            conversations.append(
                [{"role": "user", "content": str(row.get(prompt_column, ""))},
                 {"role": "assistant", "content": responses[i]}]
            )  # fmt: skip
            answer = row.get(answer_column)
            answers.append(None if answer is None else str(answer))
        result = self.scorer.score(conversations, answers)
        if len(result.scores) != len(rows):
            raise RuntimeError(f"the reward model returned {len(result.scores)} scores for {len(rows)} conversations")
        for kind, count in result.errors.items():
            if count and not self.errors[kind]:
                logger.warning("reward model: %d %s in one batch (scored 0, counted in reward_errors; logged once "
                               "per kind)", count, kind)  # fmt: skip
            self.errors[kind] += count
        return [float(s) for s in result.scores]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(weight={self.weight}, rule_weight={self.rule_weight}, scorer={self.scorer!r})"


class RemoteRewardModel(NamedActorClient):
    """The bounded client of the run's named ``reward`` actor (``rlpost.actors.reward``).

    A call waits at most ``timeout_s`` (then ``TimeoutError``); one that meets a dead or
    restarting actor looks the name up again every second for at most ``restart_wait_s`` until
    the supervisor's replacement answers, then raises ``RuntimeError`` naming the actor.
    """

    def __init__(self, actor_name: str = "reward", *, namespace: str | None = None, timeout_s: float = 120.0,
                 restart_wait_s: float = 180.0) -> None:  # fmt: skip
        super().__init__(actor_name, namespace=namespace, timeout_s=timeout_s, restart_wait_s=restart_wait_s,
                         role="reward actor",
                         settings=("reward_model.timeout_s", "reward_model.restart_wait_s"))  # fmt: skip

    def score(self, conversations: list[list[dict[str, str]]], answers: list[str | None]) -> Any:
        return self.call("score", conversations, answers, what=f"score {len(conversations)} conversations")
