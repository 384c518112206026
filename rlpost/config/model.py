"""The ``model`` section: the weights, their dtype, the tokenizer and chat template, LoRA (``model.lora``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlpost.config.base import Section

# The adapter ranks vLLM's engines are built for (its ``max_lora_rank`` choices).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraConfig(Section):
    """Train a LoRA adapter (``peft``) instead of every weight; the engines serve it with vLLM's LoRA."""

    rank: int = Field(
        16, ge=1, le=VLLM_LORA_RANKS[-1], description="The adapter's rank r (vLLM serves ranks up to 512)."
    )
    alpha: float = Field(32.0, gt=0, description="LoRA's alpha: the update is scaled by alpha / rank.")
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter's input in the training passes only (never when scoring or "
        "generating); it makes the new/old probability ratio noisy, so RL runs usually keep 0.",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Names (last part) of the linear layers that get an adapter; the default fits Llama, Qwen "
        "and Mistral models.",
    )
    sync: Literal["auto", "adapter", "merged"] = Field(
        "auto",
        description="What each weight sync sends: 'adapter' (the adapter's tensors, served with vLLM's LoRA), "
        "'merged' (every projection's weight with the adapter merged in; no LoRA in the engines) or 'auto': merged "
        "on CPU engines (resources.inference.num_gpus: 0), whose LoRA kernels are slow (steps 15.2 s merged "
        "against 18.8 s, BENCHMARKS.md section 13), else adapter, or merged with a warning where an engine "
        "cannot serve LoRA.",
    )
    save_merged: bool = Field(
        False,
        description="Checkpoints also hold the merged model in HF format (step_<N>/merged/, loadable "
        "with AutoModelForCausalLM); the adapter is always saved.",
    )


class ModelConfig(Section):
    """The policy model (also the frozen reference and the learner's starting point)."""

    name_or_path: str = Field(
        "models/tiny-model",
        description="Hugging Face hub name (GPU users) or local folder; the default is the offline tiny "
        "model shipped in models/ (`rlpost make-tiny-model` rebuilds it).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype for inference and the reference; fp32 on CPU."
    )
    tokenizer: str | None = Field(None, description="Tokenizer name or path; defaults to `name_or_path`.")
    chat_template: str | None = Field(
        None,
        description="Jinja chat template (inline text or a path to a .jinja file) replacing the "
        "tokenizer's own; it must mark assistant turns with {% generation %} for assistant masks.",
    )
    trust_remote_code: bool = Field(False, description="Allow custom model code from the hub.")
    lora: LoraConfig | None = Field(
        None,
        description="Train a LoRA adapter on the frozen base model instead of every weight (null: full "
        "fine-tuning). Set `model.lora={}` for the defaults.",
    )
    chunked_scoring: bool = Field(
        True,
        description="The learner and the reference actor compute log-probs (and the exact entropy) through the "
        "LM head in chunks of tokens, never holding the [tokens, vocabulary] logits whole (0.21x the dense peak "
        "memory for a 4,096-token row of a 151,936 vocabulary, at 1.1-1.3x its time). Llama, Mistral, Qwen2/3 "
        "and Phi-3 families, LoRA and sharded groups included. false: always the dense logits.",
    )
    pack_sequences: bool = Field(
        True,
        description="With chunked scoring, the learner and the reference actor pack a forward pass's rows end "
        "to end (each with its own position ids, attending only to itself) in rows as wide as the longest, "
        "instead of padding each. Needs attention that reads packed rows from position ids (sdpa, eager, flash, "
        "flex); others pad. Same values and gradients as padding.",
    )

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.name_or_path
