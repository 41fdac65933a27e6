"""The names in a checkpoints folder and in a state dict, shared by both checkpoint formats.

A checkpoint is checkpoints/step_<N>.pt or the directory checkpoints/step_<N>/; listing and pruning
treat both alike. A wrapped or compiled model's state dict names its keys with the wrapper's prefix
(module., _orig_mod.), which strip_prefixes removes.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

CHECKPOINT_NAME = re.compile(r"^step_(\d+)(\.pt)?$")  # a file step_N.pt or a sharded directory step_N
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP / DataParallel, torch.compile


def strip_prefixes(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys without the module. / _orig_mod. prefixes that wrapped or compiled models add."""
    clean = {}
    for key, value in state_dict.items():
        while key.startswith(WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        clean[key] = value
    return clean


def step_of(path: Path) -> int:
    """The optimizer step in a checkpoint's name."""
    return int(CHECKPOINT_NAME.match(path.name).group(1))


def list_checkpoints(directory: Path) -> list[Path]:
    """Finished checkpoints in directory, oldest first (temporary files are ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if CHECKPOINT_NAME.match(p.name) and p.is_dir() != p.name.endswith(".pt")]
    return sorted(found, key=step_of)


def prune(directory: Path, step: int, keep_last: int) -> None:
    """Delete the oldest checkpoints (files or sharded directories) before step, leaving keep_last in all."""
    older = [p for p in list_checkpoints(directory) if step_of(p) < step]
    for old in older[: max(0, len(older) - (keep_last - 1))]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
