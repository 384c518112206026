"""Data types of rlpost's LLM stack: chat histories and the containers the policies fill."""

from rlpost.data.content import ContentBase
from rlpost.data.history import PAD_ROLE, History, HistoryError
from rlpost.data.llm_data import ChatHistory, LLMData, LogProbs, Masks, Text, Tokens
from rlpost.data.stacking import as_nested_tensor, as_padded_tensor
from rlpost.data.templates import add_chat_template

__all__ = [
    "PAD_ROLE",
    "ChatHistory",
    "ContentBase",
    "History",
    "HistoryError",
    "LLMData",
    "LogProbs",
    "Masks",
    "Text",
    "Tokens",
    "add_chat_template",
    "as_nested_tensor",
    "as_padded_tensor",
]
