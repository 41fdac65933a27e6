"""run_info.json: what produced a run (versions, git commit, command line, devices, hosts), one
record per start."""

import importlib.metadata
import json
import shutil
import socket
import subprocess

import pytest
import torch

from {{ cookiecutter.package_name }}.engine import provenance
from {{ cookiecutter.package_name }}.train import main

pytestmark = pytest.mark.core  # task-independent: the template runs it in one task's bake


def records(run_dir) -> list[dict]:
    return json.loads((run_dir / "run_info.json").read_text())["runs"]


@pytest.mark.slow
def test_each_start_records_what_produced_the_run_and_a_resume_appends(tiny, run_dir):
    """A fresh run writes one record (versions, command line, devices, world size, hosts); resuming
    it appends a second that names the step it continued from; a fresh start sets the file aside."""
    assert main([*tiny, "trainer.max_steps=2"]) == 0
    (first,) = records(run_dir)
    assert first["resumed_from_step"] is None
    assert first["versions"]["torch"] == torch.__version__ and first["versions"]["python"]
    assert first["command"][-1] == "trainer.max_steps=2" and f"run.output_dir={run_dir}" in first["command"]
    assert first["world_size"] == 1 and first["hosts"] == {socket.gethostname(): 1}
    assert first["packages"]["torch"] == importlib.metadata.version("torch")

    assert main([*tiny, "trainer.max_steps=4"]) == 0
    assert [r["resumed_from_step"] for r in records(run_dir)] == [None, 2]

    assert main([*tiny, "trainer.max_steps=1", "trainer.resume=never"]) == 0
    assert len(records(run_dir)) == 1  # a new run; the earlier file is kept aside
    assert len(json.loads((run_dir / "run_info.json.superseded").read_text())["runs"]) == 2


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_git_commit_and_uncommitted_changes_are_recorded(tmp_path, monkeypatch):
    """In a git checkout the record names HEAD and whether tracked files changed; outside one, null."""
    assert provenance.git_state(tmp_path) is None
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "train.py").write_text("print(1)\n")
    for command in (["init", "-q"], ["add", "train.py"], ["commit", "-q", "-m", "first"]):
        subprocess.run(["git", "-C", str(tmp_path), *command], check=True, capture_output=True)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert provenance.git_state(tmp_path) == {"commit": head.strip(), "dirty": False}
    (tmp_path / "train.py").write_text("print(2)\n")
    assert provenance.git_state(tmp_path) == {"commit": head.strip(), "dirty": True}
