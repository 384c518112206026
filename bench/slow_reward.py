"""A reward behind a remote service (``data.reward_fn=bench.slow_reward:judged``): each call waits
$RLPOST_BENCH_REWARD_LATENCY_S seconds (0.02 by default), as a round trip to a hosted judge or a
sandbox would, and adds nothing to the task's own reward. An env pool calls its reward function
one sample at a time, so a step of 128 samples spends 128 x the latency in its pools: the workload
bench_autoscale needs, whose generation is held back by the environments rather than the
machine's two cores (more inference engines here only share the same cores)."""

from __future__ import annotations

import os
import time


def judged(completion: str, row: dict) -> float:
    time.sleep(float(os.environ.get("RLPOST_BENCH_REWARD_LATENCY_S", "0.02")))
    return 0.0
