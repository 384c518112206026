"""Every name TorchRL's LLM code imports from ``torchrl.envs`` (and its submodules) resolves under
``rlpost.torchrl.envs`` to rlpost's own object, not a placeholder.

The import lines below are those of TorchRL at ae9719f, with ``torchrl`` replaced by
``rlpost.torchrl``: its GRPO and expert-iteration scripts (sota-implementations/grpo,
expert-iteration), its LLM tests (test/llm), its LLM tutorials (llm_browser, llm_wrappers) and
examples (examples/llm), and the examples of its LLM docs and docstrings (the Compose /
TransformedEnv line is ExecuteToolsInOrder's docstring example). Then two of those examples run as
written: a TransformedEnv with a Compose of tool transforms, and IncrementalTokenizer's.
"""

from __future__ import annotations

import importlib

import pytest
from tensordict import TensorDict, set_list_to_stack

from rlpost.data import History
from rlpost.torchrl.tree import NotInRlpost

pytestmark = pytest.mark.compat

# (TorchRL module, names, where TorchRL imports them)
IMPORTS = [
    ("torchrl.envs", ["AsyncEnvPool"], "test/llm/test_llm_collectors.py, test/llm/test_llm_envs.py"),
    ("torchrl.envs", ["SerialEnv"], "test/llm/libs/test_mlgym.py"),
    ("torchrl.envs", ["StepCounter"], "test/llm/test_llm_collectors.py"),
    ("torchrl.envs", ["Transform"], "tutorials/sphinx-tutorials/llm_browser.py"),
    ("torchrl.envs", ["Compose", "TransformedEnv"], "the issue's example; both are torchrl.envs exports"),
    ("torchrl.envs", ["TransformedEnv"], "IncrementalTokenizer's docstring"),
    ("torchrl.envs", ["LLMHashingEnv"], "LLMHashingEnv's docstring"),
    ("torchrl.envs", ["EnvBase"], "torchrl/envs/llm/chat.py"),
    ("torchrl.envs.common", ["EnvBase"], "torchrl/envs/llm/reward/*.py"),
    ("torchrl.envs.transforms", ["TransformedEnv"], "examples/llm/tool_service_example.py, test_llm_transforms.py"),
    ("torchrl.envs.transforms", ["TransformedEnv", "Compose"], "ExecuteToolsInOrder's docstring"),
    ("torchrl.envs.transforms", ["Transform"], "torchrl/data/llm/topk.py"),
    ("torchrl.envs.transforms.transforms", ["Transform", "Compose"], "torchrl/envs/llm/transforms/kl.py"),
    ("torchrl.envs.llm", ["AddThinkingPrompt", "GSM8KEnv", "KLRewardTransform", "RetrieveKL"], "grpo_utils.py"),
    ("torchrl.envs.llm", ["RetrieveLogProb"], "expert-iteration/ei_utils.py"),
    ("torchrl.envs.llm", ["ChatEnv"], "examples/llm/*.py, test/llm, llm_browser.py"),
    ("torchrl.envs.llm", ["make_gsm8k_env"], "test/llm/test_llm_envs.py"),
    ("torchrl.envs.llm", ["make_mlgym"], "test/llm/libs/test_mlgym.py"),
    ("torchrl.envs.llm", ["DataLoadingPrimer", "Tokenizer"], "the LLM docs"),
    ("torchrl.envs.llm.chat", ["ChatEnv"], "test/llm/test_llm_collectors.py"),
    ("torchrl.envs.llm.chat", ["DatasetChatEnv"], "torchrl/envs/llm/datasets/*.py"),
    ("torchrl.envs.llm.envs", ["LLMEnv"], "torchrl/envs/llm/datasets/gsm8k.py"),
    ("torchrl.envs.llm.datasets", ["IFEvalEnv"], "IFEvalEnv's docstring"),
    ("torchrl.envs.llm.datasets.countdown", ["CountdownEnv"], "grpo_utils.py, ei_utils.py"),
    ("torchrl.envs.llm.datasets.gsm8k", ["GSM8KEnv"], "GSM8KEnv's docstring"),
    ("torchrl.envs.llm.datasets.ifeval", ["IFEvalEnv"], "grpo_utils.py, ei_utils.py, test_llm_envs.py"),
    ("torchrl.envs.llm.datasets.math", ["MATHEnv"], "grpo_utils.py, ei_utils.py"),
    ("torchrl.envs.llm.reward.countdown", ["CountdownRewardParser"], "test/llm/test_llm_envs.py"),
    ("torchrl.envs.llm.reward.gsm8k", ["GSM8KRewardParser"], "test/llm/test_llm_envs.py"),
    ("torchrl.envs.llm.reward.ifeval", ["IfEvalScorer"], "the LLM docs"),
    ("torchrl.envs.llm.reward.ifeval._scorer", ["IFEvalScoreData", "IfEvalScorer"], "test/llm/test_llm_envs.py"),
    ("torchrl.envs.llm.reward.math", ["MATHRewardParser"], "test/llm/test_llm_envs.py"),
    ("torchrl.envs.llm.transforms", ["AddThinkingPrompt", "MCPToolTransform", "PythonInterpreter"], "test_llm_envs.py"),
    (
        "torchrl.envs.llm.transforms",
        ["ExecuteToolsInOrder", "IncrementalTokenizer", "JSONCallParser", "PolicyVersion", "ToolCall"],
        "test/llm/test_llm_transforms.py",
    ),
    ("torchrl.envs.llm.transforms", ["ToolRegistry", "XMLBlockParser"], "examples/llm/tool_service_example.py"),
    ("torchrl.envs.llm.transforms", ["SimpleToolTransform"], "examples/llm/web_search_tool.py"),
    ("torchrl.envs.llm.transforms", ["RetrieveLogProb"], "DistillationLoss's docstring"),
    ("torchrl.envs.llm.transforms.browser", ["BrowserTransform"], "tutorials/sphinx-tutorials/llm_browser.py"),
    ("torchrl.envs.llm.transforms.dataloading", ["DataLoadingPrimer", "RayDataLoadingPrimer"], "chat.py"),
    ("torchrl.envs.llm.transforms.kl", ["KLComputation", "RetrieveKL", "RetrieveLogProb"], "test/llm/test_wrapper.py"),
    ("torchrl.envs.llm.transforms.policy_version", ["PolicyVersion"], "torchrl/collectors/llm/base.py"),
    ("torchrl.envs.llm.transforms.tokenizer", ["IncrementalTokenizer", "Tokenizer"], "torchrl/envs/llm/chat.py"),
    ("torchrl.envs.llm.transforms.tools", ["SimpleToolTransform"], "test/llm/test_llm_envs.py"),
]


def imported(module: str, names: list[str]) -> dict:
    """``from rlpost.<module> import <names>``, run as a ported script runs it."""
    namespace: dict = {}
    exec(f"from rlpost.{module} import {', '.join(names)}", namespace)  # noqa: S102
    return {name: namespace[name] for name in names}


@pytest.mark.parametrize(("module", "names", "where"), IMPORTS, ids=[f"{m}:{','.join(n)}" for m, n, _ in IMPORTS])
def test_the_name_is_rlposts_own_object(module, names, where):
    import rlpost.envs

    for name, value in imported(module, names).items():
        assert not isinstance(value, NotInRlpost), f"{module}.{name} (imported by {where}) is a placeholder: {value}"
        owner = importlib.import_module(value.__module__)
        assert getattr(owner, value.__name__) is value, (module, name)
        assert value.__module__.startswith("rlpost."), (module, name, value.__module__)
        if hasattr(rlpost.envs, name):  # one object whatever path it is imported from
            assert value is getattr(rlpost.envs, name), (module, name)


def test_the_issues_example_resolves():
    from rlpost.envs import Compose as RlpostCompose
    from rlpost.envs import TransformedEnv as RlpostTransformedEnv
    from rlpost.torchrl.envs import Compose, TransformedEnv

    assert Compose is RlpostCompose and TransformedEnv is RlpostTransformedEnv


class WebSearch:
    """The service of ExecuteToolsInOrder's docstring example."""

    name = "search"
    schema_in = {"query": str}
    schema_out = {"results": list}

    def __call__(self, query: str, **kwargs):
        return {"results": [{"title": "TorchRL docs", "url": "https://..."}]}


def test_execute_tools_in_order_docstring_with_a_compose():
    """ExecuteToolsInOrder's docstring, its transform in a Compose (``from torchrl.envs.transforms
    import TransformedEnv, Compose``), then one turn that calls the tool."""
    from rlpost.torchrl.envs.llm import ChatEnv
    from rlpost.torchrl.envs.llm.transforms import ExecuteToolsInOrder, ToolRegistry, XMLBlockParser
    from rlpost.torchrl.envs.transforms import Compose, TransformedEnv

    registry = ToolRegistry([WebSearch()])
    parser = XMLBlockParser()
    env = ChatEnv(batch_size=(1,))
    env = TransformedEnv(env, Compose(ExecuteToolsInOrder(registry=registry, parser=parser)))

    with set_list_to_stack(True):
        obs = env.reset(TensorDict({"query": "Find the TorchRL docs"}, batch_size=(1,)))
        reply = '<tool name="search">{"query": "torchrl"}</tool>'
        obs["history"].full = obs["history"].prompt.extend(History(role="assistant", content=reply).view(1, 1), dim=-1)
        out = env.step(obs)
    tool_messages = [m for m in out["next", "history"].prompt.to_chats()[0] if m["role"] == "tool"]
    assert len(tool_messages) == 1 and "TorchRL docs" in tool_messages[0]["content"]


def test_incremental_tokenizer_docstring(tiny_tokenizer):
    """IncrementalTokenizer's docstring (``from torchrl.envs import TransformedEnv``), with the
    offline tiny model's tokenizer for Qwen2.5's."""
    from rlpost.torchrl.envs import TransformedEnv
    from rlpost.torchrl.envs.llm import ChatEnv
    from rlpost.torchrl.envs.llm.transforms import IncrementalTokenizer

    env = ChatEnv(batch_size=(1,), tokenizer=tiny_tokenizer)
    env = TransformedEnv(env, IncrementalTokenizer(tiny_tokenizer))
    with set_list_to_stack(True):
        td = env.reset(TensorDict({"query": "Hello"}, batch_size=(1,)))
    assert ("tokens", "prompt") in td.keys(True, True)


def test_serial_env_of_chat_envs():
    """A SerialEnv of two ChatEnvs: batch ``[2, 1]``, row ``i`` is sub-env ``i``'s conversation,
    the specs are the sub-envs' with 2 in front, a rollout is ``[2, 1, T]``."""
    from functools import partial

    import torch

    from rlpost.torchrl.envs import SerialEnv
    from rlpost.torchrl.envs.llm import ChatEnv

    env = SerialEnv(2, partial(ChatEnv, batch_size=(1,), input_mode="history", system_prompt="sys"))
    assert env.batch_size == torch.Size([2, 1]) and env.input_mode == "history"
    spec = env.full_observation_spec
    assert spec.shape == torch.Size([2, 1]) and spec["history"].shape == torch.Size([2, 1])

    def reply(td):
        full = [
            td[i]["history"].prompt.extend(
                History(role="assistant", content=f"to {i}").view(1, 1), dim=-1, inplace=False
            )
            for i in range(2)
        ]
        td["history"].full = torch.stack(full)
        return td

    with set_list_to_stack(True):
        queries = TensorDict({"query": [["first"], ["second"]]}, batch_size=(2, 1))
        rollout = env.rollout(2, reply, tensordict=queries)
    assert rollout.batch_size == torch.Size([2, 1, 2])
    for i, query in enumerate(("first", "second")):
        chat = rollout["next", "history"].prompt[i, 0, -1].to_chats()
        assert chat[1] == {"role": "user", "content": query}
        assert chat[-1] == {"role": "assistant", "content": f"to {i}"} and len(chat) == 4
    with pytest.raises(ValueError, match="one row per sub-env"):
        env.reset(TensorDict({"query": ["only one"]}, batch_size=(1,)))
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        SerialEnv(1, partial(ChatEnv, batch_size=(1,)), not_an_option=True)


def test_serial_env_of_mlgym(monkeypatch, tmp_path, tiny_tokenizer):
    """TorchRL's MLGym tests build ``SerialEnv(1, [partial(make_mlgym, task=..., tokenizer=...,
    device=...)])`` and roll it out: here with the MLGym stand-in of tests/fake_mlgym.py and a
    policy that writes one command per turn (the tiny model would write none). The batch is
    ``[1, *sub-env batch]``, the rollout's ``[1, 1, 3]``; each step's command reaches the env."""
    from functools import partial

    import torch
    from fake_mlgym import install_fake_mlgym

    from rlpost.policies import ChatHistory
    from rlpost.torchrl.envs import SerialEnv
    from rlpost.torchrl.envs.llm import make_mlgym

    fake = install_fake_mlgym(monkeypatch, tmp_path)
    env = SerialEnv(1, [partial(make_mlgym, task="prisonersDilemma", tokenizer=tiny_tokenizer, device="cpu")])
    assert env.batch_size == torch.Size([1, 1])

    def ls(td):
        for i in range(td.batch_size[0]):
            row = td[i]
            chats = [chat + [{"role": "assistant", "content": "Look.\n```\nls\n```"}] for chat in env.prompt_rows(row)]
            full = History.from_chats(chats)
            row.set("history", ChatHistory(prompt=row["history"].prompt, full=full, batch_size=row.batch_size))
        return td

    rollout = env.rollout(3, ls)
    assert rollout.batch_size == torch.Size([1, 1, 3])
    assert fake.envs[0].actions == ["ls", "ls", "ls"]
    env.close()
