"""The distributed weight bus with plain torch processes (no Ray, no vLLM), on both routes: gloo
collectives ("bus") and same-node shared memory ("shm"), which every test except the timeouts of
joining runs on.

The publisher (rank 0) runs in the test process; each receiver is a process of its own (forked
from a server that imported torch: tests/preforked.py) driven by a command queue. Receivers check
what they got against `model_weights(version)`, recomputed on their side, bit for bit, and report
back only the verdict.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time

import pytest
import torch
from preforked import forkserver_context  # tests/preforked.py

from rlpost.transport import BusSpec, TorchWeightPublisher, TorchWeightReceiver, WeightSyncError
from rlpost.transport.bucketing import empty_buckets

pytestmark = pytest.mark.integration

TIMEOUT_S = 4.0
SLACK_S = 4.0  # detection may take the timeout plus scheduling on 2 busy cores
REPLY_S = 30.0
SLOW_RELOAD_S = 2.0  # a receiver's "stream slowly" holds its confirmation this long after the bytes
# For a test whose only wait on the bus timeout is the failure it expects (the join waits REPLY_S,
# and building gloo after it takes milliseconds): a timeout fires within ~0.1 s of its mark here,
# so a shorter one only shortens the wait.
SHORT_TIMEOUT_S = 2.0


def process_context():
    """Receivers (and the dying publisher) fork from a server that imported what they run."""
    return forkserver_context("rlpost.transport", "pytest")


def model_weights(version: int) -> dict[str, torch.Tensor]:
    """A model-like state dict: fp32, bf16 and int64, odd sizes, one oversized, one non-contiguous."""
    g = torch.Generator().manual_seed(version)
    weights = {"embed.weight": torch.randn(1000, 333, generator=g)}  # 1.3 MB: more than one bucket
    for i in range(3):
        weights[f"layers.{i}.attn.qkv"] = torch.randn(333, 3 * 111 + 1, generator=g)
        weights[f"layers.{i}.norm"] = torch.randn(333, generator=g)
        weights[f"layers.{i}.mlp.up"] = torch.randn(333, 777, generator=g).to(torch.bfloat16)
        weights[f"layers.{i}.mlp.down"] = torch.randn(333, 777, generator=g).to(torch.bfloat16).t()
    weights["position_ids"] = torch.arange(97) * version
    weights["scale"] = torch.tensor(float(version))
    return weights


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    same_kind = a.dtype == b.dtype and a.shape == b.shape
    return same_kind and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def check_update(version: int, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names that differ from `model_weights(version)` (also order and set of names)."""
    expected = model_weights(version)
    if list(tensors) != list(expected):
        return ["<names or order differ>"]
    return [name for name in expected if not bit_equal(tensors[name], expected[name])]


class DiesMidBroadcast(TorchWeightReceiver):
    """Receives its first update normally; in the second, exits once the first of its buckets
    arrived (overrides the receiver's private per-update steps: a test-only fault injection)."""

    calls = 0

    def _arriving(self, layout, fail):
        self.calls += 1
        if self.calls < 2:
            yield from super()._arriving(layout, fail)
            return
        first = empty_buckets(layout, self.device)[0]
        self._group.broadcast(first).wait()
        os._exit(17)

    def _arriving_shared(self, layout, ref, seq, fail):
        self.calls += 1
        arriving = super()._arriving_shared(layout, ref, seq, fail)
        if self.calls < 2:
            yield from arriving
            return
        next(arriving)  # the first bucket is in
        os._exit(17)


def receiver_main(spec: BusSpec, rank: int, commands, replies, dies: bool) -> None:
    receiver = (DiesMidBroadcast if dies else TorchWeightReceiver)(spec, rank)
    while True:
        command, arg = commands.get()
        try:
            if command == "receive":
                version, tensors = receiver.receive(arg)
                replies.put(("ok", version, check_update(version, tensors)))
            elif command in ("stream", "stream and fail", "stream slowly", "stream and exit"):
                got = {}

                def consume(version, tensors, got=got, command=command):
                    for name, tensor in tensors:
                        got[name] = tensor.clone()
                        if command == "stream and fail":
                            raise ValueError("these weights do not fit the model")
                    if command == "stream slowly":  # as an engine's reload, after the bytes
                        time.sleep(SLOW_RELOAD_S)
                    if command == "stream and exit":  # dies in its reload, before confirming
                        os._exit(17)

                version = receiver.receive_streamed(consume, arg)
                replies.put(("ok", version, check_update(version, got)))
            elif command == "connect":
                receiver.connect(arg)
                replies.put(("ok", None, []))
            elif command == "reform":
                receiver.reform(*arg)
                replies.put(("ok", None, []))
            else:
                receiver.close()
                return
        except WeightSyncError as exc:
            replies.put(("error", exc.version, str(exc)))


class Peer:
    """A receiver process and its command / reply queues."""

    def __init__(self, spec: BusSpec, rank: int, dies: bool = False):
        ctx = process_context()
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(
            target=receiver_main, args=(spec, rank, self.commands, self.replies, dies), daemon=True
        )
        self.process.start()

    def send(self, command: str, arg=None) -> None:
        self.commands.put((command, arg))

    def reply(self):
        return self.replies.get(timeout=REPLY_S)

    def stop(self) -> None:
        if self.process.is_alive():
            self.send("exit")
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


@pytest.fixture(params=["bus", "shm"])
def route(request) -> str:
    """How the receivers get the bytes: gloo collectives, or the same node's shared memory."""
    return request.param


def make_publisher(world_size: int, route: str, timeout_s: float = TIMEOUT_S, **kwargs) -> TorchWeightPublisher:
    return TorchWeightPublisher(
        world_size, bucket_mb=1, timeout_s=timeout_s, backend="gloo", shared_memory=route == "shm", **kwargs
    )


@pytest.fixture
def peers():
    started: list[Peer] = []
    yield started
    for peer in started:
        peer.stop()


def connect_all(publisher: TorchWeightPublisher, receivers: list[Peer]) -> None:
    """Join the group with a generous wait: a receiver may still be starting (the first one
    starts the fork server, which imports torch for seconds).
    Checks that every receiver took the publisher's route."""
    for peer in receivers:
        peer.send("connect", REPLY_S)
    publisher.connect(REPLY_S)
    for peer in receivers:
        assert peer.reply() == ("ok", None, [])
    expected = list(range(1, publisher.spec.world_size)) if publisher.spec.shared_memory else []
    assert publisher.shared_memory_ranks == expected


def publish_to(publisher: TorchWeightPublisher, receivers: list[Peer], version: int) -> None:
    for peer in receivers:
        peer.send("receive", REPLY_S)
    publisher.publish(model_weights(version), version)
    for peer in receivers:
        assert peer.reply() == ("ok", version, [])


def go_on_without_rank_2(publisher: TorchWeightPublisher, survivor: Peer, version: int) -> None:
    """After rank 2 failed an update: the bus refuses work until reformed, then the next
    generation (of world size 2, rank 1 the survivor) delivers ``version``."""
    with pytest.raises(WeightSyncError, match="reform"):
        publisher.publish(model_weights(version), version)
    spec = publisher.reform(world_size=2)
    assert spec.generation == 1 and spec.world_size == 2
    survivor.send("reform", (spec, 1))
    assert survivor.reply()[0] == "ok"
    publish_to(publisher, [survivor], version)


@pytest.mark.timeout(60)
def test_two_receivers_get_every_version_bit_exact(peers, route):
    publisher = make_publisher(3, route)
    peers += [Peer(publisher.spec, 1), Peer(publisher.spec, 2)]
    connect_all(publisher, peers)
    for version in (1, 2, 3):
        for peer in peers:
            peer.send("receive", REPLY_S)
        stats = publisher.publish(model_weights(version), version)
        assert [peer.reply() for peer in peers] == [("ok", version, [])] * 2
        assert stats.num_buckets >= 5 and stats.num_tensors == len(model_weights(version))
        # the route each receiver took, as the sync's metrics report it
        assert (stats.shm_receivers, stats.bus_receivers) == ((2, 0) if route == "shm" else (0, 2))
    with pytest.raises(ValueError, match="version"):
        publisher.publish(model_weights(2), 2)
    publisher.close()


@pytest.mark.timeout(90)
def test_a_publish_that_does_not_wait_returns_once_sent_and_is_confirmed_later(peers, route):
    """publish(wait=False) returns once the bytes are out (the caller may then change its
    tensors), while the receivers still "reload"; confirm() waits for them, and a publish
    confirms the update before it first."""
    publisher = make_publisher(3, route)
    peers += [Peer(publisher.spec, 1), Peer(publisher.spec, 2)]
    connect_all(publisher, peers)
    for peer in peers:
        peer.send("stream slowly", REPLY_S)
    weights = model_weights(1)
    start = time.monotonic()
    stats = publisher.publish(weights, 1, wait=False)
    assert time.monotonic() - start < SLOW_RELOAD_S and publisher.unconfirmed_version == 1
    for tensor in weights.values():  # the caller trains on: the receivers still get version 1
        tensor.zero_()
    publisher.confirm()
    assert time.monotonic() - start >= SLOW_RELOAD_S and publisher.unconfirmed_version is None
    assert [peer.reply() for peer in peers] == [("ok", 1, [])] * 2
    assert stats.version == 1 and stats.num_buckets >= 5

    for peer in peers:  # two updates: the second publish first confirms the one before
        peer.send("stream slowly", REPLY_S)
        peer.send("stream slowly", REPLY_S)
    publisher.publish(model_weights(2), 2, wait=False)
    publisher.publish(model_weights(3), 3)
    assert publisher.unconfirmed_version is None
    assert [peer.reply() for peer in peers for _ in range(2)] == [("ok", 2, []), ("ok", 3, [])] * 2
    publisher.close()


@pytest.mark.timeout(60)
def test_a_receiver_that_dies_before_confirming_fails_the_confirm_naming_it(peers, route):
    publisher = make_publisher(3, route)
    survivor, doomed = Peer(publisher.spec, 1), Peer(publisher.spec, 2)
    peers += [survivor, doomed]
    connect_all(publisher, peers)
    survivor.send("stream", REPLY_S)
    doomed.send("stream and exit", REPLY_S)
    publisher.publish(model_weights(1), 1, wait=False)
    start = time.monotonic()
    with pytest.raises(WeightSyncError) as failure:
        publisher.confirm()
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S
    assert (failure.value.version, failure.value.peers) == (1, [2])
    assert survivor.reply()[:2] == ("ok", 1)
    go_on_without_rank_2(publisher, survivor, 2)
    publisher.close()


@pytest.mark.timeout(60)
def test_peer_dying_mid_broadcast_raises_then_reform_without_it(peers, route):
    publisher = make_publisher(3, route)
    survivor, doomed = Peer(publisher.spec, 1), Peer(publisher.spec, 2, dies=True)
    peers += [survivor, doomed]
    connect_all(publisher, peers)
    publish_to(publisher, peers, 1)

    survivor.send("receive", REPLY_S)
    doomed.send("receive", REPLY_S)
    start = time.monotonic()
    with pytest.raises(WeightSyncError) as failure:
        publisher.publish(model_weights(2), 2)
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S
    assert (failure.value.version, failure.value.generation, failure.value.peers) == (2, 0, [2])
    doomed.process.join(10)
    assert doomed.process.exitcode == 17
    status, version, _ = survivor.reply()  # it either got all of version 2 or saw the group break
    assert (status, version) in (("ok", 2), ("error", 2))
    go_on_without_rank_2(publisher, survivor, 3)
    publisher.close()


@pytest.mark.timeout(60)
def test_restarted_peer_rejoins_in_a_new_generation(peers, route):
    publisher = make_publisher(3, route)
    first, second = Peer(publisher.spec, 1), Peer(publisher.spec, 2)
    peers += [first, second]
    connect_all(publisher, peers)
    publish_to(publisher, peers, 1)

    second.process.kill()
    second.process.join(10)
    first.send("receive", REPLY_S)
    start = time.monotonic()
    with pytest.raises(WeightSyncError) as failure:
        publisher.publish(model_weights(2), 2)
    assert time.monotonic() - start < TIMEOUT_S + SLACK_S
    assert (failure.value.version, failure.value.peers) == (2, [2])
    assert first.reply()[0] in ("ok", "error")

    spec = publisher.reform()  # same world size: rank 2 comes back as a new process
    restarted = Peer(spec, 2)
    peers.append(restarted)
    first.send("reform", (spec, 1))
    assert first.reply()[0] == "ok"
    connect_all(publisher, [first, restarted])
    publish_to(publisher, [first, restarted], 2)  # resend of the version that failed
    publish_to(publisher, [first, restarted], 3)
    publisher.close()


@pytest.mark.timeout(60)
def test_a_receiver_follows_a_new_publisher_on_the_same_port(peers):
    """A publisher closed and another started on its port (a new weight sender for the same
    engines): the receiver joins the new one's store, not the closed one's connection."""
    first = make_publisher(2, "bus")
    peer = Peer(first.spec, 1)
    peers.append(peer)
    connect_all(first, [peer])
    publish_to(first, [peer], 1)
    port, session = first.spec.port, first.spec.session
    first.close()
    del first
    gc.collect()  # the closed store's server goes with the object
    second = make_publisher(2, "bus", port=port)
    assert second.spec.port == port and second.spec.session != session
    peer.send("reform", (second.spec, 1))
    assert peer.reply()[0] == "ok"
    connect_all(second, [peer])
    publish_to(second, [peer], 2)
    second.close()


@pytest.mark.timeout(60)
def test_peer_that_never_joins_times_out_naming_it_and_connect_can_be_retried(peers):
    publisher = make_publisher(2, "shm")
    start = time.monotonic()
    with pytest.raises(WeightSyncError) as failure:
        publisher.publish(model_weights(1), 1)
    assert TIMEOUT_S - 0.5 < time.monotonic() - start < TIMEOUT_S + SLACK_S
    assert failure.value.peers == [1] and failure.value.version == 1

    peers.append(Peer(publisher.spec, 1))  # the late peer arrives: same generation, no reform needed
    connect_all(publisher, peers)
    publish_to(publisher, peers, 1)
    publisher.close()


@pytest.mark.timeout(60)
def test_peer_that_stops_receiving_times_out_naming_it(peers, route):
    publisher = make_publisher(2, route, timeout_s=SHORT_TIMEOUT_S)
    idle = Peer(publisher.spec, 1)
    peers.append(idle)
    connect_all(publisher, [idle])  # it joins the group, then never calls receive
    start = time.monotonic()
    with pytest.raises(WeightSyncError) as failure:
        publisher.publish(model_weights(1), 1)
    assert time.monotonic() - start < SHORT_TIMEOUT_S + SLACK_S
    assert failure.value.peers == [1] and failure.value.version == 1
    publisher.close()


@pytest.mark.timeout(60)
def test_streamed_tensors_arrive_bit_exact_and_are_made_bucket_by_bucket(peers, route):
    import weakref

    from rlpost.transport import StreamedTensors

    publisher = make_publisher(2, route)
    peers.append(Peer(publisher.spec, 1))
    connect_all(publisher, peers)
    # a model of several dtypes (the receiver checks every tensor bit for bit)
    weights = model_weights(1)
    specs = tuple((name, t.dtype, tuple(t.shape)) for name, t in weights.items())
    peers[0].send("receive", REPLY_S)
    stats = publisher.publish(StreamedTensors(specs, lambda: iter(weights.items())), 1)
    assert peers[0].reply() == ("ok", 1, []) and stats.num_tensors == len(weights)

    # one dtype (a learner's weights): each tensor is made when its bucket is filled, so only
    # about a bucket's worth (here 2 tensors of 0.4 MB in 1 MB buckets) exists at a time
    alive, most = [], [0]

    def produce():
        for name, tensor in model_weights(2).items():
            most[0] = max(most[0], sum(ref() is not None for ref in alive))
            made = tensor.clone()
            alive.append(weakref.ref(made))
            yield name, made
            del made

    specs = tuple((name, t.dtype, tuple(t.shape)) for name, t in model_weights(2).items())
    peers[0].send("receive", REPLY_S)
    publisher.publish(StreamedTensors(specs, produce), 2)
    assert peers[0].reply() == ("ok", 2, [])
    publisher.close()
    assert 0 < most[0] < len(specs) // 2, most[0]


@pytest.mark.timeout(60)
def test_a_streamed_receive_hands_over_every_tensor_and_a_failed_load_fails_the_update(peers, route):
    publisher = make_publisher(2, route)
    peers.append(Peer(publisher.spec, 1))
    connect_all(publisher, peers)
    for version in (1, 2):  # bit exact, in the sender's order, bucket after bucket
        peers[0].send("stream", REPLY_S)
        assert publisher.publish(model_weights(version), version).num_buckets >= 5
        assert peers[0].reply() == ("ok", version, [])

    # the loader fails on the first tensor: the update fails on both sides, naming the cause, and
    # the publisher acts on the receiver's report at once instead of waiting out its timeout
    peers[0].send("stream and fail", REPLY_S)
    start = time.monotonic()
    with pytest.raises(WeightSyncError) as failure:
        publisher.publish(model_weights(3), 3)
    assert time.monotonic() - start < TIMEOUT_S / 2, (time.monotonic() - start, str(failure.value))
    assert failure.value.version == 3
    status, version, message = peers[0].reply()
    assert (status, version) == ("error", 3)
    assert "loading version 3 failed" in message and "these weights do not fit the model" in message
    # as after any failed sync, the next generation carries the update
    spec = publisher.reform(world_size=2)
    peers[0].send("reform", (spec, 1))
    assert peers[0].reply()[0] == "ok"
    peers[0].send("stream", REPLY_S)
    publisher.publish(model_weights(3), 3)
    assert peers[0].reply() == ("ok", 3, [])
    publisher.close()


@pytest.mark.timeout(60)
def test_a_receiver_that_declines_shared_memory_gets_the_same_bytes_over_the_bus(peers):
    publisher = make_publisher(3, "shm")
    on_shm = Peer(publisher.spec, 1)
    on_bus = Peer(dataclasses.replace(publisher.spec, shared_memory=False), 2)  # as on another node
    peers += [on_shm, on_bus]
    for peer in peers:
        peer.send("connect", REPLY_S)
    publisher.connect(REPLY_S)
    assert [peer.reply() for peer in peers] == [("ok", None, [])] * 2
    assert publisher.shared_memory_ranks == [1]
    for version in (1, 2):
        publish_to(publisher, peers, version)
    publisher.close()


@pytest.mark.timeout(60)
def test_a_bigger_update_grows_the_shared_segment_and_receivers_follow(peers):
    publisher = make_publisher(2, "shm")
    peers.append(Peer(publisher.spec, 1))
    connect_all(publisher, peers)
    small = {"scale": torch.tensor(1.0)}
    peers[0].send("receive", REPLY_S)
    publisher.publish(small, 1)
    assert peers[0].reply()[:2] == ("ok", 1)  # (its check is against the full model: not this one)
    first = publisher._segment.ref
    publish_to(publisher, peers, 2)
    assert publisher._segment.ref.nbytes > first.nbytes  # a new segment, mapped by the receiver
    publish_to(publisher, peers, 3)
    publisher.close()


@pytest.mark.timeout(60)
def test_a_dead_publisher_fails_a_shared_memory_receive_instead_of_hanging():
    ctx = process_context()
    specs, go = ctx.Queue(), ctx.Event()
    process = ctx.Process(target=publisher_that_dies, args=(specs, go), daemon=True)
    process.start()
    spec = specs.get(timeout=REPLY_S)
    receiver = TorchWeightReceiver(spec, 1)
    receiver.connect(REPLY_S)
    go.set()
    start = time.monotonic()
    with pytest.raises(WeightSyncError):
        receiver.receive(REPLY_S)
    assert time.monotonic() - start < REPLY_S
    process.join(10)
    receiver.close()


def publisher_that_dies(specs, go) -> None:
    """Connects one shared-memory receiver, announces an update, fills one bucket, then exits."""
    publisher = make_publisher(2, "shm")
    specs.put(publisher.spec)
    publisher.connect(REPLY_S)
    go.wait(REPLY_S)

    def first_bucket_then_exit(layout, tensors, seq, shared):
        publisher._group.keys.set(f"ready/{seq}/0", "1")
        os._exit(3)

    publisher._send = first_bucket_then_exit
    publisher.publish(model_weights(1), 1)
