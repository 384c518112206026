"""DataLoadingPrimer and DatasetChatEnv: local files, seeded order, repeats, resume, errors.

No test touches the network: the hub path is checked with a stand-in ``datasets.load_dataset``.
"""

from __future__ import annotations

import json

import datasets
import pytest
import torch

from rlpost.envs import DataLoadingPrimer, DatasetChatEnv
from rlpost.envs.datasets import load_rows

pytestmark = pytest.mark.unit

NUM_ROWS = 12
ROWS = [{"question": f"q{i}", "answer": str(i), "level": i % 3} for i in range(NUM_ROWS)]


@pytest.fixture
def jsonl_path(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


@pytest.fixture
def parquet_path(tmp_path):
    path = tmp_path / "prompts.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    return path


def draw(primer: DataLoadingPrimer, n: int) -> list[tuple[int, int]]:
    """(row index, prompt id) of the next n prompts."""
    return [(item.row_index, item.prompt_id) for item in primer.next_items(n)]


# ---------------------------------------------------------------------------- loading


@pytest.mark.parametrize("fixture", ["jsonl_path", "parquet_path"])
def test_local_files_load_every_row(fixture, request):
    path = request.getfixturevalue(fixture)
    primer = DataLoadingPrimer(path, shuffle=False)
    items = primer.next_items(NUM_ROWS)
    assert [item.row for item in items] == ROWS
    assert len(primer) == NUM_ROWS and primer.description == f"file {path}"


def test_str_path_and_in_memory_rows_agree(jsonl_path):
    from_file = DataLoadingPrimer(str(jsonl_path), seed=3)
    in_memory = DataLoadingPrimer(ROWS, seed=3)
    assert [i.row for i in from_file.next_items(20)] == [i.row for i in in_memory.next_items(20)]


def test_missing_column_names_column_dataset_and_columns(jsonl_path):
    with pytest.raises(ValueError) as err:
        DataLoadingPrimer(jsonl_path, prompt_column="prompt")
    message = str(err.value)
    assert "'prompt'" in message and str(jsonl_path) in message
    assert "['question', 'answer', 'level']" in message
    with pytest.raises(ValueError, match=r"'solution' \(answer_column\).*in-memory rows"):
        DataLoadingPrimer(ROWS, answer_column="solution")


def test_local_file_has_only_a_train_split(jsonl_path):
    with pytest.raises(ValueError, match="single split 'train'"):
        DataLoadingPrimer(jsonl_path, split="test")


def test_unsupported_file_and_empty_dataset(tmp_path):
    csv = tmp_path / "x.csv"
    csv.write_text("question,answer\n")
    with pytest.raises(ValueError, match="unsupported extension"):
        DataLoadingPrimer(csv)
    with pytest.raises(ValueError, match="no rows"):
        DataLoadingPrimer([])


def test_non_string_prompt_is_reported(tmp_path):
    env = DatasetChatEnv(dataset=[{"question": 3, "answer": "3"}])
    with pytest.raises(ValueError, match="row 0 .* 'question' holds a int"):
        env.reset()


def test_hub_name_plumbing(monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        train = datasets.Dataset.from_list(ROWS)
        return datasets.DatasetDict({"train": train, "test": train}) if split is None else train

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    rows, description = load_rows("openai/gsm8k", name="main", split="test")
    assert calls == [("openai/gsm8k", "main", "test")] and len(rows) == NUM_ROWS
    assert description == "'openai/gsm8k' subset='main' split='test'"
    rows, _ = load_rows("openai/gsm8k", name="main", split=None)  # no split: "train"
    assert calls[-1] == ("openai/gsm8k", "main", None) and len(rows) == NUM_ROWS
    with pytest.raises(ValueError, match=r"'openai/gsm8k' subset='main'.*columns are"):
        DataLoadingPrimer("openai/gsm8k", name="main", prompt_column="problem")


# ---------------------------------------------------------------------------- order


def test_seeded_shuffle_is_reproducible_and_covers_each_epoch():
    first = draw(DataLoadingPrimer(ROWS, seed=7), 2 * NUM_ROWS)
    again = draw(DataLoadingPrimer(ROWS, seed=7), 2 * NUM_ROWS)
    other = draw(DataLoadingPrimer(ROWS, seed=8), 2 * NUM_ROWS)
    assert first == again and first != other
    epoch0, epoch1 = [r for r, _ in first[:NUM_ROWS]], [r for r, _ in first[NUM_ROWS:]]
    assert sorted(epoch0) == sorted(epoch1) == list(range(NUM_ROWS))
    assert epoch0 != epoch1  # the next epoch is reshuffled
    assert epoch0 != list(range(NUM_ROWS))
    assert [p for _, p in first] == list(range(2 * NUM_ROWS))  # ids continue across epochs


def test_no_shuffle_walks_in_dataset_order_and_wraps():
    primer = DataLoadingPrimer(ROWS, shuffle=False)
    assert [r for r, _ in draw(primer, NUM_ROWS + 2)] == list(range(NUM_ROWS)) + [0, 1]
    assert primer.epoch == 1


def test_seed_none_is_drawn_and_saved():
    primer = DataLoadingPrimer(ROWS)
    assert isinstance(primer.state_dict()["seed"], int)


# ---------------------------------------------------------------------------- repeats


def test_repeats_give_groups_with_one_prompt_id():
    primer = DataLoadingPrimer(ROWS, seed=1, repeats=3)
    items = draw(primer, 9)
    groups = [items[i : i + 3] for i in range(0, 9, 3)]
    for group in groups:
        assert len(set(group)) == 1  # same row, same prompt id, three times in a row
    assert len({group[0][1] for group in groups}) == 3


def test_groups_may_straddle_resets_without_group_repeats():
    primer = DataLoadingPrimer(ROWS, seed=1, repeats=3)
    assert [p for _, p in draw(primer, 2) + draw(primer, 2)] == [0, 0, 0, 1]


def test_group_repeats_requires_whole_groups():
    primer = DataLoadingPrimer(ROWS, seed=1, repeats=2, group_repeats=True)
    assert [p for _, p in draw(primer, 4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="whole groups of 2"):
        primer.next_items(3)


def test_shards_split_the_order_without_id_clashes():
    whole = draw(DataLoadingPrimer(ROWS, seed=5), NUM_ROWS)
    shard0 = draw(DataLoadingPrimer(ROWS, seed=5, num_shards=2, shard_index=0), NUM_ROWS // 2)
    shard1 = draw(DataLoadingPrimer(ROWS, seed=5, num_shards=2, shard_index=1), NUM_ROWS // 2)
    assert shard0 == whole[0::2] and shard1 == whole[1::2]
    with pytest.raises(ValueError, match="shard_index"):
        DataLoadingPrimer(ROWS, num_shards=2, shard_index=2)


# ---------------------------------------------------------------------------- resume


@pytest.mark.parametrize("already_drawn", [0, 5, NUM_ROWS * 2 - 1])
def test_resume_from_state_dict_gives_the_same_next_prompts(already_drawn):
    primer = DataLoadingPrimer(ROWS, seed=11, repeats=2)
    draw(primer, already_drawn)
    state = json.loads(json.dumps(primer.state_dict()))  # it must survive a checkpoint file
    expected = draw(primer, 30)
    resumed = DataLoadingPrimer(ROWS, seed=11, repeats=2)
    resumed.load_state_dict(state)
    assert draw(resumed, 30) == expected


def test_resume_restores_a_drawn_seed():
    primer = DataLoadingPrimer(ROWS)  # seed drawn at random
    state = primer.state_dict()
    expected = draw(primer, 10)
    resumed = DataLoadingPrimer(ROWS)
    resumed.load_state_dict(state)
    assert draw(resumed, 10) == expected


def test_resume_refuses_a_different_stream():
    state = DataLoadingPrimer(ROWS, seed=1, repeats=2).state_dict()
    with pytest.raises(ValueError, match="repeats=2.*repeats=4"):
        DataLoadingPrimer(ROWS, seed=1, repeats=4).load_state_dict(state)
    with pytest.raises(ValueError, match="num_rows"):
        DataLoadingPrimer(ROWS[:5], seed=1, repeats=2).load_state_dict(state)


def test_reset_dataloader_restarts_epoch_zero():
    primer = DataLoadingPrimer(ROWS, seed=2)
    first = draw(primer, 5)
    draw(primer, 20)
    assert draw(primer.reset_dataloader(), 5) == first


# ---------------------------------------------------------------------------- DatasetChatEnv


def test_dataset_chat_env_reset_fills_query_answer_row_and_prompt_id(jsonl_path):
    env = DatasetChatEnv(dataset=jsonl_path, num_envs=4, repeats=2, seed=0, system_prompt="Be brief.")
    td = env.reset()
    order = DataLoadingPrimer(ROWS, seed=0).order(0)
    expected_rows = [ROWS[order[0]]] * 2 + [ROWS[order[1]]] * 2
    assert td["query"] == [row["question"] for row in expected_rows]
    assert td["answer"] == [row["answer"] for row in expected_rows]
    assert td["row"] == expected_rows
    assert td["prompt_id"].tolist() == [0, 0, 1, 1] and td["prompt_id"].dtype == torch.int64
    assert td["history"].prompt.to_chats()[0] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": expected_rows[0]["question"]},
    ]


def test_dataset_chat_env_resume_gives_the_same_next_resets(parquet_path):
    def make():
        return DatasetChatEnv(dataset=parquet_path, num_envs=3, repeats=3, seed=4)

    env = make()
    for _ in range(5):
        env.reset()
    state = env.state_dict()
    expected = [(env.reset()["query"], env.reset()["prompt_id"].tolist()) for _ in range(3)]
    resumed = make()
    resumed.load_state_dict(state)
    assert [(resumed.reset()["query"], resumed.reset()["prompt_id"].tolist()) for _ in range(3)] == expected
    assert resumed.reset_dataloader().primer.epoch == 0


def test_dataset_chat_env_accepts_a_custom_prompt_column_and_no_answer():
    rows = [{"prompt": "tell me a joke"}, {"prompt": "tell me another"}]
    env = DatasetChatEnv(dataset=rows, prompt_column="prompt", answer_column=None, shuffle=False, num_envs=2)
    td = env.reset()
    assert td["query"] == ["tell me a joke", "tell me another"]
    assert "answer" not in td.keys()
