"""LLM policies: one interface (LLMWrapperBase) over transformers and vLLM.

The wrappers, their bases and the containers they fill are importable from here, as from
``torchrl.modules.llm.policies``. Importing it imports neither vLLM nor a model (engines come
from ``make_vllm_engine`` / :func:`rlpost.actors.vllm_workers.make_vllm_worker` or are passed
in); ``LLMOnDevice`` is loaded on first access.
"""

from rlpost.data.llm_data import ChatHistory, LogProbs, Masks, Text, Tokens
from rlpost.policies.base import Completion, LLMWrapperBase
from rlpost.policies.batching import BatchQueue
from rlpost.policies.categorical import CategoricalSequential, LLMMaskedCategorical
from rlpost.policies.generation import normalize_generate_kwargs
from rlpost.policies.remote_client import RemoteVLLMClient
from rlpost.policies.remote_transformers import RemoteTransformersWrapper
from rlpost.policies.transformers_wrapper import TransformersWrapper
from rlpost.policies.trl_interop import HFRewardModelWrapper, TorchRLBufferDataset
from rlpost.policies.vllm_client import LocalVLLMClient, VLLMEngineClient, processed_logprobs
from rlpost.policies.vllm_engine import WORKER_EXTENSION as VLLM_WORKER_EXTENSION
from rlpost.policies.vllm_engine import make_vllm_engine, shutdown_vllm_engine
from rlpost.policies.vllm_worker_ext import WeightSyncExtension as vLLMWorker  # noqa: N812 (TorchRL's name)
from rlpost.policies.vllm_wrapper import vLLMWrapper

__all__ = [
    "BatchQueue",
    "CategoricalSequential",
    "ChatHistory",
    "Completion",
    "HFRewardModelWrapper",
    "LLMMaskedCategorical",
    "LLMOnDevice",
    "LLMWrapperBase",
    "LocalVLLMClient",
    "LogProbs",
    "Masks",
    "RemoteTransformersWrapper",
    "RemoteVLLMClient",
    "Text",
    "Tokens",
    "TorchRLBufferDataset",
    "TransformersWrapper",
    "VLLMEngineClient",
    "VLLM_WORKER_EXTENSION",
    "make_vllm_engine",
    "normalize_generate_kwargs",
    "processed_logprobs",
    "shutdown_vllm_engine",
    "vLLMWorker",
    "vLLMWrapper",
]


def __getattr__(name: str):
    if name == "LLMOnDevice":
        from rlpost.policies.on_device import llm_on_device_class

        return llm_on_device_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
