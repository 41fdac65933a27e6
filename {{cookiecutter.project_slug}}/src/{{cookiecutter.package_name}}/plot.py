"""Draw a run's metrics.jsonl as one PNG: loss, a validation metric, learning rate and throughput by step.

    python -m PACKAGE.plot runs/demo                       # writes runs/demo/metrics.png
    python -m PACKAGE.plot runs/a runs/b --out ab.png      # several runs on the same axes

Needs matplotlib: pip install -e ".[plot]". Runs that are still training can be drawn any time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .engine import cli
from .engine.errors import ConfigError
from .task.config import SPEC

# (title, y label, [(metrics.jsonl key, line label)]); the validation panel is the task's (TaskSpec.plot_panel).
# A panel draws those of its keys that the runs logged.
PANELS = (
    ("Loss", "loss", [("train/loss", "train"), ("val/loss", "val")]),
    ("Validation", SPEC.plot_panel[0], list(SPEC.plot_panel[1])),
    ("Learning rate", "lr", [("train/lr", "lr")]),
    ("Throughput", "per second (all processes)", []),  # every perf/<unit>_per_s the runs logged
)


class PlotError(ConfigError):
    """A run that cannot be drawn (no metrics.jsonl, nothing in it) or matplotlib missing (exit 2)."""


def read_run(run_dir: Path) -> list[dict]:
    """The records of run_dir/metrics.jsonl; a line cut short by a kill is skipped."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path}: no such file; pass a run directory (run.output_dir of a training run)")
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if not records:
        raise PlotError(f"{path}: no records yet")
    return records


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of one metric, in logged order."""
    points = [(r["step"], r[key]) for r in records if key in r]
    return [s for s, _ in points], [v for _, v in points]


def rates(records: list[dict]) -> list[tuple[str, str]]:
    """Every perf/<unit>_per_s key the records hold, as (key, "<unit>/s") in first-logged order."""
    keys = dict.fromkeys(k for r in records for k in r if k.startswith("perf/") and k.endswith("_per_s"))
    return [(key, key.removeprefix("perf/").removesuffix("_per_s") + "/s") for key in keys]


def draw(runs: dict[str, list[dict]]):
    """A 2x2 matplotlib Figure of the PANELS for every run (label -> records)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        from matplotlib import pyplot as plt
    except ImportError:
        raise PlotError('plotting needs matplotlib: pip install -e ".[plot]"') from None
    figure, axes = plt.subplots(2, 2, figsize=(11, 7), layout="constrained")
    for ax, (title, ylabel, keys) in zip(axes.flat, PANELS, strict=True):
        for run, records in runs.items():
            for key, label in keys or rates(records):
                steps, values = series(records, key)
                if steps:
                    name = label if len(runs) == 1 else f"{run} {label}"
                    ax.plot(steps, values, marker="o" if key.startswith("val/") else None, markersize=3, label=name)
        ax.set(title=title, xlabel="optimizer step", ylabel=ylabel)
        if title == "Loss" and ax.lines and all(min(line.get_ydata()) > 0 for line in ax.lines):
            ax.set_yscale("log")  # losses span decades; a linear axis flattens everything after the start
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "not logged yet", ha="center", va="center", transform=ax.transAxes)
    return figure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}.plot", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (each holds metrics.jsonl)")
    parser.add_argument("--out", type=Path, help="PNG to write (default: RUN/metrics.png of the first run)")
    args = parser.parse_args(argv)
    return cli.run(lambda: _plot(args.runs, args.out or args.runs[0] / "metrics.png"))


def _plot(runs: list[Path], out: Path) -> int:
    figure = draw({str(run): read_run(run) for run in runs})
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out, dpi=100)
    except OSError as err:
        raise PlotError(f"could not write {out} ({err.strerror or err})") from None
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
