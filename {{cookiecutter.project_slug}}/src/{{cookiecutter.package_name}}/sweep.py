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
which holds the sweep and its trial. On Linux every training process also stops by itself (SIGTERM)
when the process that started it dies: torchrun starts its workers in sessions of their own, out of
the group's reach, so under --nproc-per-node they run as `python -m PACKAGE.sweep --worker ARGS`,
which sets that up before it trains.

Exit status: 0 done, 1 trials failed MAX_FAILURES_IN_A_ROW times in a row, 2 a bad sweep file or
training configuration, 75 stopped by a signal (run the same command again).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from . import train
from .engine.ckpt.files import atomic_write
from .engine.config import load_config
from .engine.errors import PREEMPTED_EXIT, RUNTIME_FAILURE, ConfigError, error_line, report

if TYPE_CHECKING:
    import optuna

TYPES = ("float", "int", "categorical")
SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "none")
MAX_FAILURES_IN_A_ROW = 3  # then the cause is not the sampled values: stop and say so
POLL_S = 0.5  # seconds between reads of a running trial's metrics.jsonl
WORKER = "--worker"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None  # loaded before any fork


@dataclass
class SearchSpace:
    type: str = "float"
    """float, int or categorical."""
    low: float | None = None
    """float and int: the smallest value."""
    high: float | None = None
    """float and int: the largest value (included)."""
    step: float | None = None
    """float and int: values low, low + step, ... only (int: 1 when null)."""
    log: bool = False
    """float and int: sample the logarithm uniformly (learning rates); not with step."""
    choices: list[Any] | None = None
    """categorical: the values to choose from (numbers, strings, booleans or null)."""


@dataclass
class SamplerConfig:
    name: str = "tpe"
    """tpe (a model of good and bad values, after startup_trials random ones) or random."""
    seed: int = 0
    """Seed of the sampler; a resumed sweep continues with seed + the trials so far."""
    startup_trials: int = 4
    """tpe: random trials before the model chooses."""


@dataclass
class PrunerConfig:
    name: str = "median"
    """median (stop a trial worse than the median of the completed ones at the same validation) or none."""
    startup_trials: int = 2
    """Completed trials before any trial is pruned."""
    warmup_validations: int = 1
    """Validations of each trial that are never pruned (early ones say little)."""


@dataclass
class SweepConfig:
    study: str = "sweep"
    """Name of the study (in the journal)."""
    output_dir: str | None = None
    """Directory of the journal, summary.json and the trials' run directories; null: runs/sweep/<study>."""
    trials: int = 8
    """Trials that complete or are pruned; failed ones do not count."""
    config: list[str] = field(default_factory=lambda: ["configs/default.yaml"])
    """The training --config files every trial starts from."""
    overrides: list[str] = field(default_factory=list)
    """key=value overrides every trial gets (e.g. a shorter schedule)."""
    params: dict[str, SearchSpace] = field(default_factory=dict)
    """The search space: a dotted training key and its distribution."""
    enqueue: list[dict[str, Any]] = field(default_factory=list)
    """Values to try first, e.g. the current defaults as a baseline ({key: value} each)."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    pruner: PrunerConfig = field(default_factory=PrunerConfig)
    nproc_per_node: int | None = None
    """Processes per trial under torchrun (one per GPU); null: one plain process."""


def load_sweep(path: Path, overrides: list[str]) -> SweepConfig:
    """The sweep file merged with key=value overrides (trials=20, pruner.name=none), checked."""
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        loaded = OmegaConf.load(path)
    except Exception as err:  # yaml's errors are several classes; all mean the same to the user
        raise ConfigError(f"--config {path}: not valid YAML ({str(err).strip().splitlines()[0]})") from None
    if not OmegaConf.is_dict(loaded):
        raise ConfigError(f"--config {path}: expected a mapping (study:, trials:, params:, ...)")
    where = f"--config {path}"  # what an error is about: the file, or the override being merged
    try:
        merged = OmegaConf.merge(OmegaConf.structured(SweepConfig), loaded)
        for item in overrides:
            where = f"override {item!r}"
            if "=" not in item:
                raise ConfigError(f"{where}: write it as key=value, e.g. trials=20")
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        sweep = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "sweep"
        raise ConfigError(f"{where}: {key}: {str(err).splitlines()[0]}") from None
    sweep.output_dir = sweep.output_dir or f"runs/sweep/{sweep.study}"
    check(sweep)
    return sweep


def check(sweep: SweepConfig) -> None:
    """Refuse values the sweep cannot run, naming the key."""
    if sweep.trials < 1:
        raise ConfigError(f"trials={sweep.trials} must be at least 1")
    if sweep.nproc_per_node is not None and sweep.nproc_per_node < 1:
        raise ConfigError(f"nproc_per_node={sweep.nproc_per_node} must be at least 1, or null")
    if sweep.sampler.name not in SAMPLERS:
        raise ConfigError(f"sampler.name={sweep.sampler.name!r} is not allowed; choose one of {', '.join(SAMPLERS)}")
    if sweep.pruner.name not in PRUNERS:
        raise ConfigError(f"pruner.name={sweep.pruner.name!r} is not allowed; choose one of {', '.join(PRUNERS)}")
    for key in ("sampler.startup_trials", "pruner.startup_trials", "pruner.warmup_validations"):
        section, leaf = key.split(".")
        if getattr(getattr(sweep, section), leaf) < 0:
            raise ConfigError(f"{key} must be 0 or more")
    if not sweep.params:
        raise ConfigError("params is empty; name at least one training key to search, e.g. optim.lr")
    for item in sweep.overrides:
        if item.split("=", 1)[0].strip() == "run.output_dir":
            raise ConfigError(f"overrides: {item!r}: the sweep sets run.output_dir (output_dir/trial_N)")
    if "run.output_dir" in sweep.params:
        raise ConfigError("params: run.output_dir cannot be searched (the sweep sets it)")
    for key, space in sweep.params.items():
        check_space(f"params.{key}", space)
    for point in sweep.enqueue:
        unknown = set(point) - set(sweep.params)
        if unknown:
            raise ConfigError(f"enqueue: {', '.join(sorted(unknown))} not in params; enqueue only searched keys")


def check_space(where: str, space: SearchSpace) -> None:
    """One key's distribution: complete, consistent and accepted by Optuna."""
    if space.type not in TYPES:
        raise ConfigError(f"{where}.type={space.type!r} is not allowed; choose one of {', '.join(TYPES)}")
    ranged = {"low": space.low, "high": space.high, "step": space.step, "log": space.log or None}
    if space.type == "categorical":
        if not space.choices:
            raise ConfigError(f"{where}: categorical needs choices: [a, b, ...]")
        if any(value is not None for value in ranged.values()):
            extra = ", ".join(key for key, value in ranged.items() if value is not None)
            raise ConfigError(f"{where}: categorical takes choices only, not {extra}")
        if any(value is not None and not isinstance(value, (bool, int, float, str)) for value in space.choices):
            raise ConfigError(f"{where}.choices: each must be a number, a string, true, false or null")
        return
    if space.choices is not None:
        raise ConfigError(f"{where}: choices belong to type: categorical")
    if space.low is None or space.high is None:
        raise ConfigError(f"{where}: {space.type} needs low and high")
    if not space.low < space.high:
        raise ConfigError(f"{where}: low={space.low} must be below high={space.high}")
    if space.log and (space.low <= 0 or space.step is not None):
        raise ConfigError(f"{where}: log needs low > 0 and no step")
    if space.step is not None and space.step <= 0:
        raise ConfigError(f"{where}.step={space.step} must be above 0")
    if space.type == "int" and any(v is not None and v != int(v) for v in (space.low, space.high, space.step)):
        raise ConfigError(f"{where}: int needs whole numbers for low, high and step")


def as_override(key: str, value: Any) -> str:
    """key=value as the training command line reads it (null, true, 1e-05, ...)."""
    if value is None or isinstance(value, bool):
        return f"{key}={json.dumps(value)}"
    return f"{key}={value!r}" if isinstance(value, float) else f"{key}={value}"


def probes(space: SearchSpace) -> list[Any]:
    """The values that bound what a trial may sample: the ends of a range, every choice."""
    if space.type == "categorical":
        return list(space.choices)
    return [int(space.low), int(space.high)] if space.type == "int" else [space.low, space.high]


def check_training(sweep: SweepConfig) -> tuple[str, str]:
    """Load the training config with every bound of the search space, so that a typo in a key or a value
    the training refuses stops the sweep now rather than in trial 7; returns the metric and direction."""
    try:
        cfg = load_config(sweep.config, sweep.overrides)
    except ConfigError as err:
        raise ConfigError(f"the training config of the sweep: {error_line(err)}") from None
    points = [{key: value} for key, space in sweep.params.items() for value in probes(space)] + sweep.enqueue
    for point in points:
        sampled = [as_override(key, value) for key, value in point.items()]
        try:
            load_config(sweep.config, [*sweep.overrides, *sampled])
        except ConfigError as err:
            raise ConfigError(f"{' '.join(sampled)} (from the sweep file): {error_line(err)}") from None
    metric, mode = train.monitored(cfg)
    return metric, "maximize" if mode == "max" else "minimize"


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


def lock_sweep_dir(output_dir: Path) -> int:
    """Hold output_dir/sweep.lock while this sweep runs (the kernel lets go when the process ends, however)."""
    path = output_dir / "sweep.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"another sweep runs in {output_dir} ({holder}); wait for it or choose another output_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd


def requeue(study: optuna.Study, number: int, params: dict, attrs: dict, n_params: int) -> None:
    """Mark an interrupted trial failed and queue its values again for its own directory, where
    training resumes from its checkpoint (unless it never got that far)."""
    from optuna.trial import TrialState

    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    queued = any(t.user_attrs.get("output_dir") == attrs.get("output_dir") for t in waiting)
    if "output_dir" in attrs and len(params) == n_params and not queued:
        study.enqueue_trial(params, user_attrs={"output_dir": attrs["output_dir"], "resumes": number})
    study.tell(number, state=TrialState.FAIL)


class Interrupt:
    """SIGTERM, SIGINT or SIGUSR1 to the sweep: remembered, and passed to the running trial as SIGTERM."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self):
        self.signal: signal.Signals | None = None
        self.child: subprocess.Popen | None = None
        self._previous: dict = {}

    def __enter__(self) -> Interrupt:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.signal = signal.Signals(signum)
        self.stop_child()

    def stop_child(self) -> None:
        """SIGTERM to the running trial (training checkpoints and exits 75)."""
        if self.child is not None and self.child.returncode is None:
            self.child.send_signal(signal.SIGTERM)


def stop_with_parent() -> None:
    """SIGTERM to this process (training: checkpoint, exit 75) when its parent dies; Linux only."""
    if LIBC is not None:
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _child_setup() -> None:
    """In the trial's process before it starts: Ctrl-C reaches the whole foreground group, and the
    sweep passes it on as one SIGTERM, so the trial ignores SIGINT; it stops when the sweep dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop_with_parent()


def validations(run_dir: Path, metric: str) -> list[float]:
    """The metric's logged values, in order; a line still being written (no newline yet) is left out."""
    try:
        text = (run_dir / "metrics.jsonl").read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    values = []
    for line in text.split("\n")[:-1]:
        try:
            value = json.loads(line).get(metric)
        except (json.JSONDecodeError, AttributeError):
            continue
        if value is not None:
            values.append(value)
    return values


def train_command(args: list[str], nproc: int | None, worker: bool = False) -> list[str]:
    """The trial's command: training itself, or under torchrun (workers through the --worker wrapper)."""
    module = ["-m", f"{__package__}.sweep", WORKER] if worker else ["-m", f"{__package__}.train"]
    if not nproc:
        return [sys.executable, *module, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *module, *args]


def start_trial(args: list[str], nproc: int | None, log) -> subprocess.Popen:
    """Start training as a child process in the sweep's process group, its output in log."""
    log.write(f"$ python {shlex.join(train_command(args, nproc)[1:])}\n")  # what reruns it by hand
    log.flush()
    env = os.environ.copy()
    if nproc:  # torchrun --signals-to-handle without SIGINT: the sweep sends SIGTERM instead
        env["PET_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGHUP,SIGQUIT"
    return subprocess.Popen(
        train_command(args, nproc, worker=bool(nproc)),
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_child_setup,
    )  # fmt: skip


def watch(trial: optuna.Trial, run_dir: Path, metric: str, stop: Interrupt) -> tuple[int, list[float], bool]:
    """Report each new validation of the running trial; stop it once the pruner says so.

    Returns its exit status, the metric's values and whether it was pruned. Each value is reported
    and judged whether or not the child has ended meanwhile: a trial's fate depends on its values
    only, never on when they were read.
    """
    reported, pruned = 0, False
    while True:
        code = stop.child.poll()
        values = validations(run_dir, metric)
        while not pruned and reported < len(values):
            trial.report(float(values[reported]), step=reported)
            reported += 1
            pruned = trial.should_prune()
        if pruned and code is None:
            stop.stop_child()  # it checkpoints and exits 75
            code = stop.child.wait()
        if code is not None:
            return code, values[:reported] if pruned else values, pruned
        time.sleep(POLL_S)


@dataclass
class Outcome:
    state: str
    """The trial's state in the study: COMPLETE, PRUNED or FAIL."""
    value: float | None = None
    message: str = ""
    exit_status: int | None = None
    """Set when the sweep must stop: 2 (every trial would fail alike) or 75 (stopped by a signal)."""


def run_trial(study: optuna.Study, trial: optuna.Trial, sweep: SweepConfig, metric: str, stop: Interrupt) -> Outcome:
    """Sample, train in a child process while reporting its validations, and tell Optuna how it ended."""
    from optuna.trial import TrialState

    sampled = [as_override(key, suggest(trial, key, space)) for key, space in sweep.params.items()]
    run_dir = Path(trial.user_attrs.get("output_dir") or Path(sweep.output_dir) / f"trial_{trial.number}")
    trial.set_user_attr("output_dir", str(run_dir))
    resumes = f" (resumes trial {trial.user_attrs['resumes']})" if "resumes" in trial.user_attrs else ""
    print(f"trial {trial.number}{resumes}: {' '.join(sampled)} (log: {run_dir / 'trial.log'})", flush=True)
    args = [*(f"--config={path}" for path in sweep.config), *sweep.overrides, *sampled, f"run.output_dir={run_dir}"]
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(run_dir / "trial.log", "a", encoding="utf-8") as log:
        stop.child = start_trial(args, sweep.nproc_per_node, log)
        if stop.signal:  # it arrived while the child was being started
            stop.stop_child()
        code, values, pruned = watch(trial, run_dir, metric, stop)
        stop.child = None
    trial.set_user_attr("wall_s", round(time.monotonic() - started, 1))
    if pruned:
        study.tell(trial, state=TrialState.PRUNED)
        return Outcome("PRUNED", values[-1])
    if code == 0 and values:
        best = max(values) if study.direction.name == "MAXIMIZE" else min(values)
        study.tell(trial, best)
        return Outcome("COMPLETE", best)
    if code == PREEMPTED_EXIT or (stop.signal and code != 0):
        requeue(study, trial.number, trial.params, trial.user_attrs, len(sweep.params))
        why = stop.signal.name if stop.signal else "a signal to the training"
        return Outcome("FAIL", None, f"(interrupted by {why}; the next start resumes it in {run_dir})", PREEMPTED_EXIT)
    why = last_error(run_dir / "trial.log") if code else f"it logged no {metric}"
    trial.set_user_attr("error", why)
    study.tell(trial, state=TrialState.FAIL)
    return Outcome("FAIL", None, f"trial {trial.number} failed: {why} (log: {log.name})", 2 if code == 2 else None)


def suggest(trial: optuna.Trial, key: str, space: SearchSpace) -> Any:
    """The trial's value for key (an enqueued trial's own, else the sampler's)."""
    if space.type == "categorical":
        return trial.suggest_categorical(key, space.choices)
    if space.type == "int":
        step = int(space.step or 1)
        return trial.suggest_int(key, int(space.low), int(space.high), step=step, log=space.log)
    return trial.suggest_float(key, space.low, space.high, step=space.step, log=space.log)


def last_error(log: Path) -> str:
    """The training's `error: ...` line in its log, else its last line."""
    lines = [line.strip() for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["no output"])[-1].removeprefix("error: ")[:500]


def finished(study: optuna.Study) -> int:
    """Trials that count towards `trials`: completed or pruned."""
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


def summary(study: optuna.Study, sweep: SweepConfig, metric: str) -> dict:
    """Every trial (state, value, values sampled, directory, wall time) and the best one."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    resumed_as = {t.user_attrs["resumes"]: t.number for t in trials if "resumes" in t.user_attrs}
    rows = []
    for t in trials:
        note = t.user_attrs.get("error", "")
        if t.number in resumed_as:
            note = f"interrupted; resumed as trial {resumed_as[t.number]}"
        elif "resumes" in t.user_attrs:
            note = f"resumes trial {t.user_attrs['resumes']}"
        rows.append(
            {
                "trial": t.number,
                "state": t.state.name,
                "value": t.value,
                "params": t.params,
                "output_dir": t.user_attrs.get("output_dir"),
                "wall_s": t.user_attrs.get("wall_s"),
                "note": note,
            }
        )
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    best = study.best_trial if complete else None
    return {
        "study": sweep.study,
        "metric": metric,
        "direction": study.direction.name.lower(),
        "trials": rows,
        "best": next(row for row in rows if row["trial"] == best.number) if best else None,
    }


def print_summary(result: dict, space: dict[str, SearchSpace]) -> None:
    """The trials as a table, then the best one with the commands that evaluate and export it."""
    metric = result["metric"]
    header = ["trial", "state", metric, *space, "wall_s", "note"]
    table = [header]
    for row in result["trials"]:
        params = [_short(row["params"].get(key)) for key in space]
        cells = [str(row["trial"]), row["state"], _short(row["value"]), *params, _short(row["wall_s"]), row["note"]]
        table.append(cells)
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
    best = result["best"]
    if best:
        where = best["output_dir"]
        print(f"best: trial {best['trial']}, {metric}={best['value']:.6g}, in {where} (best.safetensors, best.json)")
        print(f"  python -m {__package__}.evaluate run.output_dir={where}")
        print(f"  python -m {__package__}.export run.output_dir={where}", flush=True)


def _short(value: Any) -> str:
    """A table cell: 4 significant digits, - for nothing."""
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def write_summary(result: dict, output_dir: Path) -> None:
    """output_dir/summary.json, replaced whole after every trial."""
    path = output_dir / "summary.json"
    text = json.dumps(result, indent=1, allow_nan=False, default=str) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


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
        os.close(lock)


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
    failures, status = 0, 0
    with Interrupt() as stop:
        while finished(study) < sweep.trials and not stop.signal:
            outcome = run_trial(study, study.ask(), sweep, metric, stop)
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


def wandb_sweep(sweep: SweepConfig, metric: str, direction: str) -> dict:
    """The same search as a wandb sweep configuration, for `wandb sweep FILE` and `wandb agent`.

    wandb's agent sets WANDB_RUN_ID in each run's environment (after it has filled in the command),
    so the run's directory is named by OmegaConf's env resolver, which the training config resolves.
    """
    parameters = {}
    for key, space in sweep.params.items():
        if space.type == "categorical":
            parameters[key] = {"values": list(space.choices)}
        elif space.type == "float":
            kind = "log_uniform_values" if space.log else "q_uniform" if space.step else "uniform"
            parameters[key] = {"distribution": kind, "min": space.low, "max": space.high}
            if space.step:
                parameters[key]["q"] = space.step
        elif space.log:  # an integer q makes wandb return integers
            parameters[key] = {"distribution": "q_log_uniform_values", "min": int(space.low), "max": int(space.high)}
            parameters[key]["q"] = 1
        elif space.step and space.step != 1:  # exactly Optuna's grid low, low + step, ...
            parameters[key] = {"values": list(range(int(space.low), int(space.high) + 1, int(space.step)))}
        else:
            parameters[key] = {"distribution": "int_uniform", "min": int(space.low), "max": int(space.high)}
    run_dir = f"{sweep.output_dir}/wandb-runs/" + "${oc.env:WANDB_RUN_ID}"
    command = ["${env}", "${interpreter}", "-m", f"{__package__}.train"]
    command += [item for f in sweep.config for item in ("--config", f)]
    command += [*sweep.overrides, "tracker.name=wandb", f"run.output_dir={run_dir}", "${args_no_hyphens}"]
    return {
        "name": sweep.study,
        "method": "bayes",
        "metric": {"name": metric, "goal": direction},
        "parameters": parameters,
        "command": command,
    }


def write_wandb_sweep(path: Path, config: dict) -> None:
    """The wandb sweep file, with a comment saying how to start it."""
    header = f"# wandb sweep {path}, then wandb agent with the sweep id it prints (made by {__package__}.sweep)\n"
    text = header + yaml.safe_dump(config, sort_keys=False)
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    print(f"wrote {path}; start it with `wandb sweep {path}`, then `wandb agent` with the sweep id it prints")


def worker(argv: list[str]) -> int:
    """A trial's training process under torchrun: stops (checkpoint, exit 75) when torchrun dies."""
    stop_with_parent()
    return train.main(argv)


class _Parser(argparse.ArgumentParser):
    """Command-line mistakes as a ConfigError: one `error: ...` line and exit 2, like every entry point."""

    def error(self, message: str):
        raise ConfigError(f"{message} (see python -m {__package__}.sweep --help)")


def main(argv: list[str] | None = None) -> int:
    """The command line: parse, check, then write the wandb file or run the sweep; the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [WORKER]:
        return worker(argv[1:])
    parser = _Parser(prog=f"python -m {__package__}.sweep", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", required=True, type=Path, metavar="FILE", help="the sweep file: configs/sweep.yaml")
    parser.add_argument("--nproc-per-node", type=int, metavar="N", help="run each trial under torchrun, N processes")
    parser.add_argument("--wandb-sweep-file", type=Path, metavar="FILE", help="write a wandb sweep file, and exit")
    parser.add_argument("overrides", nargs="*", help="key=value for the sweep file's keys, e.g. trials=20")
    try:
        args = parser.parse_args(argv)
        nproc = [f"nproc_per_node={args.nproc_per_node}"] if args.nproc_per_node is not None else []
        sweep = load_sweep(args.config, [*args.overrides, *nproc])
        metric, direction = check_training(sweep)
        if args.wandb_sweep_file:
            write_wandb_sweep(args.wandb_sweep_file, wandb_sweep(sweep, metric, direction))
            return 0
        return run_sweep(sweep, metric, direction)
    except ConfigError as err:
        return report(err)


if __name__ == "__main__":
    sys.exit(main())
