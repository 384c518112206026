"""A custom loss (``loss.custom_fn=tests.blocking_loss:loss_that_blocks_once``) whose thread blocks for
ever on one call, as a deadlock in a user's code would: the learner stays alive to Ray and answers
its heartbeats, but its work makes no progress. It blocks on its $RLPOST_BLOCKING_LOSS_AT-th call in
a process when the file named by $RLPOST_BLOCKING_LOSS_FLAG does not exist yet (it creates it
first), so the learner that replaces the hung one trains on. tests/e2e/test_frozen_actors.py uses it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from rlpost.algo import grpo_loss

_calls = 0


def loss_that_blocks_once(*args, **kwargs):
    global _calls
    _calls += 1
    flag = Path(os.environ["RLPOST_BLOCKING_LOSS_FLAG"])
    if _calls == int(os.environ["RLPOST_BLOCKING_LOSS_AT"]) and not flag.exists():
        flag.write_text(f"blocked in process {os.getpid()}\n")
        threading.Event().wait()  # nothing will ever set it
    return grpo_loss(*args, **kwargs)
