"""Environments: everything around the LLM (seed 000) -- prompts, formatting, rewards, tools.

- :class:`ChatEnv` (history / text / tokens modes) and its transforms (:class:`Transform`,
  :class:`PythonInterpreter`),
- :class:`DataLoadingPrimer` / :class:`DatasetChatEnv`: prompts from a dataset, resumable,
- tasks: :class:`GSM8KEnv`, :class:`ArithmeticEnv`, reward transforms, and :func:`make_env`,
  which builds the env of a job config,
- KL retrieval on batches: :class:`RetrieveLogProb`, :class:`KLComputation`, :class:`RetrieveKL`,
- :mod:`rlpost.envs.tools` (the sandboxed ``run_python``) and :mod:`rlpost.envs.rewards`.

Nothing here imports vLLM or Ray; ``datasets`` is imported only when a dataset is loaded.
"""

from rlpost.envs.chat import ChatEnv
from rlpost.envs.datasets import DataLoadingPrimer, DatasetChatEnv
from rlpost.envs.tasks import (
    AnswerRewardParser,
    ArithmeticEnv,
    GSM8KEnv,
    GSM8KRewardParser,
    UserReward,
    make_env,
)
from rlpost.envs.kl import KLComputation, RetrieveKL, RetrieveLogProb
from rlpost.envs.transforms import PythonInterpreter, Transform

__all__ = [
    "AnswerRewardParser",
    "ArithmeticEnv",
    "ChatEnv",
    "DataLoadingPrimer",
    "DatasetChatEnv",
    "GSM8KEnv",
    "GSM8KRewardParser",
    "KLComputation",
    "PythonInterpreter",
    "RetrieveKL",
    "RetrieveLogProb",
    "Transform",
    "UserReward",
    "make_env",
]
