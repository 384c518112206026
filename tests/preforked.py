"""Child processes that start fast, for tests that run torch code in processes of their own.

A spawned child re-imports torch (and transformers, rlpost...) before it runs a line: 3-6 s
each on 2 cores. :func:`forkserver_context` forks children instead from Python's fork server,
which imports the given modules once and is then reused by every test of the session.

Fork is safe from that server, though not from the pytest process: the server only imports (no
torch op has run there, so no intra-op thread pool exists; no process group, Ray or CUDA state),
while pytest's process runs torch, gloo and Ray threads that a fork would copy half-made. Each
child builds its own process groups after the fork, as a spawned one does.

There is one fork server per process, started on first use with the preload list of that moment:
a later call's list is ignored. So a list only saves time: a child still imports whatever else
it needs itself, as a spawned one does, and a test is as correct whichever module came first.
For the same reason a child gets the environment the server started with, not the test's of
the moment: a test that sets environment variables for its children must spawn them instead.
"""

from __future__ import annotations

import torch.multiprocessing as mp


def forkserver_context(*preload: str):
    """A multiprocessing context whose processes fork from a server that imported torch and
    ``preload`` (names of modules; one that fails to import is skipped by Python)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", *preload])
    return ctx
