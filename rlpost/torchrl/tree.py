"""TorchRL's module tree, mapped to rlpost's objects.

:data:`TREE` has one entry per TorchRL module that user code imports from (the packages' public
``__all__`` at pytorch/rl ae9719f, and the submodules TorchRL's own GRPO and expert-iteration
scripts, LLM tests, LLM tutorials and examples, the examples of its LLM docs and docstrings, and its
LLM modules import from: every such name of ``torchrl.envs`` and its submodules included), keyed
by its path without the ``torchrl.``
prefix. Each name maps to ``"rlpost.module:attribute"``, the very object rlpost's own module
holds, or to a :class:`NotInRlpost` that imports fine and says, when used, why rlpost lacks it and
what to use instead.
"""

from __future__ import annotations

import logging

# TorchRL's ``torchrl_logger`` (also ``torchrl.logger`` and ``torchrl._utils.logger``): rlpost's own logger
torchrl_logger = logging.getLogger("rlpost")


class NotInRlpost:
    """A TorchRL name rlpost does not provide. Importing it works (a ported script that imports
    many names still starts); calling it, reading an attribute of it or subclassing it raises
    NotImplementedError with :attr:`message`."""

    def __init__(self, name: str, why: str):
        self.name, self.why = name, why

    @property
    def message(self) -> str:
        return f"{self.name}: {self.why}"

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(self.message)

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):  # copy, pickle and introspection probe dunders
            raise AttributeError(attribute)
        raise NotImplementedError(self.message)

    def __mro_entries__(self, bases):
        raise NotImplementedError(self.message)

    def __repr__(self) -> str:
        return f"<{self.name}: not in rlpost>"


# Why a name is missing: each is deliberate.
SGLANG = "rlpost serves models with vLLM only: use vLLMWrapper with make_vllm_worker"
RLHF_DATA = (
    "TorchRL's earlier RLHF data pipeline is not part of rlpost: load prompts with DatasetChatEnv or "
    "DataLoadingPrimer, and use KLRewardTransform (a fixed coefficient) for a KL penalty"
)
FP32_PLUGIN = (
    "rlpost does not patch vLLM's models: make_vllm_worker / make_vllm_engine take dtype='float32' "
    "for float32 log-probs"
)
TEST_HELPER = "one of TorchRL's own test helpers, not part of its API"
TORCHRL_UTILITY = "one of TorchRL's general utilities, not part of rlpost"


def _same(module: str, *names: str) -> dict[str, str]:
    return {name: f"{module}:{name}" for name in names}


def _missing(why: str, *names: str) -> dict[str, NotInRlpost]:
    return {name: _PLACEHOLDERS.setdefault(name, NotInRlpost(name, why)) for name in names}


_PLACEHOLDERS: dict[str, NotInRlpost] = {}  # one per name, whatever path it is imported from

_HISTORY = _same("rlpost.data", "History", "ContentBase", "add_chat_template")
_CONTAINERS = _same("rlpost.data", "ChatHistory", "LogProbs", "Masks", "Text", "Tokens")
_WRAPPERS = _same("rlpost.policies", "LLMWrapperBase", "TransformersWrapper", "vLLMWrapper")
_KL = _same("rlpost.envs", "KLComputation", "RetrieveKL", "RetrieveLogProb")
_STACKING = _same("rlpost.data", "as_nested_tensor", "as_padded_tensor")
_GSM8K = _same("rlpost.envs", "GSM8KEnv", "GSM8KPrepareQuestion", "make_gsm8k_env")
_IFEVAL_REWARD = _same("rlpost.envs", "IFEvalScoreData", "IfEvalScorer")
_ENV_LOOP = _same("rlpost.envs", "Compose", "Transform", "TransformedEnv")  # torchrl.envs.transforms'
_BUFFERS = _same(
    "rlpost.data",
    "LazyStackStorage",
    "ListStorage",
    "PrioritizedSampler",
    "RayReplayBuffer",
    "ReplayBuffer",
    "SamplerWithoutReplacement",
    "TensorDictReplayBuffer",
)
_WANDB_LOGGER = _same("rlpost.record.loggers", "WandbLogger")
_WORKERS = _same("rlpost.actors.vllm_workers", "make_vllm_worker") | _same(
    "rlpost.transport", "stateless_init_process_group"
)
_ASYNC_VLLM = (
    _same("rlpost.actors.async_vllm", "AsyncVLLM", "make_async_vllm_engine")
    | _same("rlpost.collect.weight_sync", "RLvLLMEngine")
    | _missing(
        "rlpost's vLLM engines are its inference workers: use make_vllm_worker (one engine) or AsyncVLLM (a fleet)",
        "RayLLMWorker",
        "LocalLLMWrapper",
        "stateless_init_process_group_async",
        "_AsyncvLLMWorker",
        "_AsyncLLMEngine",
    )
)
_SGLANG_ENGINES = _missing(SGLANG, "AsyncSGLang", "RLSGLangEngine")
_TOOLS = _same(
    "rlpost.envs",
    "BrowserTransform",
    "ExecuteToolsInOrder",
    "IncrementalTokenizer",
    "JSONCallParser",
    "MCPToolTransform",
    "PythonExecutorService",
    "ToolRegistry",
    "ToolService",
    "XMLBlockParser",
)
_NEW_LOSSES = _same(
    "rlpost.objectives",
    "CISPOLoss",
    "CISPOLossOutput",
    "DAPO",
    "DAPOLossOutput",
    "MCAdvantageSelector",
    "RayMCAdvantage",
)
_DISTILLATION = _same("rlpost.objectives", "DistillationLoss", "DistillationLossOutput", "k3_kl_token_estimate")
_SFT = _same("rlpost.objectives", "SFTLoss", "SFTLossOutput")
_VLLM_SYNC = _same("rlpost.collect.weight_sync", "VLLMWeightReceiver", "VLLMWeightSender", "VLLMWeightSyncScheme")
_VLLM_SYNC |= _missing(
    "rlpost's weight bus is reached through VLLMWeightSyncScheme's sender or vLLMUpdater", "VLLMCollectiveTransport"
) | _same("rlpost.collect.weight_update", "get_model_metadata")
_VLLM_DOUBLE_BUFFER = _missing(
    "rlpost sends weights over its bus (VLLMWeightSyncScheme), not through files on shared storage",
    "VLLMDoubleBufferSyncScheme",
    "VLLMDoubleBufferTransport",
    "VLLMDoubleBufferWeightReceiver",
    "VLLMDoubleBufferWeightSender",
)

TREE: dict[str, dict[str, str | NotInRlpost]] = {
    "": {"torchrl_logger": "rlpost.torchrl.tree:torchrl_logger", "logger": "rlpost.torchrl.tree:torchrl_logger"}
    | _same("rlpost.runtime.ray_start", "merge_ray_runtime_env", "get_ray_default_runtime_env")
    | _same("rlpost.record.timing", "timeit")
    | _missing(
        TORCHRL_UTILITY,
        "auto_unwrap_transformed_env",
        "compile_with_warmup",
        "cuda_memory_profile",
        "cuda_memory_stats",
        "implement_for",
        "reset_cuda_peak_stats",
        "set_auto_unwrap_transformed_env",
        "service_backend",
        "transport_backend",
    ),
    "_utils": {"logger": "rlpost.torchrl.tree:torchrl_logger"}
    | _same("rlpost.record.timing", "timeit")
    | _same("rlpost.runtime.ray_start", "merge_ray_runtime_env"),
    # data
    "data": _same("rlpost.data", "History", "RandomSampler", "Storage")
    | _BUFFERS
    | _same("rlpost.data.specs", "Unbounded"),
    "data.llm": _HISTORY
    | _same("rlpost.objectives", "TopKRewardSelector")
    | _missing(
        RLHF_DATA,
        "AdaptiveKLController",
        "ConstantKLController",
        "PairwiseDataset",
        "PromptData",
        "PromptTensorDictTokenizer",
        "RewardData",
        "RolloutFromModel",
        "TensorDictTokenizer",
        "TokenizedDatasetLoader",
        "create_infinite_iterator",
        "get_dataloader",
    ),
    "data.llm.history": _HISTORY,
    "data.llm.topk": _same("rlpost.objectives", "TopKRewardSelector"),
    "data.replay_buffers": _BUFFERS | _same("rlpost.data", "RandomSampler", "Sampler", "Storage"),
    "data.replay_buffers.ray_buffer": _same("rlpost.data", "RayReplayBuffer"),
    # envs
    "envs": _same("rlpost.envs", "AsyncEnvPool", "EnvBase", "LLMHashingEnv", "StepCounter")
    | _ENV_LOOP
    | _same("rlpost.envs.serial", "SerialEnv"),
    "envs.common": _same("rlpost.envs", "EnvBase"),
    "envs.transforms": _ENV_LOOP | _same("rlpost.envs", "StepCounter"),
    "envs.transforms.transforms": _ENV_LOOP | _same("rlpost.envs", "StepCounter"),
    "envs.llm": _same("rlpost.envs", "ChatEnv", "DatasetChatEnv", "DataLoadingPrimer", "LLMEnv", "LLMHashingEnv")
    | _same("rlpost.envs", "AddThinkingPrompt", "TemplateTransform", "Tokenizer", "PythonInterpreter")
    | _same("rlpost.envs", "KLRewardTransform", "GSM8KRewardParser", "IFEvalEnv", "MLGymWrapper", "make_mlgym")
    | _KL
    | _STACKING
    | _GSM8K
    | _IFEVAL_REWARD
    | _same("rlpost.envs", "CountdownEnv", "CountdownRewardParser", "IFEvalData", "MATHEnv", "MATHRewardParser")
    | {name: _TOOLS[name] for name in ("BrowserTransform", "MCPToolTransform")}
    | _same("rlpost.envs", "RayDataLoadingPrimer"),
    "envs.llm.chat": _same("rlpost.envs", "ChatEnv", "DatasetChatEnv"),
    "envs.llm.envs": _same("rlpost.envs", "LLMEnv", "LLMHashingEnv"),
    "envs.llm.datasets": _GSM8K
    | _same("rlpost.envs", "IFEvalEnv", "IfEvalScorer", "CountdownEnv", "IFEvalData", "MATHEnv"),
    "envs.llm.datasets.countdown": _same("rlpost.envs", "CountdownEnv"),
    "envs.llm.datasets.gsm8k": _GSM8K,
    "envs.llm.datasets.ifeval": _same("rlpost.envs", "IFEvalEnv"),
    "envs.llm.datasets.math": _same("rlpost.envs", "MATHEnv"),
    "envs.llm.libs": _same("rlpost.envs", "MLGymWrapper", "make_mlgym"),
    "envs.llm.reward": _same("rlpost.envs", "GSM8KRewardParser")
    | _IFEVAL_REWARD
    | _same("rlpost.envs", "CountdownRewardParser", "MATHRewardParser"),
    "envs.llm.reward.countdown": _same("rlpost.envs", "CountdownRewardParser"),
    "envs.llm.reward.gsm8k": _same("rlpost.envs", "GSM8KRewardParser"),
    "envs.llm.reward.ifeval": _IFEVAL_REWARD,
    "envs.llm.reward.ifeval._scorer": _IFEVAL_REWARD,
    "envs.llm.reward.math": _same("rlpost.envs", "MATHRewardParser"),
    "envs.llm.transforms": _same("rlpost.envs", "AddThinkingPrompt", "DataLoadingPrimer", "KLRewardTransform")
    | _same("rlpost.envs", "PolicyVersion", "PythonInterpreter", "SimpleToolTransform", "TemplateTransform")
    | _same("rlpost.envs", "Tokenizer", "ToolCall")
    | _KL
    | _STACKING
    | _TOOLS
    | _same("rlpost.envs", "RayDataLoadingPrimer"),
    "envs.llm.transforms.browser": {"BrowserTransform": _TOOLS["BrowserTransform"]},
    "envs.llm.transforms.dataloading": _same("rlpost.envs", "DataLoadingPrimer", "RayDataLoadingPrimer") | _STACKING,
    "envs.llm.transforms.kl": _KL,
    "envs.llm.transforms.policy_version": _same("rlpost.envs", "PolicyVersion"),
    "envs.llm.transforms.tokenizer": _same("rlpost.envs", "IncrementalTokenizer", "Tokenizer"),
    "envs.llm.transforms.tools": _same("rlpost.envs", "SimpleToolTransform"),
    # modules
    "modules.llm": _CONTAINERS
    | _WRAPPERS
    | _WORKERS
    | {
        name: _ASYNC_VLLM[name]
        for name in ("AsyncVLLM", "make_async_vllm_engine", "stateless_init_process_group_async")
    }
    | _SGLANG_ENGINES
    | _missing(SGLANG, "SGLangWrapper")
    | _same("rlpost.policies", "RemoteTransformersWrapper", "HFRewardModelWrapper", "TorchRLBufferDataset"),
    "modules.llm.backends": _WORKERS | _ASYNC_VLLM | _SGLANG_ENGINES,
    "modules.llm.backends.sglang": _SGLANG_ENGINES | _missing(SGLANG, "get_open_port", "wait_for_server"),
    "modules.llm.backends.vllm": _WORKERS | _ASYNC_VLLM,
    "modules.llm.backends.vllm.vllm_async": {
        name: value for name, value in _ASYNC_VLLM.items() if name in ("AsyncVLLM", "make_async_vllm_engine")
    },
    "modules.llm.backends.vllm.vllm_plugin": _missing(
        FP32_PLUGIN,
        "FP32_MODEL_OVERRIDES",
        "FP32_OVERRIDES_ENV_VAR",
        "fp32_overrides_enabled",
        "register_fp32_overrides",
    ),
    "modules.llm.policies": _CONTAINERS
    | _WRAPPERS
    | _same("rlpost.policies", "RemoteTransformersWrapper")
    | _missing(SGLANG, "SGLangWrapper"),
    "modules.llm.policies.common": _CONTAINERS,
    "modules.llm.policies.transformers_wrapper": _same("rlpost.policies", "TransformersWrapper"),
    "modules.llm.policies.vllm_wrapper": _same("rlpost.policies", "vLLMWrapper"),
    "modules.llm.trl_interop": _same("rlpost.policies", "HFRewardModelWrapper", "TorchRLBufferDataset"),
    "modules": _same("rlpost.policies", "LLMMaskedCategorical"),
    "modules.distributions": _same("rlpost.policies", "LLMMaskedCategorical"),
    "modules.distributions.discrete": _same("rlpost.policies", "LLMMaskedCategorical"),
    # collectors
    "collectors.llm": _same("rlpost.collect", "LLMCollector", "RayLLMCollector", "vLLMUpdater")
    | _same("rlpost.collect.weight_sync", "vLLMUpdaterV2"),
    "collectors.llm.base": _same("rlpost.collect", "LLMCollector"),
    "collectors.llm.weight_update": _same("rlpost.collect", "vLLMUpdater")
    | _same("rlpost.collect.weight_sync", "vLLMUpdaterV2"),
    "collectors.llm.weight_update.vllm": _same("rlpost.collect", "vLLMUpdater"),
    "collectors.llm.weight_update.vllm_v2": _same("rlpost.collect.weight_sync", "vLLMUpdaterV2"),
    # objectives
    "objectives.llm": _same("rlpost.objectives", "GRPOLoss", "GRPOLossOutput", "LLMLossOutput", "MCAdvantage")
    | _NEW_LOSSES
    | _DISTILLATION
    | _SFT,
    "objectives.llm.grpo": _same("rlpost.objectives", "GRPOLoss", "GRPOLossOutput", "MCAdvantage")
    | {name: _NEW_LOSSES[name] for name in ("CISPOLoss", "CISPOLossOutput", "MCAdvantageSelector", "RayMCAdvantage")},
    "objectives.llm.distillation": _DISTILLATION,
    "objectives.llm.sft": {"SFTLoss": _SFT["SFTLoss"]},
    # weight updates
    "weight_update.llm": _VLLM_SYNC
    | _VLLM_DOUBLE_BUFFER
    | _missing(SGLANG, "SGLangCollectiveTransport", "SGLangWeightSender", "SGLangWeightSyncScheme")
    | _missing(SGLANG, "get_sglang_model_metadata"),
    "weight_update.llm.vllm_double_buffer": {
        "VLLMDoubleBufferWeightReceiver": _VLLM_DOUBLE_BUFFER["VLLMDoubleBufferWeightReceiver"]
    },
    # the rest of TorchRL that its LLM tests and scripts import
    "record": _WANDB_LOGGER,
    "record.loggers": _WANDB_LOGGER,
    "record.loggers.wandb": _WANDB_LOGGER,
    "testing": _missing(
        TEST_HELPER,
        "DummyStrDataLoader",
        "WorkerTransformerDoubleBuffer",
        "WorkerTransformerNCCL",
        "WorkerVLLMDoubleBuffer",
        "WorkerVLLMNCCL",
    ),
    "testing.mocking_classes": _missing(TEST_HELPER, "CountingEnv"),
}
