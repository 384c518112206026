"""The load policy (``rollout.autoscale``): the run sizes its own fleet from where its time goes.

Each learner step gives one :class:`StepLoad`, read from what the run records anyway:

    wait_share     the share of the step the learner waited for its groups (collect_s / step_time_s)
    engine_busy    the inference workers' busy share of the time the pools generated
    stale_share    groups dropped as stale in the step, per group trained (async)
    buffer_fill    the buffer's groups at the step's end over its room (async)
    generated      groups the pools put in the step, over generating_s (sync: the collection;
                   async: the whole step): generation's throughput

:class:`LoadPolicy` reads them over ``window_steps`` steps all taken with the fleet as it is and
moves one role at a time, within the config's ranges::

    learner waits  >= grow_wait, engines busy >= busy_share  ->  more inference workers
    learner waits  >= grow_wait, engines mostly idle         ->  more env pools (the environments,
                                                                 tools or rewards hold generation back)
    learner waits  <= shrink_wait (async: and groups go      ->  one inference worker fewer (none
                   stale or the buffer stays full)               above the minimum: one env pool fewer)
    a grow n -> n+k raised throughput less than              ->  undone but for the actors the rise
                   min_gain x k/n                                is worth; that count is the most
                                                                 for hold_s
    a grow's actor found no room within room_wait_s          ->  undone (the autoscaler added no
                                                                 node); the count held for hold_s
    a move reversed (a shrink grown back, or the other way)  ->  the new count held for hold_s

A grow asks for as many actors as the learner's wait predicts bring it to the middle of the band
between ``shrink_wait`` and ``grow_wait``, generation taking n/n' as long with n' actors (for a
learner waiting a share w of its steps and a target t: n' = n w (1-t) / (t (1-w))), at least one
more and at most ``max_grow_factor`` times as many, as Kubernetes' horizontal autoscaler sizes by a
metric's ratio to its target and caps each step's growth: a run that starts far too small reaches
its size in a few moves instead of one per cooldown. The prediction assumes each actor adds its
full share; a grow adds no more actors than the role's last grow was worth (its rise in actors'
full shares), so the steps shrink as returns diminish (1 -> 4 worth 1.8 actors: the next adds at
most 2). Shrinks go one at a time, since a shrink too far costs the learner steps before it is
grown back.

A sync run's shrink is also skipped when the collection it predicts (n/(n-1) as long) would make
the learner wait ``grow_wait`` again. No change follows another within ``cooldown_s``, and none
is made while the fleet is not what the policy last asked for (a new worker starting, a lost one
being replaced); a step during which the fleet changed is not read (a new engine warms up in it).
A role an operator scaled (``rlpost scale``) is pinned: the policy leaves it until ``rlpost scale
RUN_DIR KEY=auto`` releases it.

Growing needs no call to Ray's autoscaler: each slot beyond the run's start is a placement group
of its own, pending until the cluster has room, and a pending group is the demand Ray's
autoscaler launches nodes for; a shrink removes the group, so the node it held goes idle and the
autoscaler ends it after its idle timeout. (``ray.autoscaler.sdk.request_resources`` is not used:
it is one request per cluster, which each caller replaces, so two runs would undo each other's;
placement groups add up.) A new worker or pool starts in the background while the run trains
(:meth:`rlpost.service.fleet.Fleet.begin`) and joins at the health check after it is up.

The policy is pure logic on a clock: the supervisor feeds it and applies its decisions
(:meth:`rlpost.service.supervisor.Supervisor.autoscale`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from rlpost.config.rollout import AutoscaleConfig

ROLES = ("inference", "env_pools")  # the scale keys the policy moves, engines first
_WORDS = {"inference": "inference workers", "env_pools": "env pools"}
# why a decision was made: the `reason` tag of rlpost_autoscale_decisions and metrics.jsonl's autoscale_reason
REASONS = {
    "engines_bound": "the learner waits for data and the engines are busy",
    "env_bound": "the learner waits for data and the engines wait for the env pools",
    "learner_bound": "the learner barely waits: generation outpaces it",
    "no_gain": "the last grow did not raise generation's throughput",
    "no_room": "the cluster found no room for the last grow",
}


@dataclasses.dataclass(frozen=True)
class StepLoad:
    """One learner step's signals (module docstring) and the fleet that served it."""

    wait_share: float
    generated: int
    generating_s: float
    inference: int
    env_pools: int
    engine_busy: float | None = None  # None: not measured (no worker answered)
    stale_share: float = 0.0
    buffer_fill: float | None = None  # None: sync mode (the buffer holds one step)


def step_load(row: dict, previous: dict | None, async_mode: bool) -> StepLoad:
    """The :class:`StepLoad` of a metrics.jsonl ``row`` (``previous``: the step before it in this
    process, None for its first): how the supervisor reads each step, and how a test replays a
    recorded run. ``engine_busy`` is the row's ``autoscale_engine_busy``; the fleet is the row's
    ``autoscale_fleet`` (serving workers and pools as the policy read them, before its decision:
    the row's own counts are taken after it, a shrink's leaving actors gone)."""
    before = previous or {}
    inference, env_pools = row.get("autoscale_fleet") or (row["inference_workers"], row["env_pools"])

    def grew(key: str) -> int:
        return int(row.get(key) or 0) - int(before.get(key) or 0)

    step_s = max(float(row["step_time_s"]), 1e-9)
    collect_s = min(float(row["collect_s"]), step_s)
    return StepLoad(
        wait_share=collect_s / step_s,
        generated=max(grew("groups_put"), 0),
        generating_s=step_s if async_mode else collect_s,
        inference=int(inference),
        env_pools=int(env_pools),
        engine_busy=row.get("autoscale_engine_busy"),
        stale_share=max(grew("groups_dropped_stale"), 0) / max(grew("groups_trained"), 1),
        buffer_fill=row.get("buffer_fill") if async_mode else None,
    )


@dataclasses.dataclass(frozen=True)
class Decision:
    """Move ``role`` from ``before`` to ``after`` actors, for ``reason`` (a key of REASONS); ``why``
    says it with the figures."""

    role: str
    before: int
    after: int
    reason: str
    why: str

    def __post_init__(self) -> None:
        if self.reason not in REASONS or self.after == self.before:
            raise ValueError(f"not a decision: {self.role} {self.before} -> {self.after} ({self.reason})")

    @property
    def direction(self) -> str:
        return "grow" if self.after > self.before else "shrink"

    def describe(self) -> str:
        return f"{self.direction} {_WORDS[self.role]} {self.before} -> {self.after}: {self.why}"


@dataclasses.dataclass
class _Hold:
    """A bound the policy keeps on a role's count until ``until`` (clock time)."""

    most: int | None = None
    least: int | None = None
    until: float = 0.0


class LoadPolicy:
    """Decides the fleet's size from step loads (module docstring).

    Args:
        settings: ``rollout.autoscale``.
        ranges: (least, most) per scale key it may move (``RolloutConfig.autoscale_ranges``).
        clock: seconds, monotonic (a test steps its own).

    The counts each role has are the fleet's (its wanted slots), handed to every :meth:`observe`:
    the policy keeps no copy of its own, so an operator's request or a resume needs no telling.
    """

    def __init__(self, settings: AutoscaleConfig, ranges: dict[str, tuple[int, int]],
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.settings, self.ranges, self.clock = settings, dict(ranges), clock
        self.wanted: dict[str, int] = {}  # the fleet's counts, as the running observe() was given them
        self.pins: set[str] = set()
        self.window: list[StepLoad] = []
        self.changed_at = -float("inf")
        self.last: Decision | None = None
        self.rate_before: float | None = None  # generation's throughput before the last grow, until judged
        self.holds: dict[str, _Hold] = {}
        self.worth: dict[str, int] = {}  # per role: its last judged grow's rise in actors' full shares, rounded
        self.counts: tuple[int, int] | None = None  # the fleet that served the last step

    # ------------------------------------------------------------------ operator

    def pin(self, role: str) -> None:
        """An operator's ``rlpost scale``: the policy leaves ``role`` at its count until :meth:`release`."""
        self.pins.add(role)
        self._restart_window()

    def release(self, role: str) -> None:
        """``rlpost scale KEY=auto``: the policy sizes ``role`` again, from its count now."""
        self.pins.discard(role)
        self._restart_window()

    # ------------------------------------------------------------------ deciding

    def observe(self, load: StepLoad, wanted: dict[str, int],
                waiting_for_room_s: dict[str, float] | None = None) -> Decision | None:  # fmt: skip
        """Take one step's ``load``; the decision it leads to, if any, for the caller to apply.
        ``wanted``: each role's count now (``Fleet.wanted``); ``waiting_for_room_s``: per role, how
        long its oldest vacant slot has waited for room."""
        self.wanted = {role: int(wanted[role]) for role in ROLES if role in wanted}
        waiting = waiting_for_room_s or {}
        for role in self._movable():
            if waiting.get(role, 0.0) >= self.settings.room_wait_s:
                serving = self._serving(load, role)
                if serving < self.wanted[role]:
                    why = f"no room for it in the cluster within {self.settings.room_wait_s:.0f} s"
                    return self._decide(role, serving, "no_room", why, hold_most=serving)
        counts, self.counts = self.counts, (load.inference, load.env_pools)
        if counts not in (None, self.counts) or any(self._serving(load, role) != n for role, n in self.wanted.items()):
            # the fleet is changing, or changed during this step (a worker joined or left mid-step,
            # its engine still warming up): such steps do not measure a size
            self._restart_window()
            return None
        self.window = [*self.window, load][-self.settings.window_steps :]
        if len(self.window) < self.settings.window_steps or self.clock() - self.changed_at < self.settings.cooldown_s:
            return None
        return self._judge_last_grow() or self._decide_by_load()

    def _judge_last_grow(self) -> Decision | None:
        """After a grow's first full window, while the learner still starves: undo it when
        throughput rose less than ``min_gain`` of the proportional gain. A grow of several actors
        keeps as many of them as the rise is worth at their full share, to the nearest actor (the
        first ones added are the most useful): 2 -> 4 raising throughput by 45% (0.9 of one actor's
        share, 1/2) keeps 3."""
        if self.rate_before is None or self.last is None:
            return None
        before, after, rate_before, role = self.last.before, self.last.after, self.rate_before, self.last.role
        self.rate_before = None
        if sum(load.wait_share for load in self.window) / len(self.window) < self.settings.grow_wait:
            return None  # the learner no longer starves: the load's rules judge the size now
        rate, added = self._rate(), after - before
        rise = (rate / rate_before - 1) * before if rate_before > 0 else 0.0  # in actors' full shares
        self.worth[role] = max(0, math.floor(rise + 0.5))  # to the nearest actor
        needed = rate_before * (1 + self.settings.min_gain * added / before)
        if rate >= needed or role in self.pins:
            return None
        keep = before + min(added - 1, self.worth[role])
        why = (f"generation went from {rate_before:.2f} to {rate:.2f} groups/s with {after} "
               f"{_WORDS[role]} (needed {needed:.2f})")  # fmt: skip
        return self._decide(role, keep, "no_gain", why, hold_most=keep)

    def _decide_by_load(self) -> Decision | None:
        s = self.settings
        wait = sum(load.wait_share for load in self.window) / len(self.window)
        busy_values = [load.engine_busy for load in self.window if load.engine_busy is not None]
        busy = sum(busy_values) / len(busy_values) if busy_values else None
        if wait >= s.grow_wait:
            role = "inference" if busy is None or busy >= s.busy_share else "env_pools"
            if not self._can_move(role, +1):
                return None
            engines = "" if busy is None else f", the engines busy {busy:.0%} of the generating time"
            why = f"the learner waited {wait:.0%} of its last {len(self.window)} steps{engines}"
            reason = "engines_bound" if role == "inference" else "env_bound"
            rate = self._rate()
            decision = self._decide(role, self._grow_to(role, wait), reason, why)
            self.rate_before = rate  # judged after the new size's first window
            return decision
        if wait > s.shrink_wait:
            return None
        async_mode = self.window[-1].buffer_fill is not None
        stale = sum(load.stale_share for load in self.window) / len(self.window)
        fill = min(load.buffer_fill or 0.0 for load in self.window)
        surplus = f"{stale:.0%} of the groups trained dropped as stale, the buffer at least {fill:.0%} full"
        if async_mode and stale < s.shrink_stale and fill < s.shrink_fill:
            return None
        for role in ROLES:
            if not self._can_move(role, -1):
                continue
            count = self.wanted[role]
            if not async_mode and role == "inference" and _predicted_wait(wait, count) >= s.grow_wait:
                return None  # it would grow back: the band is too narrow for one worker fewer
            why = f"the learner waited {wait:.0%} of its last {len(self.window)} steps"
            return self._decide(role, count - 1, "learner_bound", why + (f", {surplus}" if async_mode else ""))
        return None

    # ------------------------------------------------------------------ bookkeeping

    def _decide(self, role: str, after: int, reason: str, why: str, hold_most: int | None = None) -> Decision:
        """The decision moving ``role`` to ``after`` for ``reason``; ``hold_most``: keep it at most
        that for ``hold_s`` (an undone grow). A move that reverses the role's last holds its new count."""
        now = self.clock()
        decision = Decision(role, self.wanted[role], after, reason, why)
        hold = self.holds.setdefault(role, _Hold())
        if hold_most is not None:
            hold.most, hold.least, hold.until = hold_most, None, now + self.settings.hold_s
        elif self.last is not None and self.last.role == role and self.last.direction != decision.direction:
            grown_back = decision.direction == "grow"  # a shrink grown back: keep at least this many
            hold.most, hold.least = (None, after) if grown_back else (after, None)
            hold.until = now + self.settings.hold_s
        if decision.direction == "shrink":
            self.rate_before = None  # only a grow is judged by its gain
        self.last, self.changed_at = decision, now
        self._restart_window()
        return decision

    def _movable(self) -> list[str]:
        """The roles the policy sizes: a range, and not pinned."""
        return [role for role in ROLES if role in self.ranges and role in self.wanted and role not in self.pins]

    def _can_move(self, role: str, by: int) -> bool:
        if role not in self._movable():
            return False
        least, most = self._bounds(role)
        return least <= self.wanted[role] + by <= most

    def _bounds(self, role: str) -> tuple[int, int]:
        """The counts ``role`` may take now: its range, narrowed by a hold in force."""
        least, most = self.ranges[role]
        hold = self.holds.get(role)
        if hold is not None and self.clock() < hold.until:
            least = least if hold.least is None else max(least, hold.least)
            most = most if hold.most is None else min(most, hold.most)
        return least, most

    def _grow_to(self, role: str, wait: float) -> int:
        """The count a grow of ``role`` asks for with the learner waiting ``wait`` of its steps
        (module docstring): the predicted count, at least one more, at most ``max_grow_factor``
        times as many, no more actors than the role's last judged grow was worth (the prediction
        assumes each actor adds its full share; once returns diminish, steps shrink) and within
        the bounds (the caller checked one more fits)."""
        s, count = self.settings, self.wanted[role]
        target = (s.grow_wait + s.shrink_wait) / 2
        predicted = count * wait * (1 - target) / (target * (1 - wait)) if wait < 1 else float("inf")
        most = min(self._bounds(role)[1], max(count + 1, math.floor(count * s.max_grow_factor)))
        if role in self.worth:
            most = min(most, count + max(1, self.worth[role]))
        return max(count + 1, min(math.ceil(predicted - 1e-9), most))

    def _rate(self) -> float:
        """Generation's throughput over the window: groups put per second of generating."""
        seconds = sum(load.generating_s for load in self.window)
        return sum(load.generated for load in self.window) / seconds if seconds > 0 else 0.0

    def _restart_window(self) -> None:
        self.window = []

    @staticmethod
    def _serving(load: StepLoad, role: str) -> int:
        return load.inference if role == "inference" else load.env_pools


def _predicted_wait(wait: float, workers: int) -> float:
    """The learner's wait share if a sync run's collection took ``workers / (workers - 1)`` as
    long (one worker fewer, the rest of the step unchanged)."""
    collect = wait * workers / (workers - 1)
    return collect / (collect + 1 - wait)
