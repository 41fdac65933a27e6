"""The training core under a launcher, for any task: gradients all-reduced once per optimizer step,
accelerate launch and a two-node rendezvous."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }}.engine.config import load_config

from conftest import read_metrics, torchrun
from tiny import VAL_COUNT

COUNT_SYNCS = """
import json, os, sys
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from {{ cookiecutter.package_name }}.engine.parallel import distributed
from {{ cookiecutter.package_name }} import train

syncs, wrap_model = [], distributed.wrap_model

def counting_hook(state, bucket):
    syncs.append(bucket.is_last())  # one True per gradient all-reduce of the whole model
    return allreduce_hook(state, bucket)

def wrap_and_count(model, cfg, env):
    wrapped = wrap_model(model, cfg, env)
    wrapped.register_comm_hook(None, counting_hook)
    return wrapped

distributed.wrap_model = wrap_and_count
code = train.main(sys.argv[1:])
with open(os.environ["SYNC_COUNTS"] + os.environ["RANK"], "w") as f:
    json.dump(sum(syncs), f)
sys.exit(code)
"""


@pytest.mark.core  # DDP's communication under accumulation: the same for every task
def test_accumulation_all_reduces_once_per_optimizer_step(tiny, tmp_path):
    """With 2 micro-batches per step under DDP, gradients are all-reduced 3 times in 3 steps, not 6
    (half the tiny batch per micro-batch, so each process's global batch matches the tiny run's)."""
    script = tmp_path / "count_syncs.py"
    script.write_text(COUNT_SYNCS)
    counts = tmp_path / "syncs-rank"
    torchrun(
        2,
        [
            *tiny,
            "trainer.grad_accum_steps=2",
            "trainer.max_steps=3",
            "trainer.max_epochs=3",
            f"data.batch_size={load_config([], tiny).data.batch_size // 2}",
            f"run.output_dir={tmp_path / 'run'}",
        ],
        script=[str(script)],
        SYNC_COUNTS=str(counts),
    )
    assert [json.loads(Path(f"{counts}{rank}").read_text()) for rank in (0, 1)] == [3, 3]


@pytest.mark.slow
@pytest.mark.core  # launchers: the same for every task
def test_accelerate_launch_starts_two_cpu_processes(tiny, run_dir):
    """accelerate launch with configs/accelerate/multi_cpu.yaml really runs 2 processes that split the data."""
    pytest.importorskip("accelerate")
    config = Path(__file__).resolve().parents[2] / "configs" / "accelerate" / "multi_cpu.yaml"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    command += ["-m", "{{ cookiecutter.package_name }}.train", *tiny]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert validated(run_dir) == [(3, VAL_COUNT[1])]  # an epoch's 6 tiny steps, split over 2 processes


@pytest.mark.slow
@pytest.mark.core  # launchers: the same for every task
def test_two_nodes_rendezvous_through_c10d(tiny, run_dir):
    """Two torchrun agents (--nnodes=2, c10d rendezvous) on this machine train as one 2-process job."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two-nodes",
               "-m", "{{ cookiecutter.package_name }}.train", *tiny]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    nodes = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]  # fmt: skip
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert validated(run_dir) == [(3, VAL_COUNT[1])]  # the data split over 2 processes


def validated(run_dir) -> list[tuple[int, int]]:
    """(step, what the validation counted) of each validation line of a run."""
    key = VAL_COUNT[0]
    return [(r["step"], r[key]) for r in read_metrics(run_dir) if key in r]
