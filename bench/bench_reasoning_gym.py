"""reasoning-gym: which of the package's tasks does the tiny model learn with GRPO? (data.task: reasoning_gym)

One training run, ``rlpost train configs/tiny-cpu-reasoning-gym.yaml`` in a process of its own
(a fresh local Ray cluster), on an equal-weight mixture of four procedural tasks of the
reasoning-gym package near the offline tiny model's one skill (models/tiny-model was fine-tuned
only on "What is a + b?" -> <answer>c</answer>, operands up to 10):

- ``basic_arithmetic``: "Calculate 51 + 95." -- '+' only, 2 terms of 1-2 digits, no parentheses
  or negation: the tiny model's own sums in other words (the shipped config's main task);
- ``chain_sum``: "State the final answer to the following arithmetic problem: 31 - 24 =" -- 2
  terms of 1-2 digits joined by '+' or '-': the same sums, and as many differences (a quarter of
  all answers negative).
  (A task mapping names each task once, so subtraction is measured through this task rather than
  through a second, '-'-only ``basic_arithmetic``);
- ``decimal_chain_sum``: "... 1.4 + 5.2 =" -- 2 terms of 1 digit with 1 decimal place: sums
  and differences whose answers carry a decimal point;
- ``products``: "Solve the following multiplication: 42 * 48. ..." -- 2 factors of 1-2 digits:
  a little further, an operation the model has never seen. (1-digit factors give only ~100
  distinct questions, which the training rows all but use up, leaving the held-out split almost
  no products to evaluate.)

The run evaluates before training (step 0 of eval.jsonl), halfway and at the end, greedily on the
first ``eval.num_prompts`` (128) rows of the held-out split, whose questions are never training
questions. The held-out split drops each drawn row whose question is a training question, which
removes more of the tasks with small question spaces (most of the 1-digit sums): each task gets
roughly 20-50 of the 128 prompts, recorded per task, and its questions lean to the larger operands.

Per task the result holds: the eval reward and pass@1 before training and after (the last
evaluation), their change, and the training reward (``reward_mean/<task>`` of metrics.jsonl,
temperature-1 samples of training questions) of the first and of the last 20% of steps. A task
*learns* when its eval reward rose by more than ``--threshold`` (0.10). Why 0.10: the eval is
greedy, so the same weights score the same every time, and its noise is which questions a task's
~30 prompts happen to be. The standard error of a pass rate p on n prompts is sqrt(p(1-p)/n),
0.053 at p = 0.1 on 32 prompts, so a rise from near 0 (where these tasks start: the tiny model's
greedy answers to them are nearly all wrong) to above 0.10 is about 2 standard errors. At higher
rates the standard error grows (0.088 at p = 0.5), so a rise just over 0.10 from a middling start
is weaker evidence; the per-task prompt counts in the table let a reader judge.

This is one run with fixed seeds (data, generators, trainer and eval at 0): a learning curve of
one sampled run, not a speed ratio nor a median of repeats. Training samples at temperature 1,
so a run with other seeds can end elsewhere (not measured here).

    python -m bench reasoning_gym [--quick] [-- --steps 300 --threshold 0.1]

About 4 minutes with the default 300 steps on 2 idle cores (configs/tiny-cpu.yaml's header: ~0.6 s
a step, plus ~45 s of start-up and the three evaluations), about 6 with another job on one of the
cores (measured: ~1.0 s a step then). ``--quick`` trains 20 steps in about 80 s: a smoke test of
the path, too short to learn.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import REPO, Result, python, results_dir, run_logged, summary, wait_for_quiet

CONFIG = REPO / "configs" / "tiny-cpu-reasoning-gym.yaml"

# The mixture, equal weights (each task's weight defaults to 1). Options are the package's own
# (reasoning_gym's config dataclass of each task); see the module docstring for why these.
TASKS: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+"],
                         "allow_parentheses": False, "allow_negation": False},
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "decimal_chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                          "min_decimal_places": 1, "max_decimal_places": 1},
    "products": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
}  # fmt: skip

THRESHOLD = 0.10  # an eval reward rise above this is "learns" (module docstring: ~2 standard errors)
SEED = 0


def overrides(steps: int, eval_prompts: int, tasks: dict[str, Any]) -> list[str]:
    """The run's overrides of configs/tiny-cpu-reasoning-gym.yaml. The task mapping is one override
    in JSON, which YAML reads as flow style (the override replaces the config's whole mapping)."""
    return [
        f"data.reasoning_gym.tasks={json.dumps(tasks)}",
        f"data.reasoning_gym.seed={SEED}",
        f"data.seed={SEED}",
        f"trainer.seed={SEED}",
        f"eval.seed={SEED}",
        f"trainer.steps={steps}",
        "eval.before_training=true",
        f"eval.interval={max(1, steps // 2)}",
        f"eval.num_prompts={eval_prompts}",
        "logging.progress=false",
    ]


def check_config(run_overrides: list[str], tasks: dict[str, Any]) -> Any:
    """The config the run will load (rlpost.config.load_config), before any process starts: it
    must take the overrides and hold exactly ``tasks`` (not merged into the config's own tasks)."""
    from rlpost.config import load_config

    cfg = load_config(CONFIG, run_overrides)
    loaded = cfg.data.reasoning_gym.tasks
    if loaded != tasks:
        raise SystemExit(f"the tasks override loads as {loaded}, not {tasks}")
    return cfg


def eval_prompts_per_task(cfg: Any) -> dict[str, int]:
    """How many of the eval's prompts each task gets: the eval scores the first eval.num_prompts
    rows of the held-out split in order (rlpost.service.evaluation), which these are."""
    from rlpost.envs.reasoning_gym import reasoning_gym_rows

    gym = cfg.data.reasoning_gym
    rows = reasoning_gym_rows(gym.tasks, size=gym.size, seed=gym.seed, split=cfg.eval.split)
    return dict(Counter(row["task"] for row in rows[: cfg.eval.num_prompts]))


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _change(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def verdict(change: float | None, threshold: float) -> str:
    if change is None:
        return "not evaluated"
    if change > threshold:
        return "learns"
    if change < -threshold:
        return "worse"
    return "no clear change"


def task_figures(
    metrics: list[dict], evals: list[dict], tasks: list[str], window: int, threshold: float
) -> dict[str, dict[str, Any]]:
    """Per task (and ``all tasks``: the mixture's overall figures), from metrics.jsonl's and
    eval.jsonl's rows: eval reward and pass@1 before training (the eval at step 0) and after (the
    last eval), their changes, the training reward of the first and last ``window`` steps (mean
    over the steps whose batch held the task) and the verdict on the eval reward's change."""
    before = next((e for e in evals if e["step"] == 0), {})
    after = evals[-1] if evals and evals[-1]["step"] > 0 else {}
    head, tail = metrics[:window], metrics[-window:]
    out = {}
    for task in [*tasks, None]:
        suffix = f"/{task}" if task else ""
        reward = [before.get(f"eval_reward_mean{suffix}"), after.get(f"eval_reward_mean{suffix}")]
        passed = [before.get(f"eval_pass_at_1{suffix}"), after.get(f"eval_pass_at_1{suffix}")]
        train = [_mean([m.get(f"reward_mean{suffix}") for m in rows]) for rows in (head, tail)]
        change = _change(*reward)
        out[task or "all tasks"] = {
            "eval_reward_before": reward[0],
            "eval_reward_after": reward[1],
            "eval_reward_change": change,
            "eval_pass_at_1_before": passed[0],
            "eval_pass_at_1_after": passed[1],
            "eval_pass_at_1_change": _change(*passed),
            "train_reward_first": train[0],
            "train_reward_last": train[1],
            "train_reward_change": _change(*train),
            "verdict": verdict(change, threshold),
        }
    return out


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 300; quick 20)")
    parser.add_argument("--eval-prompts", type=int, default=128, help="eval.num_prompts, all tasks together")
    parser.add_argument("--threshold", type=float, default=THRESHOLD, help="eval reward rise that counts as learning")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the run is stopped")
    args = parser.parse_args()
    steps = args.steps or (20 if args.quick else 300)
    window = max(1, steps // 5)  # the first and last 20% of steps
    run_overrides = overrides(steps, args.eval_prompts, TASKS)
    cfg = check_config(run_overrides, TASKS)
    prompts = eval_prompts_per_task(cfg)
    settings = {
        "config": str(CONFIG.relative_to(REPO)),
        "overrides": run_overrides,
        "tasks": TASKS,
        "steps": steps,
        "prompts_per_step": cfg.trainer.prompts_per_step,
        "group_size": cfg.data.group_size,
        "eval_interval": cfg.eval.interval,
        "eval_num_prompts": cfg.eval.num_prompts,
        "eval_prompts_per_task": prompts,
        "window": window,
        "threshold": args.threshold,
        "seed": SEED,
        "model": "tiny",
    }
    result = Result("reasoning_gym", args.quick, settings)
    # one run, whose figures are rewards, not times; a quiet machine only keeps its wall time
    # (recorded) comparable and leaves the cores to it
    result.data["settings"]["busy_cores_at_start"] = round(wait_for_quiet(args.quick), 2)
    keep = results_dir(args.quick) / "runs" / "reasoning_gym"
    tmp = Path(tempfile.mkdtemp(prefix="rlpost-bench-"))
    cmd = [python(), "-m", "rlpost.ops.cli", "train", str(CONFIG), *run_overrides,
           f"logging.run_name=bench-reasoning-gym-{int(time.time())}", "--run-dir", str(tmp / "run")]  # fmt: skip
    print(f"  {steps} steps on {sorted(TASKS)}; eval prompts per task {prompts}", flush=True)
    try:
        wall = run_logged(cmd, keep / "run.log", args.timeout)
        for name in ("metrics.jsonl", "eval.jsonl", "config.yaml"):  # the run folder (checkpoint included) goes
            shutil.copy(tmp / "run" / name, keep / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    metrics, evals = _read_jsonl(keep / "metrics.jsonl"), _read_jsonl(keep / "eval.jsonl")
    result.data["settings"]["eval_steps"] = [e["step"] for e in evals]
    if len(metrics) != steps:
        result.note(f"metrics.jsonl holds {len(metrics)} steps, not {steps}")
    if not evals or evals[0]["step"] != 0 or evals[-1]["step"] != steps:
        result.note(f"evaluations at steps {[e['step'] for e in evals]}: expected 0 first and {steps} last")
    figures = task_figures(metrics, evals, sorted(TASKS), window, args.threshold)
    for task, fig in figures.items():
        fig["eval_prompts"] = prompts.get(task, cfg.eval.num_prompts if task == "all tasks" else 0)
        fig["options"] = TASKS.get(task)
        result.cases[task] = fig
        print(f"  {task:18s} eval reward {_f(fig['eval_reward_before'])} -> {_f(fig['eval_reward_after'])} "
              f"({fig['eval_prompts']} prompts), train reward {_f(fig['train_reward_first'])} -> "
              f"{_f(fig['train_reward_last'])}: {fig['verdict']}", flush=True)  # fmt: skip
    learned = [task for task in sorted(TASKS) if figures[task]["verdict"] == "learns"]
    named = f": {', '.join(learned)}" if learned else ""
    result.ratios[f"tasks that learn (eval reward up > {args.threshold:g})"] = f"{len(learned)} of {len(TASKS)}{named}"
    result.ratios["eval reward, all tasks, after - before"] = _round(figures["all tasks"]["eval_reward_change"])
    result.ratios["train reward, all tasks, last - first 20%"] = _round(figures["all tasks"]["train_reward_change"])
    result.cases["wall (s)"] = summary([round(wall, 1)])  # the run's process, start-up included
    if args.quick:
        result.note(f"quick mode: {steps} steps, a smoke test of the path, too short to learn")
    result.write()


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


if __name__ == "__main__":
    main()
