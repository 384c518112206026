"""One PYTHONHASHSEED for every process of a run (resources.python_hash_seed): the reasoning-gym tasks
whose generators iterate over sets of strings draw the same rows in every process that shares it,
so the held-out split an evaluation draws in the driver holds none of the questions the env pools
train on; with each process's own seed (Python's default) that separation does not hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlpost.config import load_config
from rlpost.envs.reasoning_gym import HASH_SEED_DEPENDENT_TASKS
from rlpost.runtime.ray_start import run_env_vars

pytestmark = pytest.mark.integration

_ROWS = """
import json, sys
from rlpost.envs.reasoning_gym import reasoning_gym_rows
tasks, splits = json.loads(sys.argv[1]), sys.argv[2:]
print(json.dumps({split: {t: [[r["question"], r["answer"]] for r in reasoning_gym_rows({t: 1}, size=12, seed=7,
                                                                                          split=split)]
                          for t in tasks} for split in splits}))
"""


def draw(hash_seed: str, *splits: str) -> subprocess.Popen:
    """Start drawing each split's rows per task (question, answer) in a process of its own with
    ``hash_seed``; :func:`rows` reads them."""
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    args = [sys.executable, "-c", _ROWS, json.dumps(sorted(HASH_SEED_DEPENDENT_TASKS)), *splits]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def rows(process: subprocess.Popen) -> dict[str, dict[str, list]]:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-2000:]
    return json.loads(out.splitlines()[-1])


@pytest.mark.long  # three processes importing the task stack (10-20 s): make test-long
def test_processes_sharing_the_runs_hash_seed_keep_the_held_out_split_held_out():
    seed = run_env_vars(load_config("configs/tiny-cpu.yaml"))["PYTHONHASHSEED"]  # what every actor gets
    assert seed == "0"
    # an env pool's process, the driver's (which draws the evaluation's rows), one with another seed
    pool, driver, other = draw(seed, "train"), draw(seed, "train", "test"), draw("1", "train")
    pool, driver, other = rows(pool), rows(driver), rows(other)["train"]
    assert driver["train"] == pool["train"]  # the same rows, whichever process draws them
    for task in sorted(HASH_SEED_DEPENDENT_TASKS):
        trained = {question for question, _ in pool["train"][task]}
        held_out = {question for question, _ in driver["test"][task]}
        assert held_out and not held_out & trained, task  # no eval question was trained on
    # the failure the shared seed prevents: a process with a hash seed of its own draws other rows
    assert [task for task in sorted(HASH_SEED_DEPENDENT_TASKS) if other[task] == pool["train"][task]] == []
