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

The subprocess tests are marked slow; the template's own test suite runs them. Faults inside one
process (non-finite steps, damaged or unwritable checkpoints, code in a checkpoint) are
test_faults_in_process.py's.
"""

import contextlib
import ctypes
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.engine import preemption
from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import (
    list_checkpoints,
    load_checkpoint,
)
from {{ cookiecutter.package_name }}.engine.preemption import PREEMPTED_EXIT, StopRequest

from conftest import newest, read_metrics
from tiny import RANDOM_DATA, SMALL_MODEL, VAL_KEYS

# Augmentation on, log windows that straddle checkpoints (log_every=3, checkpoint_every=2), the task's small model.
RESUMABLE = [*RANDOM_DATA, *SMALL_MODEL, "trainer.checkpoint_every=2", "trainer.log_every=3", "trainer.keep_last=2"]
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


@pytest.mark.core  # signals, restarts and peers: the same for every task
def test_any_signal_asked_for_is_a_stop_request_named_for_it():
    """A sweep also stops on SIGINT (Ctrl-C), a signal without a code of its own: the request is named for it."""
    with StopRequest((signal.SIGINT,)) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 5
        while not stop.poll():
            assert time.monotonic() < deadline, "no stop 5 s after SIGINT"
            time.sleep(0.01)
    assert stop.reason == "SIGINT" and stop.signal == signal.SIGINT


class PeerFlags:
    """all_reduce(MAX) with one other rank, whose flags are given one optimizer step after another."""

    def __init__(self, *flags: int):
        self.flags = list(flags)

    def __call__(self, flag, op, group, async_op):
        flag.fill_(max(int(flag.item()), self.flags.pop(0)))
        return types.SimpleNamespace(wait=lambda: None)


@pytest.mark.core  # signals, restarts and peers: the same for every task
@pytest.mark.parametrize(
    "peer, own_launcher_gone, reason",
    [
        ("SIGTERM", False, "SIGTERM to another process"),
        ("launcher", False, "the loss of another process's launcher"),  # on another node
        ("launcher", True, "the loss of its launcher (pid {launcher})"),  # its watcher had not looked yet
    ],
)
def test_a_rank_stopped_by_another_says_what_stopped_it(monkeypatch, peer, own_launcher_gone, reason):
    """The stop flag carries its kind: the exit line of a rank that another one stopped names it (the
    ranks' launcher watchers look at different moments, and the main rank's line is the one users read)."""
    launcher = os.getppid()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setattr(preemption, "LAUNCHER_CHECK_S", 3600)  # this rank's watcher never looks by itself
    monkeypatch.setattr(preemption, "joined", lambda: True)
    monkeypatch.setattr(preemption.dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(preemption.dist, "all_reduce", PeerFlags(0, preemption.CODES[peer]))
    with StopRequest() as stop:
        assert not stop.poll()  # starts step 1's all-reduce
        if own_launcher_gone:
            monkeypatch.setattr(os, "getppid", lambda: launcher + 1)
        assert not stop.poll()  # step 1's: no request; starts step 2's, which carries the peer's
        assert stop.poll()
    assert stop.reason == reason.format(launcher=launcher) and stop.signal is None


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
