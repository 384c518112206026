"""TorchRL's GSM8K tests and documented examples (``TestGSM8K`` in TorchRL's LLM env tests, the
``GSM8KEnv`` / ``GSM8KRewardParser`` / ``make_gsm8k_env`` API reference), run against rlpost.

Substitutions: rlpost's imports, the offline tiny model's tokenizer (ChatML, like the Qwen
tokenizer TorchRL uses) and a local GSM8K-format file (``tests/data/gsm8k_sample.jsonl``) instead
of the hub dataset. rlpost's envs have no ``check_env_specs`` and its ``rollout`` needs a policy
(a chat env has no random action), so the tests roll out with a scripted policy. Where rlpost
deliberately deviates, the test says so and asserts rlpost's behaviour.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlpost.data import ChatHistory, History
from rlpost.envs import GSM8KEnv, GSM8KPrepareQuestion, GSM8KRewardParser, make_gsm8k_env
from rlpost.envs.gsm8k import BASE_PROMPT

pytestmark = pytest.mark.compat

DATA = Path(__file__).resolve().parents[1] / "data" / "gsm8k_sample.jsonl"
# the response of TorchRL's test_gsm8kenv and of the GSM8KEnv docstring
RESPONSE = (
    "<think>First, calculate the total number of snakes in the breeding balls. There are 3 breeding balls with 8 "
    "snakes each, so 3 * 8 = 24 snakes. Next, calculate the number of snakes in the additional pairs. There are 6 "
    "pairs of snakes, and each pair has 2 snakes, so 6 * 2 = 12 snakes. Finally, add the number of snakes from the "
    "breeding balls and the additional pairs: 24 + 12 = 36 snakes.</think> <answer>Mary saw a total of 36 "
    "snakes.</answer><|im_end|>"
)


@pytest.fixture
def snakes_file(tmp_path):
    """The sample's snakes question (answer 36) alone, so the documented response is graded
    against the question it answers."""
    path = tmp_path / "snakes.jsonl"
    path.write_text(DATA.read_text().splitlines()[0] + "\n")
    assert json.loads(path.read_text())["answer"].endswith("#### 36")
    return path


def answering_policy(td):
    """A scripted policy (history mode): answers 36 with the expected format."""
    prompt = td["history"].prompt
    k = prompt.batch_size[0]
    reply = History(role=["assistant"] * k, content=["<think>24 + 12</think> <answer>36</answer>"] * k, batch_size=[k])
    td.set("history", ChatHistory(prompt=prompt, full=prompt.append(reply, inplace=False), batch_size=[k]))
    return td


# ---------------------------------------------------------------------------- TestGSM8K


@pytest.mark.filterwarnings("ignore:This constructor is to be deprecated")
@pytest.mark.parametrize("n_envs", [1, 4])
def test_env(n_envs):
    """TestGSM8K.test_env: make_gsm8k_env without a tokenizer warns; a rollout stops after one
    step, or goes on for 3 with break_when_any_done=False. Deviation: ``("next", "reward")`` is
    there, all zeros (a ChatEnv always writes it), and no reward field is added."""
    with pytest.warns(UserWarning, match="No tokenizer specified"):
        env = make_gsm8k_env(num_envs=n_envs, dataset=str(DATA))
    r = env.rollout(3, answering_policy)
    assert r.numel() == n_envs
    assert (r["next", "reward"] == 0).all() and ("next", "reward_answer") not in r.keys(include_nested=True)
    r = env.rollout(3, answering_policy, break_when_any_done=False)
    assert r.numel() == n_envs * 3
    assert (r["next", "reward"] == 0).all()


@pytest.mark.parametrize("n_envs", [1, 4])
def test_env_reward(n_envs, tiny_tokenizer):
    """TestGSM8K.test_env_reward: with a tokenizer the reward is assigned. Deviation: its shape is
    ``(n_envs, 3, 1)`` (TorchRL: ``(n_envs, 3, 1, 1)``)."""
    with pytest.warns(UserWarning, match="to be deprecated"):
        env = make_gsm8k_env(num_envs=n_envs, tokenizer=tiny_tokenizer, dataset=str(DATA))
    r = env.rollout(3, answering_policy)
    assert ("next", "reward") in r.keys(include_nested=True)
    assert r.numel() == n_envs
    r = env.rollout(3, answering_policy, break_when_any_done=False)
    assert r.numel() == n_envs * 3
    assert r["next", "reward"].shape == (n_envs, 3, 1)


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray cluster for TorchRL's ray_backend=True case (stopped after this module when
    this fixture started it)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, namespace="rlpost-compat")
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.parametrize("device", [None, torch.device("cpu")], ids=["none", "cpu"])
@pytest.mark.parametrize(
    "ray_backend", [False, pytest.param(True, marks=pytest.mark.long)], ids=["local", "ray"]
)  # ray: a Ray cluster starts in this tier (~10 s); the integration tier tests the shared stream
def test_gsm8kenv(ray_backend, device, tiny_tokenizer, snakes_file, request):
    """TestGSM8K.test_gsm8kenv: reset gives a (1, 2) prompt history; the documented response,
    parsed back from the rendered chat, ends the episode with a reward. With ray_backend=True the
    prompts come from the shared data-loading actor ``gsm8k_dataloader``. Deviation: the answer
    "Mary saw a total of 36 snakes." is right through math-verify (reward 1.0); TorchRL's string
    comparison gives it the format reward 0.1."""
    if ray_backend:
        ray = request.getfixturevalue("local_ray")
    env = GSM8KEnv(tokenizer=tiny_tokenizer, apply_template=True, ray_backend=ray_backend, device=device,
                   dataset=str(snakes_file))  # fmt: skip
    if ray_backend:
        assert ray.get_actor("gsm8k_dataloader") is not None
    r = env.reset()
    assert r.device == device
    assert "history" in r
    assert r["history"].prompt.shape == (1, 2)
    r = r.clone()
    text = r["history"].prompt[0].apply_chat_template(tokenizer=tiny_tokenizer, add_generation_prompt=True) + RESPONSE
    history_full = History.from_text(text).unsqueeze(0)
    assert history_full.shape[-1] == 3
    r["history"].full = history_full
    s = env.step(r)
    assert s.device == device
    assert s["next", "reward"] > 0
    assert s["next", "done"].all()
    assert (s["next", "reward_answer"].item(), s["next", "reward_think"].item()) == (1.0, 1.0)
    assert s["next", "reward"].item() == 1.0 and s["next", "success"].item()


def test_gsm8kenv_docstring_example_with_the_text_response_key(tiny_tokenizer, snakes_file):
    """GSM8KEnv's docstring: the action under TorchRL 0.9's ``"text_response"`` key; the step
    adds the reward fields and ends the episode. Deviation: the fields are ``[1, 1]`` (TorchRL's
    listing shows ``[1, 1, 1]``) and there is no ``reward_contained`` (TorchRL's current parser
    dropped it too)."""
    env = GSM8KEnv(tokenizer=tiny_tokenizer, apply_template=True, dataset=str(snakes_file))
    r = env.reset()
    assert r["history"].prompt.shape == (1, 2)  # an instruction (role="system") and a question (role="user")
    assert r["history"].prompt.to_chats()[0][0] == {"role": "system", "content": GSM8KEnv.SYSTEM_PROMPT}
    r = r.clone()
    r["text_response"] = [RESPONSE]
    s = env.step(r)
    for key in ("reward", "reward_answer", "reward_right", "reward_think", "success"):
        assert s["next", key].shape == (1, 1)
    assert s["next", "success"].dtype == torch.bool
    assert s["next", "done"].all()
    assert s["next", "history"].prompt.to_chats()[0][-1] == {
        "role": "assistant",
        "content": RESPONSE[: -len("<|im_end|>")],
    }


# ---------------------------------------------------------------------------- the API reference


def test_gsm8k_reward_parser_signature_and_grpo_convention():
    """GSM8KRewardParser's reference: TorchRL's arguments, its default out_keys, and "1.0 if the
    extracted answer matches the ground truth, format_reward (0.1) with a valid <answer> tag but a
    wrong answer, 0.0 otherwise"."""
    parameters = inspect.signature(GSM8KRewardParser).parameters
    assert list(parameters)[:8] == [
        "tokenizer", "in_keys", "out_keys", "eos_token", "set_done_if_answer", "input_mode", "format_reward",
        "correct_reward",
    ]  # fmt: skip
    assert parameters["format_reward"].default == 0.1 and parameters["correct_reward"].default == 1.0
    parser = GSM8KRewardParser(tokenizer=None)
    assert parser.out_keys == ["reward_answer", "reward_think", "reward_right", "reward", "success"]
    rewards = [parser.score(c, "#### 36")["reward"] for c in ("<answer>36</answer>", "<answer>35</answer>", "36")]
    assert rewards == pytest.approx([1.0, 0.1, 0.0])
    assert GSM8KRewardParser.extract_tags("<think>x</think> <answer>36</answer>") == ("x", "36")
    assert GSM8KRewardParser.normalize_answer("120.0") == "120"


def test_gsm8k_reward_parser_in_text_mode_reads_the_text_response(tiny_tokenizer, snakes_file):
    """The parser "automatically detects the input_mode from the parent environment": in text
    mode the response is ``("text", "response")``."""
    env = GSM8KEnv(tokenizer=tiny_tokenizer, input_mode="text", dataset=str(snakes_file), num_envs=2)
    r = env.reset()
    responses = ["<think>t</think> <answer>36</answer><|im_end|>", "<answer>12</answer><|im_end|>"]
    r["text"].response = responses
    r["text"].full = [prompt + response for prompt, response in zip(r["text"].prompt, responses)]
    s = env.step(r)
    assert s["next", "reward"].view(-1).tolist() == pytest.approx([1.0, 0.1])


def test_make_gsm8k_env_signature_and_prompt():
    """make_gsm8k_env's reference (TorchRL's arguments and defaults) and GSM8KPrepareQuestion: the
    question under ``"text"`` becomes ``BASE_PROMPT % question``."""
    parameters = inspect.signature(make_gsm8k_env).parameters
    assert list(parameters) == ["dataset", "num_envs", "repeats", "batch_size_dl", "seed", "group_repeats", "tokenizer"]
    assert parameters["dataset"].default == "openai/gsm8k" and parameters["batch_size_dl"].default == 1
    with pytest.warns(UserWarning):
        env = make_gsm8k_env(dataset=str(DATA), seed=1)
    text = env.reset()["text"][0]
    assert text.startswith("A conversation between User and Assistant. The user asks a question")
    assert text.endswith(". Assistant: <think>") and "User: " in text
    prepare = GSM8KPrepareQuestion()
    assert prepare.prepare("What is 2 + 2?") == BASE_PROMPT % "What is 2 + 2?"


def test_gsm8kenv_keywords():
    """GSM8KEnv's reference lists these keywords, in this order."""
    names = list(inspect.signature(GSM8KEnv).parameters)
    torchrl_keywords = [
        "dataset", "shuffle", "num_envs", "repeats", "batch_size_dl", "seed", "group_repeats", "tokenizer",
        "device", "template_kwargs", "apply_template", "compute_reward", "collate_fn", "max_steps", "input_mode",
        "ray_backend",
    ]  # fmt: skip
    assert names[: len(torchrl_keywords)] == torchrl_keywords


def test_gsm8kenv_with_torchrl_s_gsm8k_collate_fn():
    """GSM8KEnv's ``collate_fn``: TorchRL's own GSM8K collate stacks the rows into a TensorDict and
    renames ``question`` to ``query``."""

    def collate_fn(batch):
        batch = torch.stack([TensorDict.from_dict(row) for row in batch])
        batch.rename_key_("question", "query")
        return batch

    env = GSM8KEnv(dataset=str(DATA), num_envs=2, batch_size_dl=2, collate_fn=collate_fn, shuffle=False)
    questions = [json.loads(line)["question"] for line in DATA.read_text().splitlines()[:2]]
    assert [chat[-1]["content"] for chat in env.reset()["history"].prompt.to_chats()] == questions
