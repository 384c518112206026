"""Build the offline tiny reward model: a one-label Qwen2 sequence classifier on the tiny LM's trunk.

The reward-model role (``reward_model.kind: classifier``) is tested with a real Hugging Face reward
model on 2 CPU cores with no hub access, so rlpost trains one from a seed in about 20 s (shipped
in models/tiny-reward-model): the tiny LM's trunk (score head starting at zero), regressed (MSE)
on synthetic "What is a + b?" conversations (rendered as the reward actor renders them) answered
right, wrong or without the tag, labelled by :func:`rlpost.envs.rewards.answer_reward` (1.0, 0.1,
0.0). It learns the format half of the rule only: on held-out questions a tagged answer scores
about 0.7 (shipped build: 0.697 right and wrong), an untagged one about 0.007; the arithmetic half
is beyond this trunk (up to 1,200 steps at lr 5e-4 to 2e-3: right and wrong never more than 0.03
apart). The tests rely on exactly that: a reward model that misses part of the task.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rlpost.envs.arithmetic import make_arithmetic_rows
from rlpost.envs.rewards import answer_reward
from rlpost.tiny.model import save_model_folder

META_FILE = "rlpost_tiny_reward_model.json"


@dataclass(frozen=True)
class TinyRewardModelSpec:
    """Everything that determines the tiny reward model's bytes (with the LM it starts from)."""

    seed: int = 0
    train_rows: int = 4000
    eval_rows: int = 256
    steps: int = 200
    batch_size: int = 64
    lr: float = 2e-3
    right_share: float = 0.4  # of the synthetic answers; as many wrong, the rest without the tag
    num_threads: int = 2  # fixed so that float reductions, hence the files, do not vary by machine


def conversation(question: str, completion: str) -> list[dict[str, str]]:
    """The messages the reward actor scores for one episode: the user's prompt, the final response."""
    return [{"role": "user", "content": question}, {"role": "assistant", "content": completion}]


def synthetic_answers(rows: list[dict[str, str]], spec: TinyRewardModelSpec, seed: int) -> list[tuple[list, float]]:
    """(conversation, rule reward) pairs: each question answered right, wrong or without the tag."""
    rng = random.Random(seed)
    pairs = []
    for row in rows:
        right, draw = row["answer"], rng.random()
        if draw < spec.right_share:
            completion = f"<answer>{right}</answer>"
        elif draw < 2 * spec.right_share:
            completion = f"<answer>{int(right) + rng.choice([-3, -2, -1, 1, 2, 3, 10])}</answer>"
        else:
            completion = right
        pairs.append((conversation(row["question"], completion), answer_reward(completion, right)))
    return pairs


def _encode(tokenizer, pairs: list[tuple[list, float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    texts = [tokenizer.apply_chat_template(messages, tokenize=False) for messages, _ in pairs]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    labels = torch.tensor([label for _, label in pairs], dtype=torch.float32)
    return batch["input_ids"], batch["attention_mask"], labels


def score_pairs(model, tokenizer, pairs: list[tuple[list, float]]) -> torch.Tensor:
    """The model's score of each pair's conversation (no gradients)."""
    input_ids, mask, _ = _encode(tokenizer, pairs)
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=mask).logits.view(-1)


def separation(model, tokenizer, pairs: list[tuple[list, float]]) -> dict[str, float]:
    """Mean score of right, wrong tagged and untagged answers (the rule's 1.0, 0.1, 0.0)."""
    scores = score_pairs(model, tokenizer, pairs).tolist()
    means = {}
    for name, label in (("right", 1.0), ("wrong_tagged", 0.1), ("untagged", 0.0)):
        picked = [s for s, (_, value) in zip(scores, pairs) if value == label]
        means[f"score_{name}_mean"] = sum(picked) / max(len(picked), 1)
    return means


def build_tiny_reward_model(
    out_dir: str | Path, lm_dir: str | Path, spec: TinyRewardModelSpec = TinyRewardModelSpec(),
    log: Callable[[str], None] = print,
) -> dict:  # fmt: skip
    """Train the tiny reward model from the tiny LM in ``lm_dir`` into ``out_dir`` (atomically:
    :func:`rlpost.tiny.model.save_model_folder`); returns its metadata."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    out_dir, lm_dir = Path(out_dir), Path(lm_dir)
    torch.set_num_threads(spec.num_threads)
    torch.manual_seed(spec.seed)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(lm_dir)
    config = AutoConfig.from_pretrained(lm_dir, num_labels=1)
    config.pad_token_id = tokenizer.pad_token_id
    model = AutoModelForSequenceClassification.from_config(config)
    trunk = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32).model
    model.model.load_state_dict(trunk.state_dict())
    torch.nn.init.zeros_(model.score.weight)

    train = synthetic_answers(make_arithmetic_rows(spec.train_rows, seed=spec.seed, split="train"), spec, spec.seed)
    held_out = synthetic_answers(
        make_arithmetic_rows(spec.eval_rows, seed=spec.seed, split="test"), spec, spec.seed + 1
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    rng = random.Random(spec.seed)
    model.train()
    for step in range(1, spec.steps + 1):
        input_ids, mask, labels = _encode(tokenizer, rng.sample(train, spec.batch_size))
        loss = torch.nn.functional.mse_loss(model(input_ids=input_ids, attention_mask=mask).logits.view(-1), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == spec.steps:
            log(f"tiny reward model: step {step}/{spec.steps}, mse {loss.item():.4f}")
    model.eval()
    quality = separation(model, tokenizer, held_out)
    log(
        f"tiny reward model: held-out right answers score {quality['score_right_mean']:.3f}, wrong tagged ones "
        f"{quality['score_wrong_tagged_mean']:.3f}, untagged ones {quality['score_untagged_mean']:.3f}"
    )
    meta = {"spec": asdict(spec), "lm": lm_meta(lm_dir), "held_out": quality}
    save_model_folder(out_dir, model, tokenizer, META_FILE, meta)
    log(f"tiny reward model written to {out_dir} in {time.perf_counter() - start:.1f} s")
    return meta


def lm_meta(lm_dir: str | Path) -> dict | None:
    """What the tiny LM at ``lm_dir`` records of its build (its spec), to tell when it changed."""
    path = Path(lm_dir) / "rlpost_tiny_model.json"
    return json.loads(path.read_text()).get("spec") if path.is_file() else None


def ensure_tiny_reward_model(
    out_dir: str | Path, lm_dir: str | Path, spec: TinyRewardModelSpec = TinyRewardModelSpec(),
    log: Callable[[str], None] = print,
) -> bool:  # fmt: skip
    """Build unless ``out_dir`` holds one of the same spec and LM; True when it built."""
    path = Path(out_dir) / META_FILE
    if path.is_file():
        found = json.loads(path.read_text())
        if found.get("spec") == asdict(spec) and found.get("lm") == lm_meta(lm_dir):
            return False
        log(f"tiny reward model at {out_dir} was built from another spec or LM; rebuilding")
    build_tiny_reward_model(out_dir, lm_dir, spec, log)
    return True
