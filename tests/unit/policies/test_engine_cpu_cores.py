"""Which cores an engine's model threads are bound to (rollout.engine.cpu_threads)."""

import pytest

from rlpost.policies import vllm_engine
from rlpost.policies.vllm_engine import engine_cpu_cores

pytestmark = pytest.mark.unit


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(vllm_engine.os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})


def test_engines_take_consecutive_runs_of_the_process_cores(four_cores):
    assert engine_cpu_cores(2) == [4, 5]
    assert engine_cpu_cores(2, index=1) == [6, 7]
    assert engine_cpu_cores(1, index=2) == [6]


def test_engines_share_cores_when_their_threads_outnumber_them(four_cores):
    assert engine_cpu_cores(3, index=1) == [7, 4, 5]
    assert engine_cpu_cores(4, index=3) == [4, 5, 6, 7]


@pytest.mark.parametrize("threads", [0, 5])
def test_more_threads_than_cores_is_an_error_naming_the_key(four_cores, threads):
    with pytest.raises(ValueError, match=r"rollout\.engine\.cpu_threads=.*4 cores"):
        engine_cpu_cores(threads)
