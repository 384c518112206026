"""Build the offline tiny model: a ChatML tokenizer and a small Qwen2 LM warm-started on arithmetic.

Tests and the demo run a real GRPO job with real transformers and vLLM on 2 CPU cores with no hub
access, so rlpost builds its own model from a seed in under 3 minutes (the same bytes on one kind
of CPU, not across kinds: the result is shipped in models/, see models/README.md): a byte-level BPE
tokenizer trained on the synthetic chats, with Qwen's ChatML special tokens and a chat template
whose assistant turns sit in ``{% generation %}`` (``pad_token == eos_token == <|im_end|>`` on
purpose: it arms the "EOS log-prob masked as padding" trap in every test), and a Qwen2 causal LM
with head_dim 64 (the vLLM CPU backend rejects 16) trained on "What is a + b?" ->
"<answer>c</answer>" until its sampled reward (temperature 1.0) lies in ``target_reward``: room
for GRPO to show learning.

The ``tool_arithmetic`` variant (:data:`TOOL_SPEC`, about 2.5 minutes) mixes episodes that call
the Python tool with ones that guess, so the warm model calls the tool in some samples but not all
(:func:`evaluate_tool_episodes`) and GRPO can learn in both directions.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlpost.envs.arithmetic import (
    ARITHMETIC_SYSTEM_PROMPT,
    TOOL_ARITHMETIC_SYSTEM_PROMPT,
    make_arithmetic_rows,
    make_tool_arithmetic_rows,
)
from rlpost.envs.rewards import answer_reward

# the spec lives in rlpost.tiny.spec (importable without torch); its names stay importable here
from rlpost.tiny.spec import TASKS, TOOL_SPEC, TinyModelSpec, built_spec, spec_dict  # noqa: F401

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


def build_tiny_model(
    out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec(), log: Callable[[str], None] = print
) -> dict:
    """Build the tokenizer and model into ``out_dir`` (atomically) and return its metadata."""
    out_dir = Path(out_dir)
    torch.set_num_threads(spec.num_threads)
    torch.manual_seed(spec.seed)
    start = time.perf_counter()

    tokenizer = _build_tokenizer(spec)
    log(f"tokenizer: {len(tokenizer)} tokens, eos=pad={tokenizer.eos_token!r}")
    model = _init_model(spec, tokenizer)
    log(f"model: Qwen2, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    steps, reward, tool_rate = _supervised_warm_start(model, tokenizer, spec, log)

    meta = {
        "spec": spec_dict(spec),
        "sft_steps": steps,
        "start_reward_estimate": reward,
        "build_seconds": round(time.perf_counter() - start, 1),
        "system_prompt": ARITHMETIC_SYSTEM_PROMPT,
    }
    if spec.task == "tool_arithmetic":
        meta["start_tool_call_rate"] = tool_rate
        meta["system_prompt"] = TOOL_ARITHMETIC_SYSTEM_PROMPT
    # build_seconds varies run to run; keep it out of the deterministic artefacts' file
    save_model_folder(out_dir, model, tokenizer, "rlpost_tiny_model.json",
                      {k: v for k, v in meta.items() if k != "build_seconds"})  # fmt: skip
    log(f"tiny model written to {out_dir} in {meta['build_seconds']} s")
    return meta


def save_model_folder(out_dir: Path, model, tokenizer, meta_file: str, meta: dict) -> None:
    """Write ``model``, ``tokenizer`` and ``meta`` (as ``meta_file``) into ``out_dir`` atomically (a
    temporary sibling renamed once complete: no half-written folder later runs would trust)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / meta_file).write_text(json.dumps(meta, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_tiny_model(
    out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec(), log: Callable[[str], None] = print
) -> bool:
    """Build the tiny model unless ``out_dir`` holds one of the same spec; True when it built."""
    current = spec_dict(spec)
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


def tool_prompt(question: str) -> list[dict[str, str]]:
    """The opening messages of a tool_arithmetic episode: system prompt and question."""
    return [
        {"role": "system", "content": TOOL_ARITHMETIC_SYSTEM_PROMPT},
        {"role": "user", "content": question},
    ]


def tool_episode(question: str) -> list[dict[str, str]]:
    """The tool episode the warm start teaches: a ```` ```python ```` block printing the product,
    the tool's reply, the answer."""
    a, b = _operands(question)
    return tool_prompt(question) + [
        {"role": "assistant", "content": f"```python\nprint({a} * {b})\n```"},
        {"role": "tool", "content": tool_success_message(str(a * b))},
        {"role": "assistant", "content": f"<answer>{a * b}</answer>"},
    ]


def guess_episode(question: str, guess: str) -> list[dict[str, str]]:
    """The episode that answers at once, without the tool, with ``guess``."""
    return tool_prompt(question) + [{"role": "assistant", "content": f"<answer>{guess}</answer>"}]


def tool_success_message(output: str) -> str:
    """The tool message for one code block that printed ``output`` (one line), as
    ``rlpost.envs.tools.format_tool_response`` writes it inside the tags the template adds."""
    return f"Code block 1 executed successfully:\n{output}\n"


_QUESTION_RE = re.compile(r"What is (\d+) \* (\d+)\?")
_PYTHON_BLOCK_RE = re.compile(r"```python\n(.*?)```", re.DOTALL)
# The only code the evaluation "runs": a product of two decimal literals (no leading zeros, which
# Python rejects), computed by the evaluation itself.
_PRODUCT_CODE_RE = re.compile(r"print\(\s*(0|[1-9]\d*)\s*\*\s*(0|[1-9]\d*)\s*\)")


def _operands(question: str) -> tuple[int, int]:
    match = _QUESTION_RE.fullmatch(question)
    if match is None:
        raise ValueError(f"not a tool_arithmetic question: {question!r}")
    return int(match.group(1)), int(match.group(2))


def _guess(rng: random.Random, answer: str) -> str:
    """A random number with as many digits as ``answer``, almost always wrong. (Near misses
    made the model try to multiply in its head; in a trial it then took longer to learn to copy.)"""
    digits = len(answer)
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _tool_sft_episodes(spec: TinyModelSpec, rows: list[dict[str, str]], seed: int) -> list[list[dict[str, str]]]:
    """One supervised episode per row: the tool episode with probability ``spec.tool_fraction``,
    otherwise a (mostly wrong) guess; picked by a private ``random.Random(seed)``."""
    rng = random.Random(seed)
    episodes = []
    for r in rows:
        if rng.random() < spec.tool_fraction:
            episodes.append(tool_episode(r["question"]))
        else:
            episodes.append(guess_episode(r["question"], _guess(rng, r["answer"])))
    return episodes


def _render_chatml(messages: list[dict[str, str]]) -> str:
    """``messages`` as :data:`CHAT_TEMPLATE` renders them, for the tokenizer's training corpus
    (the tokenizer that would render them does not exist yet)."""
    parts = []
    for m in messages:
        if m["role"] == "tool":
            parts.append(f"<|im_start|>user\n<tool_response>\n{m['content']}\n</tool_response><|im_end|>\n")
        else:
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    return "".join(parts)


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
    if spec.task == "tool_arithmetic":
        rows = make_tool_arithmetic_rows(2000, seed=spec.seed + 7)
        corpus = [_render_chatml(e) for e in _tool_sft_episodes(spec, rows, seed=spec.seed + 8)]
    else:
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


def _encode_sft_batch(tokenizer, chats: list[list[dict[str, str]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels (-100 outside assistant tokens): every
    assistant turn trains, so a tool episode teaches the code block and the answer after it."""
    encoded = [
        tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        for chat in chats
    ]
    length = max(len(e["input_ids"]) for e in encoded)
    ids = torch.full((len(chats), length), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(chats), length), dtype=torch.long)
    labels = torch.full((len(chats), length), -100, dtype=torch.long)
    for i, e in enumerate(encoded):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        attn[i, :n] = 1
        mask = torch.tensor(e["assistant_masks"], dtype=torch.bool)
        labels[i, :n] = torch.where(mask, ids[i, :n], torch.tensor(-100))
    return ids, attn, labels


def _supervised_warm_start(model, tokenizer, spec: TinyModelSpec, log) -> tuple[int, float, float | None]:
    """Train on assistant tokens until the sampled reward (and, for the tool task, the tool-call
    rate) enters its target band; returns the steps, reward and rate (None for "arithmetic")."""
    tool = spec.task == "tool_arithmetic"
    if tool:
        rows = make_tool_arithmetic_rows(spec.sft_rows, seed=spec.seed + 1)
        chats = _tool_sft_episodes(spec, rows, seed=spec.seed + 3)
        eval_rows = make_tool_arithmetic_rows(spec.eval_prompts, seed=spec.seed + 2)
    else:
        rows = make_arithmetic_rows(spec.sft_rows, seed=spec.seed + 1)
        chats = [_chat(r["question"], r["answer"]) for r in rows]
        eval_rows = make_arithmetic_rows(spec.eval_prompts, seed=spec.seed + 2)

    def evaluate() -> tuple[float, float | None, str]:
        if not tool:
            reward = evaluate_reward(model, tokenizer, eval_rows, seed=spec.seed)
            return reward, None, f"sampled reward {reward:.3f}"
        result = evaluate_tool_episodes(
            model, tokenizer, eval_rows, seed=spec.seed, max_new_tokens=spec.max_turn_tokens
        )
        text = f"sampled reward {result.reward:.3f}, tool-call rate {result.tool_call_rate:.3f}"
        return result.reward, result.tool_call_rate, text

    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(spec.seed)
    reward, tool_rate, text = evaluate()
    log(f"sft step 0: {text}")
    low, high = spec.target_reward
    for step in range(1, spec.max_sft_steps + 1):
        model.train()
        idx = torch.randint(len(chats), (spec.batch_size,), generator=generator).tolist()
        ids, attn, labels = _encode_sft_batch(tokenizer, [chats[i] for i in idx])
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % spec.eval_every == 0:
            reward, tool_rate, text = evaluate()
            log(f"sft step {step}: loss {loss.item():.3f}, {text}")
            rate_ok = tool_rate is None or spec.target_tool_rate[0] <= tool_rate <= spec.target_tool_rate[1]
            if low <= reward <= high and rate_ok:
                return step, reward, tool_rate
            if reward > high:
                raise RuntimeError(
                    f"tiny model overshot the target reward band {spec.target_reward} at step {step} "
                    f"(reward {reward:.3f}); lower TinyModelSpec.eval_every or lr"
                )
    raise RuntimeError(
        f"tiny model did not reach the target reward band {spec.target_reward}"
        + (f" with a tool-call rate in {spec.target_tool_rate}" if tool else "")
        + f" in {spec.max_sft_steps} steps (last reward {reward:.3f}"
        + (f", tool-call rate {tool_rate:.3f})" if tool else ")")
    )


@torch.no_grad()
def evaluate_reward(model, tokenizer, rows: list[dict[str, str]], *, seed: int, temperature: float = 1.0) -> float:
    """Mean answer reward of one sampled completion per row (transformers generate, seeded)."""
    model.eval()
    torch.manual_seed(seed)
    chats = [_chat(r["question"]) for r in rows]
    completions = _sample_turn(model, tokenizer, chats, temperature=temperature, max_new_tokens=16)
    rewards = [answer_reward(c, r["answer"]) for c, r in zip(completions, rows)]
    return sum(rewards) / len(rewards)


@dataclass
class ToolEvaluation:
    """What :func:`evaluate_tool_episodes` measured: the mean episode reward, the share of samples
    whose first turn holds a ```` ```python ```` block (malformed ones included), and every
    episode as played (messages and reward) for inspection."""

    reward: float
    tool_call_rate: float
    episodes: list[tuple[list[dict[str, str]], float]] = field(default_factory=list)


def tool_message_for(completion: str) -> str | None:
    """The tool message the evaluation gives a first turn with a ```` ```python ```` block. It never
    executes model-written code: only exactly ``print(<int> * <int>)`` gets the product, computed
    here; any other code gives None (the sample scores 0)."""
    block = _PYTHON_BLOCK_RE.search(completion)
    if block is None:
        return None
    match = _PRODUCT_CODE_RE.fullmatch(block.group(1).strip())
    if match is None:
        return None
    return tool_success_message(str(int(match.group(1)) * int(match.group(2))))


def _sample_turn(
    model, tokenizer, chats: list[list[dict[str, str]]], *, temperature: float, max_new_tokens: int
) -> list[str]:
    """One sampled assistant turn per chat (batched, left-padded), decoded without special tokens."""
    prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(
        **batch,
        do_sample=True,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


@torch.no_grad()
def evaluate_tool_episodes(
    model, tokenizer, rows: list[dict[str, str]], *, seed: int, temperature: float = 1.0, max_new_tokens: int = 24
) -> ToolEvaluation:
    """Play and score one tool_arithmetic episode per row (the warm start's band check). A first
    turn with a ```` ```python ```` block is a tool call; with a valid product
    (:func:`tool_message_for`) turn 2 is sampled, otherwise it scores 0. The reward is
    ``answer_reward`` of the last assistant message."""
    model.eval()
    torch.manual_seed(seed)
    chats = [tool_prompt(r["question"]) for r in rows]
    firsts = _sample_turn(model, tokenizer, chats, temperature=temperature, max_new_tokens=max_new_tokens)
    tool_calls, follow_up = 0, []
    for i, (chat, first) in enumerate(zip(chats, firsts)):
        chat.append({"role": "assistant", "content": first})
        if _PYTHON_BLOCK_RE.search(first):
            tool_calls += 1
            message = tool_message_for(first)
            if message is not None:
                chat.append({"role": "tool", "content": message})
                follow_up.append(i)
    if follow_up:
        seconds = _sample_turn(
            model, tokenizer, [chats[i] for i in follow_up], temperature=temperature, max_new_tokens=max_new_tokens
        )
        for i, second in zip(follow_up, seconds):
            chats[i].append({"role": "assistant", "content": second})
    episodes = []
    for chat, r in zip(chats, rows):
        last = chat[-1]
        malformed_call = last["role"] == "assistant" and len(chat) == 3 and _PYTHON_BLOCK_RE.search(last["content"])
        reward = 0.0 if malformed_call else answer_reward(last["content"], r["answer"])
        episodes.append((chat, reward))
    return ToolEvaluation(
        reward=sum(e[1] for e in episodes) / len(episodes), tool_call_rate=tool_calls / len(rows), episodes=episodes
    )
