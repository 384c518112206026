import os
import subprocess
import sys

import pytest
import yaml

from rlpost.config import load_config
from rlpost.ops.cli import main
from rlpost.record.run_dir import create_run_dir

pytestmark = pytest.mark.unit


def run_cli(*args):
    env = {k: v for k, v in os.environ.items() if k != "RLPOST_SERVE_API_KEYS"}
    return subprocess.run([sys.executable, "-m", "rlpost.ops.cli", *args], capture_output=True, text=True, env=env)


@pytest.mark.parametrize("command", [[], ["train"], ["make-tiny-model"], ["check-config"], ["plot"], ["serve"]])
def test_help_on_every_command(command):
    out = run_cli(*command, "--help")
    assert out.returncode == 0
    assert "usage: rlpost" in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "missing.yaml"], "rlpost: error: config file not found: missing.yaml"),
        (["train", "configs/tiny-cpu.yaml", "trainer.stepz=1"], "rlpost: error: unknown config key: trainer.stepz"),
        (["train", "configs/tiny-cpu.yaml", "data.group_size=1"], "data.group_size is 1"),
        (
            ["train", "configs/tiny-cpu.yaml", "model.name_or_path=./no-such-model"],
            "model.name_or_path: no model folder",
        ),
        (
            ["train", "configs/tiny-cpu.yaml", "data.task=gsm8k", "data.dataset=./none.jsonl"],
            "data.dataset: file not found",
        ),
        (["serve", "prot=8000"], "rlpost: error: unknown config key: prot"),
        (["serve"], "rlpost: error: no API keys: set api_keys_file or $RLPOST_SERVE_API_KEYS"),
        (["serve", "api_keys_file=missing.yaml"], "api_keys_file: missing.yaml does not exist"),
    ],
)
def test_input_errors_exit_2_with_one_line(args, message):
    out = run_cli(*args)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert "Traceback" not in out.stderr


def test_check_config_prints_resolved_yaml(capsys):
    assert main(["check-config", "configs/tiny-cpu.yaml", "trainer.steps=3"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert data["trainer"]["steps"] == 3
    assert data["weight_sync"]["backend"] == "gloo"


def test_create_run_dir_writes_resolved_config(tmp_path):
    cfg = load_config("configs/tiny-cpu.yaml", ["trainer.steps=1"])
    run_dir = create_run_dir(cfg, tmp_path / "run")
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["trainer"]["steps"] == 1
    assert saved["logging"]["run_name"] == "run" == cfg.logging.run_name


def test_train_refuses_to_reuse_a_run_dir(tmp_path, tiny_model_path):
    run_dir = tmp_path / "run"
    create_run_dir(load_config("configs/tiny-cpu.yaml"), run_dir)
    before = (run_dir / "config.yaml").read_text()
    out = run_cli("train", "configs/tiny-cpu.yaml", f"model.name_or_path={tiny_model_path}", "--run-dir", str(run_dir))
    assert out.returncode == 2
    assert f"run directory {run_dir} already holds a run" in out.stderr
    assert (run_dir / "config.yaml").read_text() == before  # nothing of the earlier run is lost


def test_plot_command(tmp_path):
    from rlpost.record.metrics import REQUIRED_KEYS, MetricsWriter

    out = run_cli("plot", str(tmp_path))
    assert out.returncode == 2 and f"no metrics.jsonl in run directory {tmp_path}" in out.stderr
    for step in range(3):
        MetricsWriter(tmp_path).write({k: 0.0 for k in REQUIRED_KEYS} | {"step": step, "reward_mean": 0.1 * step})
    out = run_cli("plot", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "reward.png").stat().st_size > 1000


def test_automatic_run_names_never_collide(tmp_path):
    first = create_run_dir(load_config("configs/tiny-cpu.yaml", [f"logging.run_dir={tmp_path}"]))
    second = create_run_dir(load_config("configs/tiny-cpu.yaml", [f"logging.run_dir={tmp_path}"]))
    assert first != second and (first / "config.yaml").exists() and (second / "config.yaml").exists()


def test_tiny_model_cache_is_rebuilt_only_when_the_spec_changes(tmp_path, monkeypatch):
    import json

    from rlpost.tiny import model as tiny_model

    builds = []

    def fake_build(out_dir, spec, log=print):
        builds.append(spec)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "rlpost_tiny_model.json").write_text(json.dumps({"spec": tiny_model.spec_dict(spec)}))

    monkeypatch.setattr(tiny_model, "build_tiny_model", fake_build)
    spec = tiny_model.TinyModelSpec()
    assert tiny_model.ensure_tiny_model(tmp_path / "m", spec, log=lambda _: None) is True
    assert tiny_model.ensure_tiny_model(tmp_path / "m", spec, log=lambda _: None) is False
    changed = tiny_model.TinyModelSpec(seed=1)
    assert tiny_model.ensure_tiny_model(tmp_path / "m", changed, log=lambda _: None) is True
    assert builds == [spec, changed]
    tools = tiny_model.TinyModelSpec.for_task("tool_arithmetic")
    assert tiny_model.ensure_tiny_model(tmp_path / "m", tools, log=lambda _: None) is True
    assert tiny_model.ensure_tiny_model(tmp_path / "m", tools, log=lambda _: None) is False


def test_make_tiny_model_on_an_up_to_date_folder_answers_without_importing_torch(tmp_path):
    """`make test` and `make demo` ask for the tiny models every time: the answer for a folder
    built from the current spec comes from its stored spec, before torch and transformers load."""
    import json

    from rlpost.tiny.spec import TOOL_SPEC, spec_dict

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "rlpost_tiny_model.json").write_text(json.dumps({"spec": spec_dict(TOOL_SPEC)}))
    script = (
        "import sys; from rlpost.ops.cli import main; "
        f"code = main(['make-tiny-model', '--task', 'tool_arithmetic', {str(tmp_path / 'm')!r}]); "
        "print(code, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"rlpost: tiny model already built at {tmp_path / 'm'} (use --force to rebuild)",
        "0 False",
    ]


@pytest.mark.parametrize("policy", [None, "ACTIVE"])
def test_the_tiny_model_builds_run_with_sleeping_openmp_threads_unless_told_otherwise(tmp_path, monkeypatch, policy):
    """A build's idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE) so that a busy neighbour
    process cannot slow it tenfold; a policy the environment sets is kept."""
    from rlpost.tiny import model as tiny_model
    from rlpost.tiny import reward_model as tiny_reward_model

    monkeypatch.setenv("OMP_WAIT_POLICY", "x")  # recorded first, so the variable is restored after the test
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY")
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    seen = []
    monkeypatch.setattr(tiny_model, "ensure_tiny_model", lambda *a, **k: seen.append(os.environ["OMP_WAIT_POLICY"]))
    monkeypatch.setattr(
        tiny_reward_model, "ensure_tiny_reward_model", lambda *a, **k: seen.append(os.environ["OMP_WAIT_POLICY"])
    )
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "config.json").write_text("{}")
    assert main(["make-tiny-model", str(tmp_path / "m")]) == 0
    assert main(["make-tiny-reward-model", str(tmp_path / "rm"), "--lm", str(tmp_path / "lm")]) == 0
    assert seen == [policy or "PASSIVE"] * 2


def test_train_starts_its_python_again_with_the_runs_hash_seed(monkeypatch, tmp_path):
    """The driver hashes strings as the run's actors do: `rlpost train` with another PYTHONHASHSEED
    (Python's default is a random one) runs its command line again with the run's, before
    anything is started; with the run's already, it goes on."""
    from rlpost.ops import cli

    started = []

    def execve(path, argv, env):
        started.append((argv, env.get("PYTHONHASHSEED")))
        raise SystemExit(0)

    argv = ["rlpost", "train", "configs/tiny-cpu.yaml", "model.name_or_path=/no/model", "resources.python_hash_seed=7",
            "--run-dir", str(tmp_path / "run")]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setenv("RLPOST_DRIVER_SESSION", "1")  # the driver itself (no session of its own to start)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(SystemExit):
        cli.main()
    assert started == [([sys.executable, "-m", "rlpost.ops.cli", *argv[1:]], "7")]
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert cli.main() == 2 and len(started) == 1  # the run's seed: on to the next check (no model there)
    assert cli.main(argv[1:]) == 2 and len(started) == 1  # an in-process call never replaces its caller
