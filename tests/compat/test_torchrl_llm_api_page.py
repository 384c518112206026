"""TorchRL's "LLM interface" API page, run on rlpost with the tiny model's tokenizer.

The page's one example (a ChatEnv with a PythonInterpreter, TorchRL 0.9's keys: the query under
``"text"``, the action under ``"text_response"``) is run with the page's calls, and the history
it prints is asserted line for line. The names the page lists for the data structures and the
LLM modules must exist where a TorchRL user looks for them.
"""

from __future__ import annotations

import importlib

import pytest
from tensordict import TensorDict, set_list_to_stack

pytestmark = pytest.mark.compat

SYSTEM_PROMPT = "You are an assistant that can execute Python code. Decorate your code with ```python``` tags."
ACTION = """Here is a block of code to be executed in python:
```python
def square(x):
    return x * x
print('testing the square function with input 2:', square(2))
```
<|im_end|>
"""
# what the page prints (pprint of a one-element list, joined back into its string)
PRINTED = (
    "<|im_start|>system\n"
    "You are an assistant that can execute Python code. Decorate your code with "
    "```python``` tags.<|im_end|>\n"
    "<|im_start|>user\n"
    "Let's write a Python function that returns the square of a "
    "number.<|im_end|>\n"
    "<|im_start|>assistant\n"
    "Here is a block of code to be executed in python:\n"
    "```python\n"
    "def square(x):\n"
    "    return x * x\n"
    "print('testing the square function with input 2:', square(2))\n"
    "```<|im_end|>\n"
    "<|im_start|>user\n"
    "<tool_response>\n"
    "Code block 1 executed successfully:\n"
    "testing the square function with input 2: 4\n"
    "\n"
    "</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_python_interpreter_example(tiny_tokenizer):
    """TorchRL LLM interface page, "Transforms": a ChatEnv with a PythonInterpreter executes the
    code of the (simulated) LLM response and adds the tool's answer to the history."""
    from rlpost.envs import ChatEnv
    from rlpost.envs.tool_transforms import PythonInterpreter

    tokenizer = tiny_tokenizer
    with set_list_to_stack(True):
        base_env = ChatEnv(
            tokenizer=tokenizer,
            system_prompt=SYSTEM_PROMPT,
            user_role="user",
            system_role="system",
            batch_size=[1],
        )
        env = base_env.append_transform(PythonInterpreter())
        env.set_seed(0)
        reset_data = env.reset(
            TensorDict(text="Let's write a Python function that returns the square of a number.", batch_size=[1])
        )
        reset_data.set("text_response", [ACTION])
        s, s_ = env.step_and_maybe_reset(reset_data)
        printed = s_["history"].apply_chat_template(tokenizer=tokenizer)
    assert printed == [PRINTED]
    assert s["next", "tool_calls"].item() == 1 and s["next", "tool_errors"].item() == 0


@pytest.mark.parametrize(
    "module,names",
    [
        ("rlpost.data", ["History", "ContentBase", "LLMData"]),
        ("rlpost.policies", ["TransformersWrapper", "vLLMWrapper", "CategoricalSequential", "LLMOnDevice"]),
        ("rlpost.envs.tool_transforms", ["PythonInterpreter"]),
        ("rlpost.envs.transforms", ["as_nested_tensor", "as_padded_tensor"]),
        ("rlpost.objectives", ["GRPOLoss", "GRPOLossOutput", "MCAdvantage"]),
        ("rlpost.collect", ["LLMCollector"]),
    ],
)
def test_listed_names_exist(module, names):
    """TorchRL LLM interface page: the data structures, modules and objectives it lists."""
    imported = importlib.import_module(module)
    missing = [name for name in names if not hasattr(imported, name)]
    assert not missing, f"{module} lacks {missing}"
