"""Environments: everything around the LLM -- prompts, formatting, rewards, tools.

- the env loop (:mod:`~rlpost.envs.common`, :mod:`~rlpost.envs.transforms`) and
  :class:`ChatEnv`; prompts from a dataset (:mod:`~rlpost.envs.datasets`: :class:`DataLoadingPrimer`,
  :class:`DatasetChatEnv`; :class:`RayDataLoadingPrimer` shares one stream through a Ray actor);
- TorchRL's older envs :class:`LLMEnv` and :class:`LLMHashingEnv` and the transforms of
  :mod:`~rlpost.envs.llm_transforms`, :class:`StepCounter`, :class:`PolicyVersion`;
- tasks (:mod:`~rlpost.envs.tasks` with :func:`make_env`, which builds a job config's env; GSM8K,
  MATH, Countdown, IFEval, reasoning-gym, code graded by its tests, MLGym) and rewards, rule-based
  or learned (:mod:`~rlpost.envs.reward_model`);
- KL to a reference model as transforms (:mod:`~rlpost.envs.kl`, :mod:`~rlpost.envs.kl_reward`);
- tools: TorchRL's tool layer (:class:`ToolRegistry`, :class:`ExecuteToolsInOrder`, the call
  parsers, :class:`PythonExecutorService`, :class:`MCPToolTransform`, :class:`BrowserTransform`),
  :class:`PythonInterpreter` over the sandbox (:mod:`~rlpost.envs.sandbox`), user functions with a
  time limit (:mod:`~rlpost.envs.function_pool`);
- ``as_nested_tensor`` / ``as_padded_tensor`` (from :mod:`rlpost.data`; TorchRL's place for them).

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
