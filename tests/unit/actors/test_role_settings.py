"""Each role is given its own sections of the job config, and nothing else."""

import dataclasses
import pickle

import pytest
from pydantic import BaseModel

from rlpost.actors.buffer import BufferSettings
from rlpost.actors.env_pool import EnvPoolSettings
from rlpost.actors.inference import InferenceSettings
from rlpost.actors.learner import LearnerSettings
from rlpost.actors.reference import ReferenceSettings
from rlpost.config import JobConfig, load_config

pytestmark = pytest.mark.unit

SETTINGS = [BufferSettings, InferenceSettings, LearnerSettings, ReferenceSettings, EnvPoolSettings]


@pytest.fixture
def cfg() -> JobConfig:
    return load_config(
        "configs/tiny-cpu.yaml",
        [
            "logging.run_name=roles",
            "trainer.mode=async",
            "trainer.max_staleness=2",
            "resources.learner.num_threads=1",
            "resources.reference.num_cpus=0.75",
            "resources.env_pool.num_cpus=0.125",
            "resources.inference.num_gpus=0.5",
        ],
    )


@pytest.mark.parametrize("settings_class", SETTINGS, ids=lambda c: c.__name__)
def test_a_role_holds_no_whole_job_config(cfg, settings_class):
    settings = settings_class.from_job(cfg)
    values = [getattr(settings, f.name) for f in dataclasses.fields(settings)]
    assert not any(isinstance(v, JobConfig) for v in values)
    # every section it holds is the job config's own (the same values, not a copy that could drift)
    sections = {id(section) for section in _sections(cfg)}
    for value in values:
        if isinstance(value, BaseModel):
            assert id(value) in sections, f"{settings_class.__name__} holds a section that is not the job's"
    assert pickle.loads(pickle.dumps(settings)) == settings  # it travels to the actor's process
    assert settings.run_name == "roles"


def test_each_role_reads_the_sections_it_needs(cfg):
    learner = LearnerSettings.from_job(cfg)
    assert learner.resources is cfg.resources.learner and learner.resources.num_threads == 1
    assert (learner.loss, learner.optimizer, learner.reference) == (cfg.loss, cfg.optimizer, cfg.reference)
    reference = ReferenceSettings.from_job(cfg)
    assert reference.resources.num_cpus == 0.75 and reference.model is cfg.model
    pool = EnvPoolSettings.from_job(cfg)
    assert pool.resources.num_cpus == 0.125 and (pool.data, pool.tools) == (cfg.data, cfg.tools)
    inference = InferenceSettings.from_job(cfg)
    assert (inference.model_path, inference.dtype) == (cfg.model.name_or_path, cfg.model.dtype)
    assert inference.engine is cfg.rollout.engine and inference.resources.num_gpus == 0.5
    buffer = BufferSettings.from_job(cfg)
    assert (buffer.capacity, buffer.max_staleness) == (2 * cfg.trainer.prompts_per_step, 2)
    # none of them sees what is not its business, e.g. the Ray address or the trackers
    for settings in (learner, reference, pool, inference, buffer):
        assert not hasattr(settings, "logging") and not hasattr(settings, "weight_sync")


def _sections(model: BaseModel):
    """Every config section under ``model`` (sub-sections included)."""
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield value
            yield from _sections(value)
