"""One trial: training with the sampled values as a child process, its validations reported to Optuna
as they are written, a SIGTERM when the pruner gives up on it, and the outcome told to the study."""

from __future__ import annotations

import ctypes
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import PACKAGE
from ..errors import PREEMPTED_EXIT
from ..preemption import StopRequest
from .config import SearchSpace, SweepConfig, as_override

if TYPE_CHECKING:
    import optuna

POLL_S = 0.5  # seconds between reads of a running trial's metrics.jsonl
PR_SET_PDEATHSIG = 1  # linux/prctl.h
LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None  # loaded before any fork


class Child:
    """The running trial's process; a stop of the sweep (StopRequest's on_stop) reaches it as one SIGTERM."""

    def __init__(self):
        self.process: subprocess.Popen | None = None

    def stop(self) -> None:
        """SIGTERM to the running trial (training checkpoints and exits 75)."""
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)


def _child_setup() -> None:
    """In the trial's process before it starts: Ctrl-C reaches the whole foreground group, and the sweep
    passes it on as one SIGTERM, so the trial ignores SIGINT; on Linux it gets SIGTERM when the sweep dies.
    (torchrun's workers, in sessions of their own, stop by themselves once torchrun is gone: preemption.py.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if LIBC is not None:
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def train_command(args: list[str], nproc: int | None) -> list[str]:
    """The trial's command: training itself, or under torchrun."""
    if not nproc:
        return [sys.executable, "-m", f"{PACKAGE}.train", *args]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*torchrun, "-m", f"{PACKAGE}.train", *args]


def start_trial(args: list[str], nproc: int | None, log) -> subprocess.Popen:
    """Start training as a child process in the sweep's process group, its output in log."""
    command = train_command(args, nproc)
    log.write(f"$ python {shlex.join(command[1:])}\n")  # what reruns it by hand
    log.flush()
    env = os.environ.copy()
    if nproc:  # torchrun --signals-to-handle without SIGINT: the sweep sends SIGTERM instead
        env["PET_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGHUP,SIGQUIT"
    return subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_child_setup
    )


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


def watch(trial: optuna.Trial, run_dir: Path, metric: str, child: Child) -> tuple[int, list[float], bool]:
    """Report each new validation of the running trial; stop it once the pruner says so.

    Returns its exit status, the metric's values and whether it was pruned. Each value is reported
    and judged whether or not the child has ended meanwhile: a trial's fate depends on its values
    only, never on when they were read.
    """
    reported, pruned = 0, False
    while True:
        code = child.process.poll()
        values = validations(run_dir, metric)
        while not pruned and reported < len(values):
            trial.report(float(values[reported]), step=reported)
            reported += 1
            pruned = trial.should_prune()
        if pruned and code is None:
            child.stop()  # it checkpoints and exits 75
            code = child.process.wait()
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


def run_trial(
    study: optuna.Study, trial: optuna.Trial, sweep: SweepConfig, metric: str, stop: StopRequest, child: Child
) -> Outcome:
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
        child.process = start_trial(args, sweep.nproc_per_node, log)
        if stop.reason:  # it arrived while the child was being started
            child.stop()
        code, values, pruned = watch(trial, run_dir, metric, child)
        child.process = None
    trial.set_user_attr("wall_s", round(time.monotonic() - started, 1))
    if pruned:
        study.tell(trial, state=TrialState.PRUNED)
        return Outcome("PRUNED", values[-1])
    if code == 0 and values:
        best = max(values) if study.direction.name == "MAXIMIZE" else min(values)
        study.tell(trial, best)
        return Outcome("COMPLETE", best)
    if code == PREEMPTED_EXIT or (stop.reason and code != 0):
        requeue(study, trial.number, trial.params, trial.user_attrs, len(sweep.params))
        why = stop.reason or "a signal to the training"
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


def requeue(study: optuna.Study, number: int, params: dict, attrs: dict, n_params: int) -> None:
    """Mark an interrupted trial failed and queue its values again for its own directory, where
    training resumes from its checkpoint (unless it never got that far)."""
    from optuna.trial import TrialState

    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    queued = any(t.user_attrs.get("output_dir") == attrs.get("output_dir") for t in waiting)
    if "output_dir" in attrs and len(params) == n_params and not queued:
        study.enqueue_trial(params, user_attrs={"output_dir": attrs["output_dir"], "resumes": number})
    study.tell(number, state=TrialState.FAIL)


def last_error(log: Path) -> str:
    """The training's `error: ...` line in its log, else its last line."""
    lines = [line.strip() for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["no output"])[-1].removeprefix("error: ")[:500]
