"""The tiny model's spec and how a built folder records it; apart from :mod:`rlpost.tiny.model`
(torch, transformers) so that ``rlpost make-tiny-model`` checks a folder in a fraction of a second.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path


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
    # The fields below matter only for task "tool_arithmetic"; an "arithmetic" spec leaves them out
    # of its stored form (spec_dict), so the default model's metadata is what it always was.
    task: str = "arithmetic"  # "arithmetic" or "tool_arithmetic"
    tool_fraction: float = 0.5  # share of supervised episodes that call the tool (the rest guess)
    target_tool_rate: tuple[float, float] = (0.3, 0.7)  # sampled tool-call rate to stop in
    max_turn_tokens: int = 24  # new tokens per sampled assistant turn in the evaluation

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"TinyModelSpec.task must be one of {TASKS}, got {self.task!r}")

    @classmethod
    def for_task(cls, task: str, **overrides) -> TinyModelSpec:
        """The preset spec of ``task`` (:data:`TOOL_SPEC` for "tool_arithmetic"), with overrides."""
        base = TOOL_SPEC if task == "tool_arithmetic" else cls(task=task)
        return replace(base, **overrides)


TASKS = ("arithmetic", "tool_arithmetic")
# Fields that only the tool task reads; kept out of an arithmetic build's stored spec.
_TOOL_ONLY_FIELDS = ("task", "tool_fraction", "target_tool_rate", "max_turn_tokens")

# The tool variant learns to copy operands into the code block and the tool's output into the
# answer after a plateau (smaller batches leave it sooner; lr 2e-3 never did in a trial). Half the
# episodes call the tool, so the reward cannot pass 0.5 + 0.1 * 0.5 = 0.55: the build stops with
# room for GRPO to call the tool more and copy better. Many distinct rows, so copying pays, not
# memorising. The plateau's end depends on the CPU's float kernels (steps 825-1100 on 2-core
# Xeons, ~2300 on an EPYC without AVX-512); the cap leaves room past both and changes no byte.
TOOL_SPEC = TinyModelSpec(
    task="tool_arithmetic",
    sft_rows=20000,
    batch_size=32,
    max_sft_steps=6000,
    eval_every=25,
    eval_prompts=256,
    target_reward=(0.3, 0.55),
)


def spec_dict(spec: TinyModelSpec) -> dict:
    """The spec as stored in ``rlpost_tiny_model.json`` (JSON types). An "arithmetic" spec omits
    the tool-only fields, so builds made before the tool task still pass the up-to-date check."""
    d = asdict(spec)
    if spec.task == "arithmetic":
        for name in _TOOL_ONLY_FIELDS:
            del d[name]
    return json.loads(json.dumps(d))


def built_spec(out_dir: str | Path) -> dict | None:
    """The spec a folder was built with (None when it holds no tiny model)."""
    meta = Path(out_dir) / "rlpost_tiny_model.json"
    if not (Path(out_dir) / "config.json").is_file() or not meta.is_file():
        return None
    return json.loads(meta.read_text()).get("spec")
