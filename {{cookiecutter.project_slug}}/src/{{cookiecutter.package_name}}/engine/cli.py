"""What every command does with what went wrong: one line on stderr and the exit status errors.py's
table gives its kind, never a traceback; a bug (an error of no known kind) keeps its traceback.

    def main(argv=None) -> int:
        return cli.run(lambda: command(argv))
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
from collections.abc import Callable

import torch

from .errors import PREEMPTED_EXIT, OutOfMemory, PeerFailure, Preempted, exit_status, report
from .parallel import distributed
from .startup import imports_done

# The interpreter's last garbage collections at exit walk the million objects that torch and its
# compiler stack made: 0.7 s of every command's exit, of each torchrun worker's too. Frozen, they are
# skipped. Nothing waits on them: the commands close their files, trackers and process groups
# themselves, and logging flushes its handlers at exit as before.
atexit.register(gc.freeze)


def run(command: Callable[[], int]) -> int:
    """Run a command's body and return its exit status, or the status of the error that ended it."""
    imports_done()
    try:
        code = command()
    except Preempted as err:
        if is_main_process():
            print(f"{err}; run the same command to resume (exit status {PREEMPTED_EXIT})", file=sys.stderr)
        code = PREEMPTED_EXIT
    except Exception as err:
        code = report(known(err))
    # A run that an exception stopped left its model to the garbage collector only once the exception
    # was handled; under FSDP the model still holds the process group's threads (distributed.teardown).
    distributed.free_finished_models()
    return code


def is_main_process() -> bool:
    """Rank 0 of the launch (or a lone process), the one that prints results; no process group needed."""
    return int(os.environ.get("RANK", "0")) == 0


def known(err: Exception) -> Exception:
    """err as one of errors.py's kinds, or raised again unchanged when it is a bug."""
    if exit_status(err) is not None:
        return err
    if isinstance(err, torch.OutOfMemoryError):  # raised where no command said what to change
        return OutOfMemory("CUDA out of memory; lower data.batch_size")
    if distributed.is_peer_failure(err):
        reason = str(err).strip().splitlines()[0][:300]
        return PeerFailure(
            "a collective failed or waited longer than distributed.timeout_s: another process hung or died "
            f"(its log says why); this process stops ({reason})"
        )
    raise err
