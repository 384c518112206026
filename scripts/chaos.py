"""Chaos harness: runs of the tiny job that lose actors, killed at random moments in random ways.

Each run is a real ``rlpost train`` of the tiny model (vLLM engine, gloo bus, Ray actors) in a
subprocess. While it trains, the harness attaches to the run's Ray cluster (the address is in
``RUN_DIR/ray_address``), finds actors by name (``ray.get_actor("inference-0",
namespace="rlpost-<run>")``) and ends each in one of WAYS, drawn at random: as an operator does
(``ray.kill``), as Ray ends an actor whose process died (``ray.kill(..., no_restart=False)``),
as the OOM killer or a segfault does (SIGKILL of the actor's process), or by the process
exiting on its own (SIGTERM, on which Ray's worker exits). A kill lands a random
delay after a random metrics line, so it hits generation, a weight receive, the sync probe, a
buffer put or a checkpoint by chance; every third run kills two actors in a row. A run passes
when it finishes every step within its time bound, metrics.jsonl has one line per step, every
line's accounting holds (``groups_put == groups_trained + groups_dropped_stale +
groups_in_buffer``) and the restart was counted.

    python scripts/chaos.py                      # 20 runs (make chaos), ~1-2 min each here
    python scripts/chaos.py --runs 3 --seed 1    # a short one

Exit status 0 when every run passed; the summary (a table, and chaos.json in --out) says what
each run killed, when, and how it ended.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VICTIMS = ("inference-0", "env-pool-0", "reference", "buffer", "learner")
WAYS = ("ray.kill", "ray.kill(no_restart=False)", "SIGKILL", "SIGTERM")
COUNTER = {
    "inference-0": "restarts_inference",
    "env-pool-0": "restarts_env_pool",
    "reference": "restarts_reference",
    "buffer": "restarts_buffer",
    "learner": "learner_resumes",
}


@dataclasses.dataclass
class Kill:
    victim: str
    after_line: int  # killed once metrics.jsonl has this many lines ...
    delay_s: float  # ... plus this delay
    way: str = "ray.kill"  # one of WAYS


@dataclasses.dataclass
class Plan:
    name: str
    mode: str
    kills: list[Kill]


@dataclasses.dataclass
class Outcome:
    plan: Plan
    passed: bool
    seconds: float
    problems: list[str]
    killed: list[str]  # what was actually killed (a victim already gone is skipped)
    late: list[str]  # killed after the last step's metrics line: the run ends without needing it
    restarts: dict[str, int]
    # (victim, seconds from its kill until the run's log said it was replaced: a new actor
    # started and serving; None when the run never said so, e.g. it ended without needing it)
    replaced_s: list[tuple[str, float | None]] = dataclasses.field(default_factory=list)


def make_plans(num_runs: int, seed: int, steps: int) -> list[Plan]:
    """Random plans: modes alternate, every third run kills two actors in a row, each kill in a
    way drawn from WAYS."""
    rng = random.Random(seed)
    plans = []
    for i in range(num_runs):
        victims = rng.sample(VICTIMS, 2 if i % 3 == 2 else 1)
        first = rng.randint(1, max(1, steps // 2 - 1))
        lines = [first, first + rng.randint(2, 3)][: len(victims)]
        kills = [Kill(v, line, round(rng.uniform(0.0, 2.0), 2), rng.choice(WAYS)) for v, line in zip(victims, lines)]
        plans.append(Plan(f"chaos-{seed}-{i}", "sync" if i % 2 == 0 else "async", kills))
    return plans


def overrides(plan: Plan, model: Path, steps: int) -> list[str]:
    return [
        f"model.name_or_path={model}",
        f"trainer.steps={steps}",
        "trainer.prompts_per_step=8",
        f"trainer.mode={plan.mode}",
        "trainer.checkpoint_interval=2",
        "trainer.keep_checkpoints=3",
        "trainer.auto_resume=true",
        "reference.enabled=true",
        "reference.kl_coef=0.01",
        "weight_sync.timeout_s=20",
        "logging.progress=false",
        f"logging.run_name={plan.name}",
    ]


def run_plan(plan: Plan, out: Path, model: Path, steps: int, timeout_s: float) -> Outcome:
    """One run of ``plan``: train in a subprocess, kill its actors, check what it wrote."""
    run_dir = out / plan.name
    log = (out / f"{plan.name}.log").open("w")
    cmd = [
        sys.executable,
        "-m",
        "rlpost.cli",
        "train",
        "configs/tiny-cpu.yaml",
        *overrides(plan, model, steps),
        "--run-dir",
        str(run_dir),
    ]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    killed, late, problems, kill_times = [], [], [], []
    try:
        killed, late, kill_times = _kill_as_planned(plan, proc, run_dir, start + timeout_s, steps)
        proc.wait(timeout=max(1.0, start + timeout_s - time.monotonic()))
    except subprocess.TimeoutExpired:
        problems.append(f"did not finish within {timeout_s:.0f}s")
        proc.kill()
        proc.wait()
    finally:
        log.close()
    seconds = time.monotonic() - start
    if proc.returncode not in (0, None) and not problems:
        tail = (out / f"{plan.name}.log").read_text().strip().splitlines()[-3:]
        problems.append(f"exit {proc.returncode}: {' | '.join(tail)}")
    rows = _read_metrics(run_dir)
    problems += check_metrics(rows, steps)
    counters = [COUNTER[v] for v in killed] + ["learner_resumes"]
    restarts = {c: rows[-1].get(c, 0) for c in counters} if rows else {}
    # a kill during the last step may be recovered after its metrics line was written
    problems += [
        f"{v} was killed but {COUNTER[v]} is 0"
        for v in killed
        if rows and v not in late and not rows[-1].get(COUNTER[v])
    ]
    if len(killed) == 1 and killed != ["learner"] and restarts.get("learner_resumes"):
        # losing one actor other than the learner is recovered in place: a restart of the whole
        # run from its checkpoint means the loss was mistaken for the learner's
        problems.append(f"the run restarted from a checkpoint {restarts['learner_resumes']} times (learner_resumes)")
    replaced = replacement_times((out / f"{plan.name}.log").read_text(), kill_times)
    return Outcome(plan, not problems, round(seconds, 1), problems, killed, late, restarts, replaced)


def _kill_as_planned(
    plan: Plan, proc: subprocess.Popen, run_dir: Path, deadline: float, steps: int
) -> tuple[list[str], list[str], list[tuple[str, float]]]:
    """Kill as ``plan`` says; returns what was killed, which of those after the last step, and
    ``(victim, wall-clock time)`` of each kill."""
    import ray

    from rlpost.ray_start import use_ray_token_if_present

    address_file = run_dir / "ray_address"
    while not address_file.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            return [], [], []
        time.sleep(0.5)
    use_ray_token_if_present()  # a local cluster of Ray 2.60 wants its token
    ray.init(
        address=address_file.read_text().strip(),
        namespace=f"rlpost-{plan.name}",
        log_to_driver=False,
        logging_level="ERROR",
    )
    killed, late, kill_times = [], [], []
    lines_at_last_kill = 0
    try:
        for kill in plan.kills:
            # a second kill waits for a line written after the first: the run has recovered (a
            # learner's loss restarts every actor, and the old ones must not be the target)
            while len(_read_metrics(run_dir)) < max(kill.after_line, lines_at_last_kill + 1):
                if proc.poll() is not None or time.monotonic() > deadline:
                    return killed, late, kill_times
                time.sleep(0.2)
            time.sleep(kill.delay_s)
            if proc.poll() is not None:  # the run ended meanwhile (its cluster with it)
                break
            try:
                end_actor(ray.get_actor(kill.victim), kill.way)
                killed_at = time.time()
            except (ValueError, ProcessLookupError):  # not there at this moment (the run is restarting it)
                continue
            killed.append(kill.victim)
            lines_at_last_kill = len(_read_metrics(run_dir))
            if lines_at_last_kill >= steps - 1:  # the loss may surface after the last line
                late.append(kill.victim)
            print(
                f"  {plan.name}: killed {kill.victim} ({kill.way}) after line {kill.after_line} + {kill.delay_s}s",
                flush=True,
            )
            kill_times.append((kill.victim, killed_at))
    finally:
        ray.shutdown()
    return killed, late, kill_times


def replacement_times(log_text: str, kills: list[tuple[str, float]]) -> list[tuple[str, float | None]]:
    """``(victim, seconds)`` for each ``(victim, wall-clock time of its kill)``: the seconds until
    the run's log said it was replaced (the supervisor's ``<victim> replaced`` line; for the
    learner, the ``resumed from`` line of the run's restart), None when it never said so."""
    import datetime

    stamped = []
    for line in log_text.splitlines():
        match = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rlpost \w+ (.*)", line)
        if match:
            when = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            stamped.append((when, match[2]))
    times = []
    for victim, killed_at in kills:
        said = "resumed from" if victim == "learner" else f"{victim} replaced"
        after = [when for when, text in stamped if when >= killed_at and text.startswith(said)]
        times.append((victim, round(after[0] - killed_at, 2) if after else None))
    return times


def end_actor(handle, way: str) -> None:
    """End the actor ``handle`` in ``way`` (one of WAYS). The signals go to the actor's process,
    found in Ray's record of the actor (the harness runs on the run's node)."""
    import os
    import signal

    import ray

    from rlpost.clients import actor_record

    if way == "ray.kill":
        ray.kill(handle)
    elif way == "ray.kill(no_restart=False)":
        ray.kill(handle, no_restart=False)
    elif way in ("SIGKILL", "SIGTERM"):
        record = actor_record(handle)
        if record.get("State") != "ALIVE" or not record.get("Pid"):
            raise ProcessLookupError(f"the actor has no live process ({record.get('State')})")
        os.kill(record["Pid"], getattr(signal, way))
    else:
        raise ValueError(f"unknown way of ending an actor: {way!r}; one of {WAYS}")


def _read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return rows


def check_metrics(rows: list[dict], steps: int) -> list[str]:
    """What is wrong with a finished run's metrics.jsonl (empty: nothing)."""
    problems = []
    if [r["step"] for r in rows] != list(range(1, steps + 1)):
        problems.append(f"steps {[r['step'] for r in rows]}, expected 1..{steps}")
    for r in rows:
        if r["groups_put"] != r["groups_trained"] + r["groups_dropped_stale"] + r["groups_in_buffer"]:
            problems.append(
                f"step {r['step']}: groups_put {r['groups_put']} != trained {r['groups_trained']} + dropped "
                f"{r['groups_dropped_stale']} + in buffer {r['groups_in_buffer']}"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="number of runs (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill plans")
    parser.add_argument("--steps", type=int, default=10, help="steps per run")
    parser.add_argument("--timeout", type=float, default=480.0, help="seconds one run may take")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "chaos", help="where the runs and chaos.json go")
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "tiny-model", help="the tiny model")
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="NAME",
        help="run only these plans of the seed (e.g. chaos-0-17, to reproduce a failure)",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    plans = make_plans(args.runs, args.seed, args.steps)
    for plan in [p for p in plans if args.only is None or p.name in args.only]:
        print(
            f"{plan.name} ({plan.mode}): "
            + ", ".join(f"{k.victim} ({k.way}) after line {k.after_line}" for k in plan.kills),
            flush=True,
        )
        outcome = run_plan(plan, args.out, args.model, args.steps, args.timeout)
        print(
            f"  {'passed' if outcome.passed else 'FAILED'} in {outcome.seconds}s {outcome.restarts} "
            f"replaced after {[t for _, t in outcome.replaced_s]} s "
            f"{'; '.join(outcome.problems)}",
            flush=True,
        )
        outcomes.append(outcome)
    (args.out / "chaos.json").write_text(json.dumps([dataclasses.asdict(o) for o in outcomes], indent=2))
    passed = sum(o.passed for o in outcomes)
    for victim in VICTIMS:  # how long a replacement took, by role
        times = sorted(t for o in outcomes for v, t in o.replaced_s if v == victim and t is not None)
        if times:
            print(f"  {victim}: replaced in {times[len(times) // 2]} s (median), {times[-1]} s (max) of {len(times)}")
    print(
        f"chaos: {passed} of {len(outcomes)} runs passed ({sum(len(o.killed) for o in outcomes)} kills); "
        f"details in {args.out / 'chaos.json'}"
    )
    return 0 if passed == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
