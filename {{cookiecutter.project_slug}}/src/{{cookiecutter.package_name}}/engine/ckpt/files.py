"""Files that are never half-written: the one atomic write every output goes through, and the
rename that sets an earlier file aside instead of deleting it.

A write goes to a temporary name in the same folder, is fsynced and renamed into place, and the
folder is fsynced: a crash at any moment leaves either the old file or the new one, never a torn
one. A write that fails for a reason the user can fix (full disk, no permission) is an OutputError
naming the file (`writing`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from ..errors import OutputError, why_not_written, write_failure

log = logging.getLogger(__name__)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in the folder `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Path], None], check: Callable[[Path], None] | None = None) -> None:
    """Call write(tmp_path), check it, fsync it, then rename it to path (and fsync the folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")  # keeps the suffix torch.export checks
    try:
        write(tmp)
        if check:
            check(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


@contextmanager
def writing(path: Path):
    """A write inside that fails (full disk, no permission, a folder in the way) is an OutputError naming path."""
    try:
        yield
    except Exception as err:  # OSError; torch.save's and safetensors' RuntimeError / SafetensorError
        if write_failure(err) is None:
            raise
        raise OutputError(f"could not write {path} ({why_not_written(err, path.parent)})") from None


def unique_aside(path: Path, suffix: str) -> Path:
    """Rename path to <name>.<suffix>, or <name>.<n>.<suffix> when that is taken: nothing is overwritten."""
    target = path.with_name(f"{path.name}.{suffix}")
    n = 2
    while target.exists() or target.is_symlink():
        target = path.with_name(f"{path.name}.{n}.{suffix}")
        n += 1
    path.rename(target)
    return target


def move_aside(paths: list[Path], suffix: str, why: str) -> None:
    """Rename files to <name>.<suffix> (a unique name): resume never picks them, nothing is deleted."""
    for path in paths:
        target = unique_aside(path, suffix)
        log.warning("renamed %s to %s: %s", path.name, target.name, why)
