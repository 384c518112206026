"""Evaluation: score a policy's weights on held-out prompts through an inference engine.

One evaluation (:meth:`Evaluator.run`)::

    env    = the task's env on the eval split      (eval.dataset / eval.split; the first
                                                    eval.num_prompts rows, in order, each
                                                    repeated eval.samples_per_prompt times)
    policy = vLLMWrapper on the engine client      (greedy, or sampled at eval.temperature with
                                                    eval.seed; eval.max_tokens)
    groups = LLMCollector(env, policy=policy,       the same episodes as training (tools and
                          whole_episodes=...)      turns included): LLMCollector's whole-
             .collect_groups(num_prompts)          episodes mode, as the env pools run it
    metrics from the groups' rewards

The metrics (keys as in metrics.jsonl):

- ``eval_reward_mean``: mean reward of every completion;
- ``eval_pass_at_1``: per prompt, the share of its ``n`` completions whose reward is at least
  ``eval.pass_threshold``, averaged over prompts (the unbiased pass@1);
- ``eval_pass_at_k`` (only when ``n = eval.samples_per_prompt > 1``): the share of prompts with
  at least one passing completion (pass@k with k = n);
- ``eval_length_mean``: mean completion tokens; ``eval_s``: seconds the evaluation took;
  ``eval_num_prompts``; ``eval_policy_version``: the weights' version that generated them;
- with a task mixture (rows with a ``task`` column, e.g. ``data.task: reasoning_gym``), per task:
  ``eval_reward_mean/<task>``, ``eval_pass_at_1/<task>`` (and ``eval_pass_at_k/<task>``); with a
  reward model, the mean of each part of the reward: ``eval_reward_part/<part>``.

The same weights give the same figures every time: the prompts are fixed, greedy decoding is
deterministic and sampling is seeded. The controller runs it after a weight sync on the run's
workers; ``rlpost eval`` runs it on a checkpoint with an engine of its own.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from statistics import mean
from typing import Any

from rlpost.config import ConfigError, JobConfig
from rlpost.policies.lora import is_adapter_checkpoint, merged_model_for
from rlpost.record.metrics import reward_breakdown

EVAL_KEYS = ("eval_reward_mean", "eval_pass_at_1", "eval_pass_at_k", "eval_length_mean", "eval_s",
             "eval_num_prompts", "eval_policy_version")  # fmt: skip


def eval_job_config(cfg: JobConfig) -> JobConfig:
    """``cfg`` with its data section on the eval split: no shuffle (the first rows, every time),
    ``samples_per_prompt`` completions per prompt."""
    ev = cfg.eval
    data = cfg.data.model_copy(update={
        "dataset": ev.dataset if ev.dataset is not None else cfg.data.dataset,
        "subset": ev.subset if ev.subset is not None else cfg.data.subset,
        "split": ev.split,
        "group_size": ev.samples_per_prompt,
        "shuffle": False,
        "num_synthetic_rows": ev.num_prompts,
    })  # fmt: skip
    return cfg.model_copy(update={"data": data})


def pass_metrics(rewards_per_prompt: list[list[float]], threshold: float) -> dict[str, float]:
    """pass@1 (and pass@k for groups of k > 1) from each prompt's completion rewards."""
    if not rewards_per_prompt:
        raise ValueError("pass_metrics needs at least one prompt")
    shares = [sum(r >= threshold for r in rewards) / len(rewards) for rewards in rewards_per_prompt]
    out = {"eval_pass_at_1": mean(shares)}
    if max(len(rewards) for rewards in rewards_per_prompt) > 1:
        out["eval_pass_at_k"] = mean(float(share > 0) for share in shares)
    return out


class Evaluator:
    """Runs evaluations of ``cfg.eval`` (see the module docstring).

    ``tokenizer``: None loads ``cfg.model``'s. ``reward_scorer``: with a ``reward_model``, what
    scores the final responses (an in-process ``RewardModel``); None: the run's ``reward`` actor.
    Raises ConfigError at construction when the eval data cannot be loaded (naming the ``eval``
    keys), so a run fails before it trains rather than at its first evaluation.
    """

    def __init__(self, cfg: JobConfig, *, tokenizer: Any = None, reward_scorer: Any = None):
        from rlpost.actors.env_pool import load_tokenizer, with_chat_template

        self.cfg, self.eval_cfg, self.reward_scorer = cfg, eval_job_config(cfg), reward_scorer
        self.tokenizer = with_chat_template(tokenizer if tokenizer is not None else load_tokenizer(cfg), cfg)
        self.kept_rows: list[int] | None = None  # data.drop_long_prompts: the eval rows whose prompts fit
        self._make_env(check=True)  # fail now on bad eval data, or prompts the engine cannot take

    def _make_env(self, check: bool = False) -> Any:
        """The eval env; ``check``: also its prompts against the engine's length (every row when
        ``data.drop_long_prompts`` leaves long ones out: the evaluation draws the first that fit)."""
        from rlpost.envs.tasks import fit_prompts, make_env

        ev = self.cfg.eval
        try:
            env = make_env(self.eval_cfg, self.tokenizer, ev.num_prompts * ev.samples_per_prompt, input_mode="tokens",
                           reward_scorer=self.reward_scorer)  # fmt: skip
            if check:
                rows = None if self.cfg.data.drop_long_prompts else ev.num_prompts
                fit = fit_prompts(env, self.eval_cfg, max_tokens=ev.max_tokens or self.cfg.rollout.max_tokens,
                                  rows=rows, what="eval")  # fmt: skip
                self.kept_rows = fit.kept if fit is not None and fit.too_long else None
        except ConfigError as exc:
            source = ev.dataset if ev.dataset is not None else f"{self.cfg.data.dataset} (data.dataset)"
            raise ConfigError(f"eval (dataset={source!r}, split={ev.split!r}): {exc}") from exc
        if self.kept_rows is not None and not check:
            env.primer.keep_rows(self.kept_rows)
        return env

    def run(self, engine_client: Any, policy_version: int | None = None) -> dict[str, float]:
        """The metrics of the weights ``engine_client`` serves now; ``policy_version`` is reported
        when the client does not say which version served the completions."""
        from rlpost.collect import LLMCollector, WholeEpisodes
        from rlpost.policies import vLLMWrapper

        ev, rollout = self.cfg.eval, self.cfg.rollout
        start = time.perf_counter()
        sampling: dict[str, Any] = {"max_tokens": ev.max_tokens or rollout.max_tokens, "top_p": 1.0}
        sampling.update({"temperature": 0.0} if ev.greedy else {"temperature": ev.temperature, "seed": ev.seed})
        policy = vLLMWrapper(engine_client, tokenizer=self.tokenizer, input_mode="tokens", generate_kwargs=sampling,
                             return_log_probs=True, return_tokens=True, pad_output=False)  # fmt: skip
        episodes = WholeEpisodes(group_size=ev.samples_per_prompt, max_turns=rollout.max_turns,
                                 advantage_scale="none", max_prompt_tokens=rollout.engine.max_model_len - 1)  # fmt: skip
        collector = LLMCollector(self._make_env(), policy=policy, whole_episodes=episodes)
        groups = collector.collect_groups(ev.num_prompts)
        samples = [s for g in groups for s in g.samples]
        metrics = {
            "eval_reward_mean": mean(s.reward for s in samples),
            **pass_metrics([g.rewards for g in groups], ev.pass_threshold),
            "eval_length_mean": mean(s.num_generated for s in samples),
            "eval_num_prompts": float(len(groups)),
            **reward_breakdown(groups, prefix="eval_"),
        }
        tasks = sorted({g.samples[0].task for g in groups if g.samples and g.samples[0].task is not None})
        for task in tasks:
            of_task = [g.rewards for g in groups if g.samples and g.samples[0].task == task]
            metrics.update({f"{k}/{task}": v for k, v in pass_metrics(of_task, ev.pass_threshold).items()})
        versions = [s.policy_version for s in samples if s.policy_version is not None]
        served = min(versions) if versions else policy_version
        if served is not None:
            metrics["eval_policy_version"] = float(served)
        metrics["eval_s"] = time.perf_counter() - start
        return metrics


def append_eval_line(run_dir: str | Path, step: int, metrics: dict[str, float]) -> Path:
    """Append ``{"step": step, **metrics}`` to ``RUN_DIR/eval.jsonl`` (every evaluation of a run,
    the one before training at step 0 included); returns the file's path."""
    path = Path(run_dir) / "eval.jsonl"
    with path.open("a") as f:
        f.write(json.dumps({"step": step, **metrics}) + "\n")
    return path


def resolve_checkpoint(target: str | Path) -> tuple[Path, Path | None]:
    """(checkpoint folder, its run directory or None) for ``rlpost eval TARGET``: a run directory
    (its latest checkpoint) or a checkpoint folder (any folder holding a Hugging Face model)."""
    from rlpost.record.run_dir import latest_checkpoint

    target = Path(target)
    if (target / "config.yaml").is_file() and (target / "checkpoints").is_dir():
        checkpoint = latest_checkpoint(target)
        if checkpoint is None:
            raise ConfigError(f"run directory {target} holds no checkpoint yet")
        return checkpoint, target
    if not (target / "config.json").is_file() and not is_adapter_checkpoint(target):
        raise ConfigError(
            f"{target} is neither a run directory (config.yaml + checkpoints/) nor a checkpoint "
            "folder (config.json of a Hugging Face model, or adapter_config.json of a LoRA run's)"
        )
    run_dir = target.parent.parent if target.parent.name == "checkpoints" else None
    return target, run_dir if run_dir is not None and (run_dir / "config.yaml").is_file() else None


def evaluate_checkpoint(target: str | Path, config: str | Path | None = None,
                        overrides: list[str] | tuple[str, ...] = ()) -> tuple[Path, dict[str, float]]:  # fmt: skip
    """Score a checkpoint as a run's evaluation does, with a vLLM engine in this process; returns
    (the checkpoint scored, its metrics). ``config`` (default: the run's config.yaml) plus
    ``overrides``, its model replaced by the checkpoint (weights and tokenizer). A LoRA run's
    checkpoint is scored merged: its ``merged/`` folder, or else the base model with the adapter
    merged in (a temporary folder)."""
    from rlpost.actors.reward import RewardModel
    from rlpost.actors.vllm_workers import make_vllm_worker
    from rlpost.config import load_config

    checkpoint, run_dir = resolve_checkpoint(target)
    if config is None:
        if run_dir is None:
            raise ConfigError(f"{checkpoint} is not inside a run directory: give the CONFIG to evaluate it with")
        config = run_dir / "config.yaml"
    cfg = load_config(config, list(overrides))
    with tempfile.TemporaryDirectory(prefix="rlpost-eval-merged-") as scratch:
        model = checkpoint
        if is_adapter_checkpoint(checkpoint):
            model = merged_model_for(checkpoint, cfg.model.name_or_path, scratch,
                                     trust_remote_code=cfg.model.trust_remote_code)  # fmt: skip
        cfg.model.name_or_path, cfg.model.tokenizer, cfg.model.lora = str(model), None, None
        # a run's reward model is its `reward` actor; here it is loaded in this process
        scorer = RewardModel(cfg.reward_model) if cfg.reward_model is not None else None
        evaluator = Evaluator(cfg, reward_scorer=scorer)  # bad eval data fails here, before the engine starts
        worker = make_vllm_worker(str(model), make_ray_worker=False, engine_config=cfg.rollout.engine,
                                  dtype=cfg.model.dtype)  # fmt: skip
        try:
            metrics = evaluator.run(worker.client)
        finally:
            worker.shutdown()
            if scorer is not None:
                scorer.shutdown()
    # the engine counts versions from the weights it loaded (0): the checkpoint's name says which
    metrics.pop("eval_policy_version", None)
    return checkpoint, metrics
