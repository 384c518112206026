"""Types that cross process boundaries, with who makes them and who reads them.

They are plain dataclasses of Python lists and numbers: cheap to pickle through Ray, readable
without torch, and independent of any padding layout. Tensors are built where they are used.

    Sample          made by an env pool's collector, one completed episode
    Group           made by an env pool (all samples of one prompt + advantages), put in the
                    buffer, read by the learner (and by the reference actor when KL is on)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    """One completed episode, in full-sequence form (multi-turn safe).

    ``token_ids`` is prompt + everything after it, exactly the ids the engine generated (never
    re-tokenised text) plus, in multi-turn episodes, the env's tool/user turns. ``loss_mask`` is
    True on generated tokens only; ``logprobs`` holds the behaviour log-prob of each generated
    token and 0.0 elsewhere.
    """

    prompt_id: int
    token_ids: list[int]
    logprobs: list[float]
    loss_mask: list[bool]
    prompt_len: int
    reward: float
    policy_version: int  # oldest version that generated any of its tokens
    finished: bool
    completion_text: str = ""
    ref_logprobs: list[float] | None = None  # filled by the reference actor when KL is on
    num_turns: int = 1  # assistant turns in the episode
    num_tool_calls: int = 0  # tool calls the env ran for it (code blocks, function calls)
    num_tool_errors: int = 0  # of which failed (an exception, a limit, an unknown tool)
    tool_time_s: float = 0.0  # wall-clock seconds its tool calls took
    # per token of token_ids, the policy version that generated it (-1: not generated, or the
    # engine did not say); a weight update may land mid-completion (in-flight updates)
    token_versions: list[int] | None = None
    # the reward's named parts, summed over the episode's steps (e.g. {"rule": 1.0, "reward_model":
    # 0.7} with a reward model); None when the env reports none
    reward_parts: dict[str, float] | None = None
    task: str | None = None  # the row's "task" column (a task mixture reports metrics per task)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)


@dataclass
class Group:
    """All samples of one prompt (a GRPO group) with their advantages."""

    prompt_id: int
    samples: list[Sample]
    advantages: list[float]
    policy_version: int  # min over the samples: the staleness of the group
    info: dict = field(default_factory=dict)  # e.g. reward errors by type, env pool index
    # set by the env pool that puts the group in the buffer: its name and the group's number
    # (1, 2, 3, ... over that pool's puts, across restarts); the buffer uses them to skip replays
    # and the learner's side to acknowledge what it received
    producer: str | None = None
    seq: int | None = None

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]
