"""Learned and judged rewards: ``reward_model`` (a classifier or an LLM judge, ``reward_model.judge``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from rlpost.config.base import Section
from rlpost.config.rollout import EngineConfig


class JudgeConfig(Section):
    """The generative judge of reward_model.kind=generative: its prompt and how its verdict is read."""

    template: str = Field(
        "Rate the answer to the question from 0 to 10.\nQuestion: {prompt}\nAnswer: {completion}\n"
        "Reply with 'Score: N'.",
        description="The judge's user message (inline text, or a path to a text file) with {prompt} (the row's "
        "prompt), {completion} (the final response) and {answer} (the row's reference answer, '' without one).",
    )
    system_prompt: str | None = Field(None, description="A system message before the judge's user message.")
    pattern: str = Field(
        r"Score:\s*(-?\d+(?:\.\d+)?)",
        description="Regular expression whose first group is the verdict, searched in the judge's reply (the last "
        "match counts). A reply without a match scores 0 and counts in reward_errors as 'unparsed_verdict'.",
    )
    verdicts: dict[str, float] | None = Field(
        None,
        description="Score of each verdict text (matched without case), e.g. {yes: 1, no: 0}; None reads the "
        "verdict as a number. A verdict not in the mapping counts as unparsed.",
    )
    scale: float = Field(10.0, gt=0, description="The verdict is divided by this (0-10 ratings become 0-1 scores).")
    max_tokens: int = Field(64, ge=1, description="Most tokens of the judge's reply (greedy decoding).")

    @field_validator("pattern")
    @classmethod
    def _one_group(cls, value: str) -> str:
        import re

        try:
            compiled = re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a regular expression ({exc})") from None
        if compiled.groups < 1:
            raise ValueError("needs a group around the verdict, e.g. 'Score: (\\d+)'")
        return value


class RewardModelConfig(Section):
    """A learned reward: the supervised Ray actor ``reward`` scores each episode's final response."""

    name_or_path: str = Field(
        ..., description="The reward model: a hub name (GPU users) or a local folder (`rlpost make-tiny-reward-model`)."
    )
    kind: Literal["classifier", "generative"] = Field(
        "classifier",
        description="'classifier': a Hugging Face sequence-classification model with one label, scoring the "
        "conversation (user prompt + response) rendered with its own tokenizer's chat template; 'generative': an LLM "
        "judge on a vLLM engine of its own (reward_model.judge).",
    )
    weight: float = Field(1.0, description="Weight of the model's score in the reward.")
    rule_weight: float = Field(
        1.0,
        description="Weight of the task's own reward (data.task's rule, data.reward_fn) beside it: reward = "
        "rule_weight * rule + weight * score. 0 trains on the model's score alone.",
    )
    batch_size: int = Field(16, ge=1, description="Conversations per forward pass of the classifier.")
    max_length: int = Field(
        1024, ge=8, description="Most tokens of a scored conversation; longer ones keep their last tokens."
    )
    timeout_s: float = Field(120.0, gt=0, description="Bound of one scoring call from an env pool.")
    restart_wait_s: float = Field(
        180.0,
        gt=0,
        description="How long an env pool waits for the supervisor to start a lost reward actor again before its "
        "collection fails.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="The reward model's dtype on GPU; None: model.dtype (CPUs always use float32)."
    )
    judge: JudgeConfig = Field(default_factory=JudgeConfig, description="The generative judge (kind=generative).")
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="The judge's own vLLM engine (kind=generative)."
    )
