"""scripts/chaos.py as a module, for the tests that use its plans and checks (it is a script, not
part of the rlpost package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "chaos.py"


def load_chaos():
    """The chaos script's module, loaded once per process."""
    if "rlpost_chaos" in sys.modules:
        return sys.modules["rlpost_chaos"]
    spec = importlib.util.spec_from_file_location("rlpost_chaos", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module
