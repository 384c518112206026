import json

import pytest

from rlpost.ops.cli import main
from rlpost.record.metrics import REQUIRED_KEYS, _completion_lengths, plot_run

pytestmark = pytest.mark.unit

PNG = b"\x89PNG\r\n\x1a\n"
ALL_FIGURES = ["reward.png", "kl.png", "length.png", "staleness.png", "step_time.png"]


def full_record(step):
    """A row as the controller writes it today (the keys the figures read)."""
    rec = {k: 0.0 for k in REQUIRED_KEYS}
    rec.update(
        step=step,
        policy_version=step,
        reward_mean=0.1 * step,
        reward_std=0.05,
        loss=1.0 / step,
        kl_to_ref=0.01 * step,
        kl_to_inference=1e-6,
        staleness_mean=0.5,
        staleness_max=1.0,
        completion_len_mean=8.0 + step,
        samples_generated=64,
        tokens_generated=600,
        collect_s=2.0,
        train_s=0.5,
        weight_sync_s=0.1 if step % 2 == 0 else None,
        step_time_s=2.8,
    )
    if step % 3 == 0:
        rec.update(eval_reward_mean=0.2 * step, eval_pass_at_1=0.1 * step)
    return rec


def old_record(step):
    """A row of an older run: only the required keys, no KL (reference off) and no syncs timed."""
    rec = {k: 0.0 for k in REQUIRED_KEYS}
    rec.update(
        step=step,
        policy_version=step,
        reward_mean=0.1 * step,
        reward_std=0.05,
        loss=0.5,
        kl_to_ref=None,
        weight_sync_s=None,
    )
    return rec


def write_metrics(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def pngs(folder):
    return sorted(p.name for p in folder.glob("*.png"))


def test_plot_writes_every_figure_and_prints_the_paths(tmp_path, capsys):
    run_dir = tmp_path / "run"
    write_metrics(run_dir, [full_record(s) for s in range(1, 10)])
    assert main(["plot", str(run_dir)]) == 0
    assert pngs(run_dir) == sorted(ALL_FIGURES)
    for name in ALL_FIGURES:
        assert (run_dir / name).read_bytes()[:8] == PNG
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"rlpost: wrote {run_dir / name} (9 steps)" for name in ALL_FIGURES]


def test_figures_without_their_metrics_are_skipped(tmp_path, capsys):
    run_dir = tmp_path / "old"
    write_metrics(run_dir, [old_record(s) for s in range(1, 5)])
    assert main(["plot", str(run_dir)]) == 0
    # KL all None, no lengths, no step time parts: those figures are not drawn; staleness_mean is required
    assert pngs(run_dir) == ["reward.png", "staleness.png"]
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_out_moves_reward_png_only(tmp_path, capsys):
    run_dir = tmp_path / "run"
    write_metrics(run_dir, [full_record(s) for s in range(1, 4)])
    out = tmp_path / "elsewhere" / "curve.png"
    out.parent.mkdir()
    assert main(["plot", str(run_dir), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    assert pngs(run_dir) == sorted(set(ALL_FIGURES) - {"reward.png"})
    assert f"rlpost: wrote {out} (3 steps)" in capsys.readouterr().out


def test_step_time_needs_only_one_of_its_keys(tmp_path):
    rows = [old_record(s) | {"step_time_s": 3.0} for s in range(1, 4)]
    written = plot_run(rows, tmp_path)
    assert [p.name for p in written] == ["reward.png", "staleness.png", "step_time.png"]


def test_completion_length_falls_back_to_tokens_per_sample():
    rows = [
        {"completion_len_mean": 9.5},
        {"tokens_generated": 600, "samples_generated": 60},
        {"tokens_generated": 10, "samples_generated": 0},
        {},
    ]
    lengths = _completion_lengths(rows)
    assert lengths[:2] == [9.5, 10.0]
    assert lengths[2] != lengths[2] and lengths[3] != lengths[3]  # NaN: no point drawn
    assert _completion_lengths([{}, {"tokens_generated": None, "samples_generated": 4}]) is None


def test_missing_or_empty_metrics_are_input_errors(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["plot", str(tmp_path)]) == 2
    assert "holds no steps yet" in capsys.readouterr().err
