"""Every call into a vLLM engine's worker process is bounded (a hung worker fails it, not the run)."""

import ast
import threading
from pathlib import Path

import pytest

from rlpost.actors.inference import ENGINE_RPC_TIMEOUT_S, InferenceWorker

pytestmark = pytest.mark.unit

RLPOST = Path(__file__).resolve().parents[3] / "rlpost"


class RecordingLLM:
    """Stands in for vllm.LLM: records each collective_rpc's method and timeout."""

    def __init__(self):
        self.calls: list[tuple[str, float | None]] = []
        self.llm_engine = self  # the worker labels the engine's weights: set_weight_version below

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, timeout))
        return [{"version": 1} if method == "rlpost_receive_weights" else None]


def bare_worker() -> InferenceWorker:
    worker = InferenceWorker.__new__(InferenceWorker)  # no engine: only the call paths are exercised
    worker.llm, worker._turn = RecordingLLM(), threading.Condition()
    worker._generating = worker._busy = False
    worker._pending = None
    worker._engine_thread = None  # calls run in the calling thread
    worker.direct_reload, worker.overlap_reload = True, True
    return worker


def test_the_workers_calls_carry_a_timeout():
    worker = bare_worker()
    worker.join_bus({"host": "h", "timeout_s": 60.0}, 1)
    worker.reload_path()
    assert worker._receive_weights(timeout_s=60.0) == {"version": 1} and worker.llm.weight_version == "1"
    assert worker.llm.calls == [
        ("rlpost_join_bus", 60.0 + ENGINE_RPC_TIMEOUT_S),
        ("rlpost_direct_reload_status", ENGINE_RPC_TIMEOUT_S),
        ("rlpost_receive_weights", 60.0 + ENGINE_RPC_TIMEOUT_S),
    ]


def test_no_collective_rpc_in_rlpost_is_unbounded():
    unbounded = []
    for path in RLPOST.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "collective_rpc":
                if not any(k.arg == "timeout" for k in node.keywords):
                    unbounded.append(f"{path.relative_to(RLPOST.parent)}:{node.lineno}")
    assert unbounded == []
