"""Bad input exits 2 and a failure while running exits 1, each with one line and no traceback, and
no rank waits out distributed.timeout_s when the main process fails alone."""

import errno
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.engine.ckpt import checkpoint
from {{ cookiecutter.package_name }}.engine.config import TrackerConfig
from {{ cookiecutter.package_name }}.engine.errors import (
    BAD_INPUT,
    RUNTIME_FAILURE,
    CheckpointError,
    ConfigError,
    Diverged,
    OutputError,
    Preempted,
    exit_status,
)
from {{ cookiecutter.package_name }}.engine.metrics import MetricsLogger, truncate_metrics
from {{ cookiecutter.package_name }}.train import main


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and err.count("\n") == 0 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("tracker.tags=[a,b", "not a valid YAML value"),
        ("data.num_workers=100000", "data.num_workers=100000 is too many"),
        ("distributed.timeout_s=100000000000000", "distributed.timeout_s=100000000000000 is longer than"),
        ("distributed.timeout_s=1e14", "distributed.timeout_s"),
        ("run.output_dir=", "run.output_dir"),
        ("run.output_dir=''", "run.output_dir is empty"),  # '' would have been the current directory
        ("run.output_dir=' '", "run.output_dir is empty"),
    ],
)
def test_bad_values_exit_2_with_one_line(override, named, tiny, capsys):
    """A YAML syntax error in an override, absurd sizes and an empty output directory are refused by name."""
    assert main([*tiny, override]) == 2
    assert named in one_line_error(capsys)


def test_unwritable_best_model_exits_1_with_one_line(tiny, run_dir, monkeypatch, capsys):
    """best.safetensors that cannot be written (no permission) ends the run with exit 1 naming it."""
    monkeypatch.setattr(checkpoint, "save_file", deny_writes)
    assert main([*tiny, "trainer.max_steps=2"]) == 1
    err = one_line_error(capsys)
    assert f"could not write {run_dir / 'best.safetensors'} (no permission to write" in err


def deny_writes(tensors, filename, metadata=None):
    """safetensors' save_file where the folder is not writable (as root, real permissions would not stop it)."""
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), filename)


def test_error_kinds_map_to_exit_statuses():
    """Bad input is 2, a failed write or a divergence 1, a stop on request 75, anything else a bug (a traceback)."""
    assert exit_status(CheckpointError("x")) == exit_status(ConfigError("x")) == BAD_INPUT == 2
    assert exit_status(OutputError("x")) == exit_status(Diverged("x")) == RUNTIME_FAILURE == 1
    assert exit_status(Preempted("x")) == 75
    assert exit_status(KeyError("x")) is None and exit_status(RuntimeError("x")) is None


def test_metrics_are_strict_json_with_null_for_non_finite_values(tmp_path):
    """NaN and infinity, which JSON has no words for, are written as null, so any JSON parser reads the file."""
    logger = MetricsLogger(tmp_path, TrackerConfig(name="none"), {})
    logger.log({"train/loss": math.nan, "train/grad_norm": math.inf, "train/lr": 0.1}, step=1, epoch=0)
    logger.close()
    line = (tmp_path / "metrics.jsonl").read_text()

    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    record = json.loads(line, parse_constant=refuse)
    assert record == {"step": 1, "epoch": 0, "train/loss": None, "train/grad_norm": None, "train/lr": 0.1}


def test_truncating_metrics_is_atomic(tmp_path, monkeypatch):
    """A failure while metrics.jsonl is rewritten on resume leaves the old file whole, not half of it."""
    path = tmp_path / "metrics.jsonl"
    original = "".join(json.dumps({"step": s, "epoch": 0, "train/loss": 1.0}) + "\n" for s in range(1, 101))
    path.write_text(original)
    real_write = Path.write_text

    def dies_half_way(self, text, *args, **kwargs):
        real_write(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", dies_half_way)
    with pytest.raises(OSError):
        truncate_metrics(tmp_path, step=80)
    monkeypatch.undo()
    assert path.read_text() == original
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# Training in which rank 0 (only) may not write best.safetensors.
UNWRITABLE_BEST = """
import errno, os, sys
from {{ cookiecutter.package_name }}.engine.ckpt import checkpoint, sharded
from {{ cookiecutter.package_name }} import train

def deny_writes(tensors, filename, metadata=None):
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), filename)

def deny_header(tensors, metadata):  # the sharded model's best.safetensors, gathered tensor by tensor
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), "best.safetensors")

if os.environ["RANK"] == "0":
    checkpoint.save_file = deny_writes
    sharded._safetensors_header = deny_header
sys.exit(train.main(sys.argv[1:]))
"""


def _start_ranks_without_a_launcher(args: list[str], program: list[str]) -> list[subprocess.Popen]:
    """Two training processes started as srun starts them: nothing but the processes themselves ends the job."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    command = [sys.executable, *program, *args]
    return [
        subprocess.Popen(
            command,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]


@pytest.mark.slow
@pytest.mark.core  # rank 0's failures reach the others the same way for every task
@pytest.mark.parametrize(
    ("fault", "strategy"), [("unwritable-best", "ddp"), ("unwritable-best", "fsdp"), ("directory-in-use", "ddp")]
)
def test_other_ranks_stop_at_once_when_the_main_process_fails_alone(fault, strategy, tiny, run_dir):
    """Rank 0 alone writes files; when such a write fails (or the directory is another run's), rank 1 stops
    with the same one-line error instead of waiting out distributed.timeout_s (here an hour). Under FSDP
    best.safetensors is gathered tensor by tensor with every rank taking part, and still ends so."""
    run_dir.mkdir()
    holder = None
    program = ["-m", "{{ cookiecutter.package_name }}.train"]
    if fault == "unwritable-best":
        program = ["-c", UNWRITABLE_BEST]
        expected_code, expected = RUNTIME_FAILURE, "could not write"
    else:
        holder = subprocess.Popen(
            [sys.executable, "-c", f"import fcntl, time; f = open({str(run_dir / 'run.lock')!r}, 'w'); "
             "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(600)"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert holder.stdout.readline().strip() == "locked"
        expected_code, expected = 2, "in use by another run"
    ranks = _start_ranks_without_a_launcher(
        [*tiny, "trainer.max_steps=2", f"distributed.strategy={strategy}", "distributed.timeout_s=3600"], program
    )
    try:
        outputs = [rank.communicate(timeout=240)[0] for rank in ranks]  # an hour if a rank waited out the timeout
    finally:
        for process in [*ranks, *([holder] if holder else [])]:
            process.kill()
            process.communicate()
    for rank, output in zip(ranks, outputs, strict=True):
        assert rank.returncode == expected_code, output[-3000:]
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and expected in errors[0], output[-3000:]
        assert "Traceback" not in output, output[-3000:]
