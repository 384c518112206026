"""A run's state as the training loop keeps it: the step, the policy version, the ledger.

The controller (the loop) is the one writer of a :class:`RunState`; the supervisor holds the
same object and only reads it: the step for its messages, the version a weight publish must
carry, the ledger a new buffer is rebuilt from. Recovery's own counts (restarts, bus re-forms)
are the supervisor's, which the loop reads. A checkpoint saves both; a resumed loop restores its
state itself and hands the counts back to the supervisor (``Supervisor.restore_counts``).
"""

from __future__ import annotations

import dataclasses

from rlpost.transport.buffer import Taken


@dataclasses.dataclass
class Ledger:
    """What the learner's side received from the buffer. It outlives the buffer actor: a new
    buffer is started from it, and the accounting in metrics.jsonl comes from it."""

    groups_taken: int = 0  # trained once their step ends
    groups_dropped_stale: int = 0
    acknowledged: dict[str, int] = dataclasses.field(default_factory=dict)  # producer -> highest seq received

    def record(self, taken: Taken) -> None:
        self.groups_taken += len(taken.groups)
        self.groups_dropped_stale += taken.num_dropped_stale
        seqs = dict(taken.dropped_seqs)
        for group in taken.groups:
            if group.producer is not None and group.seq is not None:
                seqs[group.producer] = max(group.seq, seqs.get(group.producer, 0))
        for producer, seq in seqs.items():
            self.acknowledged[producer] = max(seq, self.acknowledged.get(producer, 0))

    def accounting(self, buffer_size: int, last_seqs: dict[str, int]) -> dict[str, int]:
        """The metrics.jsonl counts; after a step, ``groups_put == groups_trained +
        groups_dropped_stale + groups_in_buffer``."""
        return {
            "groups_put": sum(last_seqs.values()),
            "groups_trained": self.groups_taken,
            "groups_dropped_stale": self.groups_dropped_stale,
            "groups_in_buffer": buffer_size,
        }


@dataclasses.dataclass
class RunState:
    """What the loop has done: written by the loop, read by the supervisor."""

    step: int = 0  # the step being trained (the last trained one between steps)
    version: int = 0  # the learner's policy version, as its last train step or checkpoint said
    ledger: Ledger = dataclasses.field(default_factory=Ledger)  # what the learner's side received
