"""LLM policies: one interface (LLMWrapperBase) over transformers and vLLM.

TorchRL's layout: the wrappers, their base classes and the containers they fill (ChatHistory,
Text, Tokens, LogProbs, Masks, also in :mod:`rlpost.data`) are importable from here, as from
``torchrl.modules.llm.policies``. Importing this package imports neither vLLM nor a model;
engines are created by the caller (``make_vllm_engine``) or passed in. ``LLMOnDevice`` is built
on first access (it subclasses ``vllm.LLM``).
"""

from rlpost.data.llm_data import ChatHistory, LogProbs, Masks, Text, Tokens
from rlpost.policies.base import Completion, LLMWrapperBase
from rlpost.policies.generation import normalize_generate_kwargs
from rlpost.policies.categorical import CategoricalSequential
from rlpost.policies.transformers_wrapper import TransformersWrapper
from rlpost.policies.vllm_wrapper import (
    LocalVLLMClient,
    VLLMEngineClient,
    make_vllm_engine,
    processed_logprobs,
    shutdown_vllm_engine,
    vLLMWrapper,
)

__all__ = [
    "CategoricalSequential",
    "ChatHistory",
    "Completion",
    "LLMOnDevice",
    "LLMWrapperBase",
    "LocalVLLMClient",
    "LogProbs",
    "Masks",
    "Text",
    "Tokens",
    "TransformersWrapper",
    "VLLMEngineClient",
    "make_vllm_engine",
    "normalize_generate_kwargs",
    "processed_logprobs",
    "shutdown_vllm_engine",
    "vLLMWrapper",
]


def __getattr__(name: str):
    if name == "LLMOnDevice":
        from rlpost.policies.on_device import llm_on_device_class

        return llm_on_device_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
