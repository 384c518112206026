"""Shared fixtures and the suite's order. The tiny models are shipped in models/ (models/README.md):
the tiny model (or $RLPOST_TINY_MODEL), its tool-using variant (or $RLPOST_TINY_TOOL_MODEL) and the
tiny reward model (or $RLPOST_TINY_REWARD_MODEL); a fixture fails the session when one is stale.

Each folder of tests/ is a tier, and every test in it carries the tier's marker (a collection
error names a file that does not), so `pytest -m unit` runs exactly tests/unit. The tiers run
in the order of TIERS: the fast, pure ones first, so that a broken function fails the run in
minutes, and the whole runs last, after the integration tier's Ray cluster is gone.

Shared engines (SHARED_ENGINES): a vLLM engine that tests of several modules, in one tier or two,
only read is started once, by its first user, and shut down right after its last one (a start-up
costs 20-25 s of the 2 cores; an idle engine still holds ~2 GB and some CPU). Within a tier the
modules that use one run first, in the order of SHARED_ENGINES, so that an engine started by the
tier before is used and gone early.

Under pytest-xdist (`make test`'s ``-n 2 --dist loadfile``) each worker runs its share in this
order; a worker takes each test file whole, and every file that uses a shared engine in one unit
with the engine's other users (pytest_xdist_make_scheduler)."""

from __future__ import annotations

import atexit
import functools
import gc
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIERS = ("unit", "compat", "integration", "e2e")


def tier_of(path: Path) -> str | None:
    """The tier of a test file: the folder of tests/ it is in (None outside tests/<tier>/)."""
    parts = Path(path).resolve().parts[len(REPO.parts) :]
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS else None


def unmarked_files(items) -> list[str]:
    """The test files (relative to the repository) with a test that lacks its tier's marker."""
    return sorted(
        {
            "/".join(Path(item.path).resolve().parts[len(REPO.parts) :])
            for item in items
            if tier_of(item.path) is not None and item.get_closest_marker(tier_of(item.path)) is None
        }
    )


def pytest_collection_modifyitems(config, items):
    unmarked = unmarked_files(items)
    if unmarked:
        raise pytest.UsageError(
            "every test in tests/<tier>/ carries its tier's marker (pytestmark = pytest.mark.<tier>); "
            f"missing in: {', '.join(unmarked)}"
        )
    items.sort(key=run_order(items))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist (the dev extra), unknown without it
def pytest_xdist_make_scheduler(config, log):
    """`make test`'s ``-n 2 --dist loadfile``: a worker takes each test file whole (its
    module-scoped fixtures, Ray actors among them, start once), and the files whose tests use
    a shared engine as one unit (:func:`xdist_scope`), so that one worker starts the engine,
    once, and stops it after its last user. Other ``--dist`` modes are pytest-xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFileAndEngine(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid.split("::", 1)[0])

    return ByFileAndEngine(config, log)


@functools.cache
def xdist_scope(test_file: str) -> str:
    """The unit of work of a test file (relative to the repository) for a pytest-xdist worker:
    the name of the first shared engine its text names as a parameter (a test or fixture of the
    file asks for it), else the file. The scheduler sees only node ids, not fixtures, so it reads
    the file; an engine reached only through a conftest's fixture is missed, which costs a second
    start of the engine on the other worker, not a failure."""
    if tier_of(REPO / test_file) == "unit":  # no engine there
        return test_file
    try:
        text = (REPO / test_file).read_text()
    except OSError:
        return test_file
    named = [name for name in SHARED_ENGINES if re.search(rf"[(,]\s*{name}\s*[,):]", text)]
    return named[0] if named else test_file


def run_order(items):
    """The sort key of the suite's order: by tier (TIERS; files outside the tiers last), then the
    modules that use a shared engine, in the order of SHARED_ENGINES, then the others; a module's
    tests stay together and in their order (the sort is stable)."""
    engine_rank: dict[Path, int] = {}
    for item in items:
        ranks = [SHARED_ENGINES.index(name) for name in item.fixturenames if name in SHARED_ENGINES]
        engine_rank[item.path] = min([*ranks, engine_rank.get(item.path, len(SHARED_ENGINES))])

    def key(item) -> tuple[int, int]:
        tier = tier_of(item.path)
        return (TIERS.index(tier) if tier else len(TIERS), engine_rank[item.path])

    return key


# ----------------------------------------------------------------------------- shared engines

# the fixtures of the shared engines, in the order their users' modules run within a tier
SHARED_ENGINES = ("plain_llm", "vllm_engine")
_started: dict[str, tuple[object, Callable[[object], None]]] = {}  # fixture name -> (engine, stop)
_last_user: dict[str, str] = {}  # fixture name -> node id of the last selected test that uses it


def shared_engine(name: str, start: Callable[[], object], stop: Callable[[object], None]):
    """The engine of fixture ``name``: started by ``start()`` on first use; ``stop(engine)`` runs
    after the teardown of the last selected test that uses the fixture (or at the session's end)."""
    assert name in SHARED_ENGINES, name
    if name not in _started:
        _started[name] = (start(), stop)
    return _started[name][0]


@pytest.fixture(scope="session")
def shared_engines():
    """:func:`shared_engine`, for a conftest deeper in the suite that defines a shared engine's
    fixture of its own."""
    return shared_engine


def pytest_collection_finish(session):
    """Note each shared engine's last user among the tests selected to run (after -m and -k)."""
    for item in session.items:
        for name in SHARED_ENGINES:
            if name in item.fixturenames:
                _last_user[name] = item.nodeid


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    for name, last in _last_user.items():
        if last == item.nodeid:
            stop_shared_engine(name)


def stop_shared_engine(name: str) -> None:
    if name in _started:
        engine, stop = _started.pop(name)
        stop(engine)


CPU_ENGINE_SETTINGS = dict(
    kv_cache_memory_bytes=256 * 2**20,
    max_model_len=512,
    dtype="float32",
    enforce_eager=True,
    enable_chunked_prefill=False,
    max_num_batched_tokens=4096,
    seed=0,
)


@pytest.fixture
def plain_llm(tiny_model_path):
    """``vllm.LLM(model=tiny)`` as TorchRL's tutorials build it, so in vLLM's default
    ``logprobs_mode`` (raw log-probs), plus the settings this machine's CPU engine needs: without
    a KV-cache size vLLM's CPU backend reserves 92% of the RAM, the tiny model is fp32, and seeded
    requests need chunked prefill off (a vLLM 0.32 CPU trap). ``max_logprobs=-1`` lets a wrapper
    re-score sampled tokens at temperatures != 1. Shared by the compat tier and the integration
    tier's test of the tiny model on the plain engine."""

    def start():
        from vllm import LLM

        llm = LLM(model=str(tiny_model_path), max_logprobs=-1, **CPU_ENGINE_SETTINGS)
        assert llm.llm_engine.model_config.logprobs_mode == "raw_logprobs"
        return llm

    def stop(llm) -> None:
        from rlpost.policies import shutdown_vllm_engine

        shutdown_vllm_engine(llm)
        gc.collect()

    return shared_engine("plain_llm", start, stop)


@pytest.fixture
def vllm_engine(tiny_model_path):
    """rlpost's ``make_vllm_engine`` of the tiny model in processes of its own (the engine core
    and its model worker), its model's threads on (up to) 2 cores: ``rollout.engine.cpu_threads``'
    path. Read by the wrappers' tests and the in-process engine's test (as the engine beside
    which an in-process one runs). Its stop checks that its child processes are gone."""
    import psutil

    started: list = []

    def start():
        from rlpost.policies import make_vllm_engine
        from rlpost.policies.vllm_wrapper import engine_cpu_cores

        before = {p.pid for p in psutil.Process().children(recursive=True)}
        llm = make_vllm_engine(
            tiny_model_path, seed=0, cpu_cores=engine_cpu_cores(min(2, len(os.sched_getaffinity(0))))
        )
        # the engine-core and worker processes; multiprocessing's resource tracker (also started
        # here) is Python's own helper and lives as long as this process, by design
        started.extend(
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline())
        )
        assert started, "expected the vLLM engine to run in child processes"
        return llm

    def stop(llm) -> None:
        from rlpost.policies import shutdown_vllm_engine

        shutdown_vllm_engine(llm)
        del llm
        gc.collect()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in started):
            time.sleep(0.2)
        assert not [p.pid for p in started if _alive(p)], "vLLM child processes outlived the engine"

    return shared_engine("vllm_engine", start, stop)


def _alive(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def tiny_model_dir() -> Path:
    return Path(os.environ.get("RLPOST_TINY_MODEL", REPO / "models" / "tiny-model"))


def shipped_model(path: Path, up_to_date: bool, target: str) -> Path:
    """``path`` when it holds a tiny model of the code's current spec; otherwise the session fails
    at once, saying how to rebuild (models/README.md), instead of building inside a test's time."""
    if not up_to_date:
        pytest.fail(f"{path} is missing or was built from another spec: `make {target}` rebuilds it (models/README.md)")
    return path


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The offline tiny model: shipped in models/tiny-model (or $RLPOST_TINY_MODEL)."""
    from rlpost.tiny.spec import TinyModelSpec, built_spec, spec_dict

    path = tiny_model_dir()
    return shipped_model(path, built_spec(path) == spec_dict(TinyModelSpec()), "tiny-model")


@pytest.fixture(scope="session")
def tiny_tool_model_path() -> Path:
    """The tool_arithmetic variant (``make-tiny-model --task tool_arithmetic``): shipped in
    models/tiny-model-tools (or $RLPOST_TINY_TOOL_MODEL)."""
    from rlpost.tiny.spec import TOOL_SPEC, built_spec, spec_dict

    path = Path(os.environ.get("RLPOST_TINY_TOOL_MODEL", REPO / "models" / "tiny-model-tools"))
    return shipped_model(path, built_spec(path) == spec_dict(TOOL_SPEC), "tiny-model-tools")


@pytest.fixture(scope="session")
def tiny_reward_model_path(tiny_model_path) -> Path:
    """The tiny reward model (``make-tiny-reward-model``: a one-label classifier on the tiny LM's
    trunk): shipped in models/tiny-reward-model (or $RLPOST_TINY_REWARD_MODEL), built from the
    tiny LM the session uses."""
    from dataclasses import asdict

    from rlpost.tiny.reward_model import META_FILE, TinyRewardModelSpec, lm_meta

    path = Path(os.environ.get("RLPOST_TINY_REWARD_MODEL", REPO / "models" / "tiny-reward-model"))
    meta = json.loads((path / META_FILE).read_text()) if (path / META_FILE).is_file() else {}
    current = meta.get("spec") == asdict(TinyRewardModelSpec()) and meta.get("lm") == lm_meta(tiny_model_path)
    return shipped_model(path, current, "tiny-reward-model")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """End the test process with pytest's verdict, skipping the interpreter's teardown.

    This process has hosted vLLM clients, Ray drivers, gloo process groups and their native
    threads over ~1500 tests. Once, in CI, it died with SIGSEGV while Python tore those down,
    after pytest had printed "1581 passed", and the crash's exit status replaced the verdict.
    Each tier alone exits cleanly, and no test relies on what teardown would do (every fixture
    cleans up explicitly; the CLI's own exits are checked by the e2e tests, in their own
    processes). So the last atexit handler to be registered, which runs first, flushes the
    output and leaves with the verdict's code."""

    for name in list(_started):  # a run stopped early (-x, Ctrl-C) before an engine's last user
        try:
            stop_shared_engine(name)
        except Exception as exc:  # the verdict stands; say what was left
            print(f"shared engine {name} did not stop cleanly: {exc!r}", file=sys.stderr)
    code = int(exitstatus)

    def leave_with_the_verdict() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    atexit.register(leave_with_the_verdict)
