"""Fixtures of the TorchRL compatibility tier.

The tier runs TorchRL's documented examples with two substitutions: rlpost's imports, and the
offline tiny model instead of a hub model. Its ``vllm.LLM``, built as TorchRL's tutorial builds
it, is the suite's shared ``plain_llm`` (tests/conftest.py): one engine for the tier.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
