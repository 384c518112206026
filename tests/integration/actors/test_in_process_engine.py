"""An inference worker whose vLLM engine runs in the worker's own process (``rollout.engine.in_process``,
the CPU default): no engine processes, the model's threads on the given cores, the caller's threads
left alone, an engine in processes of its own beside it, and a second engine asked for in the
same process given processes of its own."""

from __future__ import annotations

import os

import psutil
import pytest
import torch

from rlpost.config import JobConfig

pytestmark = pytest.mark.integration


def engine_children() -> dict[int, str]:
    """This process's vLLM engine processes still running, by pid (an earlier test's engine may be exiting)."""
    found = {}
    for process in psutil.Process().children(recursive=True):
        try:
            if process.name().startswith("VLLM::") and process.status() != psutil.STATUS_ZOMBIE:
                found[process.pid] = process.name()
        except psutil.NoSuchProcess:
            pass
    return found


class RecordedStart:
    """Stands in for ``vllm.LLM`` to record how ``make_vllm_engine`` would start an engine: the
    multiprocessing switch vLLM reads as the engine starts."""

    def __init__(self, *args, **kwargs):
        self.multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")

    def collective_rpc(self, *args, **kwargs):
        return []


def test_an_in_process_engine_runs_on_its_thread_and_cores_beside_one_in_processes(tiny_model_path, vllm_engine,
                                                                                    monkeypatch):  # fmt: skip
    """The in-process engine runs beside the suite's shared engine in processes of its own
    (tests/conftest.py), and a second engine asked for in process while it runs is started in
    processes instead (vLLM's parallel state is one per process)."""
    import vllm

    from rlpost.actors.vllm_workers import make_vllm_worker
    from rlpost.policies import LocalVLLMClient, make_vllm_engine

    engine = JobConfig().rollout.engine.model_copy(
        update={"cpu_threads": 1, "max_model_len": 256, "kv_cache_space_gb": 0.25, "max_num_seqs": 16}
    )
    assert engine.in_process is None  # the default: in process on the CPU backend
    caller_affinity, caller_threads = os.sched_getaffinity(0), torch.get_num_threads()
    before = engine_children()
    assert "VLLM::Worker" in before.values()  # the shared engine's model worker
    worker = make_vllm_worker(str(tiny_model_path), make_ray_worker=False, engine_config=engine)
    try:
        assert engine_children().keys() <= before.keys()  # no EngineCore, no worker process of its own
        # the engine thread runs the model on core 0 with one thread; the caller's thread is as it was
        assert worker._on_engine_thread(lambda: (os.sched_getaffinity(0), torch.get_num_threads())) == (
            {sorted(caller_affinity)[0]},
            1,
        )
        assert (os.sched_getaffinity(0), torch.get_num_threads()) == (caller_affinity, caller_threads)
        # vLLM disables torch.set_num_threads in an engine's process; here it still works
        changed = 2 if caller_threads == 1 else 1
        torch.set_num_threads(changed)
        assert torch.get_num_threads() == changed
        torch.set_num_threads(caller_threads)
        greedy = {"max_tokens": 8, "temperature": 0.0}
        prompts = [[1, 2, 3], [4, 5, 6, 7]]
        # the wrapper's client, called from this thread, runs the engine on the engine's thread
        completions = worker.client.generate(prompts, greedy)
        assert [c[0].token_ids for c in completions] == [c[0].token_ids for c in worker.generate(prompts, greedy)[0]]

        # the engine in processes computes the same greedy tokens with the same weights, and
        # this process's engine is untouched by it
        theirs = LocalVLLMClient(vllm_engine).generate(prompts, greedy)
        assert [c[0].token_ids for c in theirs] == [c[0].token_ids for c in completions]
        assert [c[0].token_ids for c in worker.client.generate(prompts, greedy)] == [
            c[0].token_ids for c in completions
        ]

        # while this engine runs here, another asked for in process is started in processes
        monkeypatch.setattr(vllm, "LLM", RecordedStart)
        second = make_vllm_engine(tiny_model_path, max_model_len=256, seed=0, in_process=True)
        assert second.multiprocessing == "1"
    finally:
        worker.shutdown()
