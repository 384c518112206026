"""TorchRL's MLGym env (``torchrl.envs.llm.make_mlgym`` / ``MLGymWrapper``), used as a TorchRL user would.

TorchRL's tests (``test/llm/test_mlgym.py``) build ``make_mlgym(task=..., tokenizer=...,
device=...)`` or ``make_mlgym(tasks=[...], ...)`` and roll it out with a
``TransformersWrapper`` policy. Here MLGym itself (a container runtime, not on PyPI) is replaced
by the MLGym-shaped stand-in of ``tests/fake_mlgym.py``, installed as the ``mlgym`` and
``gymnasium`` modules that ``make_mlgym`` imports, and the policy is the offline tiny model in
history mode (TorchRL's test uses its 0.8 ``from_text=True`` API, which rlpost does not have).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from fake_mlgym import install_fake_mlgym
from tensordict import TensorDict

from rlpost.data import History
from rlpost.envs import MLGymWrapper, make_mlgym
from rlpost.envs.mlgym import parse_command
from rlpost.policies import ChatHistory, TransformersWrapper

pytestmark = pytest.mark.compat


@pytest.fixture
def fake_mlgym(monkeypatch, tmp_path):
    return install_fake_mlgym(monkeypatch, tmp_path)


@pytest.fixture
def policy(hf_model, tiny_tokenizer):
    return TransformersWrapper(
        hf_model,
        tokenizer=tiny_tokenizer,
        input_mode="history",
        generate=True,
        generate_kwargs={"max_new_tokens": 8},
    )


def test_public_names_and_signature():
    """``from torchrl.envs.llm import make_mlgym, MLGymWrapper``; make_mlgym's documented
    keyword-only arguments and defaults."""
    import rlpost.envs.mlgym as libs_mlgym

    assert libs_mlgym.make_mlgym is make_mlgym and libs_mlgym.MLGymWrapper is MLGymWrapper
    params = inspect.signature(make_mlgym).parameters
    assert [(p.name, p.kind, p.default) for p in params.values()] == [
        ("task", inspect.Parameter.KEYWORD_ONLY, None),
        ("tasks", inspect.Parameter.KEYWORD_ONLY, None),
        ("tokenizer", inspect.Parameter.KEYWORD_ONLY, None),
        ("device", inspect.Parameter.KEYWORD_ONLY, "cpu"),
        ("reward_wrong_format", inspect.Parameter.KEYWORD_ONLY, None),
    ]


def test_task_and_tasks_are_exclusive():
    """Documented: "task ... Exclusive with tasks argument" (and one of them is needed)."""
    with pytest.raises(ValueError):
        make_mlgym(task="prisonersDilemma", tasks=["prisonersDilemma"])
    with pytest.raises(ValueError):
        make_mlgym()


def test_mlgym_specs(fake_mlgym, policy, tiny_tokenizer):
    """TorchRL's ``test_mlgym_specs``: ``env.rollout(3, policy)`` over
    ``make_mlgym(task="prisonersDilemma", tokenizer=tokenizer, device=...)``."""
    env = make_mlgym(task="prisonersDilemma", tokenizer=tiny_tokenizer, device="cpu")
    with torch.no_grad():
        rollout = env.rollout(3, policy)
    assert rollout.batch_size == torch.Size([1, 3])  # the tiny model writes no command: never done
    for step in rollout.unbind(1):
        prompt = step["history"].prompt.to_chats()[0]
        response = step["history"].response.to_chats()[0][-1]["content"]
        assert response == step["history"].full.to_chats()[0][-1]["content"]
        command = parse_command(response)
        assert step["retry"].tolist() == [[command is None]]
        nxt = step["next"]
        chat = nxt["history"].prompt.to_chats()[0]
        assert chat[: len(prompt)] == prompt and len(chat) == len(prompt) + 2
        assert chat[-2] == {"role": "assistant", "content": response}
        assert chat[-1] == {"role": "user", "content": nxt["message"].tolist()[0]}
        assert nxt["reward"].shape == (1, 1) and nxt["reward"].dtype == torch.float32
        for flag in ("done", "terminated", "truncated"):
            assert nxt[flag].shape == (1, 1) and nxt[flag].dtype == torch.bool
        rendered = nxt["text"].prompt.tolist()[0]
        assert rendered == nxt["history"].prompt.apply_chat_template(tokenizer=tiny_tokenizer)[0]
    assert fake_mlgym.envs[0].actions == [c for c in map(parse_command, responses(rollout)) if c]


def responses(rollout: TensorDict) -> list[str]:
    return [step["history"].response.to_chats()[0][-1]["content"] for step in rollout.unbind(1)]


def test_mlgym_task_reset(fake_mlgym, tiny_tokenizer):
    """TorchRL's ``test_mlgym_task_reset``: with ``tasks=[...]`` and
    ``break_when_any_done=False``, episodes restart on drawn tasks ("We should get at least two
    tasks"). The policy submits at once, so that every step ends an episode (the tiny model
    never would)."""
    env = make_mlgym(
        tasks=["prisonersDilemma", "regressionKaggleHousePrice", "battleOfSexes"], tokenizer=tiny_tokenizer
    )
    env.set_seed(0)

    def submit(td):
        chats = [chat + [{"role": "assistant", "content": "Done.\n```\nsubmit\n```"}] for chat in env.prompt_rows(td)]
        td.set("history", ChatHistory(prompt=td["history"].prompt, full=History.from_chats(chats), batch_size=[1]))
        return td

    rollout = env.rollout(10, submit, break_when_any_done=False)
    assert rollout.batch_size == torch.Size([1, 10]) and rollout["next", "done"].all()
    tasks = [step["task"].tolist()[0] for step in rollout.unbind(1)]
    assert len(set(tasks)) >= 2
    assert set(tasks) <= {"prisonersDilemma", "regressionKaggleHousePrice", "battleOfSexes"}


def test_mlgym_wrong_format(fake_mlgym, policy, tiny_tokenizer):
    """TorchRL's ``test_mlgym_wrong_format`` (empty there): "A vanilla policy will not output
    anything useful, yet the env should run without error"; with ``reward_wrong_format`` the
    unparseable responses are penalised."""
    env = make_mlgym(task="prisonersDilemma", tokenizer=tiny_tokenizer, reward_wrong_format=-1.0)
    with torch.no_grad():
        rollout = env.rollout(2, policy)
    retry = rollout["retry"].view(-1)
    expected = torch.where(retry, -1.0, 0.0)
    assert torch.equal(rollout["next", "reward"].view(-1), expected)
