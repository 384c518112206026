"""Pure pieces behind TorchRL's layouts: per-row writes (set_rows), torch.cat of ragged Histories,
the spec view of a bare History, ChatML text past EOS and the collector's turns per batch."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from rlpost.collect.llm_collector import _turns_per_batch
from rlpost.data import History, LogProbs
from rlpost.data.stacking import is_row_stacked, set_rows
from rlpost.data.templates import parse_chatml

pytestmark = pytest.mark.unit

ROWS = [torch.arange(3.0), torch.arange(5.0)]


def test_set_rows_under_a_new_container_of_a_dense_td():
    td = TensorDict(batch_size=[2])
    set_rows(td, ("log_probs", "full"), ROWS)
    assert is_row_stacked(td, ("log_probs", "full"))
    assert [row.tolist() for row in td.get(("log_probs", "full"), as_list=True)] == [[0, 1, 2], [0, 1, 2, 3, 4]]


def test_set_rows_unbinds_an_existing_dense_container_and_keeps_its_entries():
    td = TensorDict(log_probs=LogProbs(response=torch.ones(2, 4), batch_size=[2]), batch_size=[2])
    set_rows(td, ("log_probs", "full"), ROWS)
    assert [row.shape[0] for row in td.get(("log_probs", "full"), as_list=True)] == [3, 5]
    assert torch.equal(td.get(("log_probs", "response")), torch.ones(2, 4))


def test_set_rows_into_a_lazy_stack_and_a_zero_dim_td():
    td = lazy_stack([TensorDict(), TensorDict()])
    set_rows(td, "kl", ROWS)
    assert [row.shape[0] for row in td.get("kl", as_list=True)] == [3, 5]
    single = set_rows(TensorDict(), ("log_probs", "full"), [ROWS[0]])
    assert single.get(("log_probs", "full")).tolist() == [0, 1, 2]


def test_set_rows_with_a_one_part_key_of_a_dense_td_is_jagged():
    td = set_rows(TensorDict(batch_size=[2]), "kl", ROWS)
    value = td.get("kl")
    assert value.is_nested and [row.shape[0] for row in value.unbind(0)] == [3, 5]
    assert not is_row_stacked(td, "kl")


def test_torch_cat_of_histories_of_different_lengths():
    short = History.from_chats([[{"role": "user", "content": "a"}]] * 2)
    long = History.from_chats([[{"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]])
    joined = torch.cat([short, long])
    assert joined.batch_size[0] == 3
    assert [[m["content"] for m in chat] for chat in joined.to_chats()] == [["a"], ["a"], ["b", "c"]]
    dense = torch.cat([short, short])  # same lengths: the tensorclass's own, dense cat
    assert dense.batch_size == (4, 1) and not isinstance(dense._tensordict, type(joined._tensordict))
    td = torch.cat([TensorDict(h=short, batch_size=[2]), TensorDict(h=long, batch_size=[1])])
    assert [len(row) for row in td["h"].unbind(0)] == [1, 1, 2]


def test_spec_view_of_a_history_built_without_batch_size():
    history = History(role=["user", "assistant"], content=["q", "a"])
    assert history.batch_size == () and history._spec_view().batch_size == (2,)
    assert history._spec_view().is_complete.tolist() == [True, True]
    batched = History.from_chats([[{"role": "user", "content": "q"}]])
    assert batched._spec_view() is batched


def test_parse_chatml_drops_text_after_the_last_block_but_not_before_the_first():
    text = "<|im_start|>assistant\nyes<|im_end|>\nsampled past eos<|im_end|>"
    assert parse_chatml(text) == [{"role": "assistant", "content": "yes", "is_complete": True}]
    with pytest.raises(ValueError, match="before the first"):
        parse_chatml("preamble<|im_start|>user\nq<|im_end|>")


class _Env:
    batch_size = torch.Size([4])


@pytest.mark.parametrize(
    "requested, whole_episodes, expected", [(None, False, 4), (1, False, 4), (6, False, 8), (8, False, 8), (6, True, 6)]
)
def test_turns_per_batch_rounds_up_to_whole_steps(requested, whole_episodes, expected):
    assert _turns_per_batch(requested, _Env(), whole_episodes) == expected
