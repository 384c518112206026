"""A TransformedEnv's specs are the base env's passed through each transform's
``transform_<part>_spec`` (TorchRL's spec flow); IncrementalTokenizer adds its ids."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rlpost.data.specs import Composite, Unbounded
from rlpost.envs.async_pool import AsyncEnvPool
from rlpost.envs.chat import ChatEnv
from rlpost.envs.incremental_tokenizer import IncrementalTokenizer
from rlpost.envs.transforms import Compose, Transform, TransformedEnv

pytestmark = pytest.mark.unit

PARTS = ("observation", "action", "state", "reward", "done")


class Marks(Transform):
    """Adds ``name`` to every spec it is given: a float of the spec's shape plus ``(1,)``."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _mark(self, spec: Composite) -> Composite:
        spec[self.name] = Unbounded(shape=(*spec.shape, 1))
        return spec

    transform_observation_spec = transform_action_spec = transform_state_spec = _mark
    transform_reward_spec = transform_done_spec = _mark


def test_a_plain_transform_leaves_every_spec_as_the_base_envs():
    base = ChatEnv(batch_size=(2,))
    env = base.append_transform(Transform())
    for part in PARTS:
        assert getattr(env, f"full_{part}_spec") == getattr(base, f"full_{part}_spec")


def test_every_spec_goes_through_the_transforms_in_order():
    base = ChatEnv(batch_size=(2,))
    env = TransformedEnv(base, Marks("a")).append_transform(Compose(Marks("b"), Marks("c")))
    for part in PARTS:
        spec = getattr(env, f"full_{part}_spec")
        added = [key for key in spec.keys() if key not in getattr(base, f"full_{part}_spec").keys()]
        assert added == ["a", "b", "c"] and spec["c"].shape == (2, 1)
        assert "a" not in getattr(base, f"full_{part}_spec").keys()  # the base env's spec is its own
    assert list(env.observation_spec.keys()) == ["history", "a", "b", "c"]
    assert env.done_spec is not None and "done" in env.full_done_spec.keys()


def test_incremental_tokenizer_adds_its_ids_to_the_observation_spec(tiny_tokenizer):
    env = ChatEnv(batch_size=(2,), tokenizer=tiny_tokenizer).append_transform(IncrementalTokenizer(tiny_tokenizer))
    spec = env.observation_spec
    assert spec.keys(True, True) == [("history", "prompt", key) for key in spec["history", "prompt"].keys()] + [
        ("tokens", "prompt")
    ]
    ids = spec["tokens", "prompt"]
    assert ids.shape == (2, -1) and ids.dtype == torch.int64 and spec["tokens"].shape == (2,)
    td = env.reset(TensorDict({"query": ["Hi", "What is the weather like?"]}, batch_size=(2,)))
    assert spec.is_in(td.select("history", "tokens"))  # rows of different lengths fit [2, -1]
    assert list(env.full_action_spec.keys()) == ["history"]  # the other specs are the base env's
    custom = ChatEnv(batch_size=(1,), tokenizer=tiny_tokenizer).append_transform(
        IncrementalTokenizer(tiny_tokenizer, tokens_key="ids")
    )
    assert custom.observation_spec["ids"].shape == (1, -1)
    assert ChatEnv(batch_size=(1,), tokenizer=tiny_tokenizer, with_tokenizer=True).observation_spec[
        "tokens", "prompt"
    ].shape == (1, -1)


def test_a_pool_of_tokenized_envs_shows_the_ids_with_its_batch(tiny_tokenizer):
    def make():
        return ChatEnv(batch_size=(1,), tokenizer=tiny_tokenizer).append_transform(IncrementalTokenizer(tiny_tokenizer))

    pool = AsyncEnvPool([make, make, make])
    try:
        assert pool.full_observation_spec["tokens", "prompt"].shape == (3, -1)
    finally:
        pool.close()
