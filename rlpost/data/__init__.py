"""Data types of rlpost's LLM stack: chat histories and the containers the policies fill."""

from rlpost.data.history import PAD_ROLE, History
from rlpost.data.llm_data import ChatHistory, LogProbs, Masks, Text, Tokens

__all__ = ["PAD_ROLE", "ChatHistory", "History", "LogProbs", "Masks", "Text", "Tokens"]
