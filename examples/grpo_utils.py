"""What examples/grpo_sync.py and examples/grpo_async.py share, as TorchRL's
``sota-implementations/grpo/grpo_utils.py`` is shared by its two GRPO scripts: the config, the
env, the inference fleet, the trainer's model and the weight-sync scheme.

Everything is imported as TorchRL's scripts import it, with ``torchrl`` replaced by
``rlpost.torchrl``. The differences from TorchRL's own utilities are the CPU set-up: a plain
dataclass instead of a hydra config, the offline tiny model, and a task the script writes
itself (arithmetic questions in GSM8K's row format, so GSM8KEnv scores them with its own parser).

The trainer's model carries TorchRL's default LoRA adapter (``train_model.lora.enabled: true``,
rank 8, alpha 16, every linear layer), built as TorchRL's ``get_hf_model`` builds it, and the
weight-sync scheme is given that peft model, as TorchRL's scripts give it: each update sends its
merged weights under the base model's names (``Config(lora=False)`` trains every weight).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from rlpost.torchrl import torchrl_logger
from rlpost.torchrl.envs.llm import GSM8KEnv
from rlpost.torchrl.modules.llm import TransformersWrapper, vLLMWrapper
from rlpost.torchrl.modules.llm.backends.vllm import AsyncVLLM
from rlpost.torchrl.weight_update.llm import VLLMWeightSyncScheme

SYSTEM_PROMPT = "Answer with <answer>number</answer>."  # the tiny model's answer format


@dataclass
class Config:
    """The run's settings (TorchRL's hydra config, reduced to what these scripts read)."""

    model: str = "models/tiny-model"  # a local model folder (the tiny model: ``make tiny-model``)
    num_replicas: int = 1  # vLLM replicas in the AsyncVLLM fleet
    replica_cpus: float = 1.0  # CPUs Ray reserves for each replica
    num_collectors: int = 1  # RayLLMCollector actors (the async script; the sync one has one)
    repeats: int = 8  # completions per prompt (the GRPO group)
    groups_per_batch: int = 2  # groups each collector batch holds
    questions: int = 8  # distinct questions the prompts cycle through (few: the reward climbs fast)
    max_tokens: int = 16
    temperature: float = 1.0
    lr: float = 3e-4
    lora: bool = True  # TorchRL's train_model.lora.enabled (its default)
    lora_r: int = 8  # train_model.lora.r
    lora_alpha: int = 16  # train_model.lora.alpha
    clip_grad_norm: float = 1.0
    steps: int = 10  # optimizer steps (sync: one per collected batch; async: one per sample)
    buffer_size: int = 64  # the async buffer's capacity (its oldest items are overwritten)
    weight_update_frequency: int = 1  # async: optimizer steps between weight updates
    seed: int = 0
    dataloader_actor_name: str = "arithmetic_dataloader"

    @property
    def dialog_turns_per_batch(self) -> int:
        return self.repeats * self.groups_per_batch


def arithmetic_rows(num_rows: int, seed: int) -> list[dict[str, str]]:
    """``num_rows`` questions "What is a + b?" with GSM8K's answer format (``#### c``)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        a, b = rng.randint(0, 10), rng.randint(0, 10)
        rows.append({"question": f"What is {a} + {b}?", "answer": f"#### {a + b}"})
    return rows


def make_env(cfg: Config):
    """The env each collector builds in its actor: GSM8KEnv on the script's rows, every prompt
    ``repeats`` times in one reset (one GRPO group per env batch), prompts drawn from one shared
    data-loading actor (``ray_backend=True``), so collectors never serve the same draw twice."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    return GSM8KEnv(
        dataset=arithmetic_rows(cfg.questions, cfg.seed), tokenizer=tokenizer, num_envs=cfg.repeats,
        repeats=cfg.repeats, seed=cfg.seed, system_prompt=SYSTEM_PROMPT, ray_backend=True,
        dataloader_actor_name=cfg.dataloader_actor_name,
    )  # fmt: skip


def get_inference_model(cfg: Config) -> vLLMWrapper:
    """The policy: vLLMWrapper on an AsyncVLLM fleet (on CPU: a fixed KV-cache size, no CUDA graphs)."""
    fleet = AsyncVLLM.from_pretrained(
        cfg.model, num_replicas=cfg.num_replicas, verbose=False, compile=False, dtype=torch.float32,
        max_model_len=256, kv_cache_space_gb=0.25, max_num_seqs=64, enforce_eager=True, seed=cfg.seed,
        num_cpus=cfg.replica_cpus,
    )  # fmt: skip
    torchrl_logger.info(f"Inference fleet: {fleet}")
    return vLLMWrapper(
        fleet, input_mode="history", return_log_probs=True, pad_output=False,
        generate_kwargs={"max_tokens": cfg.max_tokens, "temperature": cfg.temperature},
    )  # fmt: skip


def get_train_model(cfg: Config):
    """The trainer's policy: the same model under transformers, scoring the engine's tokens; with
    ``cfg.lora`` a peft model whose LoRA adapter is all that trains (TorchRL's ``get_hf_model``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    if cfg.lora:
        model = add_lora(model, cfg)
    model.eval()
    policy = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate=False,
                                 return_log_probs=True, pad_output=False)  # fmt: skip
    return policy, tokenizer


def add_lora(model, cfg: Config):
    """``model`` under peft with TorchRL's LoRA settings: every linear layer, no dropout (its
    ``get_hf_model`` fixes 0.0 whatever the config says), no bias, the base frozen and the
    adapters trainable in fp32."""
    from peft import LoraConfig, get_peft_model

    lora_config = LoraConfig(
        r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules="all-linear", lora_dropout=0.0, bias="none",
        task_type="CAUSAL_LM", inference_mode=False, init_lora_weights=True,
    )  # fmt: skip
    model = get_peft_model(model, lora_config, autocast_adapter_dtype=True)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(torch.float32)
            param.requires_grad_(True)
    return model


def make_weight_sync_scheme(vllm_engine) -> VLLMWeightSyncScheme:
    """TorchRL's scheme for the fleet: its group's address and size."""
    return VLLMWeightSyncScheme(
        master_address=vllm_engine.get_master_address(), master_port=vllm_engine.get_master_port(),
        gpus_per_replica=vllm_engine.get_tp_size(), num_replicas=vllm_engine.num_replicas, strategy="state_dict",
    )  # fmt: skip


def batch_reward(batch) -> float:
    """The mean reward of a sampled batch."""
    return float(batch.get(("next", "reward")).float().mean())
