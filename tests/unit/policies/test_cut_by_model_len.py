"""Completions the engine's context length cut short are told apart from the rest."""

import pytest

from rlpost.policies.base import Completion
from rlpost.policies.vllm_client import cut_by_model_len

pytestmark = pytest.mark.unit


def _c(n: int, finished: bool) -> Completion:
    return Completion(token_ids=list(range(n)), logprobs=None, finished=finished)


def test_an_unfinished_completion_short_of_max_tokens_was_cut_by_the_context():
    prompts = [[1] * 10, [2] * 229]
    assert cut_by_model_len(prompts, [[_c(128, False)], [_c(27, False)]], max_tokens=128) == (229, 27)


def test_finished_or_full_length_completions_were_not_cut():
    prompts = [[1] * 10, [2] * 20]
    assert cut_by_model_len(prompts, [[_c(3, True), _c(16, False)], [_c(16, False)]], max_tokens=16) is None
    assert cut_by_model_len(prompts, [[_c(3, False)], [_c(4, False)]], max_tokens=None) is None
