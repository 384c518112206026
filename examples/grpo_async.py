"""GRPO, asynchronous, written as TorchRL's ``sota-implementations/grpo/grpo-async.py`` is:

    RayLLMCollector x N (env: GSM8KEnv, ray_backend=True; policy: vLLMWrapper on AsyncVLLM)
        --start()--> RayReplayBuffer (MCAdvantage groups completions, adds advantages)
    trainer: sample -> GRPOLoss -> optimizer step -> every k steps the sender
        (VLLMWeightSyncScheme) pushes the weights to every replica, and the collectors' versions follow

The collectors generate on their own while the trainer trains; the trainer samples what is in
the buffer, whichever weights generated it (TorchRL's async recipe; the staleness is bounded only
by the buffer's size). Every import is TorchRL's with ``torchrl`` replaced by ``rlpost.torchrl``;
what differs from TorchRL's script is its CUDA set-up (a GPU per role, autocast, a Ray task for
the trainer) and hydra: here the trainer runs in this process on the CPU (see grpo_utils.py).

Run: ``python examples/grpo_async.py --steps 60`` (after ``make tiny-model``).
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass, field
from functools import partial

import grpo_utils  # examples/grpo_utils.py, beside this script
import ray
import torch
from grpo_utils import Config, batch_reward, get_inference_model, get_train_model, make_env, make_weight_sync_scheme

from rlpost.torchrl import merge_ray_runtime_env, torchrl_logger
from rlpost.torchrl._utils import timeit
from rlpost.torchrl.collectors.llm import RayLLMCollector
from rlpost.torchrl.data import LazyStackStorage
from rlpost.torchrl.data.replay_buffers.ray_buffer import RayReplayBuffer
from rlpost.torchrl.objectives.llm.grpo import GRPOLoss, MCAdvantage
from rlpost.torchrl.weight_update.llm import get_model_metadata

# the collectors' actors build the env from grpo_utils, which they cannot import: ship it by value
ray.cloudpickle.register_pickle_by_value(grpo_utils)


@dataclass
class Run:
    """What the run did: per optimizer step, the sampled batch's reward and the weights version
    the replicas served after it; the seconds since training started."""

    rewards: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def train(replay_buffer, cfg: Config, collectors: list, inference_policy) -> Run:
    policy_training, _ = get_train_model(cfg)
    loss_fn = GRPOLoss(actor_network=policy_training, kl_to_ref_coeff=0.0, entropy_coeff=0.0, masking_strategy="sft")

    sender = make_weight_sync_scheme(inference_policy.model).create_sender()
    sender.register_model(policy_training.model)
    sender.init_all_workers_group(get_model_metadata(policy_training.model), vllm_engine=inference_policy.model)
    with timeit("update_policy_weights"):
        sender.update_weights()
    for collector in collectors:
        collector.start()
        sender.register_collector(collector)  # each update bumps the collectors' policy version

    while not replay_buffer.write_count:
        torchrl_logger.info("Waiting for replay buffer...")
        time.sleep(1)

    optimizer = torch.optim.AdamW(policy_training.parameters(), lr=cfg.lr)
    run, start = Run(), time.monotonic()
    try:
        for step in range(cfg.steps):
            if not any(collector.is_running() for collector in collectors):
                raise RuntimeError(f"Collectors stopped before training completed at step {step}/{cfg.steps}.")
            with timeit("sampling"):
                batch = replay_buffer.sample(cfg.dialog_turns_per_batch)
            with timeit("forward_pass"):
                loss = loss_fn(batch)
                loss_val = loss.mean(reduce=True)
            with timeit("backward_pass"):
                loss_val.backward()
            with timeit("optim_step"):
                torch.nn.utils.clip_grad_norm_(policy_training.parameters(), cfg.clip_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if (step + 1) % cfg.weight_update_frequency == 0:
                with timeit("update_policy_weights"):
                    sender.update_weights()
            run.rewards.append(batch_reward(batch))
            run.versions.append(sender.version)
            run.seconds.append(time.monotonic() - start)
            torchrl_logger.info(
                f"step {step}: reward {run.rewards[-1]:.3f} loss {float(loss_val.detach()):+.4f} version {sender.version} "
                f"writes {replay_buffer.write_count}"
            )
    finally:
        for collector in collectors:
            collector.async_shutdown(timeout=60)
        sender.shutdown()
    timeit.print(prefix="timeit")
    return run


def main(cfg: Config) -> Run:
    if not ray.is_initialized():
        ray.init(**merge_ray_runtime_env({"include_dashboard": False}))
    inference_policy = get_inference_model(cfg)
    rb = RayReplayBuffer(
        storage=partial(LazyStackStorage, cfg.buffer_size),
        transform_factory=partial(MCAdvantage, grpo_size=cfg.repeats),
        batch_size=cfg.dialog_turns_per_batch,
    )
    collectors = [
        RayLLMCollector(
            env=partial(make_env, cfg),
            policy=inference_policy,
            dialog_turns_per_batch=cfg.dialog_turns_per_batch,
            total_dialog_turns=-1,
            replay_buffer=rb,
            track_policy_version=True,
            verbose=False,
        )  # fmt: skip
        for _ in range(cfg.num_collectors)
    ]
    ray.get([collector._collector.is_initialized.remote() for collector in collectors])
    try:
        return train(rb, cfg, collectors, inference_policy)
    finally:
        for collector in collectors:
            collector.shutdown()
        rb.close()
        inference_policy.model.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=Config.model)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--collectors", type=int, default=Config.num_collectors)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main(Config(model=args.model, steps=args.steps, num_collectors=args.collectors))
