"""AsyncEnvPool's asynchronous API (TorchRL's): the step, step-and-reset and reset send/recv
pairs, which sub-env each row goes to, min_get / max_get / timeout, the env_index order of the
results, busy sub-envs, per-env sends, and the errors."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tensordict import TensorDict

from rlpost.envs.async_pool import AsyncEnvPool

pytestmark = pytest.mark.unit

WAIT_S = 10.0  # a bound on every wait of these tests: none should come near it


class GatedEnv:
    """A sub-env whose reset and step wait for its ``gate`` (open by default): the next
    observation is the action plus ``10 * index``; ``finished`` is set after each step."""

    def __init__(self, index: int, batch_size=(1,)) -> None:
        self.index = index
        self.batch_size = torch.Size(batch_size)
        self.gate, self.finished = threading.Event(), threading.Event()
        self.gate.set()
        self.steps = self.resets = 0
        self.fail = False

    def _flags(self):
        return {"done": torch.zeros(*self.batch_size, 1, dtype=torch.bool)}

    def reset(self, td=None):
        assert self.gate.wait(WAIT_S)
        self.resets += 1
        given = 0 if td is None or "start" not in td.keys() else td["start"]
        obs = torch.full((*self.batch_size, 1), 100 * self.index) + given
        return TensorDict({"obs": obs, **self._flags()}, batch_size=self.batch_size)

    def step(self, td):
        assert self.gate.wait(WAIT_S)
        if self.fail:
            raise ValueError(f"env {self.index} failed")
        assert "env_index" not in td.keys()  # the pool's bookkeeping is not the sub-env's input
        self.steps += 1
        td = td.clone()
        td.set("next", TensorDict({"obs": td["action"] + 10 * self.index, **self._flags()}, batch_size=td.batch_size))
        self.finished.set()
        return td

    def step_and_maybe_reset(self, td):
        td = self.step(td)
        return td, td["next"].clone()


def make_pool(num_envs=4, sub_batch=(1,), **kwargs):
    envs = []

    def maker():
        envs.append(GatedEnv(len(envs), batch_size=sub_batch))
        return envs[-1]

    pool = AsyncEnvPool([maker] * num_envs, timeout_s=WAIT_S, **kwargs)
    return pool, envs


def wait_done(pool, count):
    """Wait until ``count`` of the pool's batch sends are done (their results not received)."""
    deadline = time.monotonic() + WAIT_S
    while sum(future.done() for future in list(pool._pending)) < count:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def actions(rows):
    """A step input of ``len(rows)`` rows whose actions are ``rows``."""
    return TensorDict({"action": torch.tensor(rows).view(-1, 1)}, batch_size=[len(rows)])


def close_gates(envs, *indices):
    for i in indices:
        envs[i].gate.clear()


def test_step_recv_returns_at_least_min_get_in_env_index_order():
    pool, envs = make_pool()
    close_gates(envs, 0, 1, 2, 3)
    pool.async_step_send(actions([0, 1, 2, 3]))
    envs[3].gate.set()
    assert envs[3].finished.wait(WAIT_S)  # env 3 finishes first, then env 1
    envs[1].gate.set()
    assert envs[1].finished.wait(WAIT_S)
    out = pool.async_step_recv(min_get=2)
    assert out.batch_size == (2,)
    assert out["env_index"].tolist() == [1, 3]  # sorted by env_index, not completion order
    assert out["next", "obs"].view(-1).tolist() == [1 + 10, 3 + 30]  # each row its own env's result
    assert "env_index" not in out["next"].keys()
    envs[0].gate.set()
    envs[2].gate.set()
    rest = pool.async_step_recv(min_get=2)
    assert rest["env_index"].tolist() == [0, 2]
    with pytest.raises(RuntimeError, match="no step is running"):
        pool.async_step_recv()
    pool.close()


def test_recv_defaults_to_min_get_one_and_takes_every_result_already_done():
    pool, envs = make_pool(3)
    assert pool.min_get == 1 and pool.num_envs == 3
    pool.async_step_send(actions([5, 6, 7]))
    wait_done(pool, 3)
    out = pool.async_step_recv()  # min_get=1, but all three are done
    assert out["env_index"].tolist() == [0, 1, 2]
    assert out["next", "obs"].view(-1).tolist() == [5, 16, 27]
    pool.close()


def test_recv_of_more_than_are_pending_raises():
    pool, envs = make_pool(2)
    pool.async_step_send(actions([0, 0]))
    with pytest.raises(RuntimeError, match="cannot await 3 steps when only 2 are running"):
        pool.async_step_recv(min_get=3)
    with pytest.raises(ValueError, match="min_get must be positive"):
        pool.async_step_recv(min_get=0)
    with pytest.raises(ValueError, match="max_get"):
        pool.async_step_recv(min_get=2, max_get=1)
    with pytest.raises(ValueError, match="timeout must be non-negative"):
        pool.async_step_recv(timeout=-1.0)
    assert pool.async_step_recv(min_get=2)["env_index"].tolist() == [0, 1]  # still pending after the errors
    pool.close()


def test_max_get_leaves_the_other_results_for_the_next_recv():
    pool, envs = make_pool(3)
    pool.async_step_send(actions([0, 0, 0]))
    wait_done(pool, 3)
    first = pool.async_step_recv(min_get=1, max_get=2)
    assert first["env_index"].tolist() == [0, 1]  # the lowest env indices first
    assert pool.async_step_recv()["env_index"].tolist() == [2]
    pool.close()


def test_timeout_waits_for_more_results_after_the_first():
    pool, envs = make_pool(2)
    close_gates(envs, 1)
    pool.async_step_send(actions([0, 0]))
    threading.Timer(0.2, envs[1].gate.set).start()
    out = pool.async_step_recv(min_get=1, timeout=WAIT_S)  # env 1 ends 0.2 s after env 0
    assert out["env_index"].tolist() == [0, 1]
    close_gates(envs, 1)
    pool.async_step_send(actions([0, 0]))
    assert envs[0].finished.wait(WAIT_S)
    out = pool.async_step_recv(min_get=1, timeout=0.05)  # env 1 does not end in time
    assert out["env_index"].tolist() == [0]
    envs[1].gate.set()
    assert pool.async_step_recv()["env_index"].tolist() == [1]
    pool.close()


def test_a_second_send_to_a_busy_env_raises_until_its_result_is_received():
    pool, envs = make_pool(3)
    pool.async_step_send(actions([0, 0]).set("env_index", torch.tensor([0, 1])))
    assert envs[0].finished.wait(WAIT_S) and envs[1].finished.wait(WAIT_S)
    # done, but not received yet: still busy (TorchRL's busy set)
    with pytest.raises(RuntimeError, match=r"still processing a step: sub-envs \[1\]"):
        pool.async_step_send(actions([0, 0]).set("env_index", torch.tensor([1, 2])))
    with pytest.raises(RuntimeError, match="still processing a step"):
        pool.async_step_and_maybe_reset_send(actions([0]).set("env_index", torch.tensor([0])))
    with pytest.raises(RuntimeError, match="still processing a step"):
        pool.step(actions([0, 0, 0]))
    with pytest.raises(RuntimeError, match="still processing a step"):
        pool.reset()
    pool.async_step_send(actions([7]).set("env_index", torch.tensor([2])))  # env 2 is free
    assert pool.async_step_recv(min_get=3)["env_index"].tolist() == [0, 1, 2]
    pool.async_step_send(actions([0, 0, 0]))  # all free again
    assert pool.async_step_recv(min_get=3).batch_size == (3,)
    assert [env.steps for env in envs] == [2, 2, 2]
    pool.close()


def test_env_index_argument_and_single_rows():
    pool, envs = make_pool(3)
    pool.async_step_send(actions([1, 2]), env_index=[2, 0])  # row 0 -> env 2, row 1 -> env 0
    out = pool.async_step_recv(min_get=2)
    assert out["env_index"].tolist() == [0, 2] and out["next", "obs"].view(-1).tolist() == [2, 21]
    # one row that says its env (TorchRL's docstring example: s0["env_index"] = 0; send(s0))
    row = TensorDict({"action": torch.tensor([4]), "env_index": torch.tensor(1)}, batch_size=[])
    pool.async_step_send(row)
    out = pool.async_step_recv()
    assert out.batch_size == (1,) and out["env_index"].tolist() == [1] and out["next", "obs"].item() == 14
    pool.close()


def test_per_env_send_and_recv():
    pool, envs = make_pool(3)
    close_gates(envs, 2)
    pool.async_step_send(TensorDict({"action": torch.tensor([3])}, batch_size=[]), env_index=2)
    pool.async_step_send(actions([0]), env_index=[0])
    with pytest.raises(RuntimeError, match="cannot await 2 steps when only 1 are running"):
        pool.async_step_recv(min_get=2)  # only env 0's step is a batch send's
    with pytest.raises(RuntimeError, match="still processing a step"):
        pool.async_step_send(actions([0]), env_index=2)  # rlpost: a busy env refuses a per-env send too
    assert pool.async_step_recv()["env_index"].tolist() == [0]
    envs[2].gate.set()
    row = pool.async_step_recv(env_index=2)
    assert row.batch_size == () and row["env_index"].item() == 2 and row["next", "obs"].item() == 23
    with pytest.raises(RuntimeError, match="sub-env 2 has no step of its own running"):
        pool.async_step_recv(env_index=2)
    pool.async_step_and_maybe_reset_send(actions([1]), env_index=1)
    step, root = pool.async_step_and_maybe_reset_recv(env_index=1)
    assert step["env_index"].item() == root["env_index"].item() == 1 and root["obs"].item() == 11
    pool.async_reset_send(env_index=0)
    reset = pool.async_reset_recv(env_index=0)
    assert reset.batch_size == () and reset["obs"].item() == 0
    pool.close()


def test_step_and_maybe_reset_pair():
    pool, envs = make_pool(3)
    close_gates(envs, 0)
    pool.async_step_and_maybe_reset_send(actions([1, 2, 3]))
    assert envs[1].finished.wait(WAIT_S) and envs[2].finished.wait(WAIT_S)
    step, root = pool.async_step_and_maybe_reset_recv(min_get=2)
    assert step["env_index"].tolist() == root["env_index"].tolist() == [1, 2]
    assert root["obs"].view(-1).tolist() == [12, 23]
    envs[0].gate.set()
    step, root = pool.async_step_and_maybe_reset_recv(min_get=5)  # rlpost: all that are pending
    assert step["env_index"].tolist() == [0]
    step, root = pool.step_and_maybe_reset(actions([0, 0, 0]))
    assert step["env_index"].tolist() == [0, 1, 2] and root["obs"].view(-1).tolist() == [0, 10, 20]
    pool.close()


def test_reset_pair():
    pool, envs = make_pool(4)
    close_gates(envs, 3)
    pool.async_reset_send(TensorDict({"start": torch.tensor([[1], [2], [3]])}, batch_size=[3]), env_index=[3, 2, 1])
    assert pool.async_reset_recv(min_get=2)["env_index"].tolist() == [1, 2]
    with pytest.raises(RuntimeError, match="cannot await 2 resets when only 1 are running"):
        pool.async_reset_recv(min_get=2)
    envs[3].gate.set()
    out = pool.async_reset_recv()
    assert out["env_index"].tolist() == [3] and out["obs"].item() == 301
    pool.async_reset_send()  # every sub-env, no input
    out = pool.async_reset_recv(min_get=4)
    assert out["obs"].view(-1).tolist() == [0, 100, 200, 300] and [env.resets for env in envs] == [1, 2, 2, 2]
    with pytest.raises(RuntimeError, match="no reset is running"):
        pool.async_reset_recv()
    with pytest.raises(ValueError, match="needs a tensordict"):
        pool.async_step_send(None)
    pool.close()


def test_bad_env_indices():
    pool, _ = make_pool(2)
    with pytest.raises(ValueError, match="out of range"):
        pool.async_step_send(actions([0]), env_index=[2])
    with pytest.raises(ValueError, match="name a sub-env twice"):
        pool.async_step_send(actions([0, 0]), env_index=[1, 1])
    with pytest.raises(ValueError, match="2 env indices for a batch of 1 rows"):
        pool.async_step_send(actions([0]), env_index=[0, 1])
    with pytest.raises(ValueError, match="needs 'env_index'"):
        pool.async_step_send(actions([0, 0, 0]))
    pool.async_step_send(actions([0, 0]))  # nothing was left busy by the refused sends
    assert pool.async_step_recv(min_get=2).batch_size == (2,)
    pool.close()


def test_a_failing_env_raises_at_recv_and_is_free_again():
    pool, envs = make_pool(2)
    envs[1].fail = True
    pool.async_step_send(actions([0, 0]), env_index=[1, 0])
    with pytest.raises(ValueError, match="env 1 failed"):
        pool.async_step_recv(min_get=2)
    envs[1].fail = False
    pool.async_step_send(actions([0, 0]))
    assert pool.async_step_recv(min_get=2)["env_index"].tolist() == [0, 1]
    pool.close()


def test_a_stuck_env_times_out_and_can_be_received_later():
    pool, envs = make_pool(2)
    pool.timeout_s = 0.1
    close_gates(envs, 1)
    pool.async_step_send(actions([0, 0]))
    with pytest.raises(TimeoutError, match=r"sub-envs \[1\] did not finish"):
        pool.async_step_recv(min_get=2)
    envs[1].gate.set()
    pool.timeout_s = WAIT_S
    assert pool.async_step_recv(min_get=2)["env_index"].tolist() == [0, 1]
    pool.close()


def test_unbatched_sub_envs_and_dense_stack():
    pool, envs = make_pool(2, sub_batch=(), stack="dense")
    assert pool.batch_size == (2,)
    td = pool.reset()
    assert td["obs"].view(-1).tolist() == [0, 100]
    pool.async_step_send(TensorDict({"action": torch.tensor([[1], [2]])}, batch_size=[2]))
    out = pool.async_step_recv(min_get=2)
    assert isinstance(out, TensorDict) and out["next", "obs"].view(-1).tolist() == [1, 12]
    pool.async_step_send(TensorDict({"action": torch.tensor([5])}, batch_size=[]), env_index=1)
    assert pool.async_step_recv(env_index=1)["next", "obs"].item() == 15
    pool.close()


def test_multiprocessing_backend_is_refused_on_purpose():
    with pytest.raises(ValueError, match="backend='threading' only.*on purpose"):
        AsyncEnvPool([lambda: GatedEnv(0)], backend="multiprocessing")
