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
from {{ cookiecutter.package_name }}.task.config import SPEC

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

def wrap_and_count(model, dcfg, env):
    wrapped = wrap_model(model, dcfg, env)
    wrapped.register_comm_hook(None, counting_hook)
    return wrapped

distributed.wrap_model = wrap_and_count
code = train.main(sys.argv[1:])
with open(os.environ["SYNC_COUNTS"] + os.environ["RANK"], "w") as f:
    json.dump(sum(syncs), f)
sys.exit(code)
"""


@pytest.mark.slow
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
            f"data.batch_size={load_config(SPEC, [], tiny).data.batch_size // 2}",
            f"run.output_dir={tmp_path / 'run'}",
        ],
        script=[str(script)],
        SYNC_COUNTS=str(counts),
    )
    assert [json.loads(Path(f"{counts}{rank}").read_text()) for rank in (0, 1)] == [3, 3]


# Under torchrun --max-restarts=1: the first attempt leaves a key in the store its group joined
# through, then rank 1 dies; the restarted attempt all-reduces and each rank writes what it saw
# into a file of its own (lines the two ranks print can interleave).
RESTART = """
import json, os, time
from datetime import timedelta
import torch
import torch.distributed as dist
from {{ cookiecutter.package_name }}.engine.config import load_config
from {{ cookiecutter.package_name }}.task.config import SPEC
from {{ cookiecutter.package_name }}.engine.parallel import distributed

joined_through, init_process_group = {}, dist.init_process_group

def spy(*args, **kwargs):
    joined_through.update(store=kwargs.get("store"))
    return init_process_group(*args, **kwargs)

dist.init_process_group = spy
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
cfg = load_config(SPEC, [], ["run.device=cpu", "distributed.timeout_s=60"])
env = distributed.setup(cfg.run, cfg.distributed)
store = joined_through["store"]
if attempt == 0:
    store.set(f"left by rank {env.rank}", "the first attempt")
    dist.barrier()
    if env.rank == 1:
        os._exit(1)  # torchrun restarts the whole group
    time.sleep(120)
agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                      timeout=timedelta(seconds=30))
total = torch.tensor([env.rank + 1.0])
dist.all_reduce(total)
report = {
    "attempt": attempt,
    "seen": [store.check([f"left by rank {r}"]) for r in range(env.world_size)],
    "in_the_agent_store": agent.check(["/worker/attempt_0/left by rank 0"]),
    "sum": total.item(),
}
with open(os.environ["REPORTS"] + str(env.rank), "w") as f:
    json.dump(report, f)
distributed.teardown()
"""


@pytest.mark.core  # launchers: the same for every task
@pytest.mark.slow  # 6 s each: the fast tier holds its 90 s on 2 cores (the template's CI runs both)
@pytest.mark.parametrize("rendezvous", ["standalone", "master-port"])
def test_a_restarted_group_never_reads_the_previous_attempts_keys(rendezvous, tmp_path):
    """Under torchrun --max-restarts=1, with no variable set, a restarted group joins through a store
    in which the dead attempt's keys are out of sight (though torchrun's store still holds them),
    and all-reduces; with --standalone and with --master-port (the static rendezvous)."""
    script = tmp_path / "restart.py"
    script.write_text(RESTART)
    static = ["--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    launch = ["--standalone"] if rendezvous == "standalone" else static
    command = [sys.executable, "-m", "torch.distributed.run", *launch, "--nproc_per_node=2", "--max-restarts=1"]
    env = {key: value for key, value in os.environ.items() if key != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    reports = tmp_path / "report-rank"
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path), REPORTS=str(reports))
    result = subprocess.run([*command, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = {"attempt": 1, "seen": [False, False], "in_the_agent_store": True, "sum": 3.0}
    assert [json.loads(Path(f"{reports}{rank}").read_text()) for rank in (0, 1)] == [expected, expected]


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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
    port = free_port()
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
