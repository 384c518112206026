"""rlpost.algo is pure torch: no ray, vllm, transformers, tensordict or torch.distributed.

``import torch`` itself loads parts of torch.distributed, so the runtime check compares against
a bare ``import torch``; the source check forbids the import statements outright.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[3]
ALGO_DIR = REPO_ROOT / "rlpost" / "algo"
FORBIDDEN_TOP_LEVEL = {"ray", "vllm", "transformers", "tensordict"}

# One fresh interpreter lists what is loaded after a bare ``import torch``, then after
# ``import rlpost.algo`` (which imports torch first anyway): one torch import instead of two.
LIST_FORBIDDEN = (
    "import sys, json\n"
    "def loaded(): return sorted(m for m in sys.modules if m.split('.')[0] in {forbidden!r} "
    "or m.startswith('torch.distributed'))\n"
    "import torch; baseline = loaded()\n"
    "import rlpost.algo; print(json.dumps([baseline, loaded()]))"
)


def _is_forbidden(module: str) -> bool:
    if module.split(".")[0] in FORBIDDEN_TOP_LEVEL:
        return True
    return module == "torch.distributed" or module.startswith("torch.distributed.")


def _loaded_forbidden() -> tuple[set[str], set[str]]:
    code = LIST_FORBIDDEN.format(forbidden=FORBIDDEN_TOP_LEVEL)
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    baseline, with_algo = json.loads(result.stdout.strip().splitlines()[-1])
    return set(baseline), set(with_algo)


def test_importing_algo_loads_nothing_forbidden_beyond_torch():
    baseline, with_algo = _loaded_forbidden()
    assert with_algo - baseline == set()
    assert not {m for m in with_algo if m.split(".")[0] in FORBIDDEN_TOP_LEVEL}


def test_algo_sources_have_no_forbidden_imports():
    sources = sorted(ALGO_DIR.glob("*.py"))
    assert {p.name for p in sources} >= {"__init__.py", "advantages.py", "grpo.py"}
    offenders = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                # "from torch import distributed" names the module only through the alias.
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            offenders += [f"{path.name}:{node.lineno} {name}" for name in names if _is_forbidden(name)]
    assert offenders == []
