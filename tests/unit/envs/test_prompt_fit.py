"""Prompts against the engine's length, before a run starts: each row's first prompt as the env
renders it (DatasetChatEnv.prompt_lengths), the rows that leave room for the completion
(prompt_fit), the refusal or the drop (fit_prompts, data.drop_long_prompts), and the primer
drawing only the kept rows (DataLoadingPrimer.keep_rows)."""

from __future__ import annotations

import pytest

from rlpost.config import ConfigError, validate_config
from rlpost.envs import DatasetChatEnv
from rlpost.envs.datasets import DataLoadingPrimer
from rlpost.envs.tasks import fit_prompts, prompt_fit

pytestmark = pytest.mark.unit

# row 1 and row 3 are long; the others are one short question each
ROWS = [{"question": "What is 1 + 2?", "answer": "3"},
        {"question": "What is " + " + ".join(["1"] * 60) + "?", "answer": "60"},
        {"question": "What is 2 + 2?", "answer": "4"},
        {"question": "What is " + " + ".join(["2"] * 40) + "?", "answer": "80"},
        {"question": "What is 5 + 2?", "answer": "7"}]  # fmt: skip


def env_of(tokenizer, rows=ROWS, **kwargs):
    return DatasetChatEnv(dataset=rows, tokenizer=tokenizer, input_mode="tokens", system_prompt="Answer.",
                          shuffle=False, **kwargs)  # fmt: skip


def test_prompt_lengths_are_the_tokens_a_reset_renders(tiny_tokenizer):
    env = env_of(tiny_tokenizer)
    lengths = env.prompt_lengths()
    assert len(lengths) == len(ROWS) and lengths[1] > lengths[3] > lengths[0]
    for i in range(len(ROWS)):  # exactly what reset() hands the policy, row by row
        td = env.reset()
        assert td.get("tokens").prompt[0].numel() == lengths[i]


def test_prompt_fit_splits_the_rows_by_the_room_left_for_the_completion(tiny_tokenizer):
    env = env_of(tiny_tokenizer)
    lengths = env.prompt_lengths()
    room = lengths[3] - 1  # row 3 and row 1 do not fit
    fit = prompt_fit(env, max_model_len=room + 16, max_tokens=16)
    assert (fit.kept, fit.too_long, fit.room) == ([0, 2, 4], [1, 3], room)
    assert (fit.longest, fit.longest_row) == (lengths[1], 1)
    assert prompt_fit(env, max_model_len=room + 16, max_tokens=16, rows=1).too_long == []  # the first row alone


def job(**data):
    return validate_config({"data": {"task": "custom", "dataset": "rows.jsonl", "reward_fn": "x:y", **data},
                            "rollout": {"max_tokens": 16, "engine": {"max_model_len": 48}}})  # fmt: skip


def test_fit_prompts_refuses_naming_the_keys_and_the_longest_or_drops_when_asked(tiny_tokenizer):
    lengths = env_of(tiny_tokenizer).prompt_lengths()
    assert lengths[1] > 32 and lengths[3] > 32 and max(lengths[0], lengths[2], lengths[4]) <= 32
    with pytest.raises(ConfigError) as refused:
        fit_prompts(env_of(tiny_tokenizer), job())
    message = str(refused.value)
    for part in (
        "2 of 5 prompts of data ('rows.jsonl')",
        "rollout.engine.max_model_len=48 less 16 tokens",
        "leaves 32",
        f"the longest has {lengths[1]} (row 1)",
        "data.drop_long_prompts=true to use the 3",
    ):
        assert part in message, message  # fmt: skip

    env = env_of(tiny_tokenizer)
    fit = fit_prompts(env, job(drop_long_prompts=True))
    assert fit.kept == [0, 2, 4] and len(env.primer) == 3
    drawn = [env.reset().get("prompt_id").item() for _ in range(4)]
    assert drawn == [0, 1, 2, 3]  # the stream of a 3-row dataset: ids go on into the next epoch
    answers = [env.primer.next_items(1)[0].row["answer"] for _ in range(3)]
    assert answers == ["4", "7", "3"]  # rows 2, 4, 0 (no shuffle): rows 1 and 3 are never drawn


def test_fit_prompts_says_when_no_prompt_fits(tiny_tokenizer):
    cfg = validate_config({"data": {"task": "custom", "dataset": "rows.jsonl", "reward_fn": "x:y",
                                    "drop_long_prompts": True},
                           "rollout": {"max_tokens": 16, "engine": {"max_model_len": 17}}})  # fmt: skip
    with pytest.raises(ConfigError, match="none fits: raise rollout.engine.max_model_len"):
        fit_prompts(env_of(tiny_tokenizer), cfg)


def test_keep_rows_orders_and_shards_the_kept_rows_keeping_their_row_index():
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(10)]
    primers = [DataLoadingPrimer(dataset=rows, seed=3, num_shards=2, shard_index=j).keep_rows([1, 4, 5, 8])
               for j in range(2)]  # fmt: skip
    drawn = [[primer.next_items(1)[0] for _ in range(4)] for primer in primers]
    first_epoch = {item.row_index for shard in drawn for item in shard[:2]}
    assert first_epoch == {1, 4, 5, 8}  # each kept row once per epoch, across the shards
    assert all(item.row["answer"] == str(item.row_index) for shard in drawn for item in shard)
    assert sorted(item.prompt_id for shard in drawn for item in shard[:2]) == [0, 1, 2, 3]
    assert primers[0].state_dict()["num_rows"] == 4  # a resume with other rows kept is refused
    with pytest.raises(ValueError, match="4 rows of dataset .* kept, fewer than the 5 shards"):
        DataLoadingPrimer(dataset=rows, num_shards=5).keep_rows([0, 1, 2, 3])
    with pytest.raises(ValueError, match="row indices, in range 0..9"):
        DataLoadingPrimer(dataset=rows).keep_rows([12])


def test_the_run_refuses_an_engine_longer_than_the_models_context(tiny_model_path):
    from rlpost.config import load_config
    from rlpost.service.preflight import check_data

    cfg = load_config("configs/tiny-cpu.yaml", [f"model.name_or_path={tiny_model_path}",
                                                "rollout.engine.max_model_len=4096"])  # fmt: skip
    with pytest.raises(ConfigError, match="max_model_len=4096 is beyond the context of model.name_or_path"):
        check_data(cfg)
    check_data(load_config("configs/tiny-cpu.yaml", [f"model.name_or_path={tiny_model_path}"]))  # the demo fits


def test_a_template_that_cannot_render_the_prompts_is_a_config_error(tiny_tokenizer):
    import copy

    tokenizer = copy.copy(tiny_tokenizer)
    tokenizer.chat_template = "{{ raise_exception('this template needs a tools list') }}"
    with pytest.raises(ConfigError, match=r"cannot be rendered with the tokenizer's chat template .*tools list.*"
                                          r"check model.chat_template"):  # fmt: skip
        fit_prompts(env_of(tokenizer), job())
