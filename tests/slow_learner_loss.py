"""A custom loss (``loss.custom_fn=tests.slow_learner_loss:loss_slowed_by_a_flag``) that makes the
learner the bottleneck on a test's word: while the file named by $RLPOST_SLOW_LOSS_FLAG exists,
each call first sleeps the seconds the file holds, as a larger model's backward would take them.
tests/e2e/test_autoscaling.py turns a generation-heavy run learner-heavy with it, so the load
policy shrinks the fleet it grew."""

from __future__ import annotations

import os
import time
from pathlib import Path

from rlpost.algo import grpo_loss


def loss_slowed_by_a_flag(*args, **kwargs):
    flag = Path(os.environ["RLPOST_SLOW_LOSS_FLAG"])
    if flag.exists():
        time.sleep(float(flag.read_text() or 0))
    return grpo_loss(*args, **kwargs)
