"""rlpost.torchrl: TorchRL's module tree, one substitution away. Every public name of TorchRL's LLM
packages (their ``__all__``) and every name TorchRL's GRPO and expert-iteration scripts, LLM tests
and LLM tutorials import resolves at its TorchRL path under ``rlpost.torchrl``: to rlpost's own
object, or to a placeholder that says, when used, why rlpost lacks it."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

import pytest

from rlpost.torchrl import resolve
from rlpost.torchrl.tree import TREE, NotInRlpost

pytestmark = pytest.mark.unit

COMMIT = "ae9719f17b1517af5c2523a36c4616f003ee55cf"  # pytorch/rl, where these lists were read

# the __all__ of TorchRL's top-level package and its LLM packages at COMMIT
TORCHRL_ALL = {
    "torchrl": [
        "auto_unwrap_transformed_env",
        "compile_with_warmup",
        "cuda_memory_profile",
        "cuda_memory_stats",
        "get_ray_default_runtime_env",
        "implement_for",
        "logger",
        "merge_ray_runtime_env",
        "reset_cuda_peak_stats",
        "set_auto_unwrap_transformed_env",
        "service_backend",
        "timeit",
        "torchrl_logger",
        "transport_backend",
    ],
    "torchrl.collectors.llm": ["LLMCollector", "RayLLMCollector", "vLLMUpdater", "vLLMUpdaterV2"],
    "torchrl.collectors.llm.weight_update": ["vLLMUpdater", "vLLMUpdaterV2"],
    "torchrl.data.llm": [
        "AdaptiveKLController",
        "ConstantKLController",
        "ContentBase",
        "History",
        "PairwiseDataset",
        "PromptData",
        "PromptTensorDictTokenizer",
        "RewardData",
        "RolloutFromModel",
        "TensorDictTokenizer",
        "TokenizedDatasetLoader",
        "TopKRewardSelector",
        "add_chat_template",
        "create_infinite_iterator",
        "get_dataloader",
    ],
    "torchrl.envs.llm": [
        "AddThinkingPrompt",
        "BrowserTransform",
        "ChatEnv",
        "CountdownEnv",
        "CountdownRewardParser",
        "DataLoadingPrimer",
        "DatasetChatEnv",
        "GSM8KEnv",
        "GSM8KPrepareQuestion",
        "GSM8KRewardParser",
        "IFEvalData",
        "IFEvalEnv",
        "IFEvalScoreData",
        "IfEvalScorer",
        "KLComputation",
        "KLRewardTransform",
        "LLMEnv",
        "LLMHashingEnv",
        "MATHEnv",
        "MATHRewardParser",
        "MCPToolTransform",
        "MLGymWrapper",
        "PythonInterpreter",
        "RayDataLoadingPrimer",
        "RetrieveKL",
        "RetrieveLogProb",
        "TemplateTransform",
        "Tokenizer",
        "as_nested_tensor",
        "as_padded_tensor",
        "make_gsm8k_env",
        "make_mlgym",
    ],
    "torchrl.envs.llm.datasets": [
        "CountdownEnv",
        "GSM8KEnv",
        "GSM8KPrepareQuestion",
        "IFEvalData",
        "IFEvalEnv",
        "IfEvalScorer",
        "MATHEnv",
        "make_gsm8k_env",
    ],
    "torchrl.envs.llm.libs": ["MLGymWrapper", "make_mlgym"],
    "torchrl.envs.llm.reward": [
        "CountdownRewardParser",
        "GSM8KRewardParser",
        "IFEvalScoreData",
        "IfEvalScorer",
        "MATHRewardParser",
    ],
    "torchrl.envs.llm.reward.ifeval": ["IFEvalScoreData", "IfEvalScorer"],
    "torchrl.envs.llm.transforms": [
        "AddThinkingPrompt",
        "BrowserTransform",
        "DataLoadingPrimer",
        "ExecuteToolsInOrder",
        "IncrementalTokenizer",
        "JSONCallParser",
        "KLComputation",
        "KLRewardTransform",
        "MCPToolTransform",
        "PolicyVersion",
        "PythonExecutorService",
        "PythonInterpreter",
        "RayDataLoadingPrimer",
        "RetrieveKL",
        "RetrieveLogProb",
        "SimpleToolTransform",
        "TemplateTransform",
        "Tokenizer",
        "ToolCall",
        "ToolRegistry",
        "ToolService",
        "XMLBlockParser",
        "as_nested_tensor",
        "as_padded_tensor",
    ],
    "torchrl.modules.llm": [
        "AsyncSGLang",
        "AsyncVLLM",
        "ChatHistory",
        "HFRewardModelWrapper",
        "LLMWrapperBase",
        "LogProbs",
        "Masks",
        "RLSGLangEngine",
        "RemoteTransformersWrapper",
        "SGLangWrapper",
        "Text",
        "Tokens",
        "TorchRLBufferDataset",
        "TransformersWrapper",
        "make_async_vllm_engine",
        "make_vllm_worker",
        "stateless_init_process_group",
        "stateless_init_process_group_async",
        "vLLMWrapper",
    ],
    "torchrl.modules.llm.backends": [
        "AsyncSGLang",
        "AsyncVLLM",
        "LocalLLMWrapper",
        "RLSGLangEngine",
        "RLvLLMEngine",
        "RayLLMWorker",
        "_AsyncLLMEngine",
        "_AsyncvLLMWorker",
        "make_async_vllm_engine",
        "make_vllm_worker",
        "stateless_init_process_group",
        "stateless_init_process_group_async",
    ],
    "torchrl.modules.llm.backends.sglang": ["AsyncSGLang", "RLSGLangEngine", "get_open_port", "wait_for_server"],
    "torchrl.modules.llm.backends.vllm": [
        "AsyncVLLM",
        "LocalLLMWrapper",
        "RLvLLMEngine",
        "RayLLMWorker",
        "_AsyncLLMEngine",
        "_AsyncvLLMWorker",
        "make_async_vllm_engine",
        "make_vllm_worker",
        "stateless_init_process_group",
        "stateless_init_process_group_async",
    ],
    "torchrl.modules.llm.policies": [
        "ChatHistory",
        "LLMWrapperBase",
        "LogProbs",
        "Masks",
        "RemoteTransformersWrapper",
        "SGLangWrapper",
        "Text",
        "Tokens",
        "TransformersWrapper",
        "vLLMWrapper",
    ],
    "torchrl.modules.llm.trl_interop": ["HFRewardModelWrapper", "TorchRLBufferDataset"],
    "torchrl.objectives.llm": [
        "CISPOLoss",
        "CISPOLossOutput",
        "DAPO",
        "DAPOLossOutput",
        "DistillationLoss",
        "DistillationLossOutput",
        "GRPOLoss",
        "GRPOLossOutput",
        "LLMLossOutput",
        "MCAdvantage",
        "MCAdvantageSelector",
        "RayMCAdvantage",
        "SFTLoss",
        "SFTLossOutput",
        "k3_kl_token_estimate",
    ],
    "torchrl.weight_update.llm": [
        "SGLangCollectiveTransport",
        "SGLangWeightSender",
        "SGLangWeightSyncScheme",
        "VLLMCollectiveTransport",
        "VLLMDoubleBufferSyncScheme",
        "VLLMDoubleBufferTransport",
        "VLLMDoubleBufferWeightReceiver",
        "VLLMDoubleBufferWeightSender",
        "VLLMWeightReceiver",
        "VLLMWeightSender",
        "VLLMWeightSyncScheme",
        "get_model_metadata",
        "get_sglang_model_metadata",
    ],
}

# what TorchRL's sota-implementations/grpo and expert-iteration scripts, test/llm and the LLM
# tutorials (llm_wrappers, llm_browser, trl_interop) import, by module, at COMMIT (private names left out)
TORCHRL_IMPORTED = {
    "torchrl": ["logger", "merge_ray_runtime_env", "torchrl_logger"],
    "torchrl._utils": ["logger", "timeit"],
    "torchrl.collectors.llm": ["LLMCollector", "RayLLMCollector"],
    "torchrl.collectors.llm.base": ["LLMCollector"],
    "torchrl.collectors.llm.weight_update.vllm": ["vLLMUpdater"],
    "torchrl.collectors.llm.weight_update.vllm_v2": ["vLLMUpdaterV2"],
    "torchrl.data": [
        "History",
        "LazyStackStorage",
        "ListStorage",
        "PrioritizedSampler",
        "RayReplayBuffer",
        "ReplayBuffer",
        "SamplerWithoutReplacement",
        "TensorDictReplayBuffer",
        "Unbounded",
    ],
    "torchrl.data.llm": ["History"],
    "torchrl.data.llm.history": ["ContentBase", "History", "add_chat_template"],
    "torchrl.data.llm.topk": ["TopKRewardSelector"],
    "torchrl.data.replay_buffers.ray_buffer": ["RayReplayBuffer"],
    "torchrl.envs": ["AsyncEnvPool", "SerialEnv", "StepCounter", "Transform"],
    "torchrl.envs.llm": [
        "AddThinkingPrompt",
        "ChatEnv",
        "GSM8KEnv",
        "KLRewardTransform",
        "RetrieveKL",
        "RetrieveLogProb",
        "make_gsm8k_env",
        "make_mlgym",
    ],
    "torchrl.envs.llm.chat": ["ChatEnv"],
    "torchrl.envs.llm.datasets.countdown": ["CountdownEnv"],
    "torchrl.envs.llm.datasets.ifeval": ["IFEvalEnv"],
    "torchrl.envs.llm.datasets.math": ["MATHEnv"],
    "torchrl.envs.llm.reward.countdown": ["CountdownRewardParser"],
    "torchrl.envs.llm.reward.gsm8k": ["GSM8KRewardParser"],
    "torchrl.envs.llm.reward.ifeval._scorer": ["IFEvalScoreData", "IfEvalScorer"],
    "torchrl.envs.llm.reward.math": ["MATHRewardParser"],
    "torchrl.envs.llm.transforms": [
        "AddThinkingPrompt",
        "ExecuteToolsInOrder",
        "IncrementalTokenizer",
        "JSONCallParser",
        "MCPToolTransform",
        "PolicyVersion",
        "PythonInterpreter",
        "ToolCall",
        "ToolRegistry",
        "XMLBlockParser",
    ],
    "torchrl.envs.llm.transforms.browser": ["BrowserTransform"],
    "torchrl.envs.llm.transforms.kl": ["KLComputation", "RetrieveKL", "RetrieveLogProb"],
    "torchrl.envs.llm.transforms.tools": ["SimpleToolTransform"],
    "torchrl.envs.transforms": ["TransformedEnv"],
    # TorchRL's LLM distribution, in its packages' __all__ (TorchRL's distribution tests import it)
    "torchrl.modules": ["LLMMaskedCategorical"],
    "torchrl.modules.distributions": ["LLMMaskedCategorical"],
    "torchrl.modules.distributions.discrete": ["LLMMaskedCategorical"],
    "torchrl.modules.llm": [
        "AsyncVLLM",
        "HFRewardModelWrapper",
        "SGLangWrapper",
        "TorchRLBufferDataset",
        "TransformersWrapper",
        "vLLMWrapper",
    ],
    "torchrl.modules.llm.backends": [
        "AsyncSGLang",
        "AsyncVLLM",
        "LocalLLMWrapper",
        "RLSGLangEngine",
        "RLvLLMEngine",
        "RayLLMWorker",
        "make_vllm_worker",
    ],
    "torchrl.modules.llm.backends.sglang": ["AsyncSGLang"],
    "torchrl.modules.llm.backends.vllm": ["AsyncVLLM", "vllm_async"],
    "torchrl.modules.llm.backends.vllm.vllm_plugin": [
        "FP32_MODEL_OVERRIDES",
        "FP32_OVERRIDES_ENV_VAR",
        "fp32_overrides_enabled",
        "register_fp32_overrides",
    ],
    "torchrl.modules.llm.policies": [
        "ChatHistory",
        "RemoteTransformersWrapper",
        "SGLangWrapper",
        "TransformersWrapper",
        "vLLMWrapper",
    ],
    "torchrl.modules.llm.policies.common": ["ChatHistory", "LogProbs", "Masks", "Text", "Tokens"],
    "torchrl.modules.llm.policies.transformers_wrapper": ["TransformersWrapper"],
    "torchrl.modules.llm.policies.vllm_wrapper": ["vLLMWrapper"],
    "torchrl.modules.llm.trl_interop": ["HFRewardModelWrapper", "TorchRLBufferDataset"],
    "torchrl.objectives.llm.distillation": ["DistillationLoss", "DistillationLossOutput", "k3_kl_token_estimate"],
    "torchrl.objectives.llm.grpo": [
        "CISPOLoss",
        "CISPOLossOutput",
        "GRPOLoss",
        "GRPOLossOutput",
        "MCAdvantage",
        "MCAdvantageSelector",
        "RayMCAdvantage",
    ],
    "torchrl.objectives.llm.sft": ["SFTLoss"],
    "torchrl.record.loggers.wandb": ["WandbLogger"],
    "torchrl.testing": [
        "DummyStrDataLoader",
        "WorkerTransformerDoubleBuffer",
        "WorkerTransformerNCCL",
        "WorkerVLLMDoubleBuffer",
        "WorkerVLLMNCCL",
    ],
    "torchrl.testing.mocking_classes": ["CountingEnv"],
    "torchrl.weight_update.llm": [
        "SGLangCollectiveTransport",
        "SGLangWeightSender",
        "SGLangWeightSyncScheme",
        "VLLMWeightSyncScheme",
        "get_model_metadata",
        "get_sglang_model_metadata",
    ],
    "torchrl.weight_update.llm.vllm_double_buffer": ["VLLMDoubleBufferWeightReceiver"],
}

# what TorchRL's LLM docs and docstring examples and its LLM modules import from torchrl.envs and
# its submodules, and the packages that re-export the replay-buffer pieces and WandbLogger, at COMMIT
# (public names rlpost has; the others are TorchRL's internals)
TORCHRL_LLM_CODE_IMPORTED = {
    "torchrl.data": ["RandomSampler", "Storage"],
    "torchrl.data.replay_buffers": [
        "LazyStackStorage",
        "ListStorage",
        "PrioritizedSampler",
        "RandomSampler",
        "RayReplayBuffer",
        "ReplayBuffer",
        "Sampler",
        "SamplerWithoutReplacement",
        "Storage",
        "TensorDictReplayBuffer",
    ],
    "torchrl.envs": ["Compose", "EnvBase", "LLMHashingEnv", "TransformedEnv"],
    "torchrl.envs.common": ["EnvBase"],
    "torchrl.envs.transforms": ["Compose", "StepCounter", "Transform", "TransformedEnv"],
    "torchrl.envs.transforms.transforms": ["Compose", "StepCounter", "Transform", "TransformedEnv"],
    "torchrl.envs.llm.chat": ["DatasetChatEnv"],
    "torchrl.envs.llm.envs": ["LLMEnv", "LLMHashingEnv"],
    "torchrl.envs.llm.datasets.gsm8k": ["GSM8KEnv", "GSM8KPrepareQuestion", "make_gsm8k_env"],
    "torchrl.envs.llm.transforms.dataloading": [
        "DataLoadingPrimer",
        "RayDataLoadingPrimer",
        "as_nested_tensor",
        "as_padded_tensor",
    ],
    "torchrl.envs.llm.transforms.policy_version": ["PolicyVersion"],
    "torchrl.envs.llm.transforms.tokenizer": ["IncrementalTokenizer", "Tokenizer"],
    "torchrl.record": ["WandbLogger"],
    "torchrl.record.loggers": ["WandbLogger"],
}

# names defined in a submodule that a package's __all__ lists (torchrl.modules.llm.backends.vllm's
# __all__ has the submodule vllm_async), at COMMIT
TORCHRL_DEFINED = {
    "torchrl.modules.llm.backends.vllm.vllm_async": ["AsyncVLLM", "make_async_vllm_engine"],
    "torchrl._utils": ["logger", "merge_ray_runtime_env", "timeit"],
}


def torchrl_names():
    for source in (TORCHRL_ALL, TORCHRL_IMPORTED, TORCHRL_LLM_CODE_IMPORTED, TORCHRL_DEFINED):
        for path, names in source.items():
            for name in names:
                yield path, name


def test_every_torchrl_name_resolves_at_its_path_to_rlposts_object_or_a_placeholder():
    resolved, placeholders = 0, []
    for path, name in sorted(set(torchrl_names())):
        module_path = path.removeprefix("torchrl").removeprefix(".")
        module = importlib.import_module("rlpost.torchrl" + (f".{module_path}" if module_path else ""))
        value = getattr(module, name)
        target = TREE[module_path].get(name)  # None: a submodule
        if isinstance(value, NotInRlpost):
            assert value is target, (path, name)
            placeholders.append(f"{path}.{name}")
        elif isinstance(target, str):  # the very object rlpost's module holds
            rlpost_module, attribute = target.split(":")
            assert value is getattr(importlib.import_module(rlpost_module), attribute), (path, name)
            resolved += 1
        else:
            assert isinstance(value, type(sys)), (path, name)  # a submodule
    # what rlpost has today; the rest are the placeholders, each with its reason
    assert resolved >= 245, resolved  # what resolves today; more as the placeholders become real
    print(f"{resolved} resolved to rlpost's objects, {len(placeholders)} placeholders")


def test_the_table_holds_nothing_torchrl_lacks():
    listed = {(path, name) for path, name in torchrl_names()}
    for module_path, names in TREE.items():
        path = "torchrl" + (f".{module_path}" if module_path else "")
        for name in names:
            assert (path, name) in listed, f"{path}.{name} is not a TorchRL name at {COMMIT}"


def test_star_imports_give_the_modules_all_and_the_names_are_the_same_objects():
    namespace = {}
    exec("from rlpost.torchrl.envs.llm import *", namespace)
    assert set(TORCHRL_ALL["torchrl.envs.llm"]) <= set(namespace)
    import rlpost.envs
    import rlpost.torchrl.envs.llm.transforms as transforms

    assert namespace["ChatEnv"] is rlpost.envs.ChatEnv and transforms.RetrieveKL is rlpost.envs.RetrieveKL


def test_a_missing_name_imports_and_raises_at_use_naming_why():
    from rlpost.torchrl.data.llm import PromptData
    from rlpost.torchrl.modules.llm import SGLangWrapper

    missing = PromptData
    for use in (lambda: missing(), lambda: missing.default_keys, lambda: types.new_class("Mine", (missing,))):
        with pytest.raises(NotImplementedError, match="PromptData: TorchRL's earlier RLHF data pipeline"):
            use()
    with pytest.raises(NotImplementedError, match="vLLM only: use vLLMWrapper"):
        SGLangWrapper(None)
    # one placeholder per name, whatever path it is imported from
    assert resolve("data.llm", "PromptData") is missing
    assert resolve("modules.llm.policies", "SGLangWrapper") is SGLangWrapper


def test_unknown_paths_and_names_are_clear_errors():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("rlpost.torchrl.envs.nope")
    import rlpost.torchrl.envs.llm as llm

    with pytest.raises(AttributeError, match="no 'NoSuchEnv' in torchrl.envs.llm"):
        getattr(llm, "NoSuchEnv")  # noqa: B009


def test_importing_the_namespace_loads_neither_vllm_nor_ray():
    script = (
        "import sys; from rlpost.torchrl.modules.llm import vLLMWrapper, make_vllm_worker; "
        "from rlpost.torchrl.collectors.llm import LLMCollector; "
        "print(sorted(m for m in ('vllm', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]"]


def test_get_model_metadata_is_one_function_at_both_of_torchrls_places():
    import torch

    from rlpost.collect import vLLMUpdater
    from rlpost.torchrl.weight_update.llm import get_model_metadata

    assert vLLMUpdater.get_model_metadata is get_model_metadata
    model = torch.nn.Linear(3, 2)
    assert get_model_metadata(model) == {
        "weight": (torch.float32, torch.Size([2, 3])),
        "bias": (torch.float32, torch.Size([2])),
    }
