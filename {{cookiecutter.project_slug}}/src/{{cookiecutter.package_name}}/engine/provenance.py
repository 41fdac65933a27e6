"""Run provenance: run_info.json in the output directory says what produced a run.

    {"runs": [{"started": ..., "resumed_from_step": null, "command": [...], "git": {...},
               "versions": {...}, "packages": {...}, "devices": {"NVIDIA H100": 2}, "world_size": 2,
               "hosts": {"node1": 2}}, ...]}

One record per start: a resumed run appends its own, so a run continued on other machines or
with another torch says so. The git commit (and whether the tree had uncommitted changes) is
recorded when the project is a git checkout. Nothing from the environment is recorded (no
variable can leak a secret); the command line is, as typed. Trackers receive the same record.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from . import PACKAGE
from .parallel import distributed

RUN_INFO = "run_info.json"
PROJECT_ROOT = Path(__file__).resolve().parents[3]  # src/PACKAGE/engine/provenance.py -> the project
# The command line of this start: set by the entry point (train.main) to the arguments it was given.
command_line: list[str] = [Path(sys.executable).name, *sys.argv]


def run_record(resumed_from_step: int | None) -> dict:
    """This start's record (every rank calls it: the hosts and devices of all ranks are gathered)."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    mine = (socket.gethostname(), device)
    everyone = distributed.all_gather_object(mine)
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),  # UTC, ISO 8601
        "resumed_from_step": resumed_from_step,
        "command": list(command_line),
        "git": git_state(PROJECT_ROOT),
        "versions": versions(),
        "packages": package_versions(),
        "devices": dict(sorted(Counter(d for _, d in everyone).items())),
        "world_size": len(everyone),
        "hosts": dict(sorted(Counter(h for h, _ in everyone).items())),
    }


def git_state(root: Path) -> dict | None:
    """{"commit": sha, "dirty": bool} of the checkout holding root; None outside one or without git."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def versions() -> dict:
    """Python, torch, CUDA, cuDNN and NCCL versions (null where there is none)."""
    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError):
            nccl = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": nccl,
        "platform": platform.platform(),
    }


def imported_distributions() -> list[str]:
    """The installed distributions that provide the top-level modules imported so far (outside the
    standard library): a distribution of the module's name, else one whose top_level.txt names it.
    (importlib.metadata.packages_distributions() would read every installed distribution's file
    list, a third of a second or more at every start in a large environment.)"""
    names = {n for n in list(sys.modules) if "." not in n and n[0] != "_" and n not in sys.stdlib_module_names}
    found, left = set(), set()
    for name in sorted(names):
        try:
            found.add(importlib.metadata.distribution(name).metadata["Name"])
        except importlib.metadata.PackageNotFoundError:
            left.add(name)
    if left:
        for dist in importlib.metadata.distributions():
            if set((dist.read_text("top_level.txt") or "").split()) & left:
                found.add(dist.metadata["Name"])
    return sorted(found)


def package_versions() -> dict:
    """The installed version of the project and of each package it requires (or, run from its source
    tree, of every package this process has imported: torch and the task's libraries among them)."""
    package = PACKAGE
    found = {}
    try:
        found[package] = importlib.metadata.version(package)
        requires = importlib.metadata.requires(package) or []
        names = [m[0] for m in (re.match(r"[A-Za-z0-9_.\-]+", r) for r in requires if "extra ==" not in r) if m]
    except importlib.metadata.PackageNotFoundError:
        names = imported_distributions()  # run from the source tree: what it imported instead
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def append_record(output_dir: Path, record: dict, fresh: bool) -> None:
    """Add this start's record to run_info.json (main process; a fresh start begins a new file)."""
    from .ckpt.files import atomic_write

    path = Path(output_dir) / RUN_INFO
    runs = []
    if not fresh and path.exists():
        try:
            runs = json.loads(path.read_text(encoding="utf-8")).get("runs", [])
        except (ValueError, OSError, AttributeError):
            runs = []  # unreadable: this start's record begins it again
    text = json.dumps({"runs": [*runs, record]}, indent=1) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
