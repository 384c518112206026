"""Runs that lose actors mid-run: a process killed by SIGKILL (as the OOM killer does), one that
exits on SIGTERM, and Ray's kill.

Real actors throughout: vLLM engines, the gloo bus, the buffer actor, the learner. Each test
runs a few small steps of the tiny-model job; the kills are placed by overriding one controller
method, so they land at a known step. The restarts run on the tier's shared cluster, the learner's
death on a local cluster of its own. Both are in the long tier (with the frozen-actor runs and
the node loss): `make test` keeps a real restart in
tests/e2e/test_dashboard.py (the reference's) and every failure over stand-ins in
tests/unit/test_supervisor.py.
"""

import json
import threading

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(600)]


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def tiny_cfg(tiny_model_path, run_name, *overrides):
    from rlpost.config import load_config

    return load_config(
        "configs/tiny-cpu.yaml",
        [
            f"model.name_or_path={tiny_model_path}",
            "trainer.prompts_per_step=4",
            "logging.progress=false",
            "weight_sync.timeout_s=20",
            f"logging.run_name={run_name}",
            *overrides,
        ],
    )


@pytest.fixture
def local_ray():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_dead_inference_worker_and_env_pool_are_restarted_and_no_group_is_lost(tmp_path, tiny_model_path,
                                                                                connect_driver):  # fmt: skip
    """Sync mode, one worker and one pool: the worker's process is killed with SIGKILL while step
    2 is being collected (its request is re-issued to the restarted worker, the bus re-formed), the
    pool's process ends on SIGTERM while step 3 is (a process that exits by a signal, as a node's
    shutdown ends it) and the new pool by ``ray.kill(..., no_restart=False)`` (how Ray ends an actor
    whose process died) while step 4 is; each new pool restarts from the last put. None frees the
    actor's name in Ray: the supervisor must see the deaths in Ray's record of the actors. Every
    prompt of the stream is trained exactly once, in order. (`make chaos` draws these ways and
    moments at random, in whole `rlpost train` runs.)"""
    import os
    import signal
    import time

    from rlpost.record.run_dir import create_run_dir
    from rlpost.runtime.actors import actor_record
    from rlpost.service.loop import Controller
    from rlpost.service.run import start_run

    ray = connect_driver("rlpost-e2e-restarts")
    cfg = tiny_cfg(tiny_model_path, "e2e-restarts", "trainer.steps=5")
    run_dir = create_run_dir(cfg, tmp_path / "restarts")
    trained, killed = [], set()

    def sigkill(handle):
        os.kill(actor_record(handle)["Pid"], signal.SIGKILL)

    def sigterm(handle):
        os.kill(actor_record(handle)["Pid"], signal.SIGTERM)

    def ray_kill_as_after_a_crash(handle):
        ray.kill(handle, no_restart=False)

    class KillMidCollection(Controller):
        def _collect_shares(self, targets):
            victim = {2: (sigkill, self.fleet.inference[0]), 3: (sigterm, self.fleet.env_pools[0]),
                      4: (ray_kill_as_after_a_crash, self.fleet.env_pools[0])}  # fmt: skip
            if self.step in victim and self.step not in killed:  # killed shortly after the pool starts generating
                killed.add(self.step)  # once: the collection runs again after the restart
                how, client = victim[self.step]
                threading.Timer(0.05, how, args=(client.handle,)).start()
            super()._collect_shares(targets)

        def _train(self, groups, step):
            trained.append([g.prompt_id for g in groups])
            return super()._train(groups, step)

    supervisor = start_run(cfg, run_dir)
    try:
        start = time.monotonic()
        KillMidCollection(cfg, run_dir, supervisor).run()
        assert time.monotonic() - start < 400
    finally:
        supervisor.close()
    rows = read(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and [r["policy_version"] for r in rows] == [1, 2, 3, 4, 5]
    assert [(r["restarts_inference"], r["restarts_env_pool"]) for r in rows] == [(0, 0), (1, 0), (1, 1), (1, 2), (1, 2)]
    assert all(r["staleness_max"] == 0 and r["sync_logprob_diff"] <= 1e-3 for r in rows)
    assert sorted(p for step in trained for p in step) == list(range(20))  # nothing lost, nothing twice
    assert [sorted(step) for step in trained] == [list(range(4 * k, 4 * k + 4)) for k in range(5)]


def test_learner_death_names_the_checkpoint_and_the_resume_command(tmp_path, tiny_model_path, local_ray):
    """The learner's process is killed by SIGKILL in step 6 (checkpoints every 2 steps, so step_4
    is the last); the run stops with LearnerDied naming step_4 and the resume command. (A resume
    that trains steps again, step 5's first metrics line kept aside: ``trainer.auto_resume`` in
    tests/e2e/test_learner_group_runs.py and test_frozen_actors.py, the same resume in-process;
    `rlpost train --resume` of a stopped run, with more steps: test_terminal_stop.py.)"""
    import os
    import signal

    from rlpost.record.run_dir import create_run_dir
    from rlpost.runtime.actors import actor_record
    from rlpost.service import loop, run
    from rlpost.service.supervisor import LearnerDied

    cfg = tiny_cfg(tiny_model_path, "e2e-learner", "trainer.steps=6", "trainer.checkpoint_interval=2")
    run_dir = create_run_dir(cfg, tmp_path / "learner")

    class KillLearner(loop.Controller):
        def _train(self, groups, step):
            if step == 6:
                os.kill(actor_record(self.fleet.learner.handle)["Pid"], signal.SIGKILL)
            return super()._train(groups, step)

    original, run.Controller = run.Controller, KillLearner
    try:
        with pytest.raises(LearnerDied) as died:
            run.run_training(cfg, run_dir)
    finally:
        run.Controller = original
    message = str(died.value)
    assert "during step 6" in message and str(run_dir / "checkpoints" / "step_4") in message
    assert f"rlpost train --resume {run_dir}" in message
    assert [r["step"] for r in read(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5]
