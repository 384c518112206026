"""The training loop and its supervisor over local stand-ins, with a death injected at every call.

The stand-ins behave like the run's actors as their clients show them (same methods, the same
errors when an actor is gone): a real LocalBuffer holds the groups, env pools number and keep
what they put, the learner counts versions, the bus fails while a worker is dead. One world
counts every call; a run kills an actor at call k (the callee, or a named actor), for every k
of a clean run. Each run must finish its steps with every prompt trained exactly once (sync) or
at most once (async), and the accounting consistent on every metrics line.
"""

from __future__ import annotations

import json

import pytest

from rlpost.actors.calls import ActorLost, BusFailure
from rlpost.data.samples import Group, Sample
from rlpost.runtime.shutdown import StopRequested
from rlpost.service.fleet import Fleet
from rlpost.service.run_state import Ledger, RunState
from rlpost.service.supervisor import LearnerDied, Supervisor
from rlpost.transport.buffer import BufferSnapshot, LocalBuffer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

NAMES = ["buffer", "inference-0", "inference-1", "env-pool-0", "env-pool-1", "reference", "learner"]


class World:
    """Counts calls and kills an actor at call ``kill_at`` (the callee when ``victim`` is None)."""

    def __init__(self, kill_at: int | None = None, victim: str | None = None):
        self.calls, self.kill_at, self.victim = 0, kill_at, victim
        self.actors: dict[str, Stand] = {}
        self.trained: list[tuple[str, int]] = []  # (producer, prompt position) per trained group
        self.served_version = 0
        self.log: list[tuple[str, str]] = []  # (actor, method) of every call, in order
        self.no_room: set[str] = set()  # actors whose bundle the cluster cannot place ...
        self.room_back_at: int | None = None  # ... until this call (None: never)
        self.node_lost_late: set[str] = set()  # actors whose replacement finds its bundle's node gone
        self.requests: dict[int, dict] = {}  # the mailbox's k-th exchange -> the scale request it hands over
        self.start_polls: dict[str, int] = {}  # a worker started in the background: looks before its engine is up
        self.failing_starts: set[str] = set()  # workers whose background start fails

    def enter(self, actor: Stand, method: str) -> None:
        if actor.dead:
            raise ActorLost(f"{actor.name} is dead", actor.name)
        self.calls += 1
        self.log.append((actor.name, method))
        if self.calls != self.kill_at:
            return
        names = () if self.victim is None else (self.victim,) if isinstance(self.victim, str) else self.victim
        targets = [actor] if self.victim is None else [self.actors[n] for n in names if n in self.actors]
        for target in targets:  # a tuple of victims: killed at the same moment (a node's loss)
            target.dead = True
        if actor in targets:
            raise ActorLost(f"{actor.name} was killed during {method}", actor.name)


class Done:
    """A finished call, as a client's Pending."""

    def __init__(self, value):
        self.value = value

    def result(self, timeout_s: float):
        return self.value

    def done(self) -> bool:
        return True


class Starting:
    """A worker's start watched in the background: up after ``polls`` looks, or failed."""

    def __init__(self, worker, polls: int, fails: bool):
        self.worker, self.polls, self.fails = worker, polls, fails

    def done(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def result(self, timeout_s: float):
        if self.fails:
            raise RuntimeError(f"{self.worker.name}: its constructor failed")
        self.worker.world.enter(self.worker, "__ray_ready__")


class Stand:
    registry: list[Stand] = []  # every stand-in made (the test of a stop looks its learner up)

    def __init__(self, world: World, name: str):
        self.world, self.name, self.dead = world, name, False
        world.actors[name] = self
        Stand.registry.append(self)

    @property
    def handle(self):
        return self

    @property
    def names(self) -> list[str]:
        return [self.name]

    def alive(self) -> bool:
        return not self.dead

    def unreachable(self, timeout_s: float) -> bool:
        return self.dead

    def wait_started(self, timeout_s: float, placed) -> bool:
        return placed()

    def submit_ready(self):
        """Its start watched in the background: up at once, unless the world says otherwise."""
        world = self.world
        if self.name in world.start_polls or self.name in world.failing_starts:
            return Starting(self, world.start_polls.get(self.name, 0), self.name in world.failing_starts)
        world.enter(self, "__ray_ready__")
        return Done(None)

    def kill(self) -> None:
        self.dead = True


class FakeBuffer(Stand):
    def __init__(self, world, capacity, max_staleness):
        super().__init__(world, "buffer")
        self.local = LocalBuffer(capacity, max_staleness)
        self.rb = self  # what the supervisor hands the pools

    def __getattr__(self, method):  # put, take, stats, snapshot, restore, producer_state, fence
        local = self.__dict__["local"]

        def call(*args, **kwargs):
            self.world.enter(self, method)
            if method == "take":
                for pool in [a for a in self.world.actors.values() if isinstance(a, FakePool)]:
                    pool.collect_async()  # the async pools' threads ran meanwhile
                args = (args[0], 0.01, *args[2:])
            return getattr(local, method)(*args, **kwargs)

        return call


class FakeInference(Stand):
    def __init__(self, world, index):
        super().__init__(world, f"inference-{index}")
        self.version = 0
        self.drained = False

    def wait_ready(self, timeout_s):
        self.world.enter(self, "get_version")
        return self.version

    def join_bus(self, spec, rank):
        self.world.enter(self, "join_bus")
        return Done(rank)

    def update_weights(self, timeout_s):
        self.world.enter(self, "update_weights")
        self.version = self.world.actors["learner"].sent
        return Done({"version": self.version, "load_s": 0.0})

    def score(self, token_ids, temperature, timeout_s):
        self.world.enter(self, "score")
        return [[0.0] * len(t) for t in token_ids]

    def drain(self, timeout_s):
        self.world.enter(self, "drain")
        self.drained = True
        return True

    def ask_busy_s(self):
        self.world.enter(self, "busy_s")
        return Done(0.0)


class FakeControl(Stand):
    """The run's mailbox: at its ``k``-th exchange it hands over ``requests[k]``."""

    def __init__(self, world, requests):
        super().__init__(world, "control")
        self.requests, self.exchanges, self.reported = dict(requests), 0, []

    def exchange(self, sizes, timeout_s):
        self.world.enter(self, "exchange")
        self.exchanges += 1
        self.reported.append(sizes)
        return self.requests.pop(self.exchanges, {})


class FakeReference(Stand):
    def __init__(self, world):
        super().__init__(world, "reference")

    def annotate(self, groups, timeout_s):
        self.world.enter(self, "annotate")
        return groups


class FakeReward(Stand):
    """The reward actor: the env pools call it (here nobody does); the supervisor only keeps it alive."""

    def __init__(self, world):
        super().__init__(world, "reward")


class FakeLearner(Stand):
    def __init__(self, world):
        super().__init__(world, "learner")
        self.weights = 0  # the weights version
        self.saved: list[tuple[int, dict]] = []
        self.stop_at_step: int | None = None  # a SIGTERM arrives while this step trains
        self.stop_after_training: int | None = None  # ... after the learner trained it, before it returns
        self.stop_at_publish: int | None = None  # ... while this step's weights are published
        self.workers: list[FakeInference] = []  # the workers its vLLMUpdater drives
        self.sent = 0  # the version of the last publish
        self.unconfirmed = False  # a publish(wait=False) whose workers have not reloaded yet
        self.waits: list[bool] = []  # each publish's wait argument

    def train_step(self, groups, timeout_s):
        self.world.enter(self, "train_step")
        if self.weights + 1 == self.stop_at_step:
            raise StopRequested("SIGTERM")
        self.weights += 1
        self.world.trained += [(g.producer, g.info["position"]) for g in groups]
        if self.weights == self.stop_after_training:
            raise StopRequested("SIGTERM")
        return {
            "loss": 0.0,
            "clip_fraction": 0.0,
            "policy_version": self.weights,
            "step_time_s": 0.01,
            "staleness_max": 0.0,
            "staleness_mean": 0.0,
        }

    def publish(self, wait=True):
        """The learner's vLLMUpdater: every worker receives while the learner publishes. With
        ``wait=False`` they reload later: the next publish confirms that first, and a worker
        that died meanwhile fails that publish (as the bus finds it then)."""
        self.world.enter(self, "publish")
        self.waits.append(wait)
        if self.weights == self.stop_at_publish:
            raise StopRequested("SIGTERM")
        self._confirm()
        if any(w.dead for w in self.workers):
            raise BusFailure("a bus peer is gone")
        self.sent, self.unconfirmed = self.weights, True
        if wait:
            self._confirm()
        return Done({"bytes": 1.0, "policy_version": self.weights, "weight_load_s": 0.0})

    def _confirm(self):
        if not self.unconfirmed:
            return
        self.unconfirmed = False
        if any(w.dead for w in self.workers):
            raise BusFailure("a bus peer died during its reload")
        self._on_workers("update_weights")
        self.world.served_version = self.sent

    def set_workers(self, workers, timeout_s):
        """The bus's next generation: the learner's vLLMUpdater joins every worker to it (an
        update not confirmed yet is forgotten and sent again)."""
        self.world.enter(self, "set_workers")
        self.workers, self.unconfirmed = list(workers), False
        self._on_workers("join_bus")
        return 1

    def _on_workers(self, method):
        """Call each worker from inside the learner: a worker's death reaches the driver as the
        learner's call failing because an actor it used died (ActorLost without a name)."""
        for rank, worker in enumerate(self.workers, start=1):
            try:
                getattr(worker, method)(*((None, rank) if method == "join_bus" else (1.0,)))
            except ActorLost as lost:
                raise ActorLost(f"learner.{method} failed because an actor it used died: {lost}", None) from lost

    def score(self, token_ids, timeout_s):
        self.world.enter(self, "score")
        return [[0.0] * len(t) for t in token_ids]

    def save_checkpoint(self, run_dir, step, rollout_state, timeout_s):
        self.world.enter(self, "save_checkpoint")
        self.saved.append((step, rollout_state))
        return f"{run_dir}/checkpoints/step_{step}"

    def version(self, timeout_s):
        self.world.enter(self, "version")
        return self.weights


class FakePool(Stand):
    """An env pool: one group per prompt, numbered and kept until acknowledged (as GroupCollector)."""

    def __init__(self, world, index, buffer, epoch, batch=2):
        super().__init__(world, f"env-pool-{index}")
        self.buffer, self.epoch, self.batch = buffer, epoch, batch
        self.position = self.num_groups_put = 0
        self.outbox: list[Group] = []
        self.left = 0  # sync: prompts left of the share
        self.forever = False  # async: collecting until stopped
        self.blocked = False  # its buffer died: waiting for set_buffer

    def start(self, num_groups_total, timeout_s=60.0):
        self.world.enter(self, "start")
        if num_groups_total is None:
            self.forever = True
        else:
            self.left = num_groups_total
            while self.left > 0 and not self.blocked and not self.dead:
                self._batch(min(self.batch, self.left))

    def collect_async(self):
        local = self.buffer.local
        if self.forever and not self.blocked and not self.dead and local.stats().size < local.capacity:
            self._batch(self.batch)

    def _version(self):
        return self.world.served_version

    def _batch(self, n):
        try:  # room for the batch first, as GroupCollector's writer reserves it before generating
            room = self.buffer.reserve(n, 0.0, self.name)
        except ActorLost:
            self.blocked = True  # GroupCollector waits for set_buffer here
            return
        if not room:
            if self.forever:
                return  # async: it waits for the learner to take
            raise RuntimeError(f"{self.name}: no room in the buffer for its share (a dead pool's reservation?)")
        if self.dead:  # killed while generating: its reservation stays until a put or a fence
            return
        groups = []
        for i in range(n):
            self.num_groups_put += 1
            sample = Sample(
                prompt_id=self.position + i,
                token_ids=[1, 2, 3],
                logprobs=[0.0, 0.0, 0.0],
                loss_mask=[False, True, True],
                prompt_len=1,
                reward=1.0,
                policy_version=self._version(),
                finished=True,
            )
            groups.append(
                Group(
                    self.position + i,
                    [sample],
                    [0.0],
                    self._version(),
                    {"position": self.position + i},
                    producer=self.name,
                    seq=self.num_groups_put,
                )
            )
        self.position += n
        self.left -= n
        self.outbox += groups
        state = self.state_dict()
        try:
            receipt = self.buffer.put(groups, 1.0, self.name, state, self.epoch)
        except ActorLost:
            self.blocked = True  # GroupCollector waits for set_buffer here
            return
        self.outbox = [g for g in self.outbox if g.seq > receipt.acknowledged]

    def wait(self, wait_s):
        self.world.enter(self, "wait")
        return not self.blocked and self.left <= 0 and not self.forever

    def set_buffer(self, buffer, timeout_s):
        self.world.enter(self, "set_buffer")
        self.buffer, self.blocked = buffer, False
        receipt = buffer.local.put(self.outbox, 1.0, self.name, self.state_dict(), self.epoch, force=True)
        self.outbox = [g for g in self.outbox if g.seq > receipt.acknowledged]
        while self.left > 0 and not self.blocked:
            self._batch(min(self.batch, self.left))
        return len(self.outbox)

    def set_inference(self, handles, timeout_s=60.0):
        self.world.enter(self, "set_inference")

    def stop(self, timeout_s):
        self.forever = False

    def state_dict(self):
        return {"num_prompts_collected": self.position, "num_groups_put": self.num_groups_put}

    def load_state_dict(self, state, timeout_s=60.0):
        self.world.enter(self, "load_state_dict")
        self.position, self.num_groups_put = state["num_prompts_collected"], state["num_groups_put"]
        self.outbox, self.left = [], 0


class Starter:
    def __init__(self, world, cfg):
        self.world, self.cfg = world, cfg

    def buffer(self):
        from rlpost.actors.buffer import buffer_capacity, staleness_cap

        return FakeBuffer(self.world, buffer_capacity(self.cfg), staleness_cap(self.cfg))

    def _node_lost_late(self, name):
        """A replacement of an actor in ``world.node_lost_late`` was sent to the bundle's node, which
        Ray declares lost only now: from here on the bundle has no node."""
        if name in self.world.node_lost_late and name in self.world.actors:
            self.world.no_room.add(name)

    def inference(self, index):
        self._node_lost_late(f"inference-{index}")
        return FakeInference(self.world, index)

    def open_slot(self, name):
        self.world.log.append((name, "open_slot"))

    def close_slot(self, name):
        self.world.log.append((name, "close_slot"))
        if name.startswith("inference-") and name in self.world.actors:  # the fleet stops its replica
            self.world.actors[name].dead = True

    def control(self):
        return FakeControl(self.world, self.world.requests)

    def remove_placement_groups(self):
        self.world.log.append(("placement", "remove_placement_groups"))

    def has_room(self, name):
        world = self.world
        return name not in world.no_room or (world.room_back_at is not None and world.calls >= world.room_back_at)

    def reference(self):
        return FakeReference(self.world)

    def reward(self):
        return FakeReward(self.world)

    def env_pool(self, index, inference, buffer, epoch=0):
        self._node_lost_late(f"env-pool-{index}")
        return FakePool(self.world, index, buffer, epoch)

    def start_all(self):
        buffer = self.buffer()
        inference = [self.inference(i) for i in range(self.cfg.rollout.num_inference_workers)]
        return {
            "buffer": buffer,
            "inference": inference,
            "env_pools": [self.env_pool(j, inference, buffer) for j in range(self.cfg.rollout.num_env_pools)],
            "learner": FakeLearner(self.world),
            "reference": self.reference(),
            "control": self.control() if self.world.requests else None,
            "reward": self.reward() if self.cfg.reward_model is not None else None,
        }

    def connect_bus(self, learner, inference):
        learner.workers = list(inference)


def make_cfg(mode, extra=()):
    from rlpost.config import load_config

    return load_config(
        "configs/tiny-cpu.yaml",
        [
            f"trainer.mode={mode}",
            "trainer.steps=3",
            "trainer.prompts_per_step=4",
            "trainer.max_staleness=1",
            "rollout.num_env_pools=2",
            "rollout.num_inference_workers=2",
            "reference.enabled=true",
            "logging.progress=false",
            "logging.run_name=stand-ins",
            "logging.trackers=[]",
            "eval.interval=0",
            *extra,
        ],
    )


def run_world(tmp_path, monkeypatch, mode, kill_at=None, victim=None, stop_at_step=None, extra=(), no_room=(),
              room_back_at=None, requests=None, node_lost_late=(), start_polls=None, failing_starts=(),
              **learner_stops):  # fmt: skip
    """One run over stand-ins (``extra``: config overrides; ``no_room``: actors the cluster cannot
    place until call ``room_back_at``; ``node_lost_late``: actors placed while their replacement
    starts, then not until ``room_back_at``; ``requests``: the mailbox's k-th exchange -> workers
    asked for); returns the world and the metrics lines."""
    import rlpost.service.loop as ctl

    monkeypatch.setattr(ctl, "plot_run", lambda records, run_dir, title: [run_dir / "reward.png"])
    monkeypatch.setattr(ctl, "POLL_S", 0.0)
    monkeypatch.setattr(ctl, "COLLECT_TIMEOUT_S", 10.0)  # a stand-in run never waits long: a hang fails fast
    world = World(kill_at, victim)
    world.no_room, world.room_back_at, world.node_lost_late = set(no_room), room_back_at, set(node_lost_late)
    world.requests = dict(requests or {})
    world.start_polls, world.failing_starts = dict(start_polls or {}), set(failing_starts)
    cfg = make_cfg(mode, extra)
    starter = Starter(world, cfg)
    run_dir = tmp_path / f"run-{mode}-{kill_at}-{victim}-{room_back_at}"
    run_dir.mkdir()
    supervisor = Supervisor(cfg, run_dir, Fleet.start(cfg, starter), RunState())
    supervisor.health_check_s = 0.0
    controller = ctl.Controller(cfg, run_dir, supervisor)
    controller.probe = [1, 2, 3]
    supervisor.fleet.learner.stop_at_step = stop_at_step
    for name, value in learner_stops.items():  # stop_after_training / stop_at_publish
        setattr(supervisor.fleet.learner, name, value)
    try:
        controller.run()
    except StopRequested:
        controller.checkpoint_on_stop()
        raise
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return world, rows


def check_run(world, rows, mode):
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # nothing completed is lost silently, nothing counted twice
        assert r["groups_put"] == r["groups_trained"] + r["groups_dropped_stale"] + r["groups_in_buffer"], r
    assert len(world.trained) == len(set(world.trained)), "a group was trained twice"
    if mode == "sync":  # each pool's prompts 0..5, every one trained once
        assert sorted(world.trained) == [(f"env-pool-{j}", p) for j in range(2) for p in range(6)]
        assert all(r["staleness_mean"] == 0.0 for r in rows)


# async mode, its syncs overlapping the next step (a sync the probe checks waits for the reload)
OVERLAPPED = ["weight_sync.probe_every=0"]
MODES = [("sync", []), ("async", []), ("async", OVERLAPPED)]
MODE_IDS = ["sync", "async", "async-overlapped"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_clean_run_over_stand_ins(tmp_path, monkeypatch, mode):
    world, rows = run_world(tmp_path, monkeypatch, mode)
    check_run(world, rows, mode)
    assert rows[-1]["groups_trained"] == 12 and rows[-1]["restarts_env_pool"] == 0


@pytest.mark.parametrize(("every", "checked"), [(1, [1, 2, 3]), (2, [1, 3]), (0, [])])
def test_the_probe_checks_the_first_sync_then_every_nth(tmp_path, monkeypatch, every, checked):
    """weight_sync.probe_every: the probe is scored on the run's first sync and every N-th after
    it; the other lines say null."""
    world, rows = run_world(tmp_path, monkeypatch, "sync", extra=[f"weight_sync.probe_every={every}"])
    assert [r["step"] for r in rows if r["sync_logprob_diff"] is not None] == checked
    assert all(r["sync_logprob_diff"] in (None, 0.0) for r in rows)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_fresh_run_syncs_and_probes_the_workers_before_its_first_step(tmp_path, monkeypatch, mode):
    """The start-up sync: the workers load the learner's version 0 and the probe compares both
    sides before anything is collected or trained; the steps' own syncs and probes are as before."""
    world, rows = run_world(tmp_path, monkeypatch, mode)
    check_run(world, rows, mode)
    first = world.log.index(("learner", "train_step"))
    before = [call for call in world.log[:first] if call[0] in ("learner", "inference-0")]
    expected = [
        ("learner", "publish"),
        ("inference-0", "update_weights"),
        ("inference-0", "score"),
        ("learner", "score"),
    ]
    assert before[:4] == expected
    assert world.actors["learner"].sent == 3 and len(world.actors["learner"].waits) == 4
    assert [r["step"] for r in rows if r["sync_logprob_diff"] is not None] == [1, 2, 3]


@pytest.mark.parametrize(
    ("mode", "extra", "waits"),
    [
        ("sync", [], [True, True, True, True]),  # the start-up sync, then one a step
        ("async", [], [True, True, True, True]),  # the probe checks every sync: each waits for the reload
        ("async", OVERLAPPED, [True, False, False, True]),
        ("async", [*OVERLAPPED, "weight_sync.train_during_reload=false"], [True, True, True, True]),
        ("sync", OVERLAPPED, [True, True, True, True]),  # the next collection needs the new weights
    ],
)
def test_async_syncs_overlap_the_next_step_and_the_last_one_waits(tmp_path, monkeypatch, mode, extra, waits):
    """weight_sync.train_during_reload: in async mode a sync without a probe check returns once
    the weights are sent and the next sync confirms the workers' reload; the run's last sync
    waits, so the workers serve the final weights when it ends."""
    world, rows = run_world(tmp_path, monkeypatch, mode, extra=extra)
    check_run(world, rows, mode)
    assert world.actors["learner"].waits == waits
    assert world.served_version == 3 and all(w.version == 3 for w in world.actors["learner"].workers)


@pytest.mark.parametrize(("mode", "extra"), MODES, ids=MODE_IDS)
def test_the_callee_dies_at_every_call(tmp_path, monkeypatch, mode, extra):
    clean, _ = run_world(tmp_path, monkeypatch, mode, extra=extra)
    recovered = 0
    for k in range(1, clean.calls + 1):
        try:
            world, rows = run_world(tmp_path, monkeypatch, mode, kill_at=k, extra=extra)
        except LearnerDied as died:
            assert "the learner died during step" in str(died)
            continue
        check_run(world, rows, mode)
        recovered += sum(
            rows[-1][key]
            for key in ("restarts_inference", "restarts_env_pool", "restarts_reference", "restarts_buffer")
        )
    assert recovered >= clean.calls // 2  # most kills were restarts, not learner deaths


@pytest.mark.parametrize(("mode", "extra"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("victim", [n for n in NAMES if n != "learner"])
def test_any_actor_dies_at_any_call(tmp_path, monkeypatch, mode, extra, victim):
    """``victim`` dies while another actor is being called, at every call of a clean run."""
    clean, _ = run_world(tmp_path, monkeypatch, mode, extra=extra)
    role = {"buffer": "restarts_buffer", "reference": "restarts_reference"}.get(victim)
    role = role or ("restarts_inference" if victim.startswith("inference") else "restarts_env_pool")
    restarted = 0
    for k in range(1, clean.calls + 1):
        world, rows = run_world(tmp_path, monkeypatch, mode, kill_at=k, victim=victim, extra=extra)
        check_run(world, rows, mode)
        assert rows[-1][role] <= 1
        restarted += rows[-1][role]
    # a death noticed by no later call (e.g. a pool killed after its last share) needs no restart
    assert restarted >= clean.calls // 2, (restarted, clean.calls)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_dead_reward_actor_is_started_again_at_the_next_health_check(tmp_path, monkeypatch, mode):
    """The reward actor dies at any call of a run with a reward_model: the supervisor's next
    health check starts it again (the env pools' calls wait for it), once, and nothing is lost."""
    extra = ["reward_model.name_or_path=rm"]
    clean, _ = run_world(tmp_path, monkeypatch, mode, extra=extra)
    for k in range(1, clean.calls // 2, 3):  # a death in the run's first half: later checks see it
        world, rows = run_world(tmp_path, monkeypatch, mode, kill_at=k, victim="reward", extra=extra)
        check_run(world, rows, mode)
        assert rows[-1]["restarts_reward"] == 1, k
        assert not world.actors["reward"].dead and rows[-1]["restarts_env_pool"] == 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_worker_lost_without_room_leaves_the_fleet_until_room_returns(tmp_path, monkeypatch, mode):
    """A node's loss with no other node to hold its worker: the run goes on with one worker
    (metrics say so), and the worker starts again once the cluster places its bundle."""
    clean, _ = run_world(tmp_path, monkeypatch, mode)
    kill_at = clean.calls // 3
    extra = ["resources.replacement_wait_s=0"]
    world, rows = run_world(tmp_path, monkeypatch, mode, kill_at=kill_at, victim="inference-1", extra=extra,
                            no_room=["inference-1"])  # fmt: skip
    check_run(world, rows, mode)
    assert [r["inference_workers"] for r in rows][-1] == 1 and rows[-1]["inference_workers_vacant"] == 1
    assert rows[-1]["restarts_inference"] == 0
    assert [w.name for w in world.actors["learner"].workers] == ["inference-0"]  # the bus without it

    back = kill_at + (clean.calls - kill_at) // 2
    world, rows = run_world(tmp_path, monkeypatch, mode, kill_at=kill_at, victim="inference-1", extra=extra,
                            no_room=["inference-1"], room_back_at=back)  # fmt: skip
    check_run(world, rows, mode)
    assert 1 in [r["inference_workers"] for r in rows[:-1]]  # a step trained with one worker serving
    assert rows[-1]["inference_workers"] == 2 and rows[-1]["inference_workers_vacant"] == 0
    assert rows[-1]["restarts_inference"] == 1
    assert [w.name for w in world.actors["learner"].workers] == ["inference-0", "inference-1"]
    assert world.served_version == 3 and all(w.version == 3 for w in world.actors["learner"].workers)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_last_worker_waits_for_room_rather_than_leave_no_fleet(tmp_path, monkeypatch, mode):
    """Both workers lost at once with no room (their node): one is left out, the other started
    again (its start waits for the cluster), and the run goes on with it."""
    clean, _ = run_world(tmp_path, monkeypatch, mode)
    extra = ["resources.replacement_wait_s=0"]
    world, rows = run_world(tmp_path, monkeypatch, mode, kill_at=clean.calls // 3, victim=("inference-0", "inference-1"),
                            extra=extra, no_room=["inference-0", "inference-1"])  # fmt: skip
    check_run(world, rows, mode)
    assert (rows[-1]["inference_workers"], rows[-1]["inference_workers_vacant"]) == (1, 1)
    assert rows[-1]["restarts_inference"] == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_range_starts_its_minimum_and_grows_as_the_cluster_places_the_rest(tmp_path, monkeypatch, mode):
    """rollout.max_inference_workers: the run starts with num_inference_workers and wants the
    range's top; the third slot is vacant until the cluster places it, then its worker starts
    and joins the bus (a new slot: not counted as a restart)."""
    clean, _ = run_world(tmp_path, monkeypatch, mode)
    extra = ["rollout.max_inference_workers=3"]
    world, rows = run_world(tmp_path, monkeypatch, mode, extra=extra, no_room=["inference-2"],
                            room_back_at=clean.calls // 2)  # fmt: skip
    check_run(world, rows, mode)
    assert ("inference-2", "open_slot") in world.log
    first, last = rows[0], rows[-1]
    assert (first["inference_workers"], first["inference_workers_vacant"], first["inference_workers_target"]) == (
        2,
        1,
        3,
    )
    assert (last["inference_workers"], last["inference_workers_vacant"], last["inference_workers_target"]) == (3, 0, 3)
    assert last["restarts_inference"] == 0
    assert [w.name for w in world.actors["learner"].workers] == ["inference-0", "inference-1", "inference-2"]
    assert world.served_version == 3 and all(w.version == 3 for w in world.actors["learner"].workers)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_operator_grows_then_shrinks_the_fleet_while_it_trains(tmp_path, monkeypatch, mode):
    """Requests through the run's mailbox: 3 workers (a new one starts and joins), then 1 (the
    two highest leave: the pools stop using them, they finish their requests, their slots close
    and the bus re-forms with inference-0 alone). Nothing is lost or trained twice."""
    world, rows = run_world(tmp_path, monkeypatch, mode, requests={1: {"inference": 3}, 3: {"inference": 1}})
    check_run(world, rows, mode)
    control = world.actors["control"]
    assert control.exchanges >= 3 and control.requests == {}  # both requests were taken
    assert control.reported[0]["inference_workers_target"] == 2 and control.reported[1]["inference_workers_target"] == 3
    assert all(world.actors[f"inference-{i}"].drained and world.actors[f"inference-{i}"].dead for i in (1, 2))
    assert [w.name for w in world.actors["learner"].workers] == ["inference-0"]
    last = rows[-1]
    assert (last["inference_workers"], last["inference_workers_vacant"], last["inference_workers_target"]) == (1, 0, 1)
    assert last["restarts_inference"] == 0 and last["bus_reforms"] >= 2
    assert world.served_version == 3 and world.actors["inference-0"].version == 3
    # the pools were told to stop using the leaving workers before they drained
    log = world.log
    first_drain = log.index(("inference-1", "drain"))
    assert any(name.startswith("env-pool") and method == "set_inference" for name, method in log[:first_drain])


def check_shards(world, rows, mode, prompts=12, steps=3):
    """Every shard's prompts trained once and in order from its start (none skipped while its
    pool was away); in sync mode the step's prompts all trained, whichever pools collected them."""
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["groups_put"] == r["groups_trained"] + r["groups_dropped_stale"] + r["groups_in_buffer"], r
    assert len(world.trained) == len(set(world.trained)), "a group was trained twice"
    if mode == "sync":
        assert len(world.trained) == prompts and all(r["staleness_mean"] == 0.0 for r in rows)
        for producer in {p for p, _ in world.trained}:
            positions = sorted(pos for p, pos in world.trained if p == producer)
            assert positions == list(range(len(positions))), (producer, positions)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_pool_lost_without_room_leaves_the_fleet_until_room_returns(tmp_path, monkeypatch, mode):
    """A node's loss takes env-pool-1 and no node can hold it: the run goes on with env-pool-0,
    which collects each step's prompts alone (its shard's positions, none repeated), and
    env-pool-1 starts again from its last put once the cluster places its bundle."""
    clean, _ = run_world(tmp_path, monkeypatch, mode)
    kill_at = clean.calls // 3
    extra = ["resources.replacement_wait_s=0"]
    world, rows = run_world(tmp_path, monkeypatch, mode, kill_at=kill_at, victim="env-pool-1", extra=extra,
                            no_room=["env-pool-1"])  # fmt: skip
    check_shards(world, rows, mode)
    last = rows[-1]
    assert (last["env_pools"], last["env_pools_vacant"], last["env_pools_target"]) == (1, 1, 2)
    assert last["restarts_env_pool"] == 0
    if mode == "sync":  # env-pool-0 collected what env-pool-1 could not
        assert sum(p == "env-pool-0" for p, _ in world.trained) > 6

    back = kill_at + (clean.calls - kill_at) // 2
    world, rows = run_world(tmp_path, monkeypatch, mode, kill_at=kill_at, victim="env-pool-1", extra=extra,
                            no_room=["env-pool-1"], room_back_at=back)  # fmt: skip
    check_shards(world, rows, mode)
    assert 1 in [r["env_pools"] for r in rows[:-1]]  # a step trained with one pool serving
    assert (rows[-1]["env_pools"], rows[-1]["env_pools_vacant"]) == (2, 0)
    assert rows[-1]["restarts_env_pool"] == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_pool_lost_without_room_at_any_call_leaves_its_shard_whole(tmp_path, monkeypatch, mode):
    """env-pool-1 lost for good (no room) at every call of a clean run: the other pool collects
    every step whatever the lost one held (a reservation of room in the buffer, a share begun),
    and no prompt of either shard is trained twice or skipped."""
    clean, _ = run_world(tmp_path, monkeypatch, mode)
    extra = ["resources.replacement_wait_s=0"]
    for k in range(1, clean.calls + 1):
        world, rows = run_world(tmp_path, monkeypatch, mode, kill_at=k, victim="env-pool-1", extra=extra,
                                no_room=["env-pool-1"])  # fmt: skip
        check_shards(world, rows, mode)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_node_declared_lost_after_its_actors_died_leaves_their_slots_vacant(tmp_path, monkeypatch, mode):
    """A node's raylet dies: its worker and pool are found dead at once, but Ray declares the node
    lost only seconds later, so their bundles still look placed and their replacements are sent
    there. Once the bundles have no node the replacements are ended and the slots left vacant (the
    run goes on with one of each, not waiting for a node that is gone); when a node joins, both
    start again."""
    clean, _ = run_world(tmp_path, monkeypatch, mode)
    node = ("inference-1", "env-pool-1")
    kill_at = clean.calls // 3
    world, rows = run_world(tmp_path, monkeypatch, mode, kill_at=kill_at, victim=node, node_lost_late=node)
    check_shards(world, rows, mode)
    last = rows[-1]
    assert (last["inference_workers"], last["inference_workers_vacant"], last["restarts_inference"]) == (1, 1, 0)
    assert (last["env_pools"], last["env_pools_vacant"], last["restarts_env_pool"]) == (1, 1, 0)
    assert [w.name for w in world.actors["learner"].workers] == ["inference-0"]

    back = kill_at + (clean.calls - kill_at) // 2
    world, rows = run_world(tmp_path, monkeypatch, mode, kill_at=kill_at, victim=node, node_lost_late=node,
                            room_back_at=back)  # fmt: skip
    check_shards(world, rows, mode)
    assert 1 in [r["inference_workers"] for r in rows[:-1]] and 1 in [r["env_pools"] for r in rows[:-1]]
    last = rows[-1]
    assert (last["inference_workers"], last["env_pools"], last["restarts_inference"], last["restarts_env_pool"]) == (
        2, 2, 1, 1,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_last_pool_waits_for_room_rather_than_leave_no_pool(tmp_path, monkeypatch, mode):
    clean, _ = run_world(tmp_path, monkeypatch, mode)
    extra = ["resources.replacement_wait_s=0"]
    world, rows = run_world(tmp_path, monkeypatch, mode, kill_at=clean.calls // 3, victim=("env-pool-0", "env-pool-1"),
                            extra=extra, no_room=["env-pool-0", "env-pool-1"])  # fmt: skip
    check_shards(world, rows, mode)
    assert (rows[-1]["env_pools"], rows[-1]["env_pools_vacant"]) == (1, 1)
    assert rows[-1]["restarts_env_pool"] == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_range_of_env_pools_starts_its_minimum_and_grows_when_placed(tmp_path, monkeypatch, mode):
    """rollout.num_env_pools: 1..2: env-pool-1 is vacant until the cluster places it (a new slot
    with a group of its own), then takes its shard from the start; not counted as a restart."""
    clean, _ = run_world(tmp_path, monkeypatch, mode)
    world, rows = run_world(tmp_path, monkeypatch, mode, extra=["rollout.num_env_pools=1..2"],
                            no_room=["env-pool-1"], room_back_at=clean.calls // 3)  # fmt: skip
    check_shards(world, rows, mode)
    assert ("env-pool-1", "open_slot") in world.log
    assert (rows[0]["env_pools"], rows[0]["env_pools_vacant"], rows[0]["env_pools_target"]) == (1, 1, 2)
    assert (rows[-1]["env_pools"], rows[-1]["env_pools_vacant"]) == (2, 0) and rows[-1]["restarts_env_pool"] == 0
    assert ("env-pool-1", 0) in world.trained  # its shard from its first position


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_operator_shrinks_then_grows_the_env_pools_while_it_trains(tmp_path, monkeypatch, mode):
    """env_pools=1: env-pool-1 stops after its batch and leaves (its slot closes), env-pool-0
    collects alone; env_pools=2: env-pool-1 starts again where its last put ended. Every shard's
    prompts are trained once, in order; scaling is not a restart."""
    world, rows = run_world(tmp_path, monkeypatch, mode, requests={1: {"env_pools": 1}, 4: {"env_pools": 2}})
    check_shards(world, rows, mode)
    control = world.actors["control"]
    assert control.requests == {}  # both requests were taken
    assert ("env-pool-1", "close_slot") in world.log and ("env-pool-1", "open_slot") not in world.log[:1]
    assert 1 in [r["env_pools"] for r in rows]
    last = rows[-1]
    assert (last["env_pools"], last["env_pools_vacant"], last["env_pools_target"]) == (2, 0, 2)
    assert last["restarts_env_pool"] == 0 and last["restarts_inference"] == 0
    assert any(sizes.get("env_pools") == 1 for sizes in control.reported)


def test_a_checkpoint_keeps_the_fleet_an_operator_asked_for(tmp_path, monkeypatch):
    """The checkpoint records each fleet's slots, and a resume asks for them again where the
    config's ranges still allow it."""
    world, rows = run_world(tmp_path, monkeypatch, "sync", requests={1: {"inference": 1, "env_pools": 1}})
    learner = world.actors["learner"]
    _, state = learner.saved[-1]
    assert state["fleet"] == {"inference": 1, "env_pools": 1}
    cfg = make_cfg("sync")
    supervisor = Supervisor(cfg, tmp_path, Fleet.start(cfg, Starter(world, cfg)), RunState())
    supervisor.restore_fleet({"inference": 1, "env_pools": 5})  # 5 pools: more than the 2 shards
    assert supervisor.fleet.sizes()["inference_workers"] == 1 and supervisor.fleet.sizes()["env_pools"] == 2


def test_a_scale_request_outside_the_range_is_refused_and_changes_nothing(tmp_path, monkeypatch):
    from rlpost.service.mailbox import RunControl, check_scale_request

    inference = {"inference": (1, None)}
    with pytest.raises(ValueError, match="at least one inference worker"):
        check_scale_request(inference, {"inference": 0})
    with pytest.raises(ValueError, match=r"inference=5 is outside the run's range 2\.\.4"):
        check_scale_request({"inference": (2, 4)}, {"inference": 5})
    with pytest.raises(ValueError, match=r"outside the run's range 2\.\.4"):
        check_scale_request({"inference": (2, 4)}, {"inference": 1})
    with pytest.raises(ValueError, match="a whole number"):
        check_scale_request(inference, {"inference": "3"})
    with pytest.raises(ValueError, match=r"env_pools=3 is outside the run's range 1\.\.2 .*shards"):
        check_scale_request({"env_pools": (1, 2)}, {"env_pools": 3})
    with pytest.raises(ValueError, match="at least one env pool"):
        check_scale_request({"env_pools": (1, 2)}, {"env_pools": 0})
    with pytest.raises(ValueError, match="nothing to change"):
        check_scale_request(inference, {})
    check_scale_request(inference, {"inference": 64})  # no range: any number from one
    mailbox = RunControl({"inference": (1, 3), "env_pools": (1, 2)})
    with pytest.raises(ValueError):
        mailbox.request(inference=4)
    with pytest.raises(ValueError):
        mailbox.request(inference=2, env_pools=3)  # one bad count refuses the whole request
    assert mailbox.fleet() == {"requested": None}
    assert mailbox.request(inference=2) == {"requested": {"inference": 2}}
    assert mailbox.request(inference=3, env_pools=1) == {"requested": {"inference": 3, "env_pools": 1}}  # later wins
    assert mailbox.exchange({"inference_workers": 1}) == {"inference": 3, "env_pools": 1}
    assert mailbox.exchange({"inference_workers": 3}) == {}
    assert mailbox.fleet() == {"requested": None, "inference_workers": 3}


def test_a_buffer_rebuilt_from_the_ledger_skips_what_was_received():
    ledger = Ledger(acknowledged={"env-pool-0": 3})
    buffer = LocalBuffer(capacity=4)
    buffer.restore(BufferSnapshot([], {}, last_seqs=dict(ledger.acknowledged), acknowledged=dict(ledger.acknowledged)))
    replay = [Group(i, [], [], 0, producer="env-pool-0", seq=i) for i in (2, 3, 4, 5)]
    receipt = buffer.put(replay, 1.0, "env-pool-0", {"num_prompts_collected": 5}, force=True)
    assert [g.seq for g in buffer.get(2, 1.0)] == [4, 5] and receipt.acknowledged == 3


def test_a_fenced_producer_cannot_put():
    buffer = LocalBuffer(capacity=4)
    buffer.put([Group(0, [], [], 0, producer="p", seq=1)], 1.0, "p", {"at": 1})
    assert buffer.fence("p", 1) == {"at": 1}
    late = buffer.put([Group(1, [], [], 0, producer="p", seq=2)], 1.0, "p", {"at": 2}, epoch=0)
    assert not late.accepted and buffer.stats().size == 1 and buffer.producer_state("p") == {"at": 1}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_stop_checkpoints_the_last_trained_step_with_the_taken_groups_back_in_the_buffer(tmp_path, monkeypatch, mode):
    with pytest.raises(StopRequested):
        run_world(tmp_path, monkeypatch, mode, stop_at_step=2)
    learner = next(a for a in reversed(Stand.registry) if isinstance(a, FakeLearner))
    ((step, state),) = learner.saved  # one checkpoint: the stop's, of step 1
    assert step == 1
    assert state["ledger"]["groups_taken"] == 4  # step 1's groups; step 2's were taken, not trained
    assert len(state["buffer_groups"]) >= 4  # step 2's groups go back first
    positions = [(g.producer, g.info["position"]) for g in state["buffer_groups"][:4]]
    assert not set(positions) & set(learner.world.trained)


@pytest.mark.parametrize("stop", ["stop_after_training", "stop_at_publish"])
def test_a_stop_after_a_step_trained_still_records_its_row(tmp_path, monkeypatch, stop):
    """A SIGTERM after the learner trained step 2 (its train call interrupted, or the weight sync
    after it): the final checkpoint is step 2's, and metrics.jsonl has step 2's row, so a resumed
    run continues at step 3 with no step missing."""
    with pytest.raises(StopRequested):
        run_world(tmp_path, monkeypatch, "sync", **{stop: 2})
    learner = next(a for a in reversed(Stand.registry) if isinstance(a, FakeLearner))
    ((step, _),) = learner.saved
    assert step == 2
    run_dir = next(tmp_path.iterdir())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["policy_version"] == 2
    assert rows[1]["stopped"] is True and "stopped" not in rows[0]
    assert rows[1]["reward_mean"] is not None
    for r in rows:  # the stop's row keeps the accounting too
        assert r["groups_put"] == r["groups_trained"] + r["groups_dropped_stale"] + r["groups_in_buffer"], r
    assert rows[1]["groups_trained"] == 8
    if stop == "stop_at_publish":  # the learner's numbers came back before the stop
        assert rows[1]["loss"] == 0.0
    else:
        assert rows[1]["loss"] is None


@pytest.mark.parametrize("role", ["inference", "reference", "env_pool"])
def test_a_role_whose_restart_keeps_failing_stops_the_run_naming_the_role_and_the_cause(tmp_path, monkeypatch, role):
    """Every actor of the role dies in its constructor (a missing file, an engine that cannot
    load), the first one and each restart: after MAX_ATTEMPTS tries of a part the run stops, and
    the error names the role and the constructor's error, never retrying forever."""
    import rlpost.service.supervisor as sup

    name = {"inference": "inference-0", "reference": "reference", "env_pool": "env-pool-0"}[role]
    original = getattr(Starter, role)
    starts = []

    def broken_start(self, *args, **kwargs):
        actor = original(self, *args, **kwargs)
        starts.append(actor.name)
        actor.dead = True  # every call to it fails as a dead actor's does, from its constructor's error
        actor.world.actors[actor.name] = actor
        original_enter = actor.world.enter

        def enter(target, method, _actor=actor, _enter=original_enter):
            if target is _actor:
                raise ActorLost(
                    f"{_actor.name} died during {method}: its constructor raised FileNotFoundError: model.safetensors",
                    _actor.name,
                )
            return _enter(target, method)

        actor.world.enter = enter
        return actor

    monkeypatch.setattr(Starter, role, broken_start)
    with pytest.raises(RuntimeError) as failed:
        run_world(tmp_path, monkeypatch, "sync", kill_at=3, victim=name)
    message = str(failed.value)
    assert f"failed {sup.MAX_ATTEMPTS} times" in message
    assert name in message and "its constructor raised FileNotFoundError: model.safetensors" in message
    # a few recoveries in all (a health check's and the failing part's tries), never unbounded
    assert 1 <= len(starts) <= 2 * sup.MAX_ATTEMPTS, starts


def test_the_fleet_scales_without_a_training_loop():
    """Fleet.scale on its own: leaving workers drain and go (True: the bus must re-form without
    them), leaving pools stop and are fenced off, new slots are vacant until started, and a
    request outside the config's ranges changes nothing."""
    world = World()
    fleet = Fleet.start(make_cfg("sync"), Starter(world, make_cfg("sync")))
    assert fleet.scale({"inference": 1}) is True
    assert world.actors["inference-1"].drained and world.actors["inference-1"].dead
    assert ("inference-1", "close_slot") in world.log and [w.name for w in fleet.inference] == ["inference-0"]
    assert fleet.scale({"env_pools": 1}) is False
    assert [p.name for p in fleet.env_pools] == ["env-pool-0"] and fleet.epochs[1] == 1  # fenced off
    before = fleet.sizes()
    with pytest.raises(ValueError):
        fleet.scale({"env_pools": 3})  # more pools than the prompt stream has shards (2)
    assert fleet.sizes() == before
    assert fleet.scale({"inference": 3}) is False  # two new slots, vacant until their actors start
    assert fleet.sizes() | fleet.wanted() == {
        "inference_workers": 1, "inference_workers_vacant": 2, "inference_workers_target": 3,
        "env_pools": 1, "env_pools_vacant": 0, "env_pools_target": 1, "inference": 3,
    }  # fmt: skip


AUTOSCALED = ["rollout.num_inference_workers=1..3", "rollout.autoscale.enabled=true",
              "rollout.autoscale.window_steps=1", "rollout.autoscale.cooldown_s=0"]  # fmt: skip


def grow_while_it_can(policy):
    """A stand-in for the policy's reading of the load: one more worker after every step."""
    if policy._can_move("inference", +1):
        return policy._decide("inference", policy.wanted["inference"] + 1, "engines_bound", "the test says so")
    return None


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_load_policy_resizes_the_fleet_after_its_steps_and_says_why(tmp_path, monkeypatch, mode):
    """With rollout.autoscale the range opens at its minimum; each decision resizes the fleet like
    an operator's request (the new worker loads the weights and joins the bus) and is on the
    step's metrics line with its reason and the signals read."""
    from rlpost.service.autoscale import LoadPolicy

    monkeypatch.setattr(LoadPolicy, "_decide_by_load", grow_while_it_can)
    world, rows = run_world(tmp_path, monkeypatch, mode, extra=AUTOSCALED)
    check_run(world, rows, mode)
    # the step the new worker joined in is not read: the next grow comes a step later
    assert [(r["inference_workers"], r["inference_workers_target"]) for r in rows] == [(2, 2), (2, 2), (3, 3)]
    assert [r.get("autoscale_reason") for r in rows] == ["engines_bound", None, "engines_bound"]
    assert rows[0]["autoscale_decision"] == "grow inference workers 1 -> 2: the test says so"
    assert rows[0]["autoscale_fleet"] == [1, 2]  # what it read: one worker, two pools, before the grow
    assert all(0.0 <= r["autoscale_wait_share"] <= 1.0 and r["autoscale_engine_busy"] == 0.0 for r in rows)
    assert [w.name for w in world.actors["learner"].workers] == ["inference-0", "inference-1", "inference-2"]
    assert world.served_version == 3 and all(w.version == 3 for w in world.actors["learner"].workers)
    assert rows[-1]["restarts_inference"] == 0  # growing is not a failure


def test_an_operators_count_pins_the_role_against_the_load_policy(tmp_path, monkeypatch):
    from rlpost.service.autoscale import LoadPolicy

    monkeypatch.setattr(LoadPolicy, "_decide_by_load", grow_while_it_can)
    world, rows = run_world(tmp_path, monkeypatch, "sync", extra=AUTOSCALED, requests={1: {"inference": 2}})
    check_run(world, rows, "sync")
    assert [(r["inference_workers"], r["inference_workers_target"]) for r in rows] == [(2, 2)] * 3
    assert not any(r.get("autoscale_reason") for r in rows)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_new_pool_starts_in_the_background_and_takes_its_shard(tmp_path, monkeypatch, mode):
    """As a worker: a range's third env pool has its constructor run while the run trains; it
    takes its shard from its start once up (sync: its share of later steps); nothing is lost or
    trained twice."""
    extra = ["trainer.steps=5", "rollout.num_env_pools=2..3"]
    world, rows = run_world(tmp_path, monkeypatch, mode, extra=extra, start_polls={"env-pool-2": 3})
    check_shards(world, rows, mode, prompts=20, steps=5)
    serving = [r["env_pools"] for r in rows]
    assert serving[0] == 2 and serving[-1] == 3, serving
    if mode == "sync":  # its share of the steps after it joined
        assert any(p == "env-pool-2" for p, _ in world.trained), "the new pool's groups were trained"
    else:  # collecting on its own from when it joined
        assert ("env-pool-2", "start") in world.log
    assert rows[-1]["restarts_env_pool"] == 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_new_worker_starts_in_the_background_while_the_run_trains(tmp_path, monkeypatch, mode):
    """A grown slot's worker loads its engine while the others serve: the run trains on without
    waiting, and the worker joins (bus re-formed, current weights) at the health check after it is
    up; a start that fails leaves its slot vacant and the run goes on."""
    extra = ["trainer.steps=5"]
    world, rows = run_world(tmp_path, monkeypatch, mode, extra=extra, requests={1: {"inference": 3}},
                            start_polls={"inference-2": 3})  # fmt: skip
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    serving = [r["inference_workers"] for r in rows]
    assert serving[0] == 2 and serving[-1] == 3, serving  # trained while it started, then it served
    assert world.actors["learner"].workers[-1].name == "inference-2" and world.actors["inference-2"].version == 5
    assert rows[-1]["restarts_inference"] == 0

    (tmp_path / "failing").mkdir()
    world, rows = run_world(tmp_path / "failing", monkeypatch, mode, requests={1: {"inference": 3}},
                            failing_starts={"inference-2"})  # fmt: skip
    check_run(world, rows, mode)
    last = rows[-1]
    assert (last["inference_workers"], last["inference_workers_vacant"], last["inference_workers_target"]) == (2, 1, 3)


def test_a_resumed_runs_first_step_is_not_read_by_the_load_policy(tmp_path):
    """After a resume the first step's counts (groups put, trained) run from the run's start, not
    the step's: the policy's window starts with the next step."""
    cfg = make_cfg("sync", AUTOSCALED)
    supervisor = Supervisor(cfg, tmp_path, Fleet.start(cfg, Starter(World(), cfg)), RunState())
    row = {"step": 7, "step_time_s": 2.0, "collect_s": 1.8, "groups_put": 28, "groups_trained": 28,
           "groups_dropped_stale": 0, "buffer_fill": 0.0}  # fmt: skip
    keys = supervisor.autoscale(row)
    assert keys["autoscale_wait_share"] == pytest.approx(0.9) and keys["autoscale_fleet"] == [1, 2]
    assert supervisor.policy.window == []
    supervisor.autoscale({**row, "step": 8, "groups_put": 32, "groups_trained": 32})
    (load,) = supervisor.policy.window
    assert load.generated == 4  # this step's groups, not the run's


def test_a_resume_restores_the_fleet_and_the_roles_an_operator_pinned(tmp_path):
    cfg = make_cfg("sync", AUTOSCALED)
    supervisor = Supervisor(cfg, tmp_path, Fleet.start(cfg, Starter(World(), cfg)), RunState())
    supervisor.restore_fleet({"inference": 3, "env_pools": 2}, pins=["inference"])
    assert supervisor.fleet.wanted() == {"inference": 3, "env_pools": 2} and supervisor.policy.pins == {"inference"}
