"""Shared settings: a seconds-long CPU configuration (the task's, in tiny.py) and the gpu marker."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import latest_checkpoint
from {{ cookiecutter.package_name }}.engine.ckpt.sharded import ShardedWeights

from tiny import TINY


def pytest_report_header(config) -> str:
    """The arithmetic this run's numbers come from: float results differ between CPUs (SIMD width)
    and thread counts, so a test compares only numbers computed in this run (README, "Tests")."""
    threads = torch.get_num_threads()
    capability = torch.backends.cpu.get_cpu_capability()
    return f"arithmetic: torch {torch.__version__}, CPU capability {capability}, {threads} thread{'s' * (threads > 1)}"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def read_metrics(output_dir: Path) -> list[dict]:
    """All records of output_dir/metrics.jsonl."""
    lines = (Path(output_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def in_full(state: dict) -> dict:
    """A loaded checkpoint with its model and optimizer state as whole tensors, whatever its format: a
    sharded one is converted with torch.distributed.checkpoint's dcp_to_torch_save into memory."""
    if not isinstance(state.get("model"), ShardedWeights):
        return state
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        whole = Path(scratch) / "whole.pt"
        dcp_to_torch_save(str(state["model"].path), str(whole))
        return {**state, **torch.load(whole, map_location="cpu", weights_only=True)}


def newest(run_dir: Path) -> dict:
    """The newest checkpoint's state, whole tensors whatever its format."""
    return in_full(latest_checkpoint(run_dir / "checkpoints")[1])


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


@pytest.fixture
def tiny(run_dir) -> list[str]:
    """Overrides for a tiny CPU run writing into a fresh directory."""
    return [*TINY, f"run.output_dir={run_dir}"]


@pytest.fixture
def final_weights():
    """Read the model weights of the newest checkpoint of a run directory (full or sharded)."""

    def read(run_dir) -> dict[str, torch.Tensor]:
        _, state = latest_checkpoint(run_dir / "checkpoints")
        return in_full(state)["model"]

    return read


def killed_when(when, args: list[str]) -> None:
    """Train with args until the run is about to log a record for which when(metrics, step) holds, and
    stop it there with a simulated kill (KeyboardInterrupt, as Ctrl-C raises): what it checkpointed
    before stays, nothing after. The metrics logger is itself again afterwards."""
    from {{ cookiecutter.package_name }}.engine.metrics import MetricsLogger
    from {{ cookiecutter.package_name }}.train import main

    real_log = MetricsLogger.log

    def log(self, metrics, step, epoch):
        if when(metrics, step):
            raise KeyboardInterrupt("simulated kill")
        real_log(self, metrics, step, epoch)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MetricsLogger, "log", log)
        with pytest.raises(KeyboardInterrupt):
            main(args)


# A torchrun driver: the task's model built as training builds it (FSDP: sharded), its gathered weights
# saved to $WEIGHTS by the main process, and each process's count of local parameter elements with
# RECORD (a dict PRELUDE may fill) to $WEIGHTS.rankN.json. PRELUDE runs first: a stand-in that watches
# (or forbids) a way of building.
BUILD_AND_GATHER = """
import json, os, sys
import torch
from {{ cookiecutter.package_name }}.engine.parallel import distributed, meta_init, state_dicts
from {{ cookiecutter.package_name }}.engine.config import load_config
from {{ cookiecutter.package_name }}.task import task as task_module
from {{ cookiecutter.package_name }}.task.config import SPEC

RECORD = {}
PRELUDE
cfg = load_config(SPEC, [], sys.argv[1:])
env = distributed.setup(cfg.run, cfg.distributed)
task = task_module.Task(cfg, env.device)
task.datasets()
model = distributed.build_model(task, env, cfg.distributed, cfg.trainer.precision)
local = sum(p.to_local().numel() for p in model.parameters())
weights = state_dicts.full_model_state(model)
if env.is_main:
    torch.save(weights, os.environ["WEIGHTS"])
with open(os.environ["WEIGHTS"] + f".rank{env.rank}.json", "w") as f:
    json.dump({**RECORD, "local": local}, f)
distributed.teardown()
"""


def build_and_gather(prelude: str) -> str:
    """BUILD_AND_GATHER's script with prelude (Python at the top level) in place."""
    return BUILD_AND_GATHER.replace("PRELUDE", prelude)


def torchrun(nproc: int, args: list[str], script: list[str] | None = None, **env) -> None:
    """Run training (or a driver script) under torchrun with nproc CPU processes; fail with its stderr."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command += script or ["-m", "{{ cookiecutter.package_name }}.train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path), **env}
    result = subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
