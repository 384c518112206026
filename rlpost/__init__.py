"""rlpost: Ray-native distributed RL post-training (GRPO) of LLMs with vLLM inference workers."""

__version__ = "0.1.0"
