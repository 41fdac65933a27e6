"""plot: a run's metrics.jsonl drawn as loss, validation metric, learning rate and throughput curves."""

import json

import pytest

from {{ cookiecutter.package_name }}.plot import PANELS, draw, main, rates, read_run
from {{ cookiecutter.package_name }}.train import main as train_main

pytest.importorskip("matplotlib")


def write_metrics(run_dir, records, tail=""):
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    (run_dir / "metrics.jsonl").write_text(text, encoding="utf-8")


@pytest.mark.slow
def test_plot_of_a_trained_run_draws_every_logged_value(tiny, run_dir):
    """After a real run each panel's lines hold exactly the values metrics.jsonl logged, at their steps
    (the throughput panel every perf/<unit>_per_s rate, the validation panel the task's metric)."""
    assert train_main([*tiny, "trainer.max_epochs=2"]) == 0
    records = read_run(run_dir)
    figure = draw({"run": records})
    for ax, (title, _, keys) in zip(figure.axes, PANELS, strict=True):
        drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}
        logged = [(key, label) for key, label in keys or rates(records) if any(key in r for r in records)]
        assert logged, f"none of {title}'s keys was logged"
        for key, label in logged:
            expected = [(r["step"], r[key]) for r in records if key in r]
            assert drawn[label] == ([s for s, _ in expected], [v for _, v in expected]), title
        assert len(drawn) == len(logged)
    assert "perf/samples_per_s" in dict(rates(records))


def test_plot_command_writes_a_png(tiny, run_dir, capsys):
    """python -m PACKAGE.plot RUN writes RUN/metrics.png."""
    write_metrics(run_dir, [{"step": 2, "epoch": 0, "train/loss": 2.0, "train/lr": 0.1}])
    assert main([str(run_dir)]) == 0
    png = (run_dir / "metrics.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert "metrics.png" in capsys.readouterr().out


def test_several_runs_share_the_axes(tmp_path):
    """Two runs give two labelled loss lines on one figure, written where --out says."""
    for name, loss in (("a", 1.0), ("b", 2.0)):
        write_metrics(tmp_path / name, [{"step": 1, "epoch": 0, "train/loss": loss}])
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "ab.png")]) == 0
    assert (tmp_path / "ab.png").is_file()
    figure = draw({"a": read_run(tmp_path / "a"), "b": read_run(tmp_path / "b")})
    assert [line.get_label() for line in figure.axes[0].lines] == ["a train", "b train"]


def test_a_line_cut_short_by_a_kill_is_skipped(tmp_path):
    """A run killed mid-write still plots: the partial last line is ignored."""
    write_metrics(tmp_path, [{"step": 1, "epoch": 0, "train/loss": 1.0}], tail='{"step": 2, "ep')
    assert read_run(tmp_path) == [{"step": 1, "epoch": 0, "train/loss": 1.0}]


def test_missing_or_empty_metrics_is_a_clear_error(tmp_path, capsys):
    """A directory without metrics, or with an empty file, exits 2 with one line naming the file."""
    assert main([str(tmp_path)]) == 2
    assert "metrics.jsonl: no such file" in capsys.readouterr().err
    write_metrics(tmp_path, [])
    assert main([str(tmp_path)]) == 2
    assert "no records yet" in capsys.readouterr().err
