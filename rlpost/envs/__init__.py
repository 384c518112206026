"""Environments: everything around the LLM -- prompts, formatting, rewards, tools.

- :class:`ChatEnv` (history / text / tokens modes) and its transforms (:class:`Transform`; the
  tools :class:`PythonInterpreter`, :class:`SimpleToolTransform`, :class:`StopWithoutToolCall`),
- :class:`DataLoadingPrimer` / :class:`DatasetChatEnv`: prompts from a dataset, resumable
  (:class:`RayDataLoadingPrimer`: one stream in a Ray actor, shared by several envs),
- TorchRL's older envs :class:`LLMEnv` (strings or token ids) and :class:`LLMHashingEnv`
  (:mod:`rlpost.envs.llm_env`), and the transforms :class:`Tokenizer`,
  :class:`TemplateTransform`, :class:`AddThinkingPrompt`, :class:`StepCounter` and
  :class:`PolicyVersion` (:mod:`rlpost.envs.llm_transforms`),
- tasks: :class:`GSM8KEnv`, :class:`ArithmeticEnv`, :class:`ToolArithmeticEnv`, reward
  transforms, and :func:`make_env`,
  which builds the env of a job config,
- GSM8K (:mod:`rlpost.envs.gsm8k`): :func:`make_gsm8k_env`, the prompt transform
  :class:`GSM8KPrepareQuestion` (and :class:`GSM8KEnv`, :class:`GSM8KRewardParser`),
- IFEval (:mod:`rlpost.envs.ifeval`): :class:`IFEvalEnv`, its rows :class:`IFEvalData`, the
  reward transform :class:`IfEvalScorer` and its :class:`IFEvalScoreData`,
- real tasks from outside: reasoning-gym's generators and verifiers (:mod:`rlpost.envs.reasoning_gym`:
  :class:`ReasoningGymEnv`, :class:`ReasoningGymRewardParser`) and code graded by its unit tests in
  the sandbox (:mod:`rlpost.envs.code`: :class:`CodeEnv`, :class:`CodeTestReward`, HumanEval's format),
- a learned reward beside a task's rule (:mod:`rlpost.envs.reward_model`: :class:`RewardModelReward`,
  and :class:`RemoteRewardModel`, the client of a run's ``reward`` actor),
- MATH (:mod:`rlpost.envs.math`: :class:`MATHEnv`, :class:`MATHRewardParser`, math-verify
  checked) and Countdown (:mod:`rlpost.envs.countdown`: :class:`CountdownEnv`,
  :class:`CountdownRewardParser`, generated problems, exact arithmetic),
- ``as_nested_tensor`` / ``as_padded_tensor`` (stacking rows of different lengths; they live in
  :mod:`rlpost.data` and are re-exported here and in :mod:`rlpost.envs.transforms`, TorchRL's
  place for them),
- KL to a reference model, as transforms: :class:`RetrieveLogProb`, :class:`KLComputation`,
  :class:`RetrieveKL`, the legacy :class:`KLRewardTransform`, and their shared Ray-actor forms
  :class:`RayRetrieveKL` / :class:`RayKLRewardTransform`,
- TorchRL's tool layer: :class:`ToolRegistry` of :class:`ToolService` objects run by
  :class:`ExecuteToolsInOrder` from calls :class:`XMLBlockParser` / :class:`JSONCallParser` read,
  :class:`PythonExecutorService` (sandboxed), :class:`MCPToolTransform` (MCP servers),
  :class:`BrowserTransform` (playwright, when installed) and :class:`IncrementalTokenizer`,
- :mod:`rlpost.envs.tools` (the sandboxed ``run_python`` / ``PythonSession``, over
  :mod:`rlpost.envs.sandbox`), :mod:`rlpost.envs.function_pool` (user functions with a time
  limit) and :mod:`rlpost.envs.rewards`.

Nothing here imports vLLM or Ray; ``datasets`` is imported only when a dataset is loaded.
"""

from rlpost.envs.async_pool import AsyncEnvPool
from rlpost.envs.browser import BrowserTransform
from rlpost.envs.chat import ChatEnv, DatasetChatEnv
from rlpost.envs.code import CodeEnv, CodeTestReward
from rlpost.envs.common import EnvBase
from rlpost.envs.countdown import CountdownEnv, CountdownRewardParser
from rlpost.envs.datasets import DataLoadingPrimer
from rlpost.envs.errors import EnvInputError
from rlpost.envs.gsm8k import GSM8KPrepareQuestion, make_gsm8k_env
from rlpost.envs.hashing_env import LLMHashingEnv
from rlpost.envs.ifeval import IFEvalData, IFEvalEnv, IFEvalScoreData, IfEvalScorer
from rlpost.envs.incremental_tokenizer import IncrementalTokenizer
from rlpost.envs.kl import KLComputation, RayRetrieveKL, RetrieveKL, RetrieveLogProb
from rlpost.envs.kl_reward import KLRewardTransform, RayKLRewardTransform
from rlpost.envs.llm_env import LLMEnv
from rlpost.envs.llm_transforms import AddThinkingPrompt, TemplateTransform, Tokenizer
from rlpost.envs.math import MATHEnv, MATHRewardParser
from rlpost.envs.mcp_tools import MCPToolTransform
from rlpost.envs.mlgym import MLGymWrapper, make_mlgym
from rlpost.envs.policy_version import PolicyVersion
from rlpost.envs.python_executor import PythonExecutorService
from rlpost.envs.ray_primer import RayDataLoadingPrimer
from rlpost.envs.reasoning_gym import ReasoningGymEnv, ReasoningGymRewardParser
from rlpost.envs.reward_model import RemoteRewardModel, RewardModelReward
from rlpost.envs.tasks import (
    AnswerRewardParser,
    ArithmeticEnv,
    GSM8KEnv,
    GSM8KRewardParser,
    ToolArithmeticEnv,
    UserReward,
    make_env,
)
from rlpost.envs.tool_parsers import JSONCallParser, XMLBlockParser
from rlpost.envs.tool_services import ExecuteToolsInOrder, ToolRegistry, ToolService
from rlpost.envs.tool_transforms import (
    HermesToolCallParser,
    PythonInterpreter,
    SimpleToolTransform,
    StopWithoutToolCall,
    ToolCall,
)
from rlpost.envs.transforms import (
    Compose,
    StepCounter,
    Transform,
    TransformedEnv,
    as_nested_tensor,
    as_padded_tensor,
)

__all__ = [
    "AddThinkingPrompt",
    "AnswerRewardParser",
    "ArithmeticEnv",
    "AsyncEnvPool",
    "BrowserTransform",
    "ChatEnv",
    "CodeEnv",
    "CodeTestReward",
    "Compose",
    "CountdownEnv",
    "CountdownRewardParser",
    "DataLoadingPrimer",
    "DatasetChatEnv",
    "EnvBase",
    "EnvInputError",
    "ExecuteToolsInOrder",
    "GSM8KEnv",
    "GSM8KPrepareQuestion",
    "GSM8KRewardParser",
    "HermesToolCallParser",
    "IFEvalData",
    "IFEvalEnv",
    "IFEvalScoreData",
    "IfEvalScorer",
    "IncrementalTokenizer",
    "JSONCallParser",
    "KLComputation",
    "KLRewardTransform",
    "LLMEnv",
    "LLMHashingEnv",
    "MATHEnv",
    "MATHRewardParser",
    "MCPToolTransform",
    "MLGymWrapper",
    "PolicyVersion",
    "PythonExecutorService",
    "PythonInterpreter",
    "RayDataLoadingPrimer",
    "RayKLRewardTransform",
    "RayRetrieveKL",
    "ReasoningGymEnv",
    "ReasoningGymRewardParser",
    "RemoteRewardModel",
    "RetrieveKL",
    "RetrieveLogProb",
    "RewardModelReward",
    "SimpleToolTransform",
    "StepCounter",
    "StopWithoutToolCall",
    "TemplateTransform",
    "Tokenizer",
    "ToolArithmeticEnv",
    "ToolCall",
    "ToolRegistry",
    "ToolService",
    "Transform",
    "TransformedEnv",
    "UserReward",
    "XMLBlockParser",
    "as_nested_tensor",
    "as_padded_tensor",
    "make_env",
    "make_gsm8k_env",
    "make_mlgym",
]
