"""The in-flight update's receive on a thread of the engine's worker process
(``_BackgroundReceive``): the bytes arrive while the caller goes on, the load happens on the
caller's thread, and the receive confirms only after it; every failure reaches both sides. A
stand-in receiver plays the bus (the real one, with a real engine, is in
tests/integration/actors/test_inference_worker.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from rlpost.policies.vllm_worker_ext import _BackgroundReceive

pytestmark = pytest.mark.unit


class StandInReceiver:
    """``receive_streamed`` as the bus's: the tensors once ``send`` is set, then ``consume``;
    the outcome ("done", or the error ``consume`` raised) is what the publisher would be told."""

    def __init__(self, version: int = 3):
        self.version, self.send, self.outcome = version, threading.Event(), None

    def receive_streamed(self, consume, timeout_s):
        if not self.send.wait(timeout_s):
            raise TimeoutError("no update announced")
        try:
            consume(self.version, iter([("w", torch.ones(2)), ("b", torch.zeros(1))]))
        except Exception as exc:
            self.outcome = exc
            raise
        self.outcome = "done"
        return self.version


def test_the_bytes_arrive_while_the_caller_goes_on_and_the_load_comes_before_the_confirmation():
    receiver = StandInReceiver()
    incoming = _BackgroundReceive(receiver, timeout_s=10)
    assert not incoming.arrived.wait(0.2)  # nothing sent: the caller is not held
    receiver.send.set()
    assert incoming.arrived.wait(5)
    assert receiver.outcome is None  # not confirmed before the load
    loaded = []
    assert incoming.load(lambda named: loaded.extend(name for name, _ in named)) == 2
    assert loaded == ["w", "b"] and receiver.outcome == "done" and incoming.version == 3


def test_a_failed_load_fails_the_receive_too():
    receiver = StandInReceiver()
    receiver.send.set()
    incoming = _BackgroundReceive(receiver, timeout_s=10)

    def broken(named):
        raise ValueError("half-loaded")

    with pytest.raises(ValueError, match="half-loaded"):
        incoming.load(broken)
    assert isinstance(receiver.outcome, ValueError)  # the publisher hears of it


def test_a_failed_receive_is_raised_by_the_load():
    incoming = _BackgroundReceive(StandInReceiver(), timeout_s=0.2)  # nothing is ever sent
    with pytest.raises(TimeoutError, match="no update announced"):
        incoming.load(lambda named: pytest.fail("nothing arrived to load"))


def test_an_update_that_arrived_but_was_never_loaded_can_be_given_up():
    receiver = StandInReceiver()
    receiver.send.set()
    incoming = _BackgroundReceive(receiver, timeout_s=10)
    assert incoming.arrived.wait(5)
    incoming.abandon()
    assert isinstance(receiver.outcome, RuntimeError) and "never loaded" in str(receiver.outcome)
