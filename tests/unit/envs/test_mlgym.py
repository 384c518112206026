"""MLGymWrapper / make_mlgym against a small MLGym-shaped env (tests/fake_mlgym.py): full episodes
driven by scripted assistant messages, task sampling, make_mlgym's use of MLGym, and the errors."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from fake_mlgym import STATE, FakeMLGymEnv, install_fake_mlgym
from tensordict import TensorDict

from rlpost.data import ChatHistory, History, Text
from rlpost.envs import MLGymWrapper, make_mlgym
from rlpost.envs.mlgym import EvaluationOutputParser, parse_command

pytestmark = pytest.mark.unit

SYSTEM = (
    "You are an autonomous ML researcher.\nCOMMANDS:\nvalidate:\n  docstring: scores your submission file\n"
    "submit:\n  docstring: ends the task\nWINDOW: 100"
)
STATE_LINES = "(Open file: n/a)\n(Current directory: /home/agent/workspace)\nbash-$"
TASK = "TASK: Predict the sale price of each house in data/test.csv."
NO_OUTPUT = "Your command ran successfully and did not produce any output."
VALIDATION = (
    "Your code produced a valid submission artefact at /home/agent/workspace/submission.csv.\n"
    "Baseline Score: {'Score': 1.0}\nEvaluation Score: {'Score': 1.75}"
)


def user_message(head: str, step: int, max_steps: int = 10) -> str:
    return f"{head}\n(Current Step: {step}, Remaining Steps: {max_steps - step})\n{STATE_LINES}"


def answer(td: TensorDict, *contents: str) -> TensorDict:
    """What a history-mode policy writes: ("history", "full") = prompt + one assistant message per row."""
    chats = td["history"].prompt.to_chats(include_state=True)
    full = History.from_chats([chat + [{"role": "assistant", "content": c}] for chat, c in zip(chats, contents)])
    td.set("history", ChatHistory(prompt=td["history"].prompt, full=full, batch_size=td.batch_size))
    return td


def strings(value) -> list[str]:
    return value.tolist() if hasattr(value, "tolist") else list(value)


# ---------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("response", "command"),
    [
        ("Let me look around.\n```\nls\n```", "ls"),
        ("DISCUSSION\nTrain first.\n\n```bash\npython train.py\n```\n", "python train.py"),
        ("```\nls\n```\nthen\n```\nvalidate\n```", "validate"),  # the last block
        ("```\nedit 1:2\n```python\nx = 1\n```\nend_of_edit\n```", "edit 1:2\n```python\nx = 1\n```\nend_of_edit"),
        ("no block at all", None),
        ("```\nls", None),  # never closed
        ("```\n\n```", None),  # blank
        ("", None),
    ],
)
def test_parse_command_reads_the_last_top_level_fenced_block(response, command):
    assert parse_command(response) == command


def test_evaluation_output_parser_reads_mlgym_validation_output():
    parser = EvaluationOutputParser()
    parsed = parser(VALIDATION + "\n(Current Step: 3, Remaining Steps: 7)\n" + STATE_LINES)
    assert parsed == {
        "submission_artefact_path": "/home/agent/workspace/submission.csv",
        "baseline_score": 1.0,
        "evaluation_score": 1.75,
        "current_step": 3,
        "remaining_steps": 7,
        "open_file": "n/a",
        "current_directory": "/home/agent/workspace",
    }
    assert parser.reward(VALIDATION) == pytest.approx(0.75)
    assert parser.reward("Epoch 1: loss 0.52") == 0.0
    assert parser.reward("Evaluation Score: {'Score': 2.5}") == 2.5  # no baseline counts as 0


def test_evaluation_output_parser_reads_scores_torchrl_cannot_convert():
    """Deviation: numpy 2 reprs and extra metrics (TorchRL's float() of the whole match fails)."""
    text = "Baseline Score: {'Score': np.float64(-0.5), 'rmse': 3}\nEvaluation Score: {'Score': 1e-1, 'rmse': 2}"
    assert EvaluationOutputParser()(text)["baseline_score"] == -0.5
    assert EvaluationOutputParser().reward(text) == pytest.approx(0.6)


# ---------------------------------------------------------------------------- reset


def test_reset_gives_the_system_and_task_messages():
    mlgym_env = FakeMLGymEnv()
    env = MLGymWrapper(mlgym_env)
    td = env.reset()
    assert td.batch_size == torch.Size([1])
    prompt = td["history"].prompt
    assert isinstance(td["history"], ChatHistory) and prompt.batch_size == torch.Size([1, 2])
    system, user = {"role": "system", "content": SYSTEM}, {"role": "user", "content": user_message(TASK, 0)}
    assert prompt.to_chats() == [[system, user]]
    assert strings(td["message"]) == [user_message(TASK, 0)]
    assert strings(td["observation"]) == [""]
    assert [json_loads(s) for s in strings(td["state"])] == [STATE]
    for flag in ("done", "terminated", "truncated"):
        assert td[flag].dtype == torch.bool and td[flag].shape == (1, 1) and not td[flag].any()
    assert "reward" not in td.keys() and "text" not in td.keys() and "task" not in td.keys()
    # What MLGym's agent setup sends: a fresh container, cd, the state command and variables.
    assert mlgym_env.num_container_resets == 1 and mlgym_env.num_resets == 1
    assert mlgym_env.communicated[0] == "cd /home/agent"
    setup = mlgym_env.communicated[1].splitlines()
    assert setup[0] == "state() {" and setup[-2:] == ['CURRENT_FILE=""', "CURRENT_LINE=0"]
    assert mlgym_env.communicated[2] == "state"
    assert mlgym_env.added_commands == [[]]


def json_loads(text: str):
    import json

    return json.loads(text)


def test_reset_keeps_the_input_keys_and_adds_the_strategy_template():
    mlgym_env = FakeMLGymEnv()
    mlgym_env.config.strategy_template = "STRATEGY: validate before you submit ({name})."
    td = MLGymWrapper(mlgym_env).reset(TensorDict({"episode": torch.tensor([7])}, batch_size=[1]))
    assert td["episode"].tolist() == [7]
    strategy = "STRATEGY: validate before you submit (Fake house prices)."
    assert strings(td["message"]) == [user_message(TASK, 0) + "\n" + strategy]


def test_reset_renders_the_prompt_with_a_tokenizer(tiny_tokenizer, tiny_model_path):
    for tokenizer in (tiny_tokenizer, str(tiny_model_path)):
        td = MLGymWrapper(FakeMLGymEnv(), tokenizer=tokenizer).reset()
        assert isinstance(td["text"], Text)
        expected = td["history"].prompt.apply_chat_template(tokenizer=tiny_tokenizer, add_generation_prompt=True)
        assert strings(td["text"].prompt) == expected
        assert expected[0].endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------------------- a whole episode


def test_scripted_episode_keys_messages_rewards_and_flags():
    mlgym_env = FakeMLGymEnv()
    env = MLGymWrapper(mlgym_env, reward_wrong_format=-0.5)
    td = env.reset()
    script = [
        # (assistant message, command sent, expected user message, reward, done)
        ("I'll look at the files.\n```\nls\n```", "ls", user_message(COMMAND_LS, 1), 0.0, False),
        ("I am not sure what to do.", None, user_message(COMMAND_LS, 1), -0.5, False),  # retry: no step
        ("Train.\n```bash\npython train.py\n```", "python train.py", user_message(TRAIN_OUT, 2), 0.0, False),
        ("```\ntouch notes.txt\n```", "touch notes.txt", user_message(NO_OUTPUT, 3), 0.0, False),
        ("Check the score.\n```\nvalidate\n```", "validate", user_message(VALIDATION, 4), 0.75, False),
        ("Good enough.\n```\nsubmit\n```", "submit", user_message("Exited (submit)", 5), 0.0, True),
    ]
    chat = td["history"].prompt.to_chats()[0]
    for turn, (response, command, message, reward, done) in enumerate(script):
        td = env.step(answer(td, response))
        nxt = td["next"]
        assert td["retry"].tolist() == [[command is None]]
        assert strings(td["action"]) == [command or ""]
        chat = chat + [{"role": "assistant", "content": response}, {"role": "user", "content": message}]
        assert nxt["history"].prompt.to_chats() == [chat], turn
        assert strings(nxt["message"]) == [message]
        assert nxt["reward"].dtype == torch.float32 and nxt["reward"].shape == (1, 1)
        assert nxt["reward"].tolist() == [[pytest.approx(reward)]], turn
        assert nxt["done"].tolist() == nxt["terminated"].tolist() == [[done]]
        assert nxt["truncated"].tolist() == [[False]]
        td = nxt.select("history", "observation", "state", "message", "done", "terminated", "truncated").clone()
    # The MLGym env saw the commands only (the retry was not sent), stripped of their fences.
    assert mlgym_env.actions == [c for _, c, *_ in script if c is not None]
    assert mlgym_env.current_step == 5


COMMAND_LS = "data\nevaluate.py\ntrain.py"
TRAIN_OUT = "Epoch 1: loss 0.52\nSaved submission.csv"


def test_a_retry_repeats_the_latest_observation_and_is_not_rewarded_twice():
    env = MLGymWrapper(FakeMLGymEnv())
    td = env.step(answer(env.reset(), "```\nvalidate\n```"))
    assert td["next", "reward"].item() == pytest.approx(0.75)
    td = env.step(answer(td["next"].clone(), "hmm"))  # no command, no penalty set
    assert td["retry"].item() and td["next", "reward"].item() == 0.0
    assert strings(td["next", "observation"]) == [VALIDATION]
    assert strings(td["next", "message"]) == [user_message(VALIDATION, 1)]


def test_the_observation_of_a_step_is_shown_in_that_step():
    """Deviation: TorchRL's message of step t shows the observation of step t - 1."""
    env = MLGymWrapper(FakeMLGymEnv())
    td = env.step(answer(env.reset(), "```\nls\n```"))
    assert strings(td["next", "observation"]) == [COMMAND_LS]
    assert strings(td["next", "message"])[0].startswith(COMMAND_LS)


def test_state_changes_reach_the_message():
    env = MLGymWrapper(FakeMLGymEnv())
    td = env.step(answer(env.reset(), "```\nopen train.py\n```"))
    assert "(Open file: train.py)" in strings(td["next", "message"])[0]
    assert json_loads(strings(td["next", "state"])[0])["open_file"] == "train.py"


def test_a_chat_not_ending_with_the_assistant_gets_an_empty_assistant_message():
    env = MLGymWrapper(FakeMLGymEnv(), reward_wrong_format=-1)
    td = env.reset()
    td.set("history", ChatHistory(prompt=td["history"].prompt, full=td["history"].prompt, batch_size=[1]))
    td = env.step(td)
    assert td["retry"].item() and td["next", "reward"].item() == -1.0
    assert [m["role"] for m in td["next", "history"].prompt.to_chats()[0]] == ["system", "user", "assistant", "user"]
    assert td["next", "history"].prompt.to_chats()[0][2]["content"] == ""


def test_torchrl_text_response_action(tiny_tokenizer):
    """TorchRL's action key: the policy's text after the prompt, end-of-turn marker included."""
    mlgym_env = FakeMLGymEnv()
    env = MLGymWrapper(mlgym_env, tokenizer=tiny_tokenizer)
    td = env.reset()
    td["text_response"] = ["  Listing.\n```\nls\n```<|im_end|>"]
    td = env.step(td)
    assert mlgym_env.actions == ["ls"]
    assert td["text_response"] == ["  Listing.\n```\nls\n```<|im_end|>"]  # kept (TorchRL overwrites it)
    chat = td["next", "history"].prompt.to_chats()[0]
    assert chat[2] == {"role": "assistant", "content": "Listing.\n```\nls\n```"}
    rendered = strings(td["next", "text"].prompt)[0]
    assert "Listing.\n```\nls\n```<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")


def test_step_and_maybe_reset_restarts_finished_episodes():
    mlgym_env = FakeMLGymEnv()
    env = MLGymWrapper(mlgym_env)
    td = env.reset()
    td, root = env.step_and_maybe_reset(answer(td, "```\nls\n```"))
    assert root["history"].prompt.batch_size == torch.Size([1, 4]) and not root["done"].any()
    assert set(env.state_keys) <= set(root.keys()) | {"task"}
    td, root = env.step_and_maybe_reset(answer(root, "```\nsubmit\n```"))
    assert td["next", "done"].item()
    assert mlgym_env.num_resets == 2 and mlgym_env.current_step == 0
    assert root["history"].prompt.to_chats()[0][1]["content"] == user_message(TASK, 0)
    assert not root["done"].any() and "reward" not in root.keys()


def test_max_steps_ends_the_episode():
    env = MLGymWrapper(FakeMLGymEnv(max_steps=1))
    td = env.step(answer(env.reset(), "```\nls\n```"))
    assert not td["next", "done"].item()
    td = env.step(answer(td["next"].clone(), "```\nls\n```"))
    assert td["next", "done"].item() and td["next", "terminated"].item()


def test_one_mlgym_env_per_row():
    envs = [FakeMLGymEnv(), FakeMLGymEnv(score=3.0)]
    env = MLGymWrapper(envs, device="cpu")
    td = env.reset()
    assert td.batch_size == torch.Size([2]) and td["history"].prompt.batch_size == torch.Size([2, 2])
    td = env.step(answer(td, "```\nvalidate\n```", "no command"))
    assert td["retry"].tolist() == [[False], [True]]
    assert td["next", "reward"].tolist() == [[pytest.approx(0.75)], [0.0]]
    assert [e.actions for e in envs] == [["validate"], []]
    td = env.step(answer(td["next"].clone(), "```\nls\n```", "```\nvalidate\n```"))
    assert td["next", "reward"].tolist() == [[0.0], [pytest.approx(2.0)]]
    assert td["next", "reward"].device == torch.device("cpu")


def test_command_files_are_installed_as_mlgym_does(tmp_path):
    files = {"edit.sh": "edit() { :; }", "search": "#!/usr/bin/env python\nprint()", "_utils.py": "X = 1"}
    for name, contents in files.items():
        (tmp_path / name).write_text(contents)
    mlgym_env = FakeMLGymEnv()
    mlgym_env.config.command_files = [str(tmp_path / name) for name in files]
    MLGymWrapper(mlgym_env).reset()
    assert mlgym_env.added_commands == [[
        {"contents": "edit() { :; }", "name": "edit.sh", "type": "source_file"},
        {"contents": "#!/usr/bin/env python\nprint()", "name": "search", "type": "script"},
        {"contents": "X = 1", "name": "_utils.py", "type": "utility"},
    ]]  # fmt: skip
    (tmp_path / "helper.py").write_text("X = 1")
    mlgym_env.config.command_files = [str(tmp_path / "helper.py")]
    with pytest.raises(ValueError, match="helper.py.*shebang"):
        MLGymWrapper(mlgym_env).reset()


# ---------------------------------------------------------------------------- tasks


def test_tasks_are_drawn_at_each_reset_and_carried():
    made = []

    def make_env(task):
        made.append(FakeMLGymEnv(task))
        return made[-1]

    first = FakeMLGymEnv("a")
    env = MLGymWrapper(first, task="a", tasks=["a", "b", "c"], make_env=make_env)
    env.set_seed(0)
    drawn = []
    for _ in range(12):
        td = env.reset()
        drawn.append(strings(td["task"])[0])
        assert env.current_tasks == drawn[-1:]
        assert env.envs[0].task.args.id == drawn[-1]
    assert set(drawn) == {"a", "b", "c"}
    # the env is rebuilt only when the task changes, and the old one is closed
    assert len(made) == sum(a != b for a, b in zip(["a"] + drawn, drawn))
    assert first.closed
    td = env.step(answer(td, "```\nls\n```"))
    assert strings(td["next", "task"]) == drawn[-1:]
    env.set_seed(0)
    assert [strings(env.reset()["task"])[0] for _ in range(12)] == drawn


def test_a_reset_input_can_name_the_task():
    env = MLGymWrapper(FakeMLGymEnv("a"), task="a", make_env=FakeMLGymEnv)
    td = env.reset(TensorDict({"task": "b"}, batch_size=[]))
    assert strings(td["task"]) == ["b"] and env.envs[0].task_id == "b"
    td = env.step(answer(td, "```\nls\n```"))
    assert strings(td["next", "task"]) == ["b"]


def test_closing_errors_do_not_block_a_task_switch():
    class Stuck(FakeMLGymEnv):
        def close(self):
            raise RuntimeError("container will not stop")

    env = MLGymWrapper(Stuck("a"), task="a", make_env=FakeMLGymEnv)
    with pytest.warns(UserWarning, match="container will not stop"):
        env.reset(TensorDict({"task": ["b"]}, batch_size=[1]))
    assert env.current_tasks == ["b"]


# ---------------------------------------------------------------------------- make_mlgym


def test_make_mlgym_registers_the_task_and_builds_its_env(monkeypatch, tmp_path):
    record = install_fake_mlgym(monkeypatch, tmp_path)
    cwd = os.getcwd()
    env = make_mlgym(task="regressionKaggleHousePrice", reward_wrong_format=-1.0)
    assert os.getcwd() == cwd
    assert isinstance(env, MLGymWrapper) and env.device == torch.device("cpu") and env.tasks is None
    ((args, register_cwd),) = record.registered
    assert register_cwd == str(tmp_path)  # MLGym's paths are relative to its repository root
    assert (args.task_config_path, args.max_steps, args.seed, args.container_type, args.verbose, args.aliases_file) == (
        "tasks/regressionKaggleHousePrice.yaml", 10, 42, "podman", False, "docker/aliases.sh"
    )  # fmt: skip
    assert record.agent_args[0].agent_config_path == tmp_path / "configs" / "agents" / "default.yaml"
    assert record.agent_args[0].model.model_name == ""
    assert record.made == [("mlgym/regressionKaggleHousePrice-v0", {"devices": ["cpu_0"]}, str(tmp_path))]
    assert env.envs[0] is record.envs[0] and env.envs[0].config is record.agent_args[0].config
    td = env.reset()
    assert env.envs[0].reset_cwd == [str(tmp_path)] and os.getcwd() == cwd
    assert "task" not in td.keys()
    td = env.step(answer(td, "no command"))
    assert td["next", "reward"].item() == -1.0


def test_make_mlgym_with_tasks_draws_one_at_each_reset(monkeypatch, tmp_path, tiny_tokenizer):
    record = install_fake_mlgym(monkeypatch, tmp_path)
    names = ["prisonersDilemma", "regressionKaggleHousePrice", "battleOfSexes"]
    env = make_mlgym(tasks=names, tokenizer=tiny_tokenizer)
    assert [a.task_config_path for a, _ in record.registered] == [f"tasks/{n}.yaml" for n in names]
    assert [m[0] for m in record.made] == ["mlgym/battleOfSexes-v0"]  # the last task's env
    env.set_seed(1)
    seen = {strings(env.reset()["task"])[0] for _ in range(10)}
    assert len(seen) >= 2 and seen <= set(names)
    assert all(e.config is not None for e in record.envs)
    assert isinstance(env.reset()["text"], Text)


def test_make_mlgym_needs_task_or_tasks():
    for kwargs in ({}, {"task": "a", "tasks": ["b"]}, {"task": "", "tasks": []}):
        with pytest.raises(ValueError, match="either task or tasks"):
            make_mlgym(**kwargs)
    with pytest.raises(ValueError, match="list of task names"):
        make_mlgym(tasks="prisonersDilemma")


def test_make_mlgym_without_mlgym_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlgym", None)
    with pytest.raises(ImportError, match=r"'mlgym'.*pip install git\+https://github.com/facebookresearch/MLGym"):
        make_mlgym(task="prisonersDilemma")


def test_mlgym_is_not_installed_here_and_is_imported_lazily():
    import importlib.util

    if importlib.util.find_spec("mlgym") is not None:
        pytest.skip("mlgym is installed")
    import rlpost.envs.mlgym  # noqa: F401  (importing rlpost's module needs no MLGym)

    assert "mlgym" not in sys.modules
    with pytest.raises(ImportError, match="not on PyPI"):
        make_mlgym(task="prisonersDilemma")


def test_make_mlgym_without_gymnasium(monkeypatch, tmp_path):
    install_fake_mlgym(monkeypatch, tmp_path)
    monkeypatch.setitem(sys.modules, "gymnasium", None)
    with pytest.raises(ImportError, match="'gymnasium'.*pip install gymnasium"):
        make_mlgym(task="prisonersDilemma")


# ---------------------------------------------------------------------------- bad input


def test_bad_constructor_arguments_are_named():
    class NotMLGym:
        def reset(self):
            return None

    with pytest.raises(ValueError, match="NotMLGym has no step, communicate"):
        MLGymWrapper(NotMLGym())
    mlgym_env = FakeMLGymEnv()
    del mlgym_env.config.tools_handler
    with pytest.raises(ValueError, match="env.config.*tools_handler"):
        MLGymWrapper(mlgym_env)
    with pytest.raises(ValueError, match="at least one"):
        MLGymWrapper([])
    with pytest.raises(ValueError, match="tasks=... needs make_env"):
        MLGymWrapper(FakeMLGymEnv(), tasks=["a"])
    with pytest.raises(ValueError, match="tasks must be a non-empty list"):
        MLGymWrapper(FakeMLGymEnv(), tasks="a", make_env=FakeMLGymEnv)
    with pytest.raises(ValueError, match="reward_wrong_format.*'bad'"):
        MLGymWrapper(FakeMLGymEnv(), reward_wrong_format="bad")


def test_bad_step_input_is_named():
    env = MLGymWrapper(FakeMLGymEnv())
    td = env.reset()
    with pytest.raises(ValueError, match=r"\('history', 'full'\).*'text_response'"):
        env.step(td)
    with pytest.raises(ValueError, match=r"batch \(1,\).*got batch \(2,\)"):
        env.step(TensorDict(batch_size=[2]))
    with pytest.raises(ValueError, match=r"batch \(1,\).*got batch \(3,\)"):
        env.reset(TensorDict(batch_size=[3]))
    td["text_response"] = [3]
    with pytest.raises(ValueError, match="'text_response' must hold one str per row"):
        env.step(td)


def test_a_task_switch_without_make_env_is_refused():
    env = MLGymWrapper(FakeMLGymEnv(), task="a")
    with pytest.raises(ValueError, match="task 'b' but runs 'a'.*no make_env"):
        env.reset(TensorDict({"task": ["b"]}, batch_size=[1]))


def test_bad_configs_and_env_outputs_are_named():
    mlgym_env = FakeMLGymEnv()
    mlgym_env.config.task_template = "TASK: {objective}"
    with pytest.raises(ValueError, match=r"task_template uses the field \{objective\}.*'description'"):
        MLGymWrapper(mlgym_env).reset()

    mlgym_env = FakeMLGymEnv()
    mlgym_env.communicate = lambda input, **kw: "oops" if input == "state" else ""  # not JSON
    mlgym_env.returncode = 0
    with pytest.raises(ValueError, match="state command 'state' printed 'oops'"):
        MLGymWrapper(mlgym_env).reset()

    mlgym_env = FakeMLGymEnv()
    mlgym_env.next_returncode = 1
    with pytest.raises(RuntimeError, match="return code 1"):
        MLGymWrapper(mlgym_env).reset()

    mlgym_env = FakeMLGymEnv()
    env = MLGymWrapper(mlgym_env)
    td = answer(env.reset(), "```\nls\n```")
    mlgym_env.step = lambda action: ("out", 0)
    with pytest.raises(ValueError, match="step must return"):
        env.step(td)


def test_fallback_templates_and_a_config_without_state_command():
    mlgym_env = FakeMLGymEnv()
    config = mlgym_env.config
    config.state_command = None
    config.task_template = "TASK: {description} ({current_step}/{remaining_steps})"
    config.next_step_template = None
    config.next_step_no_output_template = None
    env = MLGymWrapper(mlgym_env)
    td = env.reset()
    assert strings(td["state"]) == [""]
    td = env.step(answer(td, "```\nls\n```"))
    assert strings(td["next", "message"]) == [f"{TASK} (1/9)"]  # next_step_template falls back to task_template
    assert "state" not in mlgym_env.communicated


def test_no_warnings_on_a_normal_episode():
    env = MLGymWrapper(FakeMLGymEnv())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        td = env.step(answer(env.reset(), "```\nls\n```"))
        env.step(answer(td["next"].clone(), "```\nsubmit\n```"))


# ---------------------------------------------------------------------------- rollout


class Scripted:
    """A policy answering each call with the next of ``responses`` (the same for every row)."""

    def __init__(self, *responses: str) -> None:
        self.responses, self.calls = list(responses), 0

    def __call__(self, td: TensorDict) -> TensorDict:
        response = self.responses[min(self.calls, len(self.responses) - 1)]
        self.calls += 1
        return answer(td, *[response] * td.batch_size[0])


def test_rollout_stops_at_the_first_done_step_without_restarting_the_container():
    mlgym_env = FakeMLGymEnv()
    env = MLGymWrapper(mlgym_env)
    out = env.rollout(10, Scripted("```\nls\n```", "thinking", "```\nsubmit\n```", "```\nls\n```"))
    assert out.batch_size == torch.Size([1, 3])
    assert out["next", "done"].view(-1).tolist() == [False, False, True]
    assert out["retry"].view(-1).tolist() == [False, True, False]
    assert mlgym_env.num_resets == 1 and mlgym_env.actions == ["ls", "submit"]
    chats = [step["next", "history"].prompt.to_chats()[0] for step in out.unbind(1)]
    assert [len(c) for c in chats] == [4, 6, 8]


def test_rollout_goes_on_after_done_when_asked():
    mlgym_env = FakeMLGymEnv()
    env = MLGymWrapper(mlgym_env)
    out = env.rollout(4, Scripted("```\nsubmit\n```"), break_when_any_done=False)
    assert out.batch_size == torch.Size([1, 4]) and out["next", "done"].all()
    assert mlgym_env.num_resets == 4  # one reset before each step, none after the last
    with pytest.raises(ValueError, match="needs a policy"):
        env.rollout(2, None)
    with pytest.raises(ValueError, match="max_steps must be >= 1"):
        env.rollout(0, Scripted("x"))
