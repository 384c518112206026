import json

import pytest

from rlpost.metrics import REQUIRED_KEYS, MetricsWriter, plot_metrics, read_metrics

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
