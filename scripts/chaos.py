"""Chaos harness: runs of the tiny job that lose actors, killed at random moments in random ways.

Each run is a real ``rlpost train`` of the tiny model (vLLM engine, gloo bus, Ray actors) in a
subprocess. While it trains, the harness attaches to the run's Ray cluster (the address is in
``RUN_DIR/ray_address``), finds actors by name (``ray.get_actor("inference-0",
namespace="rlpost-<run>")``) and ends each in one of WAYS, drawn at random: as an operator does
(``ray.kill``), as Ray ends an actor whose process died (``ray.kill(..., no_restart=False)``),
as the OOM killer or a segfault does (SIGKILL of the actor's process), by the process
exiting on its own (SIGTERM, on which Ray's worker exits), or by freezing it: SIGSTOP, which
leaves the actor ALIVE in Ray's record and answering nothing, as a stuck collective, a deadlock
or a frozen node does (the run's watchdog must find it; the runs use short deadlines,
FREEZE_DEADLINE_S). A kill lands a random
delay after a random metrics line, so it hits generation, a weight receive, the sync probe, a
buffer put or a checkpoint by chance; every third run kills two actors, in a row (the second
once the run recovered from the first) or at the same moment.

Every fifth run loses a whole node instead: it runs on a two-node cluster on this machine (two
``ray start`` raylets, :mod:`rlpost.ops.local_cluster`) whose second node holds one of the two
inference workers and one of the two env pools, and that node's raylet is SIGKILLed (its
workers die with it, as when a host fails); a third node joins a random 5-30 s later, where
both come back. A run passes when it finishes every step within its time bound, metrics.jsonl
has one line per step, every line's accounting holds (``groups_put == groups_trained +
groups_dropped_stale + groups_in_buffer``) and the restarts were counted.

    python scripts/chaos.py                      # 20 runs (make chaos), ~1-2 min each here
    python scripts/chaos.py --runs 3 --seed 1    # a short one

Exit status 0 when every run passed; the summary (a table, and chaos.json in --out) says what
each run killed, when, and how it ended.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VICTIMS = ("inference-0", "env-pool-0", "reference", "buffer", "learner")
NODE = "node"  # a Kill's victim: the second node of a node plan (its raylet)
# a node plan's cluster: one inference worker and one env pool per node (custom resources only the
# nodes declare), every other actor on the head (it alone has CPUs)
SLOTS = {"rollout_slot": 1, "pool_slot": 1}
# an async step of the tiny job takes ~0.5 s here against ~4 s in sync mode: async runs get this
# many times the steps, so that a kill lands while the run still needs the actor
ASYNC_PACE = 4
DEATHS = ("ray.kill", "ray.kill(no_restart=False)", "SIGKILL", "SIGTERM")
FREEZES = ("SIGSTOP",)
WAYS = DEATHS + FREEZES
FREEZE_SHARE = 1 / 3  # of the kills: a freeze, else a death drawn from DEATHS
# the watchdog's answer_s for every role in these runs (the defaults, 30-120 s, would make a freeze
# cost minutes of a run of seconds): a frozen actor is killed this long after its last answer
FREEZE_DEADLINE_S = 8
COUNTER = {
    "inference-0": "restarts_inference",
    "env-pool-0": "restarts_env_pool",
    "reference": "restarts_reference",
    "buffer": "restarts_buffer",
    "learner": "learner_resumes",
    "reward": "restarts_reward",  # a run with a reward model (Plan.overrides)
    "control": None,  # the run's mailbox: started again, counted nowhere (the log says it)
}


@dataclasses.dataclass
class Kill:
    victim: str
    after_line: int  # killed once metrics.jsonl has this many lines ...
    delay_s: float  # ... plus this delay
    way: str = "ray.kill"  # one of WAYS (a node: its raylet gets SIGKILL)
    with_next: bool = False  # the next kill follows at once (two actors lost at the same moment)


@dataclasses.dataclass
class Plan:
    name: str
    mode: str
    kills: list[Kill]
    rejoin_s: float | None = None  # a node plan: a new node joins this long after the node's loss
    steps: int | None = None  # the run's steps (None: run_plan's)
    overrides: list[str] = dataclasses.field(default_factory=list)  # more config overrides of the run
    resumes: int = 0  # restarts from a checkpoint the overrides themselves cause (a learner made to hang)


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
    """Random plans: modes alternate, every fifth run loses a node, every third of the others
    kills two actors (in a row and at the same moment by turns), each kill a freeze or a death
    (:func:`draw_way`)."""
    rng = random.Random(seed)
    plans = []
    for i in range(num_runs):
        name, mode = f"chaos-{seed}-{i}", "sync" if i % 2 == 0 else "async"
        # async runs, and node runs in either mode, get more steps: their losses must land while
        # the run still needs the actors (a 10-step sync run of the tiny job ends in ~5 s, before
        # Ray declares a lost node dead)
        run_steps = steps * (ASYNC_PACE if mode == "async" or i % 5 == 4 else 1)
        first = rng.randint(1, max(1, run_steps // 2 - 1))
        if i % 5 == 4:
            kill = Kill(NODE, first, round(rng.uniform(0.0, 2.0), 2), "SIGKILL")
            plans.append(Plan(name, mode, [kill], rejoin_s=round(rng.uniform(5.0, 30.0), 1), steps=run_steps))
            continue
        victims = rng.sample(VICTIMS, 2 if i % 3 == 2 else 1)
        together = len(victims) == 2 and (i // 3) % 2 == 1
        gap = rng.randint(2, 3) * (ASYNC_PACE if mode == "async" else 1)
        lines = [first, first if together else first + gap][: len(victims)]
        kills = [Kill(v, line, round(rng.uniform(0.0, 2.0), 2), draw_way(rng)) for v, line in zip(victims, lines)]
        if together:
            kills[0].with_next = True
        plans.append(Plan(name, mode, kills, steps=run_steps))
    return plans


def draw_way(rng: random.Random) -> str:
    """A freeze one time in three (FREEZE_SHARE), else a way of dying."""
    return rng.choice(FREEZES) if rng.random() < FREEZE_SHARE else rng.choice(DEATHS)


def overrides(plan: Plan, model: Path, steps: int) -> list[str]:
    nodes = []
    if plan.rejoin_s is not None:  # one worker and one pool on each node (SLOTS)
        nodes = [
            "rollout.num_inference_workers=2", "resources.inference.num_cpus=0",
            f"resources.inference.resources={json.dumps({'rollout_slot': 1})}",
            "rollout.num_env_pools=2", "resources.env_pool.num_cpus=0",
            f"resources.env_pool.resources={json.dumps({'pool_slot': 1})}", "resources.replacement_wait_s=3",
        ]  # fmt: skip
    deadlines = [f"watchdog.{role}.answer_s={FREEZE_DEADLINE_S}" for role in
                 ("inference", "env_pool", "learner", "reference", "reward", "buffer", "control")]  # fmt: skip
    return (
        nodes
        + deadlines
        + plan.overrides
        + [
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
    )


# a node's roles whose actors may leave the fleet (no room for them) instead of being restarted
VACANT = {"restarts_inference": "inference_workers_vacant", "restarts_env_pool": "env_pools_vacant"}


def unrecovered(killed: list[str], late: list[str], rows: list[dict], resumed_pair: bool) -> list[str]:
    """The losses the run's last metrics line does not count. Not counted and fine: a kill
    during the last step (recovered after its line was written), two actors lost at once that
    cost a restart from the checkpoint (``resumed_pair``: it restored that checkpoint's counts),
    and a node's actor still waiting for room at the end (the run went on without it: its slot
    is vacant on the last line)."""
    if not rows:
        return []
    last = rows[-1]
    return [
        f"{v} was lost but {c} is 0"
        for v in killed
        for c in counters_of(v)
        if v not in late and not resumed_pair and not last.get(c) and not (v == NODE and last.get(VACANT[c]))
    ]


def counters_of(victim: str) -> list[str]:
    """The metrics.jsonl counters that must have counted ``victim``'s loss."""
    if victim == NODE:
        return ["restarts_inference", "restarts_env_pool"]
    return [COUNTER[victim]] if COUNTER[victim] else []


class Nodes:
    """A node plan's cluster (:mod:`rlpost.ops.local_cluster`): a head and a second node, each with
    SLOTS, Ray declaring a silent node dead after ~3 s instead of ~15 s; a third node joins on
    demand. Everything stops when ``stack`` closes."""

    def __init__(self, stack: contextlib.ExitStack, folder: Path):
        from rlpost.ops.local_cluster import head_node, worker_node

        self.stack, self.worker_node = stack, worker_node
        token = (folder / "ray-token").resolve()  # the nodes start in temp dirs of their own
        token.write_text(secrets.token_hex(32))
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env |= {"RAY_AUTH_TOKEN_PATH": str(token), "RAY_health_check_period_ms": "1000",
                "RAY_health_check_failure_threshold": "3"}  # fmt: skip
        self.head = stack.enter_context(head_node(env=env, num_cpus=2, resources=SLOTS))
        self.second = stack.enter_context(worker_node(self.head, num_cpus=0, resources=SLOTS, name="node2"))

    def lose_second(self) -> None:
        self.second.raylet().kill()

    def add_third(self) -> None:
        self.stack.enter_context(self.worker_node(self.head, num_cpus=0, resources=SLOTS, name="node3"))


def start_nodes(stack: contextlib.ExitStack, out: Path, name: str) -> Nodes:
    """A node plan's cluster, tried twice: a `ray start` of the second node has failed here on
    its first RPC to the head's control store (a deadline exceeded while the machine was busy),
    which is the test cluster's start, not the run under test."""
    try:
        attempt = contextlib.ExitStack()
        nodes = Nodes(attempt, out)
    except RuntimeError as exc:
        attempt.close()
        print(f"  {name}: the cluster did not start ({str(exc).splitlines()[0][:200]}); starting it again", flush=True)
        attempt = contextlib.ExitStack()
        try:
            nodes = Nodes(attempt, out)
        except BaseException:
            attempt.close()
            raise
    stack.enter_context(attempt)
    return nodes


def run_plan(plan: Plan, out: Path, model: Path, steps: int, timeout_s: float) -> Outcome:
    """One run of ``plan`` (``plan.steps`` steps, else ``steps``): train in a subprocess, kill its
    actors (or its node), check what it wrote."""
    steps = plan.steps or steps
    run_dir = out / plan.name
    log_path = out / f"{plan.name}.log"
    # a plan's folder from an earlier `make chaos`: the run would refuse it (and its stale
    # ray_address would point the harness at a cluster long gone)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "rlpost.ops.cli", "train", "configs/tiny-cpu.yaml", *overrides(plan, model, steps),
           "--run-dir", str(run_dir)]  # fmt: skip
    killed, late, problems, kill_times = [], [], [], []
    start = time.monotonic()
    with contextlib.ExitStack() as cluster, log_path.open("w") as log:
        try:
            nodes = start_nodes(cluster, out, plan.name) if plan.rejoin_s is not None else None
        except RuntimeError as exc:  # a node that did not start twice: this run fails, the others go on
            return Outcome(plan, False, 0.0, [f"the cluster did not start: {str(exc)[:500]}"], [], [], {})
        if nodes is not None:
            cmd += ["--address", nodes.head.gcs_address]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env=nodes.head.env if nodes is not None else None)  # fmt: skip
        try:
            killed, late, kill_times = _kill_as_planned(plan, proc, run_dir, start + timeout_s, steps, nodes)
            proc.wait(timeout=max(1.0, start + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            problems.append(f"did not finish within {timeout_s:.0f}s")
            proc.kill()
            proc.wait()
    seconds = time.monotonic() - start
    if proc.returncode not in (0, None) and not problems:
        tail = log_path.read_text().strip().splitlines()[-3:]
        problems.append(f"exit {proc.returncode}: {' | '.join(tail)}")
    rows = _read_metrics(run_dir)
    problems += check_metrics(rows, steps)
    counters = [c for v in killed for c in counters_of(v)] + ["learner_resumes"]
    restarts = {c: rows[-1].get(c, 0) for c in counters} if rows else {}
    # two actors lost at once may cost the run a restart from its checkpoint (the buffer with a
    # pool's position), which restores the counts of that checkpoint: the resume is the count
    resumed_pair = any(k.with_next for k in plan.kills) and restarts.get("learner_resumes")
    problems += unrecovered(killed, late, rows, resumed_pair)
    if len(killed) == 1 and killed != ["learner"] and restarts.get("learner_resumes", 0) > plan.resumes:
        # losing one actor (or a node without the learner) is recovered in place: a restart of
        # the whole run from its checkpoint means the loss was mistaken for the learner's
        problems.append(f"the run restarted from a checkpoint {restarts['learner_resumes']} times (learner_resumes)")
    replaced = replacement_times(log_path.read_text(), kill_times)
    return Outcome(plan, not problems, round(seconds, 1), problems, killed, late, restarts, replaced)


def _kill_as_planned(
    plan: Plan, proc: subprocess.Popen, run_dir: Path, deadline: float, steps: int, nodes: Nodes | None = None
) -> tuple[list[str], list[str], list[tuple[str, float]]]:
    """Kill as ``plan`` says; returns what was killed, which of those after the last step, and
    ``(victim, wall-clock time)`` of each kill."""
    import ray

    from rlpost.runtime.ray_start import use_ray_token_if_present
    from rlpost.service.mailbox import check_reachable

    address_file = run_dir / "ray_address"
    while not address_file.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            return [], [], []
        time.sleep(0.5)
    actors = any(kill.victim != NODE for kill in plan.kills)
    if actors:
        try:
            check_reachable(address_file.read_text().strip())  # never wait on a cluster that is gone
        except LookupError:
            return [], [], []
        use_ray_token_if_present()  # a local cluster of Ray 2.60 wants its token
        ray.init(
            address=address_file.read_text().strip(),
            namespace=f"rlpost-{plan.name}",
            log_to_driver=False,
            logging_level="ERROR",
        )
    killed, late, kill_times = [], [], []
    lines_at_last_kill = 0
    at_once = False  # the previous kill said the next follows at once
    try:
        for kill in plan.kills:
            # a second kill waits for a line written after the first: the run has recovered (a
            # learner's loss restarts every actor, and the old ones must not be the target)
            while not at_once and len(_read_metrics(run_dir)) < max(kill.after_line, lines_at_last_kill + 1):
                if proc.poll() is not None or time.monotonic() > deadline:
                    return killed, late, kill_times
                time.sleep(0.2)
            if not at_once:
                time.sleep(kill.delay_s)
            at_once = kill.with_next
            if proc.poll() is not None:  # the run ended meanwhile (its cluster with it)
                break
            try:
                if kill.victim == NODE:
                    nodes.lose_second()
                else:
                    end_actor(ray.get_actor(kill.victim), kill.way)
                killed_at = time.time()
            except (ValueError, ProcessLookupError):  # not there at this moment (the run is restarting it)
                continue
            killed.append(kill.victim)
            lines_at_last_kill = len(_read_metrics(run_dir))
            if lines_at_last_kill >= steps - 1:  # the loss may surface after the last line
                late.append(kill.victim)
            print(
                f"  {plan.name}: killed {kill.victim} ({kill.way}) after line {kill.after_line} + {kill.delay_s}s"
                + (" and, at once, the next" if kill.with_next else ""),
                flush=True,
            )
            kill_times.append((kill.victim, killed_at))
            if kill.victim == NODE:
                _wait_while_running(proc, plan.rejoin_s)
                if proc.poll() is None:
                    nodes.add_third()
                    print(f"  {plan.name}: a third node joined {plan.rejoin_s}s after the loss", flush=True)
    finally:
        if actors:
            ray.shutdown()
    return killed, late, kill_times


def _wait_while_running(proc: subprocess.Popen, seconds: float) -> None:
    end = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < end:
        time.sleep(0.2)


def replacement_times(log_text: str, kills: list[tuple[str, float]]) -> list[tuple[str, float | None]]:
    """``(victim, seconds)`` for each ``(victim, wall-clock time of its kill)``: the seconds until
    the run's log said it was replaced (the supervisor's ``<victim> replaced`` line; for the
    learner, the ``resumed from`` line of the run's restart; for a node, the later of its
    inference worker's and env pool's), None when it never said so."""
    import datetime

    stamped = []
    for line in log_text.splitlines():
        match = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rlpost \w+ (.*)", line)
        if match:
            when = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            stamped.append((when, match[2]))
    times = []
    for victim, killed_at in kills:
        if victim == NODE:  # both of the node's actors serve again
            said = ["inference-", "env-pool-"]
        else:
            said = ["resumed from" if victim == "learner" else f"{victim} replaced"]
        firsts = []
        for prefix in said:
            after = [when for when, text in stamped if when >= killed_at and text.startswith(prefix)
                     and (victim != NODE or " replaced: serving again" in text)]  # fmt: skip
            firsts.append(after[0] if after else None)
        done = None if None in firsts else max(firsts)
        times.append((victim, round(done - killed_at, 2) if done is not None else None))
    return times


def end_actor(handle, way: str) -> None:
    """End the actor ``handle`` in ``way`` (one of WAYS). The signals go to the actor's process,
    found in Ray's record of the actor (the harness runs on the run's node)."""
    import os
    import signal

    import ray

    from rlpost.runtime.actors import actor_record

    if way == "ray.kill":
        ray.kill(handle)
    elif way == "ray.kill(no_restart=False)":
        ray.kill(handle, no_restart=False)
    elif way in ("SIGKILL", "SIGTERM", "SIGSTOP"):
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
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny-model", help="the tiny model")
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
    for victim in (*VICTIMS, NODE):  # how long a replacement took, by role
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
