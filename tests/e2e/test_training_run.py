"""Whole runs of the service with the tiny model (real vLLM, real bus), on the tier's shared Ray cluster
(conftest.py) or on a local one of their own."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# what each role reports from its own process, plus the driver's run-level gauges
EXPECTED_METRICS = {
    "rlpost_inference_tokens_generated",
    "rlpost_inference_policy_version",
    "rlpost_env_pool_reward_mean",
    "rlpost_learner_loss",
    "rlpost_learner_clip_fraction",
    "rlpost_buffer_size",
    "rlpost_reference_samples_scored",
    "rlpost_reward_mean",
    "rlpost_weight_sync_s",
}


def scrape_rlpost_metrics(expected, timeout_s=60.0):
    """rlpost metric names on this node's Prometheus endpoint (Ray exports every ~10 s)."""
    import re
    import time
    import urllib.request

    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    deadline, found = time.monotonic() + timeout_s, set()
    while time.monotonic() < deadline and not expected <= found:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        found = {m.group(1) for m in re.finditer(r"^ray_(rlpost_\w+?)(?:_total)?\{", text, re.M)}
        time.sleep(2)
    return found


def test_async_run_with_reference_keeps_staleness_bounded_names_actors_and_restarts_the_reference(
    tmp_path, tiny_model_path
):
    # A local cluster of its own, not the tier's: on the shared cluster its Prometheus check
    # missed most of the run's metrics in 2 of ~6 runs (not yet understood; see the issue).
    import os
    import signal

    import ray

    from rlpost.clients import actor_record
    from rlpost.config import load_config
    from rlpost.controller import Controller, start_run, stop_actors
    from rlpost.runs import create_run_dir

    cfg = load_config(
        "configs/tiny-cpu.yaml",
        [
            f"model.name_or_path={tiny_model_path}",
            "trainer.mode=async",
            "trainer.max_staleness=1",
            "trainer.steps=6",
            "trainer.prompts_per_step=4",
            "reference.enabled=true",
            "reference.kl_coef=0.01",
            "weight_sync.probe_every=2",  # syncs 2 and 4 overlap the next step (train_during_reload)
            "logging.progress=false",
            "logging.run_name=e2e-async",
        ],
    )
    run_dir = create_run_dir(cfg, tmp_path / "async")

    class KillTheReferenceOnce(Controller):
        def _collect_step(self):
            if self.step == 3:  # it dies (SIGKILL of its process, a crash) before annotating step 3's groups:
                os.kill(
                    actor_record(self.actors.reference.handle)["Pid"], signal.SIGKILL
                )  # started again, no step lost
            return super()._collect_step()

    ray.init(num_cpus=2, include_dashboard=False, namespace="rlpost-e2e-async", log_to_driver=False)
    actors = None
    try:
        supervisor = start_run(cfg, run_dir)
        actors = supervisor.actors
        names = {
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "rlpost-e2e-async"
        }
        assert {"inference-0", "env-pool-0", "learner", "reference", "buffer"} <= names
        KillTheReferenceOnce(cfg, run_dir, supervisor).run()
        exported = scrape_rlpost_metrics(EXPECTED_METRICS)
    finally:
        if actors is not None:
            stop_actors(actors)
        ray.shutdown()
    assert EXPECTED_METRICS <= exported, f"missing in Prometheus: {EXPECTED_METRICS - exported}"
    rows = read(run_dir / "metrics.jsonl")
    assert len(rows) == 6
    assert [r["restarts_reference"] for r in rows] == [0, 0, 1, 1, 1, 1]
    # the probed syncs wait for the reload; the ones between are confirmed by the next sync, whose
    # probe (steps 3 and 5) then finds the workers serving exactly the learner's weights
    assert [r["step"] for r in rows if r["sync_logprob_diff"] is not None] == [1, 3, 5]
    for r in rows:
        assert r["staleness_max"] <= 1  # never beyond trainer.max_staleness
        assert r["sync_logprob_diff"] is None or r["sync_logprob_diff"] <= 1e-3
        assert r["weight_load_s"] > 0  # the latest reload confirmed (the one before, where overlapped)
        assert r["kl_to_ref"] is not None and r["kl_to_ref"] >= 0
        # tokens record their own versions: an update mid-completion makes them newer than the sample
        assert r["token_staleness_mean"] <= r["staleness_mean"] + 1e-9 and 0 <= r["inflight_token_fraction"] <= 1
    print("in-flight token fractions:", [r["inflight_token_fraction"] for r in rows])


@pytest.mark.long  # two engines and a restart: ~75 s, more than make test's budget has room for
def test_a_worker_lost_before_a_weight_sync_is_restarted_and_the_bus_reformed(tmp_path, tiny_model_path):
    import ray

    from rlpost.config import load_config
    from rlpost.controller import Controller, start_run, stop_actors
    from rlpost.runs import create_run_dir

    cfg = load_config(
        "configs/tiny-cpu.yaml",
        [
            f"model.name_or_path={tiny_model_path}",
            "rollout.num_inference_workers=2",
            "trainer.steps=4",
            "trainer.prompts_per_step=4",
            "weight_sync.timeout_s=10",
            "logging.progress=false",
            "resources.inference.num_cpus=0.25",
            "logging.run_name=e2e-reform",
        ],
    )
    run_dir = create_run_dir(cfg, tmp_path / "reform")

    class KillOneWorker(Controller):
        def _train(self, groups, step):
            record = super()._train(groups, step)
            if step == 2:  # dies between training and the weight sync of step 2
                ray.kill(self.actors.inference[1].handle)
            return record

    ray.init(num_cpus=2, include_dashboard=False, namespace="rlpost-e2e-reform", log_to_driver=False)
    actors = None
    try:
        supervisor = start_run(cfg, run_dir)
        actors = supervisor.actors
        KillOneWorker(cfg, run_dir, supervisor).run()
    finally:
        if actors is not None:
            stop_actors(actors)
        ray.shutdown()
    rows = read(run_dir / "metrics.jsonl")
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4]
    assert rows[1]["bus_reforms"] == 1  # the sync of step 2 failed, re-formed and was resent
    assert [r["restarts_inference"] for r in rows] == [0, 1, 1, 1]  # inference-1 was started again
    assert all(r["sync_logprob_diff"] <= 1e-3 for r in rows)


def test_a_tool_using_run_joins_an_existing_token_authenticated_cluster(tmp_path, tiny_tool_model_path, ray_head):
    """`rlpost train --address` on the tier's `ray start --head` cluster (token authentication on,
    as Ray 2.60 has it by default; the token found through RAY_AUTH_TOKEN_PATH, RAY_AUTH_MODE
    unset), with the tool variant of the tiny model. It calls the sandboxed Python tool in about
    half of its samples from step 1: multi-turn episodes run through the env-pool actor (bwrap
    inside Ray) and their counts reach metrics.jsonl."""
    run_dir = tmp_path / "tools"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlpost.cli",
            "train",
            "configs/tiny-cpu-tools.yaml",
            f"model.name_or_path={tiny_tool_model_path}",
            "trainer.steps=3",
            "trainer.prompts_per_step=4",
            "logging.progress=false",
            "--address",
            ray_head.gcs_address,
            "--run-dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=540,
        env=ray_head.env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"rlpost: Ray cluster at {ray_head.gcs_address}; " in out.stdout  # it joined, started no cluster
    rows = read(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0.1 < r["tool_calls_mean"] <= 1.0  # at most one code block per episode here
        assert 1.0 < r["turns_mean"] <= 2.0  # rollout.max_turns=2
        assert 0.0 <= r["tool_error_fraction"] <= 1.0 and r["tool_time_s"] > 0
        assert r["reward_errors"] == 0
        assert r["sync_logprob_diff"] <= 1e-3
    assert "tools: python; model-written code runs in sandbox bwrap" in out.stderr  # the log says what guards it
