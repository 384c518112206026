"""The state of :class:`~rlpost.objectives.mc_advantage.MCAdvantage`: a lock, the counters and two
queues (group -> trajectories for ``inv``, group -> ``(record, reward)`` pairs for ``add``), and what
it reports of them.

For writers in several processes, :meth:`MCAdvantageState.share_memory_` moves all four into a
``multiprocessing`` manager, so that every copy of the transform handed to a child process fills the
same groups; with ``TORCHRL_MC_ADVANTAGE_LOCAL_QUEUES=1`` in the environment it does nothing (a group
whose trajectories come from several processes then never completes)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from typing import Any

from rlpost.objectives.grouping import GroupQueues

logger = logging.getLogger(__name__)

LOCAL_QUEUES_ENV = "TORCHRL_MC_ADVANTAGE_LOCAL_QUEUES"

MC_ADVANTAGE_STATS: tuple[str, ...] = (
    "completed_trajectories", "completed_decisions", "trajectory_return_sum", "trajectory_return_max",
    "successful_trajectories", "completed_groups", "written_groups", "dropped_groups", "num_dropped_equal",
    "rescued_groups", "selected_trajectories", "unselected_trajectories",
)  # fmt: skip


def _fresh_stats() -> dict[str, float | int]:
    stats: dict[str, float | int] = dict.fromkeys(MC_ADVANTAGE_STATS, 0)
    stats.update(trajectory_return_sum=0.0, trajectory_return_max=float("-inf"))
    return stats


class _Stat:
    """A counter of the transform, kept in its ``_stats`` dict (a manager's once shared)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, transform: Any, owner: type | None = None) -> Any:
        if transform is None:
            return self
        return transform._stats[self.name]

    def __set__(self, transform: Any, value: Any) -> None:
        transform._stats[self.name] = value


class MCAdvantageState:
    """The lock, counters and queues of a grouping transform, and their sharing across processes."""

    completed_trajectories = _Stat()
    completed_decisions = _Stat()
    trajectory_return_sum = _Stat()
    trajectory_return_max = _Stat()
    successful_trajectories = _Stat()
    completed_groups = _Stat()
    written_groups = _Stat()
    dropped_groups = _Stat()
    num_dropped_equal = _Stat()
    rescued_groups = _Stat()
    selected_trajectories = _Stat()
    unselected_trajectories = _Stat()

    def _init_state(self) -> None:
        self._lock: Any = threading.RLock()
        self._stats: Any = _fresh_stats()
        self.queues = GroupQueues()
        self._pending = GroupQueues()
        self._manager: Any = None
        self._shared = False

    def reset_stats(self) -> None:
        """Zero the counters (the queues are kept)."""
        with self._lock:
            self._stats.update(_fresh_stats())

    def clear_queues(self) -> None:
        """Forget every incomplete group (the counters are kept)."""
        with self._lock:
            self.queues.clear()
            self._pending.clear()

    def get_stats(self) -> dict[str, float | int]:
        """The counters and the queue sizes, as a plain dict."""
        with self._lock:
            stats = self._stats.copy()
            stats.update(
                queued_groups=self.queued_groups,
                queued_trajectories=self.queued_trajectories,
                max_queued_trajectories_per_group=self.max_queued_trajectories_per_group,
                num_pending=self.num_pending,
            )
            return stats

    @property
    def num_emitted_groups(self) -> int:
        """Groups released so far, by either way in (``written_groups``)."""
        return self.written_groups

    @property
    def queued_groups(self) -> int:
        """Group identities with an incomplete group of trajectories (``inv``)."""
        return len(self.queues)

    @property
    def queued_trajectories(self) -> int:
        """Trajectories waiting in incomplete groups (``inv``)."""
        return sum(len(queue) for queue in self.queues.values())

    @property
    def max_queued_trajectories_per_group(self) -> int:
        """The largest number of trajectories waiting for one group (``inv``)."""
        return max((len(queue) for queue in self.queues.values()), default=0)

    @property
    def num_pending(self) -> int:
        """Records and trajectories waiting in incomplete groups (both ways in)."""
        return sum(len(members) for members in self._pending.values()) + self.queued_trajectories

    @property
    def num_pending_groups(self) -> int:
        """Incomplete groups (both ways in)."""
        return len(self._pending) + len(self.queues)

    # ------------------------------------------------------------------ sharing across processes

    @property
    def is_shared(self) -> bool:
        """Whether the queues and counters live in a ``multiprocessing`` manager."""
        return self._shared

    def share_memory_(self) -> MCAdvantageState:
        """Share the state through a ``multiprocessing`` manager (a server process started here; see the
        module docstring). Call it before the writers start; a no-op when already shared."""
        if self._shared:
            return self
        if os.environ.get(LOCAL_QUEUES_ENV) == "1":
            logger.info(
                "MCAdvantage.share_memory_: %s=1, the queues stay in each process; a group whose trajectories "
                "come from several writer processes will never complete",
                LOCAL_QUEUES_ENV,
            )
            return self
        manager = multiprocessing.Manager()
        with self._lock:
            self.queues = self.queues.shared(manager)
            self._pending = self._pending.shared(manager)
            self._stats = manager.dict(self._stats)
            self._lock = manager.RLock()
            self._manager, self._shared = manager, True
        return self

    def close(self) -> None:
        """Stop the manager that :meth:`share_memory_` started, after taking its queues and
        counters back into this process (copies in other processes can no longer write). Does
        nothing for a transform that is not shared, or in a process that received a copy."""
        if self._manager is None:
            return
        with self._lock:
            self.queues = GroupQueues(dict(self.queues.items()))
            self._pending = GroupQueues(dict(self._pending.items()))
            self._stats = self._stats.copy()
        self._lock = threading.RLock()
        self._manager.shutdown()
        self._manager, self._shared = None, False

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_manager"] = None  # the creator's: it cannot travel, and only the creator stops it
        if not self._shared:
            del state["_lock"]  # a threading lock; a shared one (a manager's proxy) travels
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if "_lock" not in state:
            self._lock = threading.RLock()
