"""Build the offline tiny model: a ChatML tokenizer and a small Qwen2 LM warm-started on arithmetic.

Why it exists: tests and the demo must run a real GRPO job with real transformers and a real vLLM
engine on 2 CPU cores with no hub access. So rlpost builds its own model, deterministically from a
seed, in well under 3 minutes:

1. a byte-level BPE tokenizer trained on the synthetic arithmetic chats, with the ChatML special
   tokens of Qwen (``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``) and a Qwen-style chat
   template whose assistant turns are wrapped in ``{% generation %}`` so that
   ``return_assistant_tokens_mask=True`` works. ``pad_token == eos_token == <|im_end|>`` on
   purpose: it is the configuration that hides the "EOS log-prob masked as padding" bug
   (REFERENCE.md pitfall 2), so every test runs with the trap armed.
2. a Qwen2-architecture causal LM with head_dim 64 (the vLLM CPU backend rejects 16), trained with
   a short supervised pass on "What is a + b?" -> "<answer>c</answer>" until its sampled reward
   (temperature 1.0) lies in ``target_reward`` — room for GRPO to show learning.

The result is an ordinary Hugging Face folder that both transformers and vLLM load.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from rlpost.envs.arithmetic import ARITHMETIC_SYSTEM_PROMPT, make_arithmetic_rows
from rlpost.envs.rewards import answer_reward

CHATML_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen2.5-style ChatML template. Assistant content (and its <|im_end|>) sits inside
# {% generation %} so transformers can return the assistant-token mask. Tool messages render the
# way Qwen renders them: a user turn wrapping the content in <tool_response> tags.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines the tiny model's bytes; the same spec gives identical files."""

    seed: int = 0
    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2  # head_dim = 128 / 2 = 64, the smallest size vLLM's CPU attention accepts
    num_kv_heads: int = 1
    intermediate_size: int = 384
    max_position_embeddings: int = 512
    sft_rows: int = 4000
    batch_size: int = 64
    lr: float = 1e-3
    max_sft_steps: int = 2000
    eval_every: int = 25
    eval_prompts: int = 128
    target_reward: tuple[float, float] = (0.35, 0.5)
    num_threads: int = 2  # fixed so that float reductions, hence the files, do not vary by machine


def build_tiny_model(
    out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec(), log: Callable[[str], None] = print
) -> dict:
    """Build the tokenizer and model into ``out_dir`` (atomically) and return its metadata.

    The folder is written to a temporary sibling and renamed, so an interrupted build never
    leaves a half-written model that later runs would trust.
    """
    out_dir = Path(out_dir)
    torch.set_num_threads(spec.num_threads)
    torch.manual_seed(spec.seed)
    start = time.perf_counter()

    tokenizer = _build_tokenizer(spec)
    log(f"tokenizer: {len(tokenizer)} tokens, eos=pad={tokenizer.eos_token!r}")
    model = _init_model(spec, tokenizer)
    log(f"model: Qwen2, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    steps, reward = _supervised_warm_start(model, tokenizer, spec, log)

    meta = {
        "spec": asdict(spec),
        "sft_steps": steps,
        "start_reward_estimate": reward,
        "build_seconds": round(time.perf_counter() - start, 1),
        "system_prompt": ARITHMETIC_SYSTEM_PROMPT,
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # build_seconds varies run to run; keep it out of the deterministic artefacts' file
        (tmp / "rlpost_tiny_model.json").write_text(
            json.dumps({k: v for k, v in meta.items() if k != "build_seconds"}, indent=2) + "\n"
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"tiny model written to {out_dir} in {meta['build_seconds']} s")
    return meta


def built_spec(out_dir: str | Path) -> dict | None:
    """The spec a folder was built with (None when it holds no tiny model)."""
    meta = Path(out_dir) / "rlpost_tiny_model.json"
    if not (Path(out_dir) / "config.json").is_file() or not meta.is_file():
        return None
    return json.loads(meta.read_text()).get("spec")


def ensure_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec(), log: Callable[[str], None] = print) -> bool:
    """Build the tiny model unless ``out_dir`` already holds one built from the same spec.

    Returns True when it built. A cached model from an older spec is rebuilt, so a change of
    :class:`TinyModelSpec` never leaves tests or the demo on stale weights.
    """
    current = json.loads(json.dumps(asdict(spec)))  # tuples -> lists, as stored
    found = built_spec(out_dir)
    if found == current:
        return False
    if found is not None:
        log(f"tiny model at {out_dir} was built from another spec; rebuilding")
    build_tiny_model(out_dir, spec, log)
    return True


def _chat(question: str, answer: str | None = None) -> list[dict[str, str]]:
    messages = [
        {"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT},
        {"role": "user", "content": question},
    ]
    if answer is not None:
        messages.append({"role": "assistant", "content": f"<answer>{answer}</answer>"})
    return messages


def _build_tokenizer(spec: TinyModelSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    # Digits one by one (as Qwen does), then GPT-2 style byte-level pieces.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=CHATML_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    rows = make_arithmetic_rows(2000, seed=spec.seed + 7)
    corpus = [
        f"<|im_start|>system\n{ARITHMETIC_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{r['question']}"
        f"<|im_end|>\n<|im_start|>assistant\n<think>{r['question']}</think><answer>{r['answer']}</answer>"
        for r in rows
    ]
    corpus += [_GENERAL_TEXT] * 20
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
        padding_side="left",
    )


# A little ordinary text so the tokenizer has merges for the words that system prompts, GSM8K
# questions and tool messages use; every byte is encodable regardless.
_GENERAL_TEXT = (
    "You are a helpful assistant. Think step by step inside <think> </think> and give the final "
    "answer inside <answer> </answer>. Here is a block of code to be executed in python:\n"
    "```python\nprint('the answer is', 6 * 7)\n```\n<tool_response>\nCode block 1 executed "
    "successfully:\nthe answer is 42\n\n</tool_response> How many apples does she have left? "
    "The total cost of the tickets is $12.50, so he pays 3 times as much."
)


def _init_model(spec: TinyModelSpec, tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    vocab = int(math.ceil(len(tokenizer) / 64) * 64)  # padded like real checkpoints
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    return model


def _encode_sft_batch(tokenizer, rows: list[dict[str, str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels (-100 outside assistant tokens)."""
    encoded = [
        tokenizer.apply_chat_template(
            _chat(r["question"], r["answer"]), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        for r in rows
    ]
    length = max(len(e["input_ids"]) for e in encoded)
    ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    for i, e in enumerate(encoded):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        attn[i, :n] = 1
        mask = torch.tensor(e["assistant_masks"], dtype=torch.bool)
        labels[i, :n] = torch.where(mask, ids[i, :n], torch.tensor(-100))
    return ids, attn, labels


def _supervised_warm_start(model, tokenizer, spec: TinyModelSpec, log) -> tuple[int, float]:
    """Train on assistant tokens until the sampled reward enters ``spec.target_reward``."""
    rows = make_arithmetic_rows(spec.sft_rows, seed=spec.seed + 1)
    eval_rows = make_arithmetic_rows(spec.eval_prompts, seed=spec.seed + 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(spec.seed)
    reward = evaluate_reward(model, tokenizer, eval_rows, seed=spec.seed)
    log(f"sft step 0: sampled reward {reward:.3f}")
    low, high = spec.target_reward
    for step in range(1, spec.max_sft_steps + 1):
        model.train()
        idx = torch.randint(len(rows), (spec.batch_size,), generator=generator).tolist()
        ids, attn, labels = _encode_sft_batch(tokenizer, [rows[i] for i in idx])
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % spec.eval_every == 0:
            reward = evaluate_reward(model, tokenizer, eval_rows, seed=spec.seed)
            log(f"sft step {step}: loss {loss.item():.3f}, sampled reward {reward:.3f}")
            if low <= reward <= high:
                return step, reward
            if reward > high:
                raise RuntimeError(
                    f"tiny model overshot the target reward band {spec.target_reward} at step {step} "
                    f"(reward {reward:.3f}); lower TinyModelSpec.eval_every or lr"
                )
    raise RuntimeError(
        f"tiny model did not reach the target reward band {spec.target_reward} in "
        f"{spec.max_sft_steps} steps (last reward {reward:.3f})"
    )


@torch.no_grad()
def evaluate_reward(model, tokenizer, rows: list[dict[str, str]], *, seed: int, temperature: float = 1.0) -> float:
    """Mean answer reward of one sampled completion per row (transformers generate, seeded)."""
    model.eval()
    prompts = [tokenizer.apply_chat_template(_chat(r["question"]), tokenize=False, add_generation_prompt=True) for r in rows]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    out = model.generate(
        **batch,
        do_sample=True,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        max_new_tokens=16,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    rewards = [answer_reward(c, r["answer"]) for c, r in zip(completions, rows)]
    return sum(rewards) / len(rewards)
