"""How a learner holds its memory (rlpost.actors.learner.memory): the process gives freed tensor
memory back to the OS (glibc's allocator settings), and activation checkpointing refuses a model
it cannot checkpoint.

Each allocator case runs in a fresh interpreter: the allocator settings are process-wide.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

# Allocates 40 blocks of 4 MB with a long-lived 256 KB one after each (what a training
# step's activations and metrics look like to malloc), frees the blocks and reports the resident
# memory above the start.
_SCRIPT = """
import ctypes, json, sys
applied = None
if sys.argv[1] == "on":  # the plain process does not even import rlpost (~5 s here)
    from rlpost.actors.learner.memory import return_freed_memory_to_os
    applied = return_freed_memory_to_os()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
warm = libc.malloc(8 << 20); libc.memset(warm, 1, 8 << 20); libc.free(warm)  # raises glibc's threshold
start = rss()
blocks, pins = [], []
for _ in range(40):
    block = libc.malloc(4 << 20); libc.memset(block, 1, 4 << 20); blocks.append(block)
    pin = libc.malloc(256 << 10); libc.memset(pin, 1, 256 << 10); pins.append(pin)
for block in blocks:
    libc.free(block)
print(json.dumps({"applied": applied, "kept_mb": (rss() - start) / 2**20}))
"""


def _run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_blocks_leave_the_process_with_the_learner_setting_and_stay_without_it():
    treated, plain = _run("on"), _run("off")
    assert treated["applied"] is True
    assert treated["kept_mb"] < 16  # 160 MB were freed; the 10 MB of small blocks stay
    assert plain["kept_mb"] > 100  # glibc's default keeps them in its heap


def test_only_a_group_of_ranks_releases_freed_memory_by_default():
    """Releasing costs step time (fresh pages on every large allocation), so by default only the
    ranks of a group, whose point is memory per rank, pay it; the config can say either way."""
    from rlpost.actors.learner.memory import release_freed_memory
    from rlpost.config import LearnerResources

    auto = LearnerResources(num_cpus=1)
    assert not release_freed_memory(auto, world_size=1) and release_freed_memory(auto, world_size=2)
    assert release_freed_memory(LearnerResources(num_cpus=1, release_freed_memory=True), world_size=1)
    assert not release_freed_memory(LearnerResources(num_cpus=1, release_freed_memory=False), world_size=4)


def test_gradient_checkpointing_refuses_a_model_it_cannot_checkpoint():
    from types import SimpleNamespace

    import torch

    from rlpost.actors.learner.memory import enable_activation_checkpointing

    with pytest.raises(ValueError, match="trainer.gradient_checkpointing: Linear does not support"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))

    class NoCheckpointableLayers(torch.nn.Module):  # claims support, but no layer takes it
        supports_gradient_checkpointing = True
        config = SimpleNamespace(use_cache=True)

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            pass

    with pytest.raises(ValueError, match="no layer of NoCheckpointableLayers can be checkpointed"):
        enable_activation_checkpointing(NoCheckpointableLayers())
