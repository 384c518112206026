"""A job's run from its start to its end: the checks, Ray, the fleet and its supervisor, the
loop, and the restarts from the last checkpoint (``trainer.auto_resume``).

:func:`run_training` is what ``rlpost train`` and ``rlpost submit``'s job call; :func:`start_run`
starts a run's actors and their supervisor for a loop (:class:`~rlpost.service.loop.Controller`)
to drive.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from rlpost.config import JobConfig
from rlpost.record.run_dir import latest_checkpoint
from rlpost.runtime.ray_start import init_ray
from rlpost.runtime.shutdown import StopRequested, raise_if_stopping, stop_on_signals
from rlpost.service.evaluation import Evaluator
from rlpost.service.fleet import Fleet, ResumeNeeded
from rlpost.service.loop import Controller
from rlpost.service.preflight import check_job
from rlpost.service.run_state import RunState
from rlpost.service.supervisor import Supervisor

log = logging.getLogger("rlpost")

MAX_AUTO_RESUMES = 3  # restarts of a whole run from its last checkpoint (trainer.auto_resume)

__all__ = ["run_training", "run_with_auto_resume", "start_run"]


def run_training(cfg: JobConfig, run_dir: Path, resume: bool = False) -> int:
    """Run the job (``resume``: from its latest checkpoint); returns the exit code (0). With
    ``trainer.auto_resume`` a lost learner (or an actor lost with the state it needed) restarts
    the run from its last checkpoint. SIGTERM / Ctrl-C raise StopRequested at the loop's next
    safe point (rlpost.runtime.shutdown), after the final checkpoint."""
    import ray

    logging.basicConfig(level=logging.INFO, format="%(asctime)s rlpost %(levelname)s %(message)s")
    check_job(cfg)
    # the eval data is loaded now: a bad eval section fails before any actor starts
    evaluator = Evaluator(cfg) if cfg.eval.enabled else None
    started_ray = init_ray(cfg)
    # where the run's Ray cluster is (operators and tools attach to it: `ray.init(address=...)`)
    (Path(run_dir) / "ray_address").write_text(ray.get_runtime_context().gcs_address + "\n")
    try:
        # after ray.init: Ray installs a C++ SIGTERM handler there that aborts the driver (exit -6)
        with stop_on_signals():
            run_with_auto_resume(
                cfg, run_dir, resume, lambda again, resumes: _run_once(cfg, run_dir, again, resumes, evaluator)
            )
        return 0
    finally:
        if started_ray:
            ray.shutdown()


def run_with_auto_resume(cfg: JobConfig, run_dir: Path, resume: bool, run_once: Callable[[bool, int], None]) -> None:
    """``run_once(resume, learner_resumes)``; when it raises ResumeNeeded (the learner died) and
    ``trainer.auto_resume`` is on, run it again from the last checkpoint, at most
    MAX_AUTO_RESUMES times. Otherwise the error propagates, naming the resume command."""
    learner_resumes = 0
    while True:
        try:
            return run_once(resume, learner_resumes)
        except ResumeNeeded as exc:
            if not (cfg.trainer.auto_resume and learner_resumes < MAX_AUTO_RESUMES and latest_checkpoint(run_dir)):
                raise
            learner_resumes += 1
            log.warning("%s; auto_resume: restarting the run from its last checkpoint (%d of %d)", exc,
                        learner_resumes, MAX_AUTO_RESUMES)  # fmt: skip
            resume = True


def _run_once(cfg: JobConfig, run_dir: Path, resume: bool, learner_resumes: int,
              evaluator: Evaluator | None = None) -> None:  # fmt: skip
    supervisor = None
    try:
        supervisor = start_run(cfg, run_dir)
        raise_if_stopping()  # a stop asked while the actors started takes effect now
        controller = Controller(cfg, run_dir, supervisor, resume=resume, evaluator=evaluator)
        controller.learner_resumes = learner_resumes
        try:
            controller.run()
        except StopRequested:
            controller.checkpoint_on_stop()  # writes the stop's last metrics row
            raise
        finally:
            controller.writer.close()  # the trackers, after every row reached them
    finally:
        if supervisor is not None:
            supervisor.close()


def start_run(cfg: JobConfig, run_dir: Path) -> Supervisor:
    """Start every actor of the run and the supervisor that keeps them alive, its watchdog watching
    them (stop both with ``Supervisor.close()``)."""
    supervisor = Supervisor(cfg, run_dir, Fleet.start(cfg), RunState())
    supervisor.watch()
    return supervisor
