import json

import pytest

from rlpost.record.metrics import REQUIRED_KEYS, MetricsWriter, plot_metrics, read_metrics

pytestmark = pytest.mark.unit


def record(step, reward):
    rec = {k: 0.0 for k in REQUIRED_KEYS}
    rec.update(step=step, policy_version=step, reward_mean=reward, reward_std=0.1, loss=1.0 / (step + 1))
    return rec


def test_jsonl_appends_and_reads_back(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write(record(0, 0.2))
    MetricsWriter(tmp_path).write(record(1, 0.3) | {"sync_logprob_diff": float("nan"), "extra": 5})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["sync_logprob_diff"] is None and rows[1]["extra"] == 5


def test_missing_required_key_is_an_error(tmp_path):
    rec = record(0, 0.1)
    del rec["loss"]
    with pytest.raises(ValueError, match=r"lacks required keys \['loss'\]"):
        MetricsWriter(tmp_path).write(rec)


def test_torn_last_line_is_skipped_other_bad_lines_are_not(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(record(0, 0.1)) + "\n" + '{"step": 1, "rew')
    assert len(read_metrics(path)) == 1
    path.write_text('{"bad\n' + json.dumps(record(0, 0.1)) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl:1"):
        read_metrics(path)


def test_plot_writes_png(tmp_path):
    out = plot_metrics([record(i, 0.1 * i) for i in range(5)], tmp_path / "reward.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------ the driver's progress


def progress_row(step, reward, **extra):
    return {"step": step, "reward_mean": reward, "loss": 0.5, "policy_version": step, "samples_per_s": 12.5, **extra}


def test_progress_off_a_terminal_prints_a_line_every_n_steps():
    import io

    from rlpost.record.progress import Progress

    out = io.StringIO()
    progress = Progress(10, enabled=True, every=3, stream=out)
    assert progress.bar is None  # a StringIO is not a terminal
    for step in range(1, 11):
        extra = {"eval_pass_at_1": 0.75} if step == 5 else {}
        progress.update(progress_row(step, 0.1 * step, **extra))
    progress.close()
    lines = out.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["3/10", "6/10", "9/10", "10/10"]  # every 3rd and the last
    assert lines[0].startswith("rlpost: step 3/10 reward=0.300 samples/s=12.5 eta=")
    assert "eval" not in lines[0]
    assert "reward=0.600 eval=0.750 samples/s=12.5" in lines[1]  # the last eval seen is kept
    assert "eval=0.750" in lines[3] and lines[3].endswith("eta=0:00:00")


def test_progress_line_every_defaults_to_a_twentieth_and_counts_a_resume():
    import io

    from rlpost.record.progress import Progress

    assert Progress(100, enabled=True, stream=io.StringIO()).every == 5
    assert Progress(7, enabled=True, stream=io.StringIO()).every == 1
    out = io.StringIO()
    progress = Progress(40, enabled=True, initial=20, stream=out)  # resumed after step 20: a line every 2 steps
    progress.started -= 100.0  # this process has run 100 s
    progress.update(progress_row(21, 0.5, eval_reward_mean=0.25))
    assert out.getvalue() == ""
    progress.update(progress_row(22, 0.4, loss=None))
    # 2 steps in 100 s, 18 to go: 900 s
    assert out.getvalue() == "rlpost: step 22/40 reward=0.400 eval=0.250 samples/s=12.5 eta=0:15:00\n"


def test_progress_bar_on_a_terminal_and_nothing_when_off():
    import io

    from rlpost.record.progress import Progress

    out = io.StringIO()
    progress = Progress(4, enabled=True, stream=out, is_terminal=True)
    progress.update(progress_row(1, 0.25, eval_reward_mean=0.5, loss=None))
    progress.close()
    shown = out.getvalue()
    assert "1/4" in shown and "reward=0.250" in shown and "eval=0.500" in shown and "sps=12.5" in shown
    assert "loss=-" in shown
    quiet = io.StringIO()
    for terminal in (True, False):
        progress = Progress(4, enabled=False, every=1, stream=quiet, is_terminal=terminal)
        progress.update(progress_row(1, 0.25))
        progress.close()
    assert quiet.getvalue() == ""
