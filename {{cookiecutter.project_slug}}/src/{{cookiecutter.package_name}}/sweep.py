"""Hyperparameter search with Optuna: each trial is a training run in a directory of its own.

    python -m PACKAGE.sweep --config configs/sweep.yaml                      # trials one after another
    python -m PACKAGE.sweep --config configs/sweep.yaml --nproc-per-node 4   # each trial under torchrun
    python -m PACKAGE.sweep --config configs/sweep.yaml trials=20 pruner.name=none
    python -m PACKAGE.sweep --config configs/sweep.yaml --wandb-sweep-file sweep-wandb.yaml  # for `wandb agent`

configs/sweep.yaml says what to search; its comments document every key. Trial N runs
`python -m PACKAGE.train --config FILES OVERRIDES SAMPLED run.output_dir=OUTPUT_DIR/trial_N` as a
child process (its output in trial.log there). The sweep reads the trial's validations from its
metrics.jsonl as they are written, reports each to Optuna, and stops a trial the pruner finds
hopeless with SIGTERM (the run checkpoints and exits). A trial's value is the best value of the
metric its training config monitors in its metrics.jsonl (trainer.monitor, in the direction of
trainer.monitor_mode: the study's direction too).

Resume: the study is kept in OUTPUT_DIR/journal.log. Run the same command again: finished trials
are kept, and a trial left running is re-run with the same parameters in the same directory, where
training resumes from its newest checkpoint. The sweep ends once `trials` trials completed or were
pruned (failed ones do not count), with a table of the trials and OUTPUT_DIR/summary.json.

Stopping: SIGTERM, SIGINT (Ctrl-C) or SIGUSR1 reaches the running trial as one SIGTERM: it
checkpoints and the sweep exits 75. `kill -9` belongs to the process group (`kill -9 -- -PGID`),
which holds the sweep and its trial. On Linux the trial also gets SIGTERM when the sweep dies, and
torchrun's workers (in sessions of their own, out of the group's reach) stop the same way by
themselves once torchrun is gone (engine/preemption.py).

Exit status: 0 done, 1 trials failed MAX_FAILURES_IN_A_ROW times in a row, 2 a bad sweep file or
training configuration, 75 stopped by a signal (run the same command again).

The search itself is engine/sweep/: config (the sweep file), study, trial, report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .engine import PACKAGE, cli
from .engine.errors import ConfigError
from .engine.sweep.config import check_training, load_sweep
from .engine.sweep.report import wandb_sweep, write_wandb_sweep
from .engine.sweep.study import run_sweep
from .task.config import SPEC


class _Parser(argparse.ArgumentParser):
    """Command-line mistakes as a ConfigError: one `error: ...` line and exit 2, like every entry point."""

    def error(self, message: str):
        raise ConfigError(f"{message} (see python -m {PACKAGE}.sweep --help)")


def main(argv: list[str] | None = None) -> int:
    """The command line: parse, check, then write the wandb file or run the sweep; the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    return cli.run(lambda: _sweep(argv))


def _sweep(argv: list[str]) -> int:
    parser = _Parser(prog=f"python -m {PACKAGE}.sweep", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", required=True, type=Path, metavar="FILE", help="the sweep file: configs/sweep.yaml")
    parser.add_argument("--nproc-per-node", type=int, metavar="N", help="run each trial under torchrun, N processes")
    parser.add_argument("--wandb-sweep-file", type=Path, metavar="FILE", help="write a wandb sweep file, and exit")
    parser.add_argument("overrides", nargs="*", help="key=value for the sweep file's keys, e.g. trials=20")
    args = parser.parse_args(argv)
    nproc = [f"nproc_per_node={args.nproc_per_node}"] if args.nproc_per_node is not None else []
    sweep = load_sweep(args.config, [*args.overrides, *nproc])
    metric, direction = check_training(sweep, SPEC)
    if args.wandb_sweep_file:
        write_wandb_sweep(args.wandb_sweep_file, wandb_sweep(sweep, metric, direction))
        return 0
    return run_sweep(sweep, metric, direction)


if __name__ == "__main__":
    sys.exit(main())
