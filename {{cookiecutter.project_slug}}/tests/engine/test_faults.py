"""The fault matrix: each fault is injected for real on CPU, and what must hold afterwards is asserted.

| fault                                             | must hold                                           |
|---------------------------------------------------|-----------------------------------------------------|
| SIGKILL at a random moment (1 process + workers,  | resume ends bit-identical to an uninterrupted run:  |
| 2 processes DDP, 2 processes FSDP with sharded    | weights, optimizer, scheduler, logged losses        |
| checkpoints, written in the background too)       |                                                     |
| SIGTERM to torchrun (FSDP); SIGUSR1 to every      | one checkpoint after an agreed step, exit well      |
| process (1 process, saving in the background)     | inside torchrun's 30 s (75 without torchrun), exact |
| SIGKILL to torchrun alone (DDP), its workers live | they stop within seconds as on SIGTERM (exit 75);   |
| on in sessions of their own                       | the same command resumes at once, exact             |
| a worker dies under torchrun --max-restarts=1     | the restarted group resumes by itself, bit-exact    |
| (FSDP, sharded checkpoints)                       |                                                     |
| a peer hangs (DDP) or dies (FSDP)                 | the others exit 1 within distributed.timeout_s with |
|                                                   | one clear line; the newest checkpoint verifies      |
| NaN gradient                                      | exit 1 naming the step; update skipped; no NaN saved|
| corrupt, truncated or bit-flipped newest file     | warned, renamed aside, previous one used            |
| disk full while saving                            | exit 2, older checkpoints intact                    |
| pickle payload given to train or evaluate         | refused, exit 2, the payload never runs             |

The subprocess tests are marked slow; the template's own test suite runs them.
"""

import contextlib
import ctypes
import errno
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.engine import preemption
from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from {{ cookiecutter.package_name }}.engine.preemption import PREEMPTED_EXIT, StopRequest
from {{ cookiecutter.package_name }}.evaluate import main as evaluate_main
from {{ cookiecutter.package_name }}.export import main as export_main
from {{ cookiecutter.package_name }}.task.task import Task
from {{ cookiecutter.package_name }}.train import main

from conftest import in_full, read_metrics
from tiny import RANDOM_DATA, VAL_KEYS

# Augmentation on, log windows that straddle checkpoints (log_every=3, checkpoint_every=2).
RESUMABLE = [*RANDOM_DATA, "trainer.checkpoint_every=2", "trainer.log_every=3", "trainer.keep_last=2"]
# One process loads with DataLoader workers (which signals reach too), two processes gather their
# batches on the device (data.loader=device): both pipelines must resume bit-exactly.
ONE_PROCESS = [*RESUMABLE, "data.loader=workers", "data.num_workers=2", "trainer.max_epochs=8"]  # 6 steps per epoch
TWO_PROCESSES = [*RESUMABLE, "data.loader=device", "trainer.max_epochs=8"]  # 3 steps per epoch: 192 samples / (2 x 32)

# Runs training with a fault injected right after optimizer step FAULT_STEP on rank FAULT_RANK,
# only in a process's first life (torchrun sets TORCHELASTIC_RESTART_COUNT on restarts); FAULT=none
# injects nothing. STEP_PAUSE_S pauses after every step (a run that must outlast a reaction time).
DRIVER = """
import os, signal, sys, time
import torch
from {{ cookiecutter.package_name }} import train

real_step = torch.optim.lr_scheduler.LambdaLR.step

def step_then_fault(self, *args, **kwargs):
    real_step(self, *args, **kwargs)
    time.sleep(float(os.environ.get("STEP_PAUSE_S", "0")))
    first_life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    mine = os.environ.get("RANK", "0") == os.environ.get("FAULT_RANK", "0")
    if os.environ["FAULT"] != "none" and first_life and mine and self.last_epoch == int(os.environ["FAULT_STEP"]):
        if os.environ["FAULT"] == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)  # hang

torch.optim.lr_scheduler.LambdaLR.step = step_then_fault
sys.exit(train.main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def environment(**extra) -> dict:
    """This environment, one thread per process, and no TORCH_DISABLE_SHARE_RDZV_TCP_STORE: restarts
    must work without it (engine/parallel/distributed.py, restart_store)."""
    inherited = {key: value for key, value in os.environ.items() if key != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    return {**inherited, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path), **extra}


def start(nproc: int, args: list[str], *launcher_args: str, script: Path | None = None, **env) -> subprocess.Popen:
    """Start training in its own session: plain python for nproc=0, else torchrun with nproc CPU processes."""
    program = [str(script)] if script else ["-m", "{{ cookiecutter.package_name }}.train"]
    command = [sys.executable]
    if nproc:
        command += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *launcher_args]
    return subprocess.Popen(
        [*command, *program, *args],
        env=environment(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (torchrun starts its workers in sessions of their own)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended meanwhile
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += parents.get(tree[-1], [])
    return tree


def kill_everything(process: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it at once, as a node failure would."""
    for pid in process_tree(process.pid):
        os.kill(pid, signal.SIGKILL)
    process.communicate(timeout=60)


@contextlib.contextmanager
def adopting_orphans():
    """Inside, this process adopts its descendants whose parent dies (Linux's child subreaper), so it can
    wait for them and read their exit status."""
    prctl, pr_set_child_subreaper = ctypes.CDLL(None, use_errno=True).prctl, 36  # linux/prctl.h
    assert prctl(pr_set_child_subreaper, 1) == 0, os.strerror(ctypes.get_errno())
    try:
        yield
    finally:
        prctl(pr_set_child_subreaper, 0)


def exit_statuses(pids: list[int], timeout: float) -> dict[int, int | None]:
    """Wait up to timeout for adopted processes to end: {pid: exit status}; one still running is
    SIGKILLed and gets None."""
    statuses, deadline = {}, time.monotonic() + timeout
    while len(statuses) < len(pids):
        for pid in [pid for pid in pids if pid not in statuses]:
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not adopted yet: its parent is only now dying
                done = 0
            if done:
                statuses[pid] = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                statuses[pid] = None
        time.sleep(0.05)
    return statuses


def finish(process: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    """Wait for a run; one that outlives timeout is killed with everything under it, and fails the test."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_everything(process)
        pytest.fail(f"still running after {timeout} s")
    return process.returncode, output


def completed(nproc: int, args: list[str]) -> str:
    code, output = finish(start(nproc, args))
    assert code == 0, output[-3000:]
    return output


def wait_for_checkpoint(run_dir: Path, process: subprocess.Popen, step: int, timeout: float = 120) -> None:
    """Wait until a checkpoint of at least this step exists (fail if the run ends first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list_checkpoints(run_dir / "checkpoints")
        if found and int(found[-1].name[5:13]) >= step:
            return
        assert process.poll() is None, finish(process)[1][-3000:]
        time.sleep(0.02)
    pytest.fail(f"no step-{step} checkpoint within {timeout} s")


def newest(run_dir: Path) -> dict:
    """The newest checkpoint's state, whole tensors whatever its format."""
    return in_full(latest_checkpoint(run_dir / "checkpoints")[1])


def logged(run_dir: Path) -> list[tuple]:
    """Every training and validation line of metrics.jsonl, without the timing-dependent ones."""
    keys = ("step", "epoch", "train/loss", "train/lr", "train/grad_norm", *VAL_KEYS)
    return [tuple(record.get(k) for k in keys) for record in read_metrics(run_dir)]


def assert_bit_identical(reference: Path, resumed: Path) -> None:
    """Weights (and their average), optimizer moments, scheduler, progress and logged losses all equal,
    bit for bit."""
    want, got = newest(reference), newest(resumed)
    assert got["progress"] == want["progress"]
    assert all(torch.equal(want["model"][k], got["model"][k]) for k in want["model"]), "weights differ"
    assert want.get("ema", {}).keys() == got.get("ema", {}).keys()
    assert all(torch.equal(want["ema"][k], got["ema"][k]) for k in want.get("ema", {})), "weight averages differ"
    assert want["optimizer"]["state"].keys() == got["optimizer"]["state"].keys()
    for name, moments in want["optimizer"]["state"].items():
        assert all(torch.equal(value, got["optimizer"]["state"][name][k]) for k, value in moments.items()), name
    assert got["scheduler"] == want["scheduler"]
    assert logged(resumed) == logged(reference)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted runs of each setup, made once: {name: run directory}."""
    from conftest import TINY

    root, made = tmp_path_factory.mktemp("references"), {}

    def reference(name: str) -> Path:
        if name not in made:
            nproc, extra = SETUPS[name]
            made[name] = root / name
            completed(nproc, [*TINY, *extra, f"run.output_dir={made[name]}"])
        return made[name]

    return reference


# The multi-process setups keep a weight average too (its shards under FSDP), which must resume exactly.
EMA = "optim.ema_decay=0.9"
SETUPS = {
    "one-process-workers": (0, ONE_PROCESS),
    "ddp": (2, [*TWO_PROCESSES, "distributed.strategy=ddp", EMA]),
    "fsdp": (2, [*TWO_PROCESSES, "distributed.strategy=fsdp", EMA]),  # sharded checkpoints, the default under FSDP
    "fsdp-async": (2, [*TWO_PROCESSES, "distributed.strategy=fsdp", "trainer.async_checkpoint=true", EMA]),
}
SAME_TRAINING = {"fsdp-async": "fsdp"}  # saving in the background changes nothing the run computes
# Rows that test the machinery rather than the task: the async save (the same training as fsdp); DDP,
# whose 2-process resume of each task is also tested by test_two_processes_match_one_and_resume_on_one;
# and one process with workers, whose resume with each task's random draws in workers is also tested by
# test_resume_after_a_crash_matches_an_uninterrupted_run (full). Each task runs the fsdp row (a task's
# buffers, BatchNorm's say, must come back on every rank).
CORE_ROWS = {"fsdp-async", "ddp", "one-process-workers"}


@pytest.mark.slow
@pytest.mark.parametrize("setup", [pytest.param(s, marks=pytest.mark.core) if s in CORE_ROWS else s for s in SETUPS])
def test_sigkill_at_a_random_moment_then_resume_is_bit_exact(setup, tiny, run_dir, references):
    """SIGKILL to every process at a random moment (0-0.3 s after a random one of the first eight
    checkpoints appears: mid-step, mid-epoch, mid-save or in validation), then the same command
    again: the run ends exactly where an uninterrupted one does."""
    nproc, extra = SETUPS[setup]
    args = [*tiny, *extra]
    process = start(nproc, args)
    wait_for_checkpoint(run_dir, process, step=random.randrange(2, 17, 2))
    time.sleep(random.uniform(0, 0.3))
    assert process.poll() is None, "the run finished before the kill; give it more steps"
    kill_everything(process)
    killed_at = newest(run_dir)["progress"]["step"]
    completed(nproc, args)
    assert newest(run_dir)["progress"]["step"] > killed_at
    print(f"killed after the step-{killed_at} checkpoint")
    assert_bit_identical(references(SAME_TRAINING.get(setup, setup)), run_dir)


@pytest.mark.slow
@pytest.mark.core  # signals, restarts and peers: the same for every task
def test_sigterm_to_torchrun_stops_cleanly_in_time_and_resumes_exactly(tiny, run_dir, references):
    """torchrun forwards SIGTERM to its workers: they agree on a step, write one checkpoint, and exit
    well inside the 30 s torchrun allows before SIGKILL; the resumed run is bit-exact."""
    args = [*tiny, *SETUPS["fsdp"][1]]  # sharded checkpoints
    process = start(2, args)
    wait_for_checkpoint(run_dir, process, step=2)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)  # torchrun itself, as Kubernetes or a scheduler would
    code, output = finish(process)
    took = time.monotonic() - signalled
    print(f"SIGTERM to torchrun: stopped in {took:.1f} s")
    assert took < 15, f"{took:.1f} s to stop\n{output[-3000:]}"
    assert "stopped by SIGTERM after step" in output, output[-3000:]
    stopped_at = int(output.split("stopped by SIGTERM after step ")[1].split(";")[0])
    assert newest(run_dir)["progress"]["step"] == stopped_at
    completed(2, args)
    assert_bit_identical(references("fsdp"), run_dir)


@pytest.mark.slow
@pytest.mark.core  # signals, restarts and peers: the same for every task
def test_workers_stop_cleanly_when_torchrun_is_killed_and_a_restart_resumes_exactly(
    tiny, run_dir, tmp_path, references
):
    """SIGKILL to torchrun alone: its workers notice within seconds, stop as SIGTERM stops them (one
    checkpoint, exit 75), and the same command, started at once, resumes and ends bit-exact. Steps
    pause 0.2 s in the first run: unpaused, the 22 steps left after the kill took 0.7 s, less than
    the launcher check's period (1 s), and the run could end before its workers noticed."""
    args = [*tiny, *SETUPS["ddp"][1]]
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    with adopting_orphans():
        process = start(2, args, script=script, FAULT="none", FAULT_STEP="0", STEP_PAUSE_S="0.2")
        wait_for_checkpoint(run_dir, process, step=2)
        workers = process_tree(process.pid)[1:]
        assert len(workers) == 2, workers
        killed = time.monotonic()
        process.kill()  # torchrun only; the workers' output still reaches the pipe
        statuses = exit_statuses(workers, timeout=15)
    took = time.monotonic() - killed
    output = process.communicate(timeout=60)[0]
    print(f"SIGKILL to torchrun: its workers exited {list(statuses.values())} after {took:.1f} s")
    assert list(statuses.values()) == [PREEMPTED_EXIT] * 2, f"{statuses}\n{output[-3000:]}"
    stop = re.search(r"stopped by (.*) after step (\d+);", output)
    assert stop and f"launcher (pid {process.pid})" in stop[1], output[-3000:]
    assert newest(run_dir)["progress"]["step"] == int(stop[2])
    restarted = time.monotonic() - killed
    output = completed(2, args)
    assert restarted < 30 and f"at step {stop[2]}," in output, output[-3000:]  # resumed from that checkpoint
    assert_bit_identical(references("ddp"), run_dir)


@pytest.mark.core  # signals, restarts and peers: the same for every task
def test_a_worker_whose_launcher_is_gone_asks_to_stop(monkeypatch):
    """Under torchrun's agent, a parent that is no longer the launcher is a stop request, named for it."""
    launcher = os.getppid()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setattr(preemption, "LAUNCHER_CHECK_S", 0.01)
    with StopRequest() as stop:
        time.sleep(0.05)
        assert not stop.poll()
        # adopted by init or a subreaper: another parent than the launcher (not a fixed 1, which a test
        # process already adopted by init would have as its launcher)
        monkeypatch.setattr(os, "getppid", lambda: launcher + 1)
        deadline = time.monotonic() + 5
        while not stop.poll():
            assert time.monotonic() < deadline, "no stop 5 s after the launcher went away"
            time.sleep(0.01)
    assert stop.reason == f"the loss of its launcher (pid {launcher})" and stop.signal is None


@pytest.mark.slow
@pytest.mark.core  # signals, restarts and peers: the same for every task
def test_sigusr1_to_every_process_exits_75_and_resumes_exactly(tiny, run_dir, references):
    """SLURM's warning signal reaches every process of the job, data workers included: the trainer
    checkpoints and exits 75 (the workers ignore it), and the resumed run is bit-exact. Checkpoints
    are written in the background here: the stop waits for the one in flight and writes its own."""
    args = [*tiny, *SETUPS["one-process-workers"][1], "trainer.async_checkpoint=true"]
    process = start(0, args)
    wait_for_checkpoint(run_dir, process, step=2)
    os.killpg(process.pid, signal.SIGUSR1)
    code, output = finish(process)
    assert code == PREEMPTED_EXIT, output[-3000:]
    assert "stopped by SIGUSR1" in output and "Traceback" not in output, output[-3000:]
    completed(0, args)
    assert_bit_identical(references("one-process-workers"), run_dir)


@pytest.mark.slow
@pytest.mark.core  # signals, restarts and peers: the same for every task
def test_elastic_restart_resumes_by_itself_and_ends_exact(tiny, run_dir, tmp_path, references):
    """A worker SIGKILLed at step 5 under torchrun --max-restarts=1: the restarted group resumes from
    the step-4 checkpoint on its own and ends bit-identical to an uninterrupted run, with no
    variable set: before the restarted group keyed its store by the restart count, 3 restarts in 6
    read the dead group's addresses from torchrun's store and failed or hung (pytorch#135712)."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    process = start(2, [*tiny, *SETUPS["fsdp"][1]], "--max-restarts=1", script=script,
                    FAULT="die", FAULT_STEP="5", FAULT_RANK="1")  # fmt: skip
    code, output = finish(process)
    assert code == 0, output[-3000:]
    assert "resumed from" in output and "step_00000004 at step 4" in output, output[-3000:]
    assert_bit_identical(references("fsdp"), run_dir)


@pytest.mark.slow
@pytest.mark.core  # signals, restarts and peers: the same for every task
@pytest.mark.parametrize(("fault", "strategy"), [("hang", "ddp"), ("die", "fsdp")])
def test_hung_or_dead_peer_ends_the_job_with_a_clear_error(fault, strategy, tiny, run_dir, tmp_path):
    """Rank 1 hangs (DDP, full checkpoints) or dies (FSDP, sharded ones) before the step-4 save:
    rank 0 exits 1 within distributed.timeout_s with one clear line, the newest checkpoint is the
    complete step-3 one, and the unfinished save left nothing behind.

    The two ranks are started the way srun starts them (RANK, WORLD_SIZE, MASTER_ADDR set directly),
    so nothing but the timeout ends rank 0's wait."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    port, timeout_s = free_port(), 5
    ranks = [
        start(0, [*tiny, *TWO_PROCESSES, f"distributed.strategy={strategy}", f"distributed.timeout_s={timeout_s}"],
              script=script, FAULT=fault, FAULT_STEP="4", FAULT_RANK="1", RANK=str(rank), LOCAL_RANK=str(rank),
              WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        for rank in (0, 1)
    ]  # fmt: skip
    wait_for_checkpoint(run_dir, ranks[0], step=3)
    waiting = time.monotonic()
    code, output = finish(ranks[0], timeout=timeout_s + 60)
    took = time.monotonic() - waiting
    kill_everything(ranks[1])
    print(f"peer {fault}: rank 0 exited {code} after {took:.1f} s (distributed.timeout_s={timeout_s})")
    assert code == 1, output[-3000:]
    assert took < timeout_s + 20, f"{took:.1f} s"
    error = [line for line in output.splitlines() if line.startswith("error:")]
    assert error and "another process hung or died" in error[0], output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    step_3 = run_dir / "checkpoints" / ("step_00000003.pt" if strategy == "ddp" else "step_00000003")
    assert list_checkpoints(run_dir / "checkpoints")[-1] == step_3  # epoch 1's end
    assert load_checkpoint(step_3)["progress"]["step"] == 3
    assert not list((run_dir / "checkpoints").glob(".*tmp*"))


@pytest.mark.slow
def test_nan_gradient_stops_before_the_update_and_saves_nothing(tiny, run_dir, monkeypatch, capsys):
    """A NaN loss at step 3 (so NaN gradients): that update is skipped, the run stops with exit 1
    naming step 3 and the remedies, and nothing after the step-2 checkpoint is saved."""
    real_loss, real_build, calls, built = Task.loss, Task.build_model, [], []

    def nan_at_step_3(self, model, batch):
        calls.append(1)
        loss, samples = real_loss(self, model, batch)
        return loss * (float("nan") if len(calls) == 3 else 1.0), samples

    monkeypatch.setattr(Task, "loss", nan_at_step_3)
    monkeypatch.setattr(Task, "build_model", lambda self, *a: built.append(real_build(self, *a)) or built[-1])
    assert main([*tiny, "trainer.checkpoint_every=2", "trainer.log_every=3"]) == 1
    err = capsys.readouterr().err
    assert "gradient norm is not finite at step 3" in err and "lower optim.lr" in err
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000002.pt"]
    saved = newest(run_dir)["model"]
    for name, param in built[0].named_parameters():  # the skipped update left every weight as it was
        assert torch.equal(param.detach(), saved[name]), name


@pytest.mark.slow
def test_the_first_non_finite_step_of_a_log_window_is_named(tiny, run_dir, monkeypatch, capsys):
    """NaN losses at steps 2 and 3 of a 4-step log window: both updates are skipped on the device,
    and the check at the log line (one host read per window) names step 2, the first of them."""
    real_loss, calls = Task.loss, []

    def nan_at_steps_2_and_3(self, model, batch):
        calls.append(1)
        loss, samples = real_loss(self, model, batch)
        return loss * (float("nan") if len(calls) in (2, 3) else 1.0), samples

    monkeypatch.setattr(Task, "loss", nan_at_steps_2_and_3)
    assert main([*tiny, "trainer.log_every=4", "trainer.checkpoint_every=100"]) == 1
    err = capsys.readouterr().err
    assert "gradient norm is not finite at step 2 " in err, err[-2000:]
    assert not list_checkpoints(run_dir / "checkpoints")


@pytest.mark.gpu
def test_fp16_overflow_steps_are_skipped_counted_and_not_fatal(tiny, run_dir, monkeypatch):
    """fp16 on a GPU: a loss scaled up 1e6x at step 3 overflows the fp16 gradients, so the GradScaler
    skips that step; the run goes on, counts it in train/skipped_steps and exits 0."""
    on_gpu = [o for o in tiny if o != "run.device=cpu"] + ["trainer.precision=fp16", "trainer.log_every=1"]
    real_loss, calls = Task.loss, []

    def overflow_at_step_3(self, model, batch):
        calls.append(1)
        loss, samples = real_loss(self, model, batch)
        return loss * (1e6 if len(calls) == 3 else 1.0), samples

    monkeypatch.setattr(Task, "loss", overflow_at_step_3)
    assert main(on_gpu) == 0
    skipped = {r["step"]: r["train/skipped_steps"] for r in read_metrics(run_dir) if "train/skipped_steps" in r}
    assert skipped[3] == skipped[2] + 1
    assert all(torch.isfinite(v).all() for v in newest(run_dir)["model"].values() if v.is_floating_point())


def test_anomaly_detection_names_the_operation(tiny, monkeypatch, capsys):
    """trainer.detect_anomaly=true turns a NaN gradient into an error naming the backward operation."""
    real_loss = Task.loss

    def sqrt_of_zero(self, model, batch):  # d sqrt(x) / dx is inf at 0, and inf x 0 is NaN
        loss, samples = real_loss(self, model, batch)
        return loss + (loss * 0).sqrt() * -1, samples

    monkeypatch.setattr(Task, "loss", sqrt_of_zero)
    assert main([*tiny, "trainer.detect_anomaly=true", "trainer.max_steps=1"]) == 1
    err = capsys.readouterr().err
    assert "Backward" in err and "nan" in err.lower()


def _two_checkpoints(tiny, run_dir) -> list[Path]:
    assert main([*tiny, "trainer.checkpoint_every=2", "trainer.max_steps=4", "trainer.keep_last=5"]) == 0
    return list_checkpoints(run_dir / "checkpoints")  # steps 2 and 4 (the end-of-run one is step 4 too)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "flip-a-bit"])
def test_damaged_newest_checkpoint_is_set_aside_and_the_previous_one_used(damage, tiny, run_dir, caplog):
    """A truncated or bit-flipped newest checkpoint is named in a warning, renamed *.corrupt (kept),
    and the run resumes from the previous one instead of step 0."""
    first, second = _two_checkpoints(tiny, run_dir)
    data = bytearray(second.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01  # torch.load alone would load this as a wrong weight
    second.write_bytes(bytes(data))
    with caplog.at_level("INFO"):
        assert main([*tiny, "trainer.checkpoint_every=2", "trainer.max_steps=4", "trainer.keep_last=5"]) == 0
    assert second.name in caplog.text and "resumed from" in caplog.text and first.name in caplog.text
    assert second.with_name(second.name + ".corrupt").exists()
    assert newest(run_dir)["progress"]["step"] == 4  # redone from step 2


@pytest.mark.slow
def test_an_older_starting_point_renames_later_checkpoints_instead_of_deleting_them(tiny, run_dir):
    """Resuming from an explicit older checkpoint renames the later ones *.superseded (kept), so a
    later auto-resume cannot jump back to the replaced run."""
    first, second = _two_checkpoints(tiny, run_dir)
    kept = second.read_bytes()
    assert main([*tiny, "trainer.checkpoint_every=2", "trainer.max_steps=3", f"trainer.resume={first}"]) == 0
    assert second.with_name(second.name + ".superseded").read_bytes() == kept
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == [first.name, "step_00000003.pt"]


def test_keep_last_one_never_deletes_the_only_good_checkpoint(tmp_path, monkeypatch):
    """With keep_last=1, a save that fails verification leaves the previous checkpoint in place."""
    good = save_checkpoint(tmp_path, {"model": {"w": torch.ones(3)}}, step=1, keep_last=1)
    real_save = torch.save

    def corrupting_save(obj, path):
        real_save(obj, path)
        data = bytearray(Path(path).read_bytes())
        data[len(data) // 2] ^= 0x01
        Path(path).write_bytes(bytes(data))

    monkeypatch.setattr(torch, "save", corrupting_save)
    with pytest.raises(CheckpointError, match="CRC"):
        save_checkpoint(tmp_path, {"model": {"w": torch.zeros(1000)}}, step=2, keep_last=1)
    assert [p.name for p in tmp_path.iterdir()] == [good.name]


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["ENOSPC", "torch-write-failed"])
def test_disk_full_while_saving_exits_1_and_keeps_older_checkpoints(failure, tiny, run_dir, monkeypatch, capsys):
    """A full disk during a save (an OSError, or torch.save's own RuntimeError when it writes to a
    full device) exits 1 with one line naming the folder; the earlier checkpoint is intact."""
    real_save, saves = torch.save, []

    def full_disk(obj, path):
        saves.append(path)
        if len(saves) == 2 and failure == "ENOSPC":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, "/dev/full" if len(saves) == 2 else path)  # /dev/full: every write fails with ENOSPC

    monkeypatch.setattr(torch, "save", full_disk)
    assert main([*tiny, "trainer.checkpoint_every=2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "could not write the step 4 checkpoint" in err and "older ones are kept" in err
    if failure == "ENOSPC":
        assert "no space left" in err
    monkeypatch.setattr(torch, "save", real_save)
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000002.pt"]
    assert load_checkpoint(run_dir / "checkpoints" / "step_00000002.pt")["progress"]["step"] == 2


class Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("command", ["train", "evaluate", "export"])
def test_pickle_payload_is_refused_by_train_evaluate_and_export(command, tiny, run_dir, monkeypatch, capsys):
    """A checkpoint that carries code, given to train (resume), evaluate or export, exits 2 and never runs it."""
    monkeypatch.chdir(run_dir.parent)
    (run_dir / "checkpoints").mkdir(parents=True)
    path = run_dir / "checkpoints" / "step_00000002.pt"
    torch.save({"model": {}, "progress": Payload()}, path)  # a zip checkpoint with valid CRCs
    if command == "train":
        code = main([*tiny, f"trainer.resume={path}"])
    elif command == "evaluate":
        code = evaluate_main(["--checkpoint", str(path), *tiny])
    else:
        code = export_main(["--checkpoint", str(path), *tiny])
    assert code == 2
    assert "refused" in capsys.readouterr().err
    assert not (run_dir.parent / "PWNED").exists()
