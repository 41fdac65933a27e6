"""The baked project's tooling works as shipped: Makefile, CI, pre-commit, .gitignore, Docker."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import bake, run

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

BIN = str(Path(sys.executable).parent)


@pytest.fixture(scope="module")
def project(cookies_session):
    """A default bake, made a git repository (pre-commit and git check-ignore need one)."""
    baked = bake(cookies_session)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com"}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    for command in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "bake"]):
        assert run(command, cwd=baked.path, env=env).returncode == 0
    return baked


def project_env(project, **extra) -> dict:
    """This interpreter's tools first on PATH, the baked package importable from src/."""
    path = os.pathsep.join([BIN, os.environ["PATH"]])
    return {**os.environ, "PATH": path, "PYTHONPATH": str(project.path / "src"), **extra}


def make(project, *targets: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run make targets in the baked project with this interpreter as PYTHON."""
    command = ["make", f"PYTHON={sys.executable}", *targets]
    return run(command, cwd=project.path, env=project_env(project), timeout=timeout)


def test_make_lint_passes_on_a_fresh_bake(project):
    """`make lint` (ruff check and format check) passes on the project as baked."""
    completed = make(project, "lint")
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_make_smoke_trains_two_gloo_processes(project):
    """`make smoke` trains 2 CPU processes with gloo and logs validation over the whole set."""
    completed = make(project, "smoke")
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
    records = [json.loads(line) for line in (project.path / "runs/smoke/metrics.jsonl").open()]
    val = [r for r in records if "val/samples" in r]
    assert val and all(r["val/samples"] == 101 for r in val)
    assert "32 per process x 2 processes" in completed.stderr  # rank 0's log of the global batch


def test_every_make_target_expands_to_a_real_command(project):
    """Each target the README lists exists in the Makefile and names the baked package's modules."""
    targets = ("install", "train", "smoke", "test", "test-all", "test-portable", "lint", "format")
    for target in (*targets, "plot"):
        completed = make(project, "-n", target)
        assert completed.returncode == 0, (target, completed.stderr)
    dry = make(project, "-n", "train", "plot").stdout
    assert f"-m {project.package}.train" in dry and f"-m {project.package}.plot" in dry


def test_ci_workflow_lints_tests_and_runs_the_two_process_smoke(project):
    """The GitHub Actions job installs the CPU build, then runs make lint, every test tier
    (make test-all), the fast tier under a second arithmetic (make test-portable) and the smoke
    run."""
    workflow = yaml.safe_load((project.path / ".github/workflows/ci.yml").read_text())
    steps = workflow["jobs"]["test"]["steps"]
    runs = [step["run"].strip() for step in steps if "run" in step]
    assert "download.pytorch.org/whl/cpu" in runs[0] and 'pip install -e ".[dev]"' in runs[0]
    assert runs[1:] == ["make lint", "make test-all", "make test-portable", "make smoke"]
    python = steps[1]["with"]["python-version"]
    assert python == project.context["python_version"]


def test_ci_workflow_grants_only_read_access(project):
    """The workflow's token may only read the repository: `permissions: contents: read` at the
    top, and no job asks for more."""
    workflow = yaml.safe_load((project.path / ".github/workflows/ci.yml").read_text())
    assert workflow["permissions"] == {"contents": "read"}
    for name, job in workflow["jobs"].items():
        assert job.get("permissions", {"contents": "read"}) == {"contents": "read"}, name


def test_pre_commit_runs_ruff_offline_and_catches_a_lint_error(project, tmp_path):
    """pre-commit's ruff hooks pass on the fresh bake and fail on an undefined name."""
    env = project_env(project, PRE_COMMIT_HOME=str(tmp_path / "pre-commit"))
    command = [sys.executable, "-m", "pre_commit", "run", "--all-files"]
    completed = run(command, cwd=project.path, env=env)
    assert completed.returncode == 0, completed.stdout + completed.stderr

    bad = project.path / "src" / project.package / "scratch.py"
    bad.write_text("print(undefined_name)\n")
    try:
        run(["git", "add", str(bad)], cwd=project.path)
        completed = run(command, cwd=project.path, env=env)
        assert completed.returncode != 0 and "F821" in completed.stdout
    finally:
        run(["git", "rm", "-q", "--cached", "-f", str(bad)], cwd=project.path)
        bad.unlink(missing_ok=True)


@pytest.mark.parametrize(
    ("path", "ignored"),
    [
        ("runs/exp1/metrics.jsonl", True),
        ("runs/exp1/checkpoints/step_00000100.pt", True),
        ("checkpoints/step_00000100.pt", True),
        ("outputs/model.safetensors", True),
        ("export/model.pt2", True),
        ("wandb/offline-run-1/files/config.yaml", True),
        ("tensorboard/events.out.tfevents.1", True),
        ("data/cifar-10-batches-py/data_batch_1", True),
        (".env", True),
        (".env.local", True),
        (".env.example", False),
        ("configs/default.yaml", False),
        ("src/PKG/train.py", False),
        ("tests/test_train.py", False),
    ],
)
def test_gitignore_covers_outputs_data_and_secrets(project, path, ignored):
    """Run outputs, checkpoints, tracker files, data and .env are ignored; code and configs not."""
    path = path.replace("PKG", project.package)
    completed = run(["git", "check-ignore", "-q", "--no-index", path], cwd=project.path)
    assert completed.returncode == (0 if ignored else 1), path


@pytest.fixture(scope="module")
def docker_project(cookies_session):
    """A bake with include_docker=yes."""
    return bake(cookies_session, include_docker="yes")


def test_dockerfile_builds_from_files_the_project_has(docker_project):
    """The Dockerfile starts from a CUDA PyTorch image no older than the project's torch floor,
    copies only paths that exist, and runs the baked package's train module."""
    root = docker_project.path
    text = (root / "Dockerfile").read_text()
    base = re.search(
        r"^FROM pytorch/pytorch:(\d+)\.(\d+)\.\d+-cuda[\d.]+-cudnn\d+-runtime$", text, re.M
    )
    assert base, "FROM must name an official CUDA runtime image of PyTorch"
    requires = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = next(r for r in requires if r.startswith("torch>="))
    major, minor = (int(x) for x in floor.removeprefix("torch>=").split(".")[:2])
    assert (int(base[1]), int(base[2])) >= (major, minor)
    for line in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for source in line.split():
            assert (root / source).exists(), source
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M)[1])
    assert cmd[:3] == ["python", "-m", f"{docker_project.package}.train"]
    assert (root / cmd[cmd.index("--config") + 1]).is_file()


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """The Dockerfile's (INSTRUCTION, arguments) in order, continuation lines joined."""
    logical = re.sub(r"\\\n(\s*#[^\n]*\n)*", " ", text)
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
        for line in logical.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_dockerfile_trains_as_a_non_root_user_with_writable_dirs(docker_project):
    """The image installs as root, then switches to a user that is not root (by a number, which
    Kubernetes' runAsNonRoot can check) and that the image creates, before the training command;
    the working directory (runs/, data/) and $HOME are writable by it."""
    steps = dockerfile_instructions((docker_project.path / "Dockerfile").read_text())
    kinds = [kind for kind, _ in steps]
    users = [args for kind, args in steps if kind == "USER"]
    assert users, "no USER: the container would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid != "0", users[-1]
    last_user = len(kinds) - 1 - kinds[::-1].index("USER")
    assert kinds.index("CMD") > last_user
    install = next(i for i, (kind, args) in enumerate(steps) if "pip install" in args)
    assert install < last_user, "pip must install as root, before USER"
    commands = [
        command.split()
        for kind, args in steps
        if kind == "RUN"
        for command in re.split(r"&&|;", args)
    ]
    useradd = next(command for command in commands if command[0] == "useradd")
    assert useradd[useradd.index("--uid") + 1] == uid, "the USER must exist in the image"
    owners = {uid, useradd[-1]}
    workdir = [args for kind, args in steps if kind == "WORKDIR"][-1]
    home = re.search(r"\bHOME=(\S+)", " ".join(a for k, a in steps if k == "ENV"))[1]
    for path in (workdir, f"{workdir}/runs", home):
        owned = any(
            c[0] == "chown" and c[1].split(":")[0] in owners and path in c for c in commands
        )
        open_to_all = any(c[0] == "chmod" and c[1][-1] in "67" and path in c for c in commands)
        created = "--create-home" in useradd and path == f"/home/{useradd[-1]}"
        assert owned or open_to_all or created, f"{path} is not writable by {users[-1]}"


def test_dockerignore_keeps_outputs_data_and_secrets_out_of_the_image(docker_project):
    """.dockerignore leaves run outputs, data, checkpoints and .env out of the build context."""
    ignored = set((docker_project.path / ".dockerignore").read_text().split())
    assert {".git", ".venv", "runs", "data", "wandb", ".env", "*.pt", "*.safetensors"} <= ignored


def test_docker_section_only_when_chosen(project, docker_project):
    """The README documents Docker only in bakes that include the Dockerfile."""
    assert "## Docker" not in (project.path / "README.md").read_text()
    assert "docker build" in (docker_project.path / "README.md").read_text()
