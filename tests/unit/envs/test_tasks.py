"""Tasks through the env: the GSM8K reward table, the arithmetic task, user rewards, make_env."""

from __future__ import annotations

import json
import textwrap
from collections import Counter

import pytest
import torch
from pool_functions import flaky_reward

from rlpost.config import ConfigError, validate_config
from rlpost.data import ChatHistory, History, Text
from rlpost.envs import ArithmeticEnv, DatasetChatEnv, GSM8KEnv, PythonInterpreter, make_env
from rlpost.envs.arithmetic import ARITHMETIC_SYSTEM_PROMPT, make_arithmetic_rows
from rlpost.envs.tasks import GSM8K_SYSTEM_PROMPT, UserReward

pytestmark = pytest.mark.unit

GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
        "clips in May. How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 "
        "clips altogether in April and May.\n#### 72",
    },
    {
        "question": "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts "
        "in total does it take?",
        "answer": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total is 2+1=<<2+1=3>>3 bolts\n#### 3",
    },
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she did 50 minutes. How much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned "
        "0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
    },
]


@pytest.fixture
def gsm8k_file(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in GSM8K_ROWS))
    return path


def respond(env, td, completions: list[str]):
    """Act as the policy (history mode): append one assistant message per env, then step."""
    prompt = td["history"].prompt
    k = prompt.batch_size[0]
    reply = History(role=["assistant"] * k, content=completions, batch_size=[k])
    td.set("history", ChatHistory(prompt=prompt, full=prompt.append(reply, inplace=False), batch_size=[k]))
    return env.step_and_maybe_reset(td)


def target_of(answer_field: str) -> str:
    return answer_field.rsplit("####", 1)[1].strip()


# ---------------------------------------------------------------------------- GSM8K


def test_gsm8k_prompt_has_the_answer_format_system_prompt(gsm8k_file):
    env = GSM8KEnv(dataset=gsm8k_file, num_envs=2, seed=0)
    chats = env.reset()["history"].prompt.to_chats()
    assert chats[0][0] == {"role": "system", "content": GSM8K_SYSTEM_PROMPT}
    assert "<think>" in GSM8K_SYSTEM_PROMPT and "<answer>" in GSM8K_SYSTEM_PROMPT
    assert env.max_steps == 1  # one answer per episode by default, as in TorchRL


def test_gsm8k_reward_table_through_the_env(gsm8k_file):
    env = GSM8KEnv(dataset=gsm8k_file, num_envs=4, repeats=4, seed=0, max_steps=3)
    td = env.reset()
    target = target_of(td["answer"][0])
    completions = [
        f"<think>work it out</think><answer>{target}</answer>",  # correct: 1.0
        f"<think>work it out</think><answer>{int(target) + 1}</answer>",  # wrong, tag present: 0.1
        f"The answer is {target}.",  # no tag: 0.0
        f"<think>money</think><answer> ${target}.00 </answer>",  # correct once normalised: 1.0
    ]
    stepped, _ = respond(env, td, completions)
    nxt = stepped["next"]
    assert nxt["reward"].view(-1).tolist() == pytest.approx([1.0, 0.1, 0.0, 1.0])
    # the episode ends when an answer appears; without one it goes on (max_steps=3)
    assert nxt["terminated"].view(-1).tolist() == [True, True, False, True]
    assert nxt["done"].view(-1).tolist() == [True, True, False, True]
    assert env.reward_errors == Counter()


def test_gsm8k_answer_in_a_later_turn_ends_the_episode(gsm8k_file):
    env = GSM8KEnv(dataset=gsm8k_file, num_envs=1, seed=0, max_steps=3)
    td = env.reset()
    first_prompt_id = td["prompt_id"].item()
    stepped, td = respond(env, td, ["<think>still thinking"])
    assert stepped["next", "reward"].item() == 0.0 and not stepped["next", "done"].item()
    stepped, td = respond(env, td, [f"<answer>{target_of(td['answer'][0])}</answer>"])
    assert stepped["next", "reward"].item() == 1.0 and stepped["next", "done"].item()
    assert td["prompt_id"].item() == first_prompt_id + 1  # the next root is a new prompt
    assert td["step_count"].item() == 0


def test_malformed_gsm8k_row_gives_zero_and_is_counted(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "no final answer"}) + "\n")
    env = GSM8KEnv(dataset=path)
    stepped, _ = respond(env, env.reset(), ["<answer>1</answer>"])
    assert stepped["next", "reward"].item() == 0.0
    assert env.reward_errors == Counter({"ValueError": 1})


# ---------------------------------------------------------------------------- arithmetic


def test_arithmetic_env_rewards_the_generated_rows():
    env = ArithmeticEnv(num_rows=50, num_envs=3, seed=2)
    td = env.reset()
    rows = make_arithmetic_rows(50, seed=2)
    assert all(row in rows for row in td["row"])
    assert td["history"].prompt.to_chats()[0][0] == {"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT}
    answers = td["answer"]
    stepped, _ = respond(env, td, [f"<answer>{answers[0]}</answer>", "<answer>x</answer>", "I don't know"])
    assert stepped["next", "reward"].view(-1).tolist() == pytest.approx([1.0, 0.1, 0.0])
    assert stepped["next", "done"].all()  # max_steps=1


# ---------------------------------------------------------------------------- user rewards


def test_raising_user_reward_gives_zero_is_counted_and_never_stops_the_env():
    rows = [{"question": "q", "answer": "1"}]
    env = DatasetChatEnv(dataset=rows, num_envs=3, max_steps=1).append_transform(UserReward(flaky_reward))
    for _ in range(2):
        stepped, _ = respond(env, env.reset(), ["fine", "boom", "nan"])
        assert stepped["next", "reward"].view(-1).tolist() == [1.25, 0.0, 0.0]
    assert env.reward_errors == Counter({"ZeroDivisionError": 2, "NonFiniteReward": 2})


def test_user_reward_from_a_dotted_path_adds_to_the_task_reward(tmp_path, monkeypatch):
    (tmp_path / "task_user_rewards.py").write_text(
        textwrap.dedent(
            """
            def brevity(completion, row):
                return 0.5 if len(completion) < 30 else 0.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = ArithmeticEnv(num_rows=10, num_envs=2, seed=0).append_transform(UserReward("task_user_rewards:brevity"))
    td = env.reset()
    stepped, _ = respond(env, td, [f"<answer>{td['answer'][0]}</answer>", "x" * 40])
    assert stepped["next", "reward"].view(-1).tolist() == pytest.approx([1.5, 0.0])


# ---------------------------------------------------------------------------- make_env


def config(**data):
    return validate_config({"data": data, "rollout": {"max_turns": data.pop("max_turns", 1)}})


def test_make_env_arithmetic_defaults(tiny_tokenizer):
    cfg = config(group_size=4, seed=3, num_synthetic_rows=20, system_prompt="Custom.")
    env = make_env(cfg, tiny_tokenizer, batch_size=8)
    assert isinstance(env, ArithmeticEnv) and env.batch_size == torch.Size([8])
    assert env.primer.repeats == 4 and env.primer.seed == 3 and len(env.primer) == 20
    assert env.max_steps == 1
    td = env.reset()
    assert td["prompt_id"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert td["history"].prompt.to_chats()[0][0]["content"] == "Custom."


def test_make_env_gsm8k_from_a_local_file(gsm8k_file, tiny_tokenizer):
    cfg = config(task="gsm8k", dataset=str(gsm8k_file), group_size=2, max_turns=3)
    env = make_env(cfg, tiny_tokenizer, batch_size=2, input_mode="text")
    assert isinstance(env, GSM8KEnv) and env.max_steps == 3 and env.input_mode == "text"
    assert env.reset()["text"].prompt[0].startswith(f"<|im_start|>system\n{GSM8K_SYSTEM_PROMPT}<|im_end|>")


def test_make_env_custom_task_with_reward_fn(tmp_path, monkeypatch, tiny_tokenizer):
    source = "def score(completion, row):\n    return float(row['label'] in completion)\n"
    (tmp_path / "custom_reward.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    data_file = tmp_path / "data.jsonl"
    data_file.write_text(json.dumps({"prompt": "say yes", "label": "yes"}) + "\n")
    cfg = config(task="custom", dataset=str(data_file), prompt_column="prompt", answer_column="label",
                 reward_fn="custom_reward:score", group_size=2)  # fmt: skip
    env = make_env(cfg, tiny_tokenizer, batch_size=2)
    stepped, _ = respond(env, env.reset(), ["yes", "no"])
    assert stepped["next", "reward"].view(-1).tolist() == [1.0, 0.0]


def test_make_env_reports_data_mistakes_as_config_errors(gsm8k_file, tiny_tokenizer):
    cfg = config(task="gsm8k", dataset=str(gsm8k_file), prompt_column="problem", group_size=2)
    with pytest.raises(ConfigError, match="'problem'.*gsm8k.jsonl"):
        make_env(cfg, tiny_tokenizer, batch_size=2)
    cfg = config(reward_fn="no_such_module_xyz:fn", group_size=2)
    with pytest.raises(ConfigError, match="no_such_module_xyz"):
        make_env(cfg, tiny_tokenizer, batch_size=2)


def test_tools_compose_with_a_task():
    env = ArithmeticEnv(num_rows=5, max_steps=2).append_transform(PythonInterpreter(timeout_s=5.0))
    td = env.reset()
    stepped, td = respond(env, td, ["```python\nprint(6 * 7)\n```"])
    assert not stepped["next", "done"].item() and stepped["next", "reward"].item() == 0.0
    last = td["history"].prompt.to_chats()[0][-1]
    assert last == {"role": "tool", "content": "Code block 1 executed successfully:\n42\n"}


def test_text_mode_reward_ignores_the_end_of_turn_marker(tiny_tokenizer):
    """vLLM stops at "</answer>" (stripped) or at EOS (kept when decoding with special tokens)."""
    env = ArithmeticEnv(num_rows=10, num_envs=2, seed=0, tokenizer=tiny_tokenizer, input_mode="text")
    td = env.reset()
    prompts, answers = td["text"].prompt, td["answer"]
    responses = [f"<answer>{answers[0]}<|im_end|>", f"<think>hm</think><answer>{answers[1]}</answer><|im_end|>"]
    full = [p + r for p, r in zip(prompts, responses)]
    td.set("text", Text(prompt=prompts, response=responses, full=full, batch_size=[2]))
    stepped, _ = env.step_and_maybe_reset(td)
    assert stepped["next", "reward"].view(-1).tolist() == [1.0, 1.0]
