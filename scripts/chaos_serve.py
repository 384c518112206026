"""Chaos harness of ``rlpost serve``: two tenants train through the official tinker SDK while the
service's actors are killed, and every tenant's steps must be applied exactly once.

One service on a local Ray cluster (the tiny model, one trainer, one vLLM inference worker, the
HTTP server in this process) serves two tenants, each with its own key and SDK client, at once.
A tenant's run: a LoRA model from a fixed seed, ``--steps`` steps of ``forward_backward`` and
``optim_step`` on its own data, a sampler of its adapter after the second step sampled every other
step from then on, then a ``forward`` of a probe. First both run undisturbed (the reference); then each of
``--runs`` runs kills one actor (the trainer or the inference worker, drawn at random) in one of
WAYS (drawn at random) at a random moment of the run, while both tenants' calls are in flight.
SIGSTOP freezes the actor instead: alive in Ray's record, answering nothing, until the service's
call bound (``call_timeout_s``, short here) finds it.

A run passes when both tenants finish, the last ``optim_step`` says ``step:max`` == ``--steps``
(no step lost, none applied twice) and the probe's log-probs equal the reference run's within
BOUND (the same steps applied to the same adapter from the service's own snapshots).

    python scripts/chaos_serve.py                 # 10 runs (make chaos-serve), ~1 min each here
    python scripts/chaos_serve.py --runs 2 --seed 3

Exit status 0 when every run passed; chaos-serve.json in --out has each run's kill and outcome.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TENANTS = {"alice": "tml-chaos-alice-0123456789", "bob": "tml-chaos-bob-0123456789"}
VICTIMS = ("trainer", "inference-0")
WAYS = ("SIGKILL", "ray.kill", "SIGSTOP")
BOUND = 1e-5  # the probe's log-probs against the reference run's (float32, CPU)
CALL_TIMEOUT_S = 20.0  # the service's bound on one actor call: a frozen actor is found after this


@dataclasses.dataclass
class Outcome:
    run: int
    victim: str
    way: str
    at_s: float
    wall_s: float = 0.0
    steps: dict = dataclasses.field(default_factory=dict)  # tenant -> the last optim_step's step:max
    max_diff: dict = dataclasses.field(default_factory=dict)  # tenant -> probe log-prob difference
    error: str | None = None
    restarts: dict = dataclasses.field(default_factory=dict)

    @property
    def landed(self) -> bool:
        """Whether the victim was replaced while the tenants ran (not after their last call)."""
        return self.restarts.get("trainer" if self.victim == "trainer" else "inference", 0) >= 1

    @property
    def passed(self) -> bool:
        return self.error is None and all(d <= BOUND for d in self.max_diff.values()) and len(self.max_diff) == 2


def tenant_run(url: str, key: str, model: str, seed: int, steps: int, tokens: list[int]) -> tuple[int, list[float]]:
    """One tenant's run through the SDK: (the last step:max, the probe's log-probs)."""
    import tinker
    from tinker import types

    def datum(ids):
        return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                           loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})  # fmt: skip

    data = [datum(tokens[i : i + 12]) for i in range(0, len(tokens) - 12, 4)]
    adam = types.AdamParams(learning_rate=5e-3)
    with tinker.ServiceClient(base_url=url, api_key=key) as client:
        training = client.create_lora_training_client(base_model=model, rank=8, seed=seed).result()
        last, sampler, prompt = 0, None, types.ModelInput.from_ints(tokens[:6])
        for step in range(steps):
            training.forward_backward(data, "cross_entropy").result()
            last = int(training.optim_step(adam).result().metrics["step:max"])
            if step == 1:  # a sampler of the adapter after two steps, sampled every other step from then on
                sampler = training.save_weights_and_get_sampling_client().result()
            if sampler is not None and step % 2:
                sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=1.0)).result()
        probe = training.forward([datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
        return last, probe.tolist()


def both_tenants(url: str, model: str, steps: int, tokens: dict[str, list[int]]) -> dict[str, tuple]:
    """Both tenants' runs at once (a thread each): tenant -> (step:max, probe) or the error raised."""
    results: dict[str, tuple] = {}

    def one(tenant: str, seed: int) -> None:
        try:
            results[tenant] = tenant_run(url, TENANTS[tenant], model, seed, steps, tokens[tenant])
        except Exception as exc:  # noqa: BLE001 (reported as the run's failure)
            results[tenant] = (None, f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(t, 10 + i)) for i, t in enumerate(TENANTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    return results


def pid_of(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def kill(fleet, victim: str, way: str) -> None:
    import ray

    actor = fleet.trainer if victim == "trainer" else fleet.inference[0]
    if way == "ray.kill":
        ray.kill(actor)
        return
    pid = pid_of(actor)
    os.kill(pid, signal.SIGKILL if way == "SIGKILL" else signal.SIGSTOP)
    if way == "SIGSTOP":  # the service kills it once its call bound passes; end it for good after that
        threading.Timer(CALL_TIMEOUT_S * 3, lambda: _kill_quietly(pid)).start()


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=str(REPO / "models" / "tiny-model"))
    parser.add_argument("--out", default=str(REPO / "chaos-serve"))
    args = parser.parse_args()
    import ray
    from transformers import AutoTokenizer

    from rlpost.config import ServeConfig
    from rlpost.serve.access import ApiKeys
    from rlpost.serve.fleet import ServiceFleet
    from rlpost.serve.server import RunningServer

    os.environ["TINKER_TELEMETRY"] = "0"
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokens = {"alice": tokenizer.encode("What is 3 + 4? The answer is 7, and 5 + 6 is 11."),
              "bob": tokenizer.encode("Name a colour: blue. Name a fruit: apple. Name a tree: oak.")}  # fmt: skip
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="rlpost-chaos-serve")
    cfg = ServeConfig(base_model=args.model, port=0, storage_dir=tempfile.mkdtemp(prefix="chaos-serve-"),
                      call_timeout_s=CALL_TIMEOUT_S, engine={"max_model_len": 256},
                      resources={"trainer": {"num_cpus": 0.5}, "inference": {"num_cpus": 0.5}})  # fmt: skip
    fleet = ServiceFleet.start(cfg, args.model, name_prefix="chaos-")
    running = RunningServer(cfg, ApiKeys({key: tenant for tenant, key in TENANTS.items()}), fleet)
    ready = threading.Event()
    thread = threading.Thread(target=lambda: asyncio.run(running.serve(lambda url: ready.set())), daemon=True)
    thread.start()
    assert ready.wait(60), "the HTTP server did not start"
    outcomes: list[Outcome] = []
    try:
        # two undisturbed runs: the same results (what the disturbed ones are held to), and the
        # second's time, warm, sets when a kill may land
        first: dict[str, tuple] = {}
        for attempt in range(2):
            start = time.monotonic()
            reference = both_tenants(running.url, cfg.served_name, args.steps, tokens)
            took = time.monotonic() - start
            for tenant, (steps, probe) in reference.items():
                if steps != args.steps:
                    print(f"the undisturbed run failed for {tenant}: {probe}", flush=True)
                    return 1
                if attempt and max(abs(a - b) for a, b in zip(probe, first[tenant][1])) > BOUND:
                    print(f"two undisturbed runs of {tenant} differ: the comparison would mean nothing", flush=True)
                    return 1
            first = reference
        print(f"reference: both tenants' {args.steps} steps in {took:.1f} s (twice, the same)", flush=True)
        for run in range(1, args.runs + 1):
            # early enough that both tenants still have calls to make when the kill lands
            outcome = Outcome(run, rng.choice(VICTIMS), rng.choice(WAYS), round(rng.uniform(0.05, 0.6) * took, 2))
            before = dict(fleet.restarts)
            timer = threading.Timer(outcome.at_s, kill, args=(fleet, outcome.victim, outcome.way))
            started = time.monotonic()
            timer.start()
            results = both_tenants(running.url, cfg.served_name, args.steps, tokens)
            timer.join()
            outcome.wall_s = round(time.monotonic() - started, 1)
            outcome.restarts = {k: v - before.get(k, 0) for k, v in fleet.restarts.items()}
            for tenant, (steps, probe) in results.items():
                if steps is None:
                    outcome.error = f"{tenant}: {probe}"
                    continue
                outcome.steps[tenant] = steps
                if steps != args.steps:
                    outcome.error = f"{tenant}: step:max {steps} after {args.steps} steps"
                ref = reference[tenant][1]
                outcome.max_diff[tenant] = max(abs(a - b) for a, b in zip(probe, ref))
            outcomes.append(outcome)
            verdict = "passed" if outcome.passed else f"FAILED ({outcome.error or outcome.max_diff})"
            landed = "replaced during the run" if outcome.landed else "not noticed during the run"
            print(f"run {run}: {outcome.way} of {outcome.victim} at {outcome.at_s:.1f} s ({landed}); "
                  f"{outcome.wall_s:.0f} s; restarts {outcome.restarts}; {verdict}", flush=True)  # fmt: skip
    finally:
        running.stop()
        thread.join(10)
        fleet.stop()
        ray.shutdown()
        summary = {"runs": [dataclasses.asdict(o) | {"passed": o.passed, "landed": o.landed} for o in outcomes],
                   "passed": sum(o.passed for o in outcomes), "bound": BOUND, "steps": args.steps}  # fmt: skip
        (out / "chaos-serve.json").write_text(json.dumps(summary, indent=1) + "\n")
    passed, landed = sum(o.passed for o in outcomes), sum(o.landed for o in outcomes)
    print(f"{passed} of {len(outcomes)} runs passed (every tenant's steps applied exactly once); in {landed} the "
          "killed actor was replaced while the tenants ran", flush=True)  # fmt: skip
    return 0 if outcomes and passed == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
