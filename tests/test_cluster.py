"""Cluster launch files: the SLURM script and the Kubernetes PyTorchJob render, parse, launch."""

import ast
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import bake

STUB_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$SRUN_ARGS"
echo "$MASTER_ADDR:$MASTER_PORT" > "$SRUN_ARGS.master"
exit "${SRUN_EXIT:-0}"
"""
# Emulates srun on one node: SLURM_NTASKS copies of the command with SLURM's task variables,
# exiting with the highest status, as srun does. The task pids go to $SRUN_PIDS for signals.
LOCAL_SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i "$@" &
    pids+=($!)
done
echo "${pids[@]}" > "$SRUN_PIDS"
status=0
for pid in "${pids[@]}"; do
    wait "$pid" && code=0 || code=$?
    if [ "$code" -gt "$status" ]; then status=$code; fi
done
exit "$status"
"""
STUB_SCONTROL = """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then printf '%s\\n' ${NODES:-gpu-node-7 gpu-node-8}; fi
if [ "$1" = "requeue" ]; then echo "$2" >> "$REQUEUED"; fi
"""


def _stub(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _baked_tiny_config(project: Path) -> list[str]:
    """The baked project's own seconds-long CPU overrides (TINY in its tests/task/tiny.py)."""
    tree = ast.parse((project / "tests" / "task" / "tiny.py").read_text())
    assignment = next(
        n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "TINY"
    )
    return ast.literal_eval(assignment.value)


def _slurm(baked, tmp_path, srun: str, **env) -> tuple[Path, dict]:
    """The baked SLURM script, and an environment with SLURM's variables and stub commands."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir / "srun", srun)
    _stub(bin_dir / "scontrol", STUB_SCONTROL)
    _stub(bin_dir / "python", f'#!/bin/bash\nexec "{sys.executable}" "$@"\n')
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SRUN_ARGS": str(tmp_path / "srun-args"),
        "REQUEUED": str(tmp_path / "requeued"),
        "SLURM_JOB_NODELIST": "gpu-node-[7-8]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "4242",
        **env,
    }
    return baked.path / "scripts" / "slurm" / "train.sbatch", env


@pytest.mark.parametrize(("status", "requeued"), [(0, False), (1, False), (75, True)])
def test_slurm_script_launches_one_task_per_gpu_and_requeues_only_after_preemption(
    cookies, tmp_path, status, requeued
):
    """Given SLURM's variables, the script runs srun with one task per GPU (torch's variables come
    from SLURM's), requeues only when training exits 75, and exits with training's status."""
    baked = bake(cookies, cluster="slurm")
    script, env = _slurm(baked, tmp_path, STUB_SRUN, SRUN_EXIT=str(status))
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    result = subprocess.run(
        ["bash", str(script), "run.output_dir=runs/exp1"],
        cwd=baked.path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == status, result.stderr
    args = (tmp_path / "srun-args").read_text().splitlines()
    assert args[0] == "--kill-on-bad-exit=0" and args[1:3] == ["bash", "-c"]
    ranks = "RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS"
    assert f"{ranks} exec python" in args[3]
    assert f"-m {baked.package}.train" in args[3]
    assert args[4:] == ["train", "--config", "configs/default.yaml", "run.output_dir=runs/exp1"]
    assert (tmp_path / "requeued").exists() == requeued
    text = script.read_text()
    assert "#SBATCH --signal=USR1@120" in text and "#SBATCH --requeue" in text


def test_slurm_script_takes_the_first_node_of_a_large_allocation_as_master(cookies, tmp_path):
    """20000 host names (more than a pipe holds): the script reads the whole list, exports the
    first host as MASTER_ADDR and runs training; cutting the list with `| head -n 1` under
    pipefail killed the job with scontrol's SIGPIPE (status 141) before srun ran."""
    baked = bake(cookies, cluster="slurm")
    script, env = _slurm(baked, tmp_path, STUB_SRUN)
    _stub(
        tmp_path / "bin" / "scontrol",
        STUB_SCONTROL.replace("${NODES:-gpu-node-7 gpu-node-8}", "gpu-node-{0..19999}"),
    )
    result = subprocess.run(
        ["bash", str(script)], cwd=baked.path, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    host, port = (tmp_path / "srun-args.master").read_text().strip().split(":")
    assert host == "gpu-node-0" and port.isdigit()


def _master_port(baked, tmp_path, **env) -> int:
    """The MASTER_PORT the SLURM script hands srun, given these extra environment variables."""
    script, slurm_env = _slurm(baked, tmp_path, STUB_SRUN, **env)
    if "MASTER_PORT" not in env:
        slurm_env.pop("MASTER_PORT", None)  # one set where the tests run must not choose it
    result = subprocess.run(
        ["bash", str(script)], cwd=baked.path, env=slurm_env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return int((tmp_path / "srun-args.master").read_text().strip().rsplit(":", 1)[1])


def test_slurm_script_gives_each_job_its_own_unprivileged_port(cookies, tmp_path):
    """Jobs get different rendezvous ports (two jobs on one first node must not collide), each
    unprivileged and below Linux's ephemeral range; MASTER_PORT from the environment wins."""
    baked = bake(cookies, cluster="slurm")
    ports = []
    for job_id in ("4242", "4243", "1", "987654321"):
        run_dir = tmp_path / job_id
        run_dir.mkdir()
        ports.append(_master_port(baked, run_dir, SLURM_JOB_ID=job_id))
    assert len(set(ports)) == len(ports), ports
    assert all(1024 <= port < 32768 for port in ports), ports
    (tmp_path / "override").mkdir()
    assert _master_port(baked, tmp_path / "override", MASTER_PORT="12345") == 12345


def test_slurm_script_skips_a_port_that_is_taken(cookies, tmp_path):
    """When another program listens on the job's port, the script takes the next free one."""
    baked = bake(cookies, cluster="slurm")
    job_id = 4242
    taken = 20000 + job_id % 10000
    with socket.socket() as holder:
        try:
            holder.bind(("", taken))
        except OSError:
            pytest.skip(f"port {taken} is already in use here")
        holder.listen()
        port = _master_port(baked, tmp_path, SLURM_JOB_ID=str(job_id))
    assert taken < port < taken + 200


def test_slurm_preemption_end_to_end_on_cpu(cookies, tmp_path):
    """The SLURM script with an srun that starts 2 real training tasks here: SIGUSR1 to the tasks
    (what --signal does) makes them checkpoint and exit 75, and the script requeues the job."""
    baked = bake(cookies, cluster="slurm")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script, env = _slurm(
        baked,
        tmp_path,
        LOCAL_SRUN,
        SLURM_NTASKS="2",
        SRUN_PIDS=str(tmp_path / "pids"),
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(baked.path / "src"),
        NODES="127.0.0.1",
    )
    run_dir = tmp_path / "run"
    overrides = [
        *_baked_tiny_config(baked.path),
        "trainer.max_epochs=20",
        "trainer.checkpoint_every=2",
    ]
    overrides.append(f"run.output_dir={run_dir}")
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        job = subprocess.Popen(
            ["bash", str(script), *overrides],
            cwd=baked.path,
            env=env,
            text=True,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 120
    while not list((run_dir / "checkpoints").glob("step_*.pt")):
        if job.poll() is not None or time.monotonic() > deadline:
            os.killpg(job.pid, signal.SIGKILL)
            pytest.fail(f"no checkpoint:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    for pid in (tmp_path / "pids").read_text().split():
        os.kill(int(pid), signal.SIGUSR1)
    try:
        job.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        pytest.fail(f"still running 120 s after SIGUSR1:\n{log.read_text()[-3000:]}")
    output = log.read_text()
    assert job.returncode == 75, output[-3000:]
    assert (tmp_path / "requeued").read_text().split() == ["4242"]
    assert "stopped by SIGUSR1 after step" in output
    stopped_at = int(output.split("stopped by SIGUSR1 after step ")[1].split(";")[0])
    assert max(int(p.name[5:13]) for p in (run_dir / "checkpoints").glob("step_*.pt")) == stopped_at


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


# Kubernetes object names: a DNS-1123 label (names of volumes, containers, label values, ...), and
# the stricter DNS-1035 label the training operator requires of a PyTorchJob's name.
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def _k8s_names(node, key=""):
    """Yield (key, value) for every name, claimName and label value in a manifest's tree."""
    if isinstance(node, dict):
        for child_key, child in node.items():
            if child_key == "labels":
                yield from ((f"label {k}", v) for k, v in child.items())
            elif child_key in ("name", "claimName") and isinstance(child, str):
                yield child_key, child
            else:
                yield from _k8s_names(child, child_key)
    elif isinstance(node, list):
        for child in node:
            yield from _k8s_names(child, key)


@pytest.mark.parametrize(
    "answers",
    [
        {},
        {"project_slug": "2nd_model", "package_name": "second_model"},
        {"project_slug": "my__vision_lab", "package_name": "vision_lab"},
        {"project_slug": "9" * 70, "package_name": "long_model"},
    ],
    ids=["default", "digit-and-underscore", "underscores", "70-digits"],
)
def test_kubernetes_names_are_valid_dns_labels(cookies, answers):
    """Whatever the slug (underscores, a leading digit, 70 characters), the PyTorchJob's name is a
    DNS-1035 label short enough for the operator's "<name>-worker-<index>" services, and every
    other name and label value is a DNS-1123 label."""
    baked = bake(cookies, cluster="kubernetes", **answers)
    job = yaml.safe_load((baked.path / "scripts" / "kubernetes" / "pytorchjob.yaml").read_text())
    name = job["metadata"]["name"]
    assert DNS1035_LABEL.fullmatch(name) and len(name + "-worker-99999") <= 63, name
    names = list(_k8s_names(job))
    assert ("claimName", f"{name}-runs") in names
    for key, value in names:
        assert DNS1123_LABEL.fullmatch(value) and len(value) <= 63, (key, value)


def test_cluster_files_are_left_out_unless_chosen(cookies):
    """cluster=none bakes no scripts/ folder."""
    assert not (bake(cookies).path / "scripts").exists()
