"""examples/grpo_by_hand.py: TorchRL's GRPO loop composed from rlpost's public pieces, run for a
few steps on the tiny model with a real vLLM engine."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_by_hand.py"


@pytest.mark.long  # a whole training script (9-14 s): make test-long
def test_grpo_by_hand_raises_the_reward_and_versions_advance(tiny_model_path):
    spec = importlib.util.spec_from_file_location("grpo_by_hand", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # its dataclasses look their module up there
    spec.loader.exec_module(example)
    # every step practises the same 2 questions (32 completions a step), so their reward climbs
    # within a dozen steps: measured over seeds 0-4, the last 4 steps' mean reward beat the first
    # 4 steps' by 0.20-0.32 (rewards are 0.1 for the format, 1.0 for the right answer)
    run = example.grpo_by_hand(str(tiny_model_path), steps=12, group_size=16, prompts_per_step=2, num_questions=2)
    assert run.versions == list(range(1, 13))  # each step's weights reached the worker
    assert all(0.0 <= r <= 1.0 for r in run.rewards)
    first, last = sum(run.rewards[:4]) / 4, sum(run.rewards[-4:]) / 4
    assert last - first > 0.08, run.rewards
    # GRPO steps move probability towards their better-than-average completions. One Adam step
    # is not a gradient step, so a single step may lose a little (a CI run saw one step below 0);
    # measured over seeds 0-2: 12 of 12 steps gained, 2.2-2.8 in total
    assert sum(i > 0 for i in run.improvements) >= 9, run.improvements
    assert sum(run.improvements) > 0.5, run.improvements
