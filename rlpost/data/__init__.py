"""Data types of rlpost's LLM stack: chat histories, the containers the policies fill, and a replay
buffer with its storages and samplers (a prioritized one too, and TorchRL's TensorDictReplayBuffer),
also as a Ray actor (RayReplayBuffer)."""

from rlpost.data.content import ContentBase
from rlpost.data.history import PAD_ROLE, History, HistoryError
from rlpost.data.llm_data import ChatHistory, LLMData, LogProbs, Masks, Text, Tokens
from rlpost.data.prioritized import PrioritizedSampler
from rlpost.data.ray_replay_buffer import RayReplayBuffer
from rlpost.data.replay_buffers import ReplayBuffer
from rlpost.data.samplers import RandomSampler, Sampler, SamplerWithoutReplacement
from rlpost.data.stacking import as_nested_tensor, as_padded_tensor
from rlpost.data.storages import LazyStackStorage, ListStorage, Storage
from rlpost.data.templates import add_chat_template
from rlpost.data.tensordict_replay_buffer import TensorDictReplayBuffer

__all__ = [
    "PAD_ROLE",
    "ChatHistory",
    "ContentBase",
    "History",
    "HistoryError",
    "LLMData",
    "LazyStackStorage",
    "ListStorage",
    "LogProbs",
    "Masks",
    "PrioritizedSampler",
    "RandomSampler",
    "RayReplayBuffer",
    "ReplayBuffer",
    "Sampler",
    "SamplerWithoutReplacement",
    "Storage",
    "TensorDictReplayBuffer",
    "Text",
    "Tokens",
    "add_chat_template",
    "as_nested_tensor",
    "as_padded_tensor",
]
