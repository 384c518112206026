"""The TRL baseline: GRPOTrainer (TRL 1.16) on CPU, with rlpost's model, task, reward and settings.

Run by bench_e2e.py in a process of its own (one per repeat), like an rlpost run; writes a JSON
file with the per-step wall times and mean rewards. Settings are mapped field by field onto
rlpost's (configs/tiny-cpu.yaml + the benchmark's overrides):

    rlpost                              TRL GRPOConfig
    data.group_size                     num_generations
    trainer.prompts_per_step * group    per_device_train_batch_size (completions per step;
                                        gradient_accumulation_steps=1, steps_per_generation=1:
                                        one generation and one optimizer step per step)
    rollout.max_tokens                  max_completion_length
    rollout.temperature/top_p           temperature / top_p (top_k=0)
    optimizer lr, betas, wd, clip       learning_rate, adam_beta1/2, weight_decay, max_grad_norm,
                                        lr_scheduler_type=constant, warmup_steps=0,
    optimizer.fused (default true)      optim="adamw_torch_fused" (transformers' default with torch >= 2.8)
    loss clip 0.2 / 0.28, token_mean    epsilon / epsilon_high, loss_type="dapo" (token mean)
    advantage_scale=group, no KL        scale_rewards="group", beta=0 (no reference model)
    the answer reward                   a reward function calling rlpost.envs.rewards.answer_reward
    data.system_prompt                  --system-prompt (the prompts' system message)
    model.lora (rank, alpha, dropout,   --lora-rank: peft's LoraConfig with the same values, passed
      target modules)                   as GRPOTrainer(peft_config=...)

TRL defaults changed for a fair race: ``gradient_checkpointing=False`` (TRL's GRPOConfig turns it
on; rlpost does not checkpoint activations) and ``disable_dropout=True`` (rlpost trains in eval
mode). CPU mode as TRL documents it: ``use_cpu=True, bf16=False``; generation with transformers
(no vLLM in TRL's CPU mode; ``--vllm-colocate`` tries TRL's colocated vLLM, which fails on
vLLM's CPU build at the first weight push).

    python -m bench.trl_grpo --model models/tiny-model --steps 40 --out /tmp/trl.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    t_start = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--beta2", type=float, default=0.99)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--clip-low", type=float, default=0.2)
    parser.add_argument("--clip-high", type=float, default=0.28)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--system-prompt", default=None, help="instead of the arithmetic task's (data.system_prompt)")
    parser.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter of this rank (0: every weight)")
    parser.add_argument(
        "--vllm-colocate",
        action="store_true",
        help="generate with TRL's vLLM colocate mode instead of transformers (fails on vLLM's CPU build: "
        "TRL's per-parameter weight push cannot load the repacked CPU layers; kept to re-try it)",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlpost.envs.arithmetic import ARITHMETIC_SYSTEM_PROMPT, make_arithmetic_rows
    from rlpost.envs.rewards import answer_reward

    rows = make_arithmetic_rows(args.rows, seed=args.seed)
    dataset = Dataset.from_list(
        [
            {
                "prompt": [
                    {"role": "system", "content": args.system_prompt or ARITHMETIC_SYSTEM_PROMPT},
                    {"role": "user", "content": r["question"]},
                ],
                "answer": r["answer"],
            }
            for r in rows
        ]
    )

    def arithmetic_reward(prompts, completions, answer, **kwargs):
        return [answer_reward(c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.begin, self.end = [], []

        def on_step_begin(self, *a, **k):
            self.begin.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            self.end.append(time.perf_counter())

    with tempfile.TemporaryDirectory(prefix="rlpost-bench-trl-") as out_dir:
        config = GRPOConfig(
            output_dir=out_dir,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            disable_dropout=True,
            max_steps=args.steps,
            per_device_train_batch_size=args.prompts_per_step * args.group_size,
            gradient_accumulation_steps=1,
            num_generations=args.group_size,
            max_completion_length=args.max_tokens,
            temperature=args.temperature,
            top_p=1.0,
            top_k=0,
            learning_rate=args.lr,
            adam_beta1=0.9,
            adam_beta2=args.beta2,
            weight_decay=0.0,
            max_grad_norm=args.grad_clip,
            lr_scheduler_type="constant",
            warmup_steps=0,
            optim="adamw_torch_fused",
            epsilon=args.clip_low,
            epsilon_high=args.clip_high,
            loss_type="dapo",
            beta=0.0,
            scale_rewards="group",
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            seed=args.seed,
            dataloader_num_workers=0,
            **({"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 256} if args.vllm_colocate else {}),
        )
        times = StepTimes()
        peft_config = None
        if args.lora_rank:
            from peft import LoraConfig

            from rlpost.config import LoraConfig as RlpostLora

            defaults = RlpostLora(rank=args.lora_rank)  # rlpost's model.lora: alpha, dropout, modules
            peft_config = LoraConfig(r=defaults.rank, lora_alpha=defaults.alpha, lora_dropout=defaults.dropout,
                                     target_modules=defaults.target_modules, task_type="CAUSAL_LM")  # fmt: skip
        trainer = GRPOTrainer(
            model=args.model, reward_funcs=arithmetic_reward, args=config, train_dataset=dataset, callbacks=[times],
            peft_config=peft_config,
        )  # fmt: skip
        # the step's generation and scoring (TRL's counterpart of rlpost's collect_s), timed per call
        generate_s = []
        generate = trainer._generate_and_score_completions

        def timed_generate(*a, **k):
            start = time.perf_counter()
            out = generate(*a, **k)
            generate_s.append(time.perf_counter() - start)
            return out

        trainer._generate_and_score_completions = timed_generate
        t_ready = time.perf_counter()
        output = trainer.train()
        t_done = time.perf_counter()
        history = [h for h in trainer.state.log_history if "reward" in h]
    step_s = [e - b for b, e in zip(times.begin, times.end)]
    result = {
        "steps": len(step_s),
        "samples_per_step": args.prompts_per_step * args.group_size,
        "step_s": step_s,
        "generate_s": generate_s,
        "steps_wall_s": times.end[-1] - times.begin[0],
        "train_runtime_s": output.metrics.get("train_runtime"),
        "startup_s": t_ready - t_start,
        "process_wall_s": t_done - t_start,
        "rewards": [h["reward"] for h in history],
        "completion_len": [h.get("completions/mean_length") for h in history],
        "torch_threads": torch.get_num_threads(),
        "trl_config": {
            k: getattr(config, k)
            for k in (
                "per_device_train_batch_size",
                "num_generations",
                "max_completion_length",
                "learning_rate",
                "adam_beta2",
                "max_grad_norm",
                "epsilon",
                "epsilon_high",
                "loss_type",
                "beta",
                "scale_rewards",
                "gradient_checkpointing",
                "steps_per_generation",
                "generation_batch_size",
                "use_vllm",
            )
        },
    }
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"trl: {result['steps']} steps in {result['steps_wall_s']:.1f} s; rewards {result['rewards'][:3]}...")


if __name__ == "__main__":
    main()
