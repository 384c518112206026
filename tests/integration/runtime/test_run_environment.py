"""The environment every process of a run gets, and what it does to torch's CPU memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlpost.config import load_config
from rlpost.runtime.ray_start import RUN_ENV_VARS, run_env_vars

pytestmark = pytest.mark.integration

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_MODE = _THP.read_text() if _THP.exists() else "[never]"  # e.g. "always [madvise] never"

# a process that allocates and touches a 64 MB tensor, then prints its anonymous huge-page kB
_ALLOCATE = """
import torch
x = torch.ones(16 * 2**20)
with open("/proc/self/smaps_rollup") as f:
    print(next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")))
"""


def test_the_run_environment_is_rlposts_with_the_users_over_it():
    cfg = load_config("configs/tiny-cpu.yaml", ["resources.env_vars={THP_MEM_ALLOC_ENABLE: '0', MY_FLAG: x}"])
    assert run_env_vars(load_config("configs/tiny-cpu.yaml")) == {**RUN_ENV_VARS, "PYTHONHASHSEED": "0"}
    assert RUN_ENV_VARS["THP_MEM_ALLOC_ENABLE"] == "1"
    assert run_env_vars(cfg) == {**RUN_ENV_VARS, "THP_MEM_ALLOC_ENABLE": "0", "MY_FLAG": "x", "PYTHONHASHSEED": "0"}
    seeded = load_config("configs/tiny-cpu.yaml", ["resources.python_hash_seed=123"])
    assert run_env_vars(seeded)["PYTHONHASHSEED"] == "123"
    with pytest.raises(ValueError, match="PYTHONHASHSEED is resources.python_hash_seed"):
        load_config("configs/tiny-cpu.yaml", ["resources.env_vars={PYTHONHASHSEED: '1'}"])


def _huge_page_kb(extra_env: dict[str, str]) -> int:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | extra_env
    out = subprocess.run([sys.executable, "-c", _ALLOCATE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif("[never]" in THP_MODE, reason="the kernel gives no transparent huge pages")
def test_a_run_process_puts_large_tensors_on_huge_pages():
    """With the run's environment torch backs a 64 MB tensor with 2 MB pages (fewer page faults
    when a vLLM CPU reload re-creates the weights); without it, with 4 KB pages."""
    assert _huge_page_kb(run_env_vars(load_config("configs/tiny-cpu.yaml"))) >= 32 * 1024
    if "[madvise]" in THP_MODE:
        assert _huge_page_kb({}) == 0  # (a kernel in "always" mode gives them to every process)
