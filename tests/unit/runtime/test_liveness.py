"""The watchdog's pure parts: an actor's work sections and progress (rlpost.runtime.liveness), each role's
deadlines and the verdicts drawn from a heartbeat (rlpost.service.watchdog)."""

import threading
import time

import pytest

from rlpost.config import JobConfig, RoleDeadlines
from rlpost.runtime import liveness
from rlpost.service.watchdog import role_of, verdict

pytestmark = pytest.mark.unit


def test_an_idle_process_is_never_stalled():
    report = liveness.report()
    assert report["working"] == [] and report["stalled_s"] == 0.0
    assert isinstance(report["pid"], int)


def test_work_without_progress_grows_stalled_and_progress_resets_it():
    with liveness.working("train_step"):
        time.sleep(0.05)
        first = liveness.report()
        assert first["working"] == ["train_step"] and first["stalled_s"] >= 0.05
        liveness.progress()
        assert liveness.report()["stalled_s"] < 0.05
    after = liveness.report()
    assert after["working"] == [] and after["stalled_s"] == 0.0


def test_nested_sections_count_as_the_outer_one_and_threads_each_open_their_own():
    entered, release = threading.Event(), threading.Event()

    def other_thread():
        with liveness.working("generate"):
            entered.set()
            release.wait(5)

    thread = threading.Thread(target=other_thread)
    thread.start()
    entered.wait(5)
    with liveness.working("score"), liveness.working("inner"):
        assert liveness.report()["working"] == ["generate", "score"]
    assert liveness.report()["working"] == ["generate"]
    release.set()
    thread.join(5)
    assert liveness.report()["working"] == []


def test_a_section_left_by_an_error_is_closed():
    with pytest.raises(RuntimeError), liveness.working("save_checkpoint"):
        raise RuntimeError("disk full")
    assert liveness.report()["working"] == []


def test_role_of_maps_actor_names_to_the_watchdog_sections():
    cfg = JobConfig().watchdog
    names = ["inference-0", "inference-12", "env-pool-3", "learner", "learner-2", "reference", "reward", "buffer",
             "control"]  # fmt: skip
    roles = [role_of(name) for name in names]
    assert roles == ["inference", "inference", "env_pool", "learner", "learner", "reference", "reward", "buffer",
                     "control"]  # fmt: skip
    assert all(isinstance(getattr(cfg, role), RoleDeadlines) for role in roles)


def test_the_default_deadlines_leave_long_work_room():
    cfg = JobConfig().watchdog
    assert cfg.enabled and cfg.interval_s == 2.0
    assert (cfg.inference.answer_s, cfg.inference.progress_s) == (30.0, 300.0)
    assert (cfg.learner.answer_s, cfg.learner.progress_s) == (120.0, 900.0)
    assert cfg.env_pool.progress_s is None and cfg.buffer.progress_s is None and cfg.control.progress_s is None


DEADLINES = RoleDeadlines(answer_s=30.0, progress_s=300.0)


def test_silence_past_answer_s_is_frozen():
    assert verdict(DEADLINES, now=100.0, waiting_since=75.0, reply=None) is None
    why = verdict(DEADLINES, now=100.0, waiting_since=69.0, reply=None)
    assert why.startswith("frozen: no answer to its heartbeat for 31 s") and "answer_s=30" in why


def test_work_without_progress_past_progress_s_is_hung_and_answers_alone_are_not():
    busy = {"pid": 1, "working": ["generate"], "stalled_s": 301.0}
    why = verdict(DEADLINES, now=100.0, waiting_since=None, reply=busy)
    assert why.startswith("hung: its work (generate) made no progress for 301 s") and "progress_s=300" in why
    assert verdict(DEADLINES, now=100.0, waiting_since=None, reply={**busy, "stalled_s": 299.0}) is None
    # the same answer from a role judged by its answers alone
    assert verdict(RoleDeadlines(answer_s=30.0), now=100.0, waiting_since=None, reply=busy) is None
    # an idle actor's answer: nothing is working, however long ago the last progress was
    assert verdict(DEADLINES, now=100.0, waiting_since=None, reply={"working": [], "stalled_s": 0.0}) is None


def test_watchdog_config_refuses_non_positive_deadlines():
    from rlpost.config import load_config

    with pytest.raises(ValueError, match=r"watchdog\.inference\.answer_s"):
        load_config(None, ["watchdog.inference.answer_s=0"])
