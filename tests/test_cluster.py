"""Cluster launch files: the SLURM script and the Kubernetes PyTorchJob render, parse, launch."""

import os
import stat
import subprocess

import yaml
from conftest import bake

STUB_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$SRUN_ARGS"
"""
STUB_SCONTROL = """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then printf 'gpu-node-7\\ngpu-node-8\\n'; fi
"""


def _stub(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_slurm_script_builds_the_torchrun_command(cookies, tmp_path):
    """Given SLURM's variables, the script runs srun + torchrun with c10d on the first node."""
    baked = bake(cookies, cluster="slurm")
    script = baked.path / "scripts" / "slurm" / "train.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir / "srun", STUB_SRUN)
    _stub(bin_dir / "scontrol", STUB_SCONTROL)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SRUN_ARGS": str(tmp_path / "srun-args"),
        "SLURM_JOB_NODELIST": "gpu-node-[7-8]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_GPUS_ON_NODE": "4",
    }
    result = subprocess.run(
        ["bash", str(script), "run.output_dir=runs/exp1"],
        cwd=baked.path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "srun-args").read_text().splitlines()
    assert args == [
        "--kill-on-bad-exit=1", "torchrun", "--nnodes=2", "--nproc_per_node=4", "--rdzv_id=4242",
        "--rdzv_backend=c10d", "--rdzv_endpoint=gpu-node-7:29500", "-m", f"{baked.package}.train",
        "--config", "configs/default.yaml", "run.output_dir=runs/exp1",
    ]  # fmt: skip
    text = script.read_text()
    assert "#SBATCH --signal=B:USR1@120" in text and "#SBATCH --requeue" in text


def test_kubernetes_pytorchjob_parses_and_matches_its_replicas(cookies):
    """The PyTorchJob is valid YAML; torchrun --nnodes equals its pod count; it runs the package."""
    baked = bake(cookies, cluster="kubernetes")
    job = yaml.safe_load((baked.path / "scripts" / "kubernetes" / "pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    pods = sum(spec["replicas"] for spec in specs.values())
    for spec in specs.values():
        container = spec["template"]["spec"]["containers"][0]
        command = container["command"]
        assert command[0] == "torchrun" and f"--nnodes={pods}" in command
        assert (
            "--rdzv_backend=c10d" in command
            and "--rdzv_endpoint=$(MASTER_ADDR):$(MASTER_PORT)" in command
        )
        assert command[command.index("-m") + 1] == f"{baked.package}.train"
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert f"--nproc_per_node={gpus}" in command


def test_cluster_files_are_left_out_unless_chosen(cookies):
    """cluster=none bakes no scripts/ folder."""
    assert not (bake(cookies).path / "scripts").exists()
