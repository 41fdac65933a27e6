"""Hyperparameter sweeps: trials are training runs in their own directories, pruned, resumed after a kill.

The trials train the tiny CPU configuration as child processes; those tests are marked slow.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import list_checkpoints
from {{ cookiecutter.package_name }}.engine.config import load_config, parse_args
from {{ cookiecutter.package_name }}.engine.monitor import monitored
from {{ cookiecutter.package_name }}.engine.preemption import PREEMPTED_EXIT
from {{ cookiecutter.package_name }}.engine.sweep.study import lock_sweep_dir
from {{ cookiecutter.package_name }}.sweep import main
from {{ cookiecutter.package_name }}.task.config import SPEC

from conftest import read_metrics
from tiny import TINY

SWEEP = ["-m", "{{ cookiecutter.package_name }}.sweep"]
LR = {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}
METRIC, MODE = monitored(load_config(SPEC, [], TINY).trainer, SPEC)
BEST = max if MODE == "max" else min


@pytest.fixture(autouse=True)
def children_find_the_package(monkeypatch):
    """The trials' processes import this package as the tests do, one thread each."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def sweep_file(tmp_path: Path, **keys) -> Path:
    """A sweep over optim.lr of tiny runs into tmp_path/sweep, with `keys` replaced."""
    spec = {
        "study": "test",
        "output_dir": str(tmp_path / "sweep"),
        "trials": 3,
        "config": [],
        "overrides": TINY,
        "pruner": {"name": "none"},
        "params": {"optim.lr": LR},
        **keys,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    return path


def summary(tmp_path: Path) -> list[dict]:
    return json.loads((tmp_path / "sweep" / "summary.json").read_text(encoding="utf-8"))["trials"]


def logged(run_dir: Path) -> list[float]:
    """The monitored metric's values in a run's metrics.jsonl."""
    return [record[METRIC] for record in read_metrics(run_dir) if METRIC in record]


def start(path: Path, *args: str) -> subprocess.Popen:
    """The sweep as a command, in a process group of its own (like a shell's job)."""
    command = [sys.executable, *SWEEP, "--config", str(path), *args]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def wait_for_checkpoint(run_dir: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not list_checkpoints(run_dir / "checkpoints"):
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"no checkpoint in {run_dir} within {timeout} s"
        time.sleep(0.05)


def processes_writing_to(path: Path) -> list[int]:
    """Live (not zombie) processes whose command line names path: the trials' training processes."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            named = str(path).encode() in (proc / "cmdline").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # ended meanwhile
        if named and state != "Z":
            found.append(int(proc.name))
    return found


def wait_until_gone(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while processes_writing_to(path):
        assert time.monotonic() < deadline, f"training processes still running after {timeout} s"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.core  # the study, its trials' directories and the summary: the same for every task
def test_a_small_study_trains_each_trial_in_its_own_directory(tmp_path, capsys):
    """Three trials, each a training run in output_dir/trial_N with its sampled values. The study goes
    the way the training config's trainer.monitor_mode says (here against the metric's own direction, so
    that the best validation is not simply the last): each trial's value is the best monitored metric in
    its metrics.jsonl, and the summary names the best trial with the commands that evaluate and export it."""
    reverse = {"max": "min", "min": "max"}[MODE]
    params = {"optim.lr": LR, "optim.weight_decay": {"type": "float", "low": 0.0, "high": 0.2}}
    overrides = [*TINY, "trainer.max_epochs=2", f"trainer.monitor_mode={reverse}"]
    assert main(["--config", str(sweep_file(tmp_path, overrides=overrides, params=params))]) == 0
    out = capsys.readouterr().out
    assert json.loads((tmp_path / "sweep" / "summary.json").read_text())["direction"] == f"{reverse}imize"
    best_of = max if reverse == "max" else min
    trials = summary(tmp_path)
    assert [t["state"] for t in trials] == ["COMPLETE"] * 3
    for t in trials:
        run_dir = Path(t["output_dir"])
        assert run_dir == tmp_path / "sweep" / f"trial_{t['trial']}"
        assert len(logged(run_dir)) == 2 and t["value"] == best_of(logged(run_dir))
        trained = load_config(SPEC, [run_dir / "config.yaml"]).optim
        assert {"optim.lr": trained.lr, "optim.weight_decay": trained.weight_decay} == t["params"]
    assert len({t["params"]["optim.lr"] for t in trials}) == 3
    best = best_of(trials, key=lambda t: t["value"])
    assert f"best: trial {best['trial']}," in out
    assert f"{{ cookiecutter.package_name }}.evaluate run.output_dir={best['output_dir']}" in out


@pytest.mark.slow
@pytest.mark.core  # the pruner and the failure count: the same for every task
def test_a_trial_worse_than_the_median_is_pruned_and_stopped(tmp_path):
    """After a normal trial, one that cannot learn (optim.lr=1e-7; both enqueued) is worse at its fourth
    validation, the first after the warm-up: the median pruner stops it there with SIGTERM."""
    path = sweep_file(
        tmp_path,
        trials=2,
        # 25 epochs of a few steps each: room for the SIGTERM to land before the end on a loaded machine
        overrides=[*TINY, "trainer.max_epochs=25", "trainer.checkpoint_every=1000"],
        pruner={"name": "median", "startup_trials": 1, "warmup_validations": 3},
        enqueue=[{"optim.lr": 0.002}, {"optim.lr": 1e-7}],
        params={"optim.lr": {"type": "float", "low": 1e-8, "high": 1e-2, "log": True}},
    )
    assert main(["--config", str(path)]) == 0
    normal, hopeless = summary(tmp_path)
    assert (normal["state"], hopeless["state"]) == ("COMPLETE", "PRUNED")
    assert hopeless["params"]["optim.lr"] == 1e-7
    values = logged(Path(hopeless["output_dir"]))
    assert 4 <= len(values) < 25, "pruned at the fourth validation, so stopped before the last"
    assert hopeless["value"] == values[3]
    assert "stopped by SIGTERM" in (Path(hopeless["output_dir"]) / "trial.log").read_text()


@pytest.mark.slow
@pytest.mark.core  # the pruner and the failure count: the same for every task
def test_failed_trials_do_not_count_and_three_in_a_row_end_the_sweep(tmp_path, capsys):
    """Trials whose training fails (exit 1: here each diverges) are FAIL with the training's error line
    and do not count towards `trials`; three failures in a row end the sweep with exit 1."""
    diverges = {"optim.lr": {"type": "float", "low": 1e9, "high": 1e10, "log": True}}
    path = sweep_file(tmp_path, overrides=[*TINY, "trainer.max_steps=1", "optim.warmup_steps=0"], params=diverges)
    assert main(["--config", str(path)]) == 1
    trials = summary(tmp_path)
    assert [t["state"] for t in trials] == ["FAIL"] * 3
    assert all(t["note"].startswith("val/loss is nan at step 1; lower optim.lr") for t in trials), trials
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: 3 trials failed in a row; the last one: trial 2 failed"), err


@pytest.mark.slow
@pytest.mark.core  # the sweep's journal, signals and resume: the same for every task
def test_a_sweep_killed_mid_trial_resumes_it_and_ends_with_as_many_trials(tmp_path):
    """SIGKILL to the sweep's process group while trial 1 trains, after its first checkpoint, leaves no
    training process behind; the same command then re-runs trial 1's values in its directory, where
    training resumes from the checkpoint rather than starting again, draws new values for the next
    trial (not the first start's again), and ends with 3 trials."""
    path = sweep_file(tmp_path, overrides=[*TINY, "trainer.max_epochs=2", "trainer.checkpoint_every=2"])
    process = start(path)
    interrupted = tmp_path / "sweep" / "trial_1"
    wait_for_checkpoint(interrupted, process)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=60)
    wait_until_gone(tmp_path / "sweep", timeout=10)
    killed_at = int(list_checkpoints(interrupted / "checkpoints")[-1].name[5:13])

    again = subprocess.run([sys.executable, *SWEEP, "--config", str(path)], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    trials = summary(tmp_path)
    assert [t["state"] for t in trials] == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    assert trials[1]["state"] == "FAIL" and trials[1]["note"].startswith("interrupted; resumed as trial 2")
    resumed = trials[2]
    assert resumed["output_dir"] == str(interrupted) and resumed["params"] == trials[1]["params"]
    starts = json.loads((interrupted / "run_info.json").read_text())["runs"]
    assert [run["resumed_from_step"] for run in starts] == [None, killed_at]
    steps = [record["step"] for record in read_metrics(interrupted) if METRIC in record]
    assert steps == sorted(set(steps)) and len(steps) == 2  # each epoch's validation once
    assert resumed["value"] == BEST(logged(interrupted))
    assert trials[3]["params"]["optim.lr"] not in (trials[0]["params"]["optim.lr"], trials[1]["params"]["optim.lr"])


@pytest.mark.slow
@pytest.mark.core  # the sweep's journal, signals and resume: the same for every task
def test_ctrl_c_stops_the_trial_with_a_checkpoint_and_the_sweep_resumes_it(tmp_path):
    """SIGINT to the whole process group (Ctrl-C in a terminal) reaches the trial as one SIGTERM: it
    checkpoints, the sweep exits 75, and the same command finishes the trial from there."""
    path = sweep_file(tmp_path, trials=1, overrides=[*TINY, "trainer.max_epochs=4", "trainer.checkpoint_every=100"])
    process = start(path)
    run_dir = tmp_path / "sweep" / "trial_0"
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").exists():  # training has started
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0][-3000:]
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == PREEMPTED_EXIT, output[-3000:]
    log = (run_dir / "trial.log").read_text()
    assert log.count("stopped by SIGTERM") == 1 and "Traceback" not in log, log[-3000:]
    stopped_at = int(list_checkpoints(run_dir / "checkpoints")[-1].name[5:13])
    assert 0 < stopped_at < 24

    assert main(["--config", str(path)]) == 0
    assert [t["state"] for t in summary(tmp_path)] == ["FAIL", "COMPLETE"]
    starts = json.loads((run_dir / "run_info.json").read_text())["runs"]
    assert [run["resumed_from_step"] for run in starts] == [None, stopped_at]


@pytest.mark.slow
@pytest.mark.core  # the sweep's journal, signals and resume: the same for every task
def test_torchrun_workers_stop_with_a_checkpoint_when_the_sweep_is_killed(tmp_path):
    """Under --nproc-per-node torchrun starts its workers in sessions of their own, out of reach of a
    SIGKILL to the sweep's process group: they stop by themselves once torchrun is gone, with a
    checkpoint, long before their 180 steps are done, and the next start finishes the trial. (With 24
    steps, as this test had, a trial could end in the second its workers take to notice.)"""
    path = sweep_file(tmp_path, trials=1, overrides=[*TINY, "trainer.max_epochs=60", "trainer.checkpoint_every=2"])
    process = start(path, "--nproc-per-node", "2")
    run_dir = tmp_path / "sweep" / "trial_0"
    wait_for_checkpoint(run_dir, process)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=60)
    wait_until_gone(tmp_path / "sweep", timeout=30)
    assert "launcher (pid" in (run_dir / "trial.log").read_text()  # stopped by the loss of its launcher
    stopped_at = int(list_checkpoints(run_dir / "checkpoints")[-1].name[5:13])
    assert stopped_at < 180

    assert main(["--config", str(path), "--nproc-per-node", "2"]) == 0
    starts = json.loads((run_dir / "run_info.json").read_text())["runs"]
    assert [(run["resumed_from_step"], run["world_size"]) for run in starts] == [(None, 2), (stopped_at, 2)]


@pytest.mark.core  # the same for every task
@pytest.mark.parametrize(
    ("keys", "args", "expected"),
    [
        ({}, ["trials=0"], "error: trials=0 must be at least 1"),
        ({"trails": 3}, [], "trails: Key 'trails' not in 'SweepConfig'"),
        ({"params": {"optim.lrr": LR}}, [], "optim.lrr: unknown key; did you mean optim.lr?"),
        ({"params": {"optim.lr": {**LR, "low": 0.1}}}, [], "params.optim.lr: low=0.1 must be below high=0.01"),
        ({"params": {"optim.lr": {"type": "normal"}}}, [], "choose one of float, int, categorical"),
        ({"params": {"data.batch_size": {"type": "categorical", "choices": [8, 0]}}}, [], "batch_size=0 must be at"),
        ({"pruner": {"name": "hyperband"}}, [], "pruner.name='hyperband' is not allowed"),
        ({"overrides": [*TINY, "run.output_dir=x"]}, [], "the sweep sets run.output_dir"),
        ({"enqueue": [{"optim.wd": 0.1}]}, [], "enqueue: optim.wd not in params"),
        ({}, ["--nproc-per-node", "two"], "invalid int value: 'two'"),
    ],
)
def test_a_bad_sweep_file_exits_2_with_one_line_before_any_trial(keys, args, expected, tmp_path, capsys):
    """Mistakes in the sweep file, in its search space (checked against the training config at each
    bound) or on the command line: exit 2, one `error:` line naming the key, and no trial started."""
    assert main(["--config", str(sweep_file(tmp_path, **keys)), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and expected in err[0], err
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
@pytest.mark.core  # the same for every task
def test_a_configuration_error_in_a_trial_stops_the_sweep_with_exit_2(tmp_path, capsys):
    """A configuration that only training finds wrong fails every trial alike: the first one's error
    line ends the sweep with exit status 2 instead of starting the next."""
    path = sweep_file(tmp_path, overrides=[*TINY, "trainer.grad_accum_steps=100"])
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trial 0 failed: trainer.grad_accum_steps=100 exceeds" in err[0], err
    assert [t["state"] for t in summary(tmp_path)] == ["FAIL"]


@pytest.mark.core  # the same for every task
def test_a_second_sweep_in_the_same_directory_is_refused(tmp_path, capsys):
    """Two sweeps cannot share an output_dir (each would take the other's running trial for a dead one)."""
    path = sweep_file(tmp_path)
    (tmp_path / "sweep").mkdir()
    held = lock_sweep_dir(tmp_path / "sweep")
    try:
        assert main(["--config", str(path)]) == 2
    finally:
        held.release()
    assert f"another sweep runs in {tmp_path / 'sweep'} (pid {os.getpid()}" in capsys.readouterr().err


def test_the_shipped_sweep_file_searches_the_training_config(tmp_path, monkeypatch, capsys):
    """configs/sweep.yaml is a valid search: every key and bound of its space loads with the training
    config it names (writing the wandb file checks all that and trains nothing)."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # its paths are relative to the project root
    assert main(["--config", "configs/sweep.yaml", "--wandb-sweep-file", str(tmp_path / "w.yaml")]) == 0
    assert yaml.safe_load((tmp_path / "w.yaml").read_text())["metric"]["name"] == METRIC


@pytest.mark.core  # the same for every task
def test_the_wandb_sweep_file_searches_the_same_space_through_wandb_agent(tmp_path, monkeypatch):
    """--wandb-sweep-file writes the same search for `wandb agent`: each distribution in wandb's terms,
    the metric and its goal, and a command whose key=value arguments train in a directory per run."""
    params = {
        "optim.lr": LR,
        "optim.weight_decay": {"type": "float", "low": 0.0, "high": 0.2, "step": 0.05},
        "trainer.grad_accum_steps": {"type": "int", "low": 1, "high": 4},
        "trainer.log_every": {"type": "int", "low": 2, "high": 8, "step": 2},
        "trainer.keep_last": {"type": "int", "low": 1, "high": 16, "log": True},
        "data.batch_size": {"type": "categorical", "choices": [16, 32]},
    }
    out = tmp_path / "wandb-sweep.yaml"
    assert main(["--config", str(sweep_file(tmp_path, params=params)), "--wandb-sweep-file", str(out)]) == 0
    spec = yaml.safe_load(out.read_text())
    assert spec["method"] == "bayes"
    assert spec["metric"] == {"name": METRIC, "goal": "maximize" if MODE == "max" else "minimize"}
    assert spec["parameters"] == {
        "optim.lr": {"distribution": "log_uniform_values", "min": 1e-3, "max": 1e-2},
        "optim.weight_decay": {"distribution": "q_uniform", "min": 0.0, "max": 0.2, "q": 0.05},
        "trainer.grad_accum_steps": {"distribution": "int_uniform", "min": 1, "max": 4},
        "trainer.log_every": {"values": [2, 4, 6, 8]},
        "trainer.keep_last": {"distribution": "q_log_uniform_values", "min": 1, "max": 16, "q": 1},
        "data.batch_size": {"values": [16, 32]},
    }
    command = spec["command"]
    assert command[:4] == ["${env}", "${interpreter}", "-m", "{{ cookiecutter.package_name }}.train"]
    assert command[-1] == "${args_no_hyphens}" and "tracker.name=wandb" in command
    # What the agent starts: ${args_no_hyphens} are key=value pairs, and it sets WANDB_RUN_ID.
    monkeypatch.setenv("WANDB_RUN_ID", "r4nd0m")
    files, overrides = parse_args(SPEC, [*command[4:-1], "optim.lr=0.004", "data.batch_size=16"], "train")
    cfg = load_config(SPEC, files, overrides)
    assert cfg.run.output_dir == f"{tmp_path / 'sweep'}/wandb-runs/r4nd0m"
    assert (cfg.optim.lr, cfg.data.batch_size, cfg.tracker.name) == (0.004, 16, "wandb")
    assert not (tmp_path / "sweep").exists()  # writing the file runs nothing
