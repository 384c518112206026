"""timeit (TorchRL's torchrl._utils.timeit) and merge_ray_runtime_env: the two helpers TorchRL's
GRPO scripts call around their loop and their ray.init."""

from __future__ import annotations

import logging
import time

import pytest

from rlpost.record.timing import timeit
from rlpost.runtime.ray_start import RUN_ENV_VARS, merge_ray_runtime_env

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def empty_registry(monkeypatch):
    monkeypatch.setattr(timeit, "_REG", {})
    monkeypatch.setattr(timeit, "_MARKS", {})
    monkeypatch.setattr(timeit, "_printevery_count", 0)


def test_a_block_a_decorated_function_and_marks_record_under_their_names(monkeypatch):
    clock = iter([10.0, 10.5, 20.0, 21.5, 30.0, 30.25, 40.0, 41.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    with timeit("collect"):
        pass

    @timeit("collect")
    def collect():
        return "done"

    assert collect() == "done"
    timeit.mark_start("train")
    timeit.mark_end("train")
    timer = timeit("sync").start()
    assert timer.elapsed() == 1.0  # still running: nothing recorded
    assert timeit.todict() == {"collect": 1.0, "train": 0.25}  # the mean of 0.5 and 1.5
    assert timeit.todict(percall=False, prefix="timeit") == {"timeit/collect": 2.0, "timeit/train": 0.25}


def test_print_logs_a_line_per_name_and_reset_zeroes_them(caplog):
    timeit._record("b", 0.002)
    timeit._record("a", 1.0)
    with caplog.at_level(logging.INFO, logger="rlpost"):
        text = timeit.print(prefix="timeit")
    assert text.splitlines() == [
        "timeit -- a took 1000.0000 msec (total =  1.0000 sec since last reset).",
        "timeit -- b took 2.0000 msec (total =  0.0020 sec since last reset).",
    ]
    assert [r.getMessage() for r in caplog.records] == text.splitlines()
    timeit.reset()
    assert timeit.todict() == {"a": 0.0, "b": 0.0}


def test_printevery_prints_the_asked_number_of_times(caplog):
    timeit._record("step", 0.1)
    with caplog.at_level(logging.INFO, logger="rlpost"):
        for _ in range(10):
            timeit.printevery(num_prints=2, total_count=10)
    assert len(caplog.records) == 2


def test_a_timer_never_started_or_an_end_without_start_is_a_clear_error():
    with pytest.raises(RuntimeError, match="was not started"):
        timeit("x").elapsed()
    with pytest.raises(KeyError, match="without timeit.mark_start"):
        timeit.mark_end("never")


def test_merge_ray_runtime_env_adds_the_uploads_excludes_and_env_vars_keeping_the_scripts(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf-secret")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    config = {"num_cpus": 4, "runtime_env": {"excludes": ["data/"], "env_vars": {"TOKENIZERS_PARALLELISM": "true"}}}
    merged = merge_ray_runtime_env(config)
    assert merged is config and merged["num_cpus"] == 4
    excludes = merged["runtime_env"]["excludes"]
    assert excludes[0] == "data/" and {".venv", ".git", "runs", ".cache"} <= set(excludes)
    assert len(excludes) == len(set(excludes))
    env_vars = merged["runtime_env"]["env_vars"]
    assert env_vars["TOKENIZERS_PARALLELISM"] == "true"  # the script's value wins
    assert env_vars["HF_TOKEN"] == "hf-secret" and "WANDB_API_KEY" not in env_vars
    assert env_vars["THP_MEM_ALLOC_ENABLE"] == RUN_ENV_VARS["THP_MEM_ALLOC_ENABLE"]
    assert merge_ray_runtime_env({})["runtime_env"]["excludes"] == merged["runtime_env"]["excludes"][1:]
