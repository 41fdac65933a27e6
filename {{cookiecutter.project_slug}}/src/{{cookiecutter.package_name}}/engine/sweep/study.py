"""The Optuna study in output_dir/journal.log, and the loop that runs trials until enough are done."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import PREEMPTED_EXIT, RUNTIME_FAILURE, ConfigError
from ..preemption import StopRequest
from ..rundir import RunLock
from .config import SweepConfig
from .report import print_summary, summary, write_summary
from .trial import Child, requeue, run_trial

if TYPE_CHECKING:
    import optuna

MAX_FAILURES_IN_A_ROW = 3  # then the cause is not the sampled values: stop and say so
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)  # each reaches the running trial as one SIGTERM
LOCK_NAME = "sweep.lock"
BUSY = "another sweep runs in {dir} ({holder}); wait for it or choose another output_dir"


def import_optuna():
    """optuna, quiet (the sweep prints its own progress), or a ConfigError saying how to install it."""
    try:
        import optuna
    except ImportError:
        raise ConfigError("the sweep needs optuna: pip install -e '.[sweep]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def open_study(sweep: SweepConfig, direction: str) -> optuna.Study:
    """The study in output_dir/journal.log, created or loaded."""
    optuna = import_optuna()
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    pruner = (
        optuna.pruners.MedianPruner(sweep.pruner.startup_trials, n_warmup_steps=sweep.pruner.warmup_validations)
        if sweep.pruner.name == "median"
        else optuna.pruners.NopPruner()
    )
    storage = JournalStorage(JournalFileBackend(str(Path(sweep.output_dir) / "journal.log")))
    study = optuna.create_study(
        study_name=sweep.study, storage=storage, pruner=pruner, direction=direction, load_if_exists=True
    )
    # A resumed sweep seeds its sampler past the trials so far: the seed alone would draw the
    # first start's values again.
    seed = sweep.sampler.seed + len(study.trials)
    study.sampler = (
        optuna.samplers.TPESampler(seed=seed, n_startup_trials=sweep.sampler.startup_trials)
        if sweep.sampler.name == "tpe"
        else optuna.samplers.RandomSampler(seed=seed)
    )
    if study.direction.name.lower() != direction:
        raise ConfigError(
            f"study {sweep.study!r} in {sweep.output_dir} was started to {study.direction.name.lower()}; this "
            f"training config's metric is to {direction}; choose another study or output_dir"
        )
    return study


def lock_sweep_dir(output_dir: Path) -> RunLock:
    """Hold output_dir/sweep.lock while this sweep runs (the kernel lets go when the process ends, however)."""
    return RunLock(output_dir, LOCK_NAME, BUSY).acquire()


def finished(study: optuna.Study) -> int:
    """Trials that count towards `trials`: completed or pruned."""
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


def run_sweep(sweep: SweepConfig, metric: str, direction: str) -> int:
    """Run trials until `trials` of them completed or were pruned; the exit status."""
    output_dir = Path(sweep.output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"output_dir={str(output_dir)!r} cannot be created ({err.strerror})") from None
    lock = lock_sweep_dir(output_dir)
    try:
        return _run_sweep(sweep, metric, direction)
    finally:
        lock.release()


def _run_sweep(sweep: SweepConfig, metric: str, direction: str) -> int:
    """run_sweep once output_dir is locked: requeue what a killed sweep left running, then the trials."""
    from optuna.trial import TrialState

    output_dir = Path(sweep.output_dir)
    study = open_study(sweep, direction)
    for left in study.get_trials(states=(TrialState.RUNNING,)):  # the sweep that ran them was killed
        requeue(study, left.number, left.params, left.user_attrs, len(sweep.params))
    if not study.trials:
        for point in sweep.enqueue:
            study.enqueue_trial(point)
    done = finished(study)
    print(f"sweep {sweep.study}: {done} of {sweep.trials} trials done; {metric} ({direction}); in {output_dir}/")
    if study.trials:
        print_summary(summary(study, sweep, metric), sweep.params)
    failures, status, child = 0, 0, Child()
    with StopRequest(SIGNALS, on_stop=child.stop) as stop:
        while finished(study) < sweep.trials and not stop.reason:
            outcome = run_trial(study, study.ask(), sweep, metric, stop, child)
            write_summary(summary(study, sweep, metric), output_dir)
            value = f" {metric}={outcome.value:.6g}" if outcome.value is not None else ""
            print(f"  -> {outcome.state}{value} {outcome.message}".rstrip(), flush=True)
            failures = failures + 1 if outcome.state == "FAIL" else 0
            if outcome.exit_status == 2:  # a configuration error: every trial would fail the same way
                print(f"error: {outcome.message}", file=sys.stderr)
            if outcome.exit_status:
                status = outcome.exit_status
                break
            if failures == MAX_FAILURES_IN_A_ROW:
                print(f"error: {failures} trials failed in a row; the last one: {outcome.message}", file=sys.stderr)
                status = RUNTIME_FAILURE
                break
    result = summary(study, sweep, metric)
    write_summary(result, output_dir)
    print_summary(result, sweep.params)
    if status in (0, PREEMPTED_EXIT) and finished(study) < sweep.trials:
        print(f"sweep stopped; run the same command to resume (exit status {PREEMPTED_EXIT})", file=sys.stderr)
        return PREEMPTED_EXIT
    return status
