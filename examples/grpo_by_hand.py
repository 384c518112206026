"""GRPO composed by hand from rlpost's public pieces: TorchRL's GRPO loop, on the offline tiny model.

    env (ArithmeticEnv: prompts, rewards)  -- policy: vLLMWrapper on a vLLM worker -->
    LLMCollector --> ReplayBuffer (MCAdvantage: group advantages) --> GRPOLoss on a
    TransformersWrapper --> optimizer step --> vLLMUpdater pushes the weights to the worker

This is what ``rlpost train`` runs as a Ray service (several workers, env pools, async mode,
restarts); here every piece is in one process, as a TorchRL user would write it, and imported
as TorchRL's code imports it with ``torchrl`` replaced by ``rlpost.torchrl``.

Run: ``python examples/grpo_by_hand.py --steps 20`` (after ``make tiny-model``). On this
machine a step takes a few seconds. On a stream of fresh questions the reward climbs over
hundreds of steps (the demo's 600 steps gain about +0.2); ``--questions 2 --group-size 16`` makes
every step practise the same two questions, and their reward climbs within a dozen steps.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

# TorchRL's imports with the prefix replaced (from torchrl.collectors.llm import ... in TorchRL)
from rlpost.envs import ArithmeticEnv  # rlpost's own task, no TorchRL name
from rlpost.torchrl.collectors.llm import LLMCollector, vLLMUpdater
from rlpost.torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement
from rlpost.torchrl.modules.llm import TransformersWrapper, make_vllm_worker, vLLMWrapper
from rlpost.torchrl.objectives.llm import GRPOLoss, MCAdvantage


@dataclass
class Run:
    """What a run did, step by step."""

    rewards: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # sum_i A_i * (log p_new(y_i) - log p_old(y_i)) / n over the step's completions: a GRPO step
    # moves probability towards the better-than-average answers, so this is > 0 when it learns
    improvements: list[float] = field(default_factory=list)


def grpo_by_hand(model_path: str, *, steps: int = 3, group_size: int = 4, prompts_per_step: int = 2,
                 lr: float = 3e-4, max_tokens: int = 16, num_questions: int = 2000, seed: int = 0) -> Run:  # fmt: skip
    """Run ``steps`` GRPO steps of ``prompts_per_step`` prompts x ``group_size`` completions.

    The prompts cycle through ``num_questions`` generated questions: the default is a stream
    that rarely repeats; a handful (e.g. 2) makes every step practise the same questions, so the
    reward on them climbs within a dozen steps instead of hundreds.
    """
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    num_envs = group_size * prompts_per_step

    # Inference: one vLLM engine that takes weight updates, and the policy generating with it.
    worker = make_vllm_worker(model_path, make_ray_worker=False, max_model_len=256, kv_cache_space_gb=0.25,
                              max_num_seqs=64, enforce_eager=True, seed=seed)  # fmt: skip
    policy = vLLMWrapper(worker, tokenizer=tokenizer, input_mode="history", return_log_probs=True,
                         generate_kwargs={"max_tokens": max_tokens, "temperature": 1.0})  # fmt: skip

    # The task: each prompt repeated group_size times in a row (one GRPO group per prompt).
    env = ArithmeticEnv(num_envs=num_envs, repeats=group_size, seed=seed, tokenizer=tokenizer, num_rows=num_questions)

    # Collected steps go to a buffer whose MCAdvantage releases each group with its advantages.
    buffer = ReplayBuffer(storage=LazyStackStorage(10 * num_envs), sampler=SamplerWithoutReplacement(),
                          batch_size=num_envs)  # fmt: skip
    buffer.append_transform(MCAdvantage(grpo_size=group_size, prompt_key="prompt_id"))
    updater = vLLMUpdater([worker], backend="gloo", timeout_s=120)
    collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=num_envs, replay_buffer=buffer,
                             weight_updater=updater, track_policy_version=True)  # fmt: skip

    # Training: the same model under transformers, scoring the engine's token ids.
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    actor = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate=False,
                                return_log_probs=True, pad_output=True)  # fmt: skip
    loss_fn = GRPOLoss(actor, clip_epsilon=(0.2, 0.28), entropy_coeff=0.0, entropy_bonus=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    run = Run()
    for step, _ in enumerate(collector):  # each iteration writes one batch of turns to the buffer
        batch = buffer.sample()
        before = completion_logprobs(actor, batch)
        out = loss_fn(batch)
        loss = out.loss_objective
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        advantage = batch.get("advantage").reshape(-1)
        run.improvements.append(float((advantage * (completion_logprobs(actor, batch) - before)).mean()))
        collector.update_policy_weights_(model)  # the worker now serves the new weights
        buffer.empty()  # on-policy: the next step trains on what the new weights generate
        run.rewards.append(float(batch.get(("next", "reward")).float().mean()))
        run.losses.append(float(loss.detach()))
        run.versions.append(int(collector.policy_version))
        print(f"step {step}: reward {run.rewards[-1]:.3f} loss {run.losses[-1]:+.4f} "
              f"improvement {run.improvements[-1]:+.4f} version {run.versions[-1]}")  # fmt: skip
        if step + 1 == steps:
            break
    updater.close()
    worker.shutdown()
    return run


def completion_logprobs(actor: TransformersWrapper, batch) -> torch.Tensor:
    """Each completion's log-probability under the actor (the response tokens only)."""
    with torch.no_grad():
        scored = actor(batch.copy())
    log_probs = scored.get(("log_probs", "full"), as_padded_tensor=True)
    response = scored.get(("masks", "all_assistant_mask"), as_padded_tensor=True)
    return (log_probs * response).sum(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-model", help="model folder (default: the tiny model)")
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--group-size", type=int, default=4, help="completions per prompt")
    parser.add_argument("--prompts-per-step", type=int, default=2, help="prompts per step")
    parser.add_argument("--questions", type=int, default=2000, help="distinct questions the prompts cycle through")
    args = parser.parse_args()
    grpo_by_hand(
        args.model,
        steps=args.steps,
        group_size=args.group_size,
        prompts_per_step=args.prompts_per_step,
        num_questions=args.questions,
    )


if __name__ == "__main__":
    main()
