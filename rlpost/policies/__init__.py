"""LLM policies: one interface (LLMWrapperBase) over transformers and vLLM.

Importing this package imports neither vLLM nor a model; engines are created by the caller
(``make_vllm_engine``) or passed in.
"""

from rlpost.policies.base import Completion, LLMWrapperBase, normalize_generate_kwargs
from rlpost.policies.transformers_wrapper import TransformersWrapper
from rlpost.policies.vllm_wrapper import (
    LocalVLLMClient,
    VLLMEngineClient,
    make_vllm_engine,
    shutdown_vllm_engine,
    vLLMWrapper,
)

__all__ = [
    "Completion",
    "LLMWrapperBase",
    "LocalVLLMClient",
    "TransformersWrapper",
    "VLLMEngineClient",
    "make_vllm_engine",
    "normalize_generate_kwargs",
    "shutdown_vllm_engine",
    "vLLMWrapper",
]
