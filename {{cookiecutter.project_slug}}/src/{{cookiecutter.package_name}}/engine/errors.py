"""What can go wrong, named for what it means, and the exit status each kind gets.

Every entry point turns these into one line on stderr and the status below, never a traceback:

    2  bad input the user must fix: configuration, data, a checkpoint (ConfigError and subclasses)
    1  a failure while running: an output could not be written (OutputError, e.g. a full disk),
       the run diverged (Diverged), the device ran out of memory (OutOfMemory), another process
       hung or died (PeerFailure)
   75  stopped on request after writing a checkpoint (Preempted): run the same command again
"""

from __future__ import annotations

import errno
import re
import shutil
import sys
from pathlib import Path

BAD_INPUT = 2
RUNTIME_FAILURE = 1
PREEMPTED_EXIT = 75  # EX_TEMPFAIL in sysexits.h: a temporary failure, run the same command again


class ConfigError(Exception):
    """A configuration the user must fix; the message names the key and what is allowed (exit 2)."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; the message says which file and why (exit 2)."""


class DataError(ConfigError):
    """Data that cannot be read or used: an unreadable file, a data set too small (exit 2)."""


class OutputError(Exception):
    """An output file could not be written: disk full, no permission, a read-only folder (exit 1)."""


class RunDirectoryBusy(ConfigError):
    """Another run is writing into the same run.output_dir (exit 2)."""


class Diverged(RuntimeError):
    """The loss or gradient norm became NaN or infinite; nothing non-finite is ever checkpointed (exit 1)."""


class OutOfMemory(RuntimeError):
    """The device ran out of memory; the message says what to change (exit 1)."""


class PeerFailure(RuntimeError):
    """A collective failed or timed out: another process hung or died, and its own log says why (exit 1)."""


class Preempted(Exception):
    """Training stopped on request after writing a checkpoint; run the same command to resume (exit 75)."""


# The one table from error kind to exit status; the first matching kind wins.
EXIT_STATUS = (
    (ConfigError, BAD_INPUT),
    (OutputError, RUNTIME_FAILURE),
    (Diverged, RUNTIME_FAILURE),
    (OutOfMemory, RUNTIME_FAILURE),
    (PeerFailure, RUNTIME_FAILURE),
    (Preempted, PREEMPTED_EXIT),
)


def error_line(err: BaseException) -> str:
    """The one line to show the user, also when a DataLoader worker wrapped it in its traceback."""
    last = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
    return re.sub(r"^[\w.]+Error: ", "", last)


def report(err: BaseException) -> int:
    """Print err as one `error: ...` line on stderr and return its exit status (exit_status must know it)."""
    print(f"error: {error_line(err)}", file=sys.stderr)
    return exit_status(err)


def exit_status(err: BaseException) -> int | None:
    """The exit status for an error the entry points report in one line; None for a bug (traceback)."""
    return next((status for kind, status in EXIT_STATUS if isinstance(err, kind)), None)


def write_failure(err: BaseException) -> str | None:
    """Why a write failed, in words, when err is a full disk or a permission problem; else None.

    torch.save reports a full disk as a RuntimeError ("file write failed") rather than an OSError
    with ENOSPC, so the text is read as well as the errno.
    """
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on the device"
    if isinstance(err, OSError) and err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"no permission to write ({err.strerror})"
    if isinstance(err, OSError):
        return err.strerror or str(err)
    text = str(err).lower()
    if isinstance(err, RuntimeError) and ("write failed" in text or "no space left" in text):
        return "the write failed (is the disk full?)"
    if type(err).__name__ == "SafetensorError":  # safetensors' own error type for a failed write
        return error_line(err)
    return None


def why_not_written(err: BaseException, where: Path) -> str:
    """The reason a write under `where` failed, with the free space there (a full disk shows as 0)."""
    reason = write_failure(err) or error_line(err)
    try:
        free = shutil.disk_usage(Path(where) if Path(where).exists() else Path(where).parent).free
    except OSError:
        return reason
    return f"{reason}; {free / 2**20:.0f} MiB free there"
