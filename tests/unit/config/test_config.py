import pytest
import yaml

from rlpost.config import ConfigError, JobConfig, load_config, save_config, section_type

pytestmark = pytest.mark.unit

REPO_CONFIGS = [
    "configs/tiny-cpu.yaml",
    "configs/gsm8k-qwen2.5-1.5b.yaml",
    "configs/tiny-cpu-reasoning-gym.yaml",
    "configs/tiny-cpu-code.yaml",
    "configs/tiny-cpu-reward-model.yaml",
    "configs/tiny-cpu-cispo.yaml",
]


def write(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", REPO_CONFIGS)
def test_shipped_configs_validate_and_round_trip(name, tmp_path):
    cfg = load_config(name)
    out = save_config(cfg, tmp_path / "config.yaml")
    again = load_config(out)
    assert again == cfg
    assert again.model_dump() == cfg.model_dump()


def test_gsm8k_recipe_values_follow_published_grpo_recipes():
    cfg = load_config("configs/gsm8k-qwen2.5-1.5b.yaml")
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-1.5B-Instruct"
    assert cfg.data.dataset == "openai/gsm8k" and cfg.data.task == "gsm8k"
    assert 8 <= cfg.data.group_size <= 16
    assert 1e-6 <= cfg.optimizer.lr <= 1e-5
    assert (cfg.loss.clip_eps_low, cfg.loss.clip_eps_high) == (0.2, 0.28)
    assert cfg.rollout.temperature == 1.0


def test_defaults_are_a_valid_job():
    cfg = load_config(None)
    assert cfg.data.group_size == 8
    assert cfg.samples_per_step == cfg.trainer.prompts_per_step * cfg.data.group_size


def test_every_field_has_a_description():
    def walk(model, prefix):
        for name, field in model.model_fields.items():
            assert field.description, f"{prefix}{name} has no description"
            section = section_type(field.annotation)  # optional sections too (model.lora)
            if section is not None:
                walk(section, f"{prefix}{name}.")

    walk(JobConfig, "")


def test_overrides_apply_with_types(tmp_path):
    path = write(tmp_path, "trainer:\n  steps: 5\n")
    cfg = load_config(
        path,
        [
            "trainer.steps=20",
            "rollout.temperature=0.7",
            "optimizer.betas=[0.9, 0.95]",
            "reference.enabled=true",
            "rollout.engine.extra.swap_space=2",
        ],
    )
    assert cfg.trainer.steps == 20 and isinstance(cfg.trainer.steps, int)
    assert cfg.rollout.temperature == 0.7
    assert cfg.optimizer.betas == (0.9, 0.95)
    assert cfg.reference.enabled is True
    assert cfg.rollout.engine.extra == {"swap_space": 2}


@pytest.mark.parametrize(
    "text, overrides, expected",
    [
        ("trainer:\n  stepz: 3\n", [], "unknown config key: trainer.stepz"),
        ("", ["resources.inference.num_threads=2"], "unknown config key: resources.inference.num_threads"),
        ("", ["resources.learner.num_threads=0"], "resources.learner.num_threads: Input should be greater than"),
        ("rollout:\n  engine:\n    tp: 2\n", [], "unknown config key: rollout.engine.tp"),
        ("bogus: {}\n", [], "unknown config key: bogus"),
        ("", ["trainer.stepz=3"], "unknown config key: trainer.stepz"),
        ("", ["model.name_or_path.x=3"], "unknown config key: model.name_or_path.x"),
        ("trainer:\n  steps: abc\n", [], "trainer.steps: Input should be a valid integer"),
        ("", ["trainer.mode=fast"], "trainer.mode: Input should be 'sync' or 'async'"),
        ("", ["rollout.temperature=0"], "rollout.temperature: Input should be greater than 0"),
        ("", ["trainer.steps"], "is not of the form section.key=value"),
        ("- a\n- b\n", [], "the top level must be a mapping"),
        ("trainer: [\n", [], "invalid YAML"),
    ],
)
def test_errors_name_the_key(tmp_path, text, overrides, expected):
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("(", r"\(")):
        load_config(write(tmp_path, text), overrides)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["data.group_size=1"], "data.group_size is 1"),
        (["data.task=gsm8k"], "data.dataset is required for data.task=gsm8k"),
        (["data.task=custom", "data.dataset=x.jsonl"], "data.reward_fn is required"),
        (["rollout.num_env_pools=3", "trainer.prompts_per_step=8"], r"prompts_per_step \(8\) must be divisible"),
        (["optimizer.grad_accumulation=5"], r"grad_accumulation \(5\) must divide the samples per step"),
        (["reference.kl_coef=0.1"], "reference.enabled is false"),
        (
            ["reference.enabled=true", "reference.kl_in=reward", "loss.type=dapo"],
            "loss.filter_equal_rewards with reference.kl_in=reward",
        ),
        (["weight_sync.backend=nccl"], "weight_sync.backend=nccl needs GPUs"),
        (["rollout.max_tokens=600"], "must be below rollout.engine.max_model_len"),
    ],
)
def test_cross_field_checks(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config("configs/tiny-cpu.yaml", overrides)


def test_batch_scaled_advantages_go_with_the_kl_in_the_reward():
    # each env pool has its batch penalised by the reference actor, then scales over that batch
    cfg = load_config(
        "configs/tiny-cpu.yaml", ["reference.enabled=true", "reference.kl_in=reward", "loss.advantage_scale=batch"]
    )
    assert (cfg.reference.kl_in, cfg.loss.advantage_scale) == ("reward", "batch")


def test_missing_file_names_it(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_saved_config_is_complete_yaml(tmp_path):
    cfg = load_config("configs/tiny-cpu.yaml")
    data = yaml.safe_load(save_config(cfg, tmp_path / "c.yaml").read_text())
    assert set(data) == set(JobConfig.model_fields)
    assert data["trainer"]["steps"] == cfg.trainer.steps


def test_a_custom_loss_is_checked_before_any_actor_starts(tmp_path):
    from rlpost.service.preflight import check_custom_loss

    with pytest.raises(ConfigError, match="loss.custom_fn: loss function 'reinforce' is not of the form"):
        check_custom_loss(load_config(None, ["loss.custom_fn=reinforce"]))  # no module
    cfg = load_config(None, ["loss.custom_fn=no_such_module_xyz:reinforce"])
    with pytest.raises(ConfigError, match="loss.custom_fn: .*cannot import module 'no_such_module_xyz'"):
        check_custom_loss(cfg)
    check_custom_loss(load_config(None, ["loss.custom_fn=rlpost.algo:grpo_loss"]))  # importable: fine


def test_relative_local_paths_resolve_against_the_given_directory(tmp_path, monkeypatch):
    from rlpost.config import resolve_local_paths
    from rlpost.ops.cli import _resolve_paths_for_a_cluster

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    (tmp_path / "model").mkdir()

    def job():
        return load_config(None, ["data.task=custom", "data.dataset=data/rows.jsonl", "data.reward_fn=x:y",
                                  "model.name_or_path=model", "model.tokenizer=Qwen/Qwen2.5-0.5B",
                                  "model.chat_template={{ messages }}", "eval.dataset=/abs/eval.jsonl"])  # fmt: skip

    cfg = job()
    resolved = resolve_local_paths(cfg, tmp_path)
    assert resolved == {"model.name_or_path": ("model", str(tmp_path / "model")),
                        "data.dataset": ("data/rows.jsonl", str(tmp_path / "data" / "rows.jsonl"))}  # fmt: skip
    assert cfg.data.dataset == str(tmp_path / "data" / "rows.jsonl") and cfg.model.name_or_path == str(
        tmp_path / "model"
    )
    # a hub name, an inline template and an absolute path are left as written
    assert (cfg.model.tokenizer, cfg.model.chat_template, cfg.eval.dataset) == (
        "Qwen/Qwen2.5-0.5B", "{{ messages }}", "/abs/eval.jsonl")  # fmt: skip

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    cfg = job()
    _resolve_paths_for_a_cluster(cfg)  # a local run: its actors start here
    assert cfg.data.dataset == "data/rows.jsonl"
    cfg.resources.address = "10.0.0.1:6379"  # --address: they start elsewhere
    _resolve_paths_for_a_cluster(cfg)
    assert cfg.data.dataset == str(tmp_path / "data" / "rows.jsonl")
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", '{"runtime_env": {"working_dir": "/tmp/upload"}}')
    cfg = job()
    cfg.resources.address = "auto"  # rlpost submit's driver: its actors start in their copy of the working dir
    _resolve_paths_for_a_cluster(cfg)
    assert cfg.data.dataset == "data/rows.jsonl"


@pytest.mark.parametrize(
    "overrides,where",
    [
        ([], None),
        (["reference.kl_in=reward"], None),  # no reference actor: no KL anywhere, whatever kl_in says
        (["reference.enabled=true"], "loss"),
        (["reference.enabled=true", "reference.kl_in=reward"], "reward"),
    ],
)
def test_where_the_kl_goes_is_decided_once_from_enabled_and_kl_in(overrides, where):
    assert load_config("configs/tiny-cpu.yaml", overrides).reference.kl_goes_to == where
