import pytest

from rlpost.actors.buffer import buffer_capacity, staleness_cap
from rlpost.config import load_config
from rlpost.service.starter import role_bundles, role_plan

pytestmark = pytest.mark.unit


def test_role_plan_names_every_actor_with_its_resources():
    cfg = load_config("configs/gsm8k-qwen2.5-1.5b.yaml")
    plan = role_plan(cfg)
    assert [name for name, _ in plan] == [
        "inference-0",
        "inference-1",
        "learner",
        "reference",
        "env-pool-0",
        "env-pool-1",
    ]
    gpus = sum(role.num_gpus for _, role in plan)
    assert gpus == pytest.approx(3.1)  # 2 inference GPUs + the learner's + the reference's share


def test_the_demo_fits_two_cpu_cores_and_no_gpu():
    cfg = load_config("configs/tiny-cpu.yaml")
    plan = role_plan(cfg)
    assert sum(role.num_cpus for _, role in plan) + cfg.resources.buffer.num_cpus <= 2
    assert all(role.num_gpus == 0 for _, role in plan)


def test_buffer_bounds_follow_the_mode():
    sync = load_config("configs/tiny-cpu.yaml", ["trainer.prompts_per_step=8"])
    assert (buffer_capacity(sync), staleness_cap(sync)) == (8, 0)
    asynchronous = load_config(
        "configs/tiny-cpu.yaml", ["trainer.mode=async", "trainer.max_staleness=2", "trainer.prompts_per_step=8"]
    )
    assert (buffer_capacity(asynchronous), staleness_cap(asynchronous)) == (8 * 2, 2)


def test_custom_resources_go_in_each_bundle_of_their_role():
    from rlpost.config import load_config

    cfg = load_config("configs/tiny-cpu.yaml", ["rollout.num_inference_workers=2", "resources.inference.num_cpus=0",
                                                'resources.inference.resources={"rollout_slot": 1}'])  # fmt: skip
    bundles = dict(role_bundles(cfg))
    assert bundles["inference-0"] == bundles["inference-1"] == {"rollout_slot": 1.0}
    assert "rollout_slot" not in bundles["learner"]
    for bad in ('{"rollout_slot": 0}', '{"CPU": 1}'):
        with pytest.raises(ValueError, match="custom resources need positive amounts"):
            load_config("configs/tiny-cpu.yaml", [f"resources.inference.resources={bad}"])
