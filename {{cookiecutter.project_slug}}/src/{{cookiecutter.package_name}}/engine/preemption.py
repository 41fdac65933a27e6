"""Preemption: SIGTERM and SIGUSR1 ask training to stop cleanly after the current optimizer step.

The signal handler only sets a flag. Once per optimizer step every rank shares its flag with a
small non-blocking all-reduce on the CPU; a stop asked of any rank stops all of them after the same
step. Training then writes one checkpoint and exits with PREEMPTED_EXIT, so a scheduler knows to
run the same command again (which resumes). Schedulers send these signals: SLURM sends SIGUSR1
ahead of the time limit (--signal), Kubernetes and torchrun send SIGTERM (torchrun forwards it to
its workers and kills them 30 s later).
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from .errors import PREEMPTED_EXIT, Preempted  # noqa: F401 - the names of the stop protocol, used with it
from .parallel.distributed import joined

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """A stop requested by SIGTERM or SIGUSR1 on any rank, agreed on by all ranks.

    Use as a context manager around training: it installs the handlers and puts the previous
    ones back. poll() is called once per optimizer step on every rank.
    """

    def __init__(self):
        self.signal: signal.Signals | None = None  # the signal this process received, if any
        self._previous: dict = {}
        self._group = None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # Python only allows handlers there
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        if joined() and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # a CPU flag: no device sync in the step
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._pending and exc[0] is None:
            self._pending[0].wait()  # every rank launched the same all-reduces; leave none in flight

    def _handle(self, signum, frame) -> None:
        self.signal = signal.Signals(signum)

    def poll(self) -> bool:
        """Whether every rank stops now. Without a process group: whether a signal arrived.

        With one, each call starts an all-reduce of this rank's flag and reads the one started by
        the previous call, so a stop lands one optimizer step after the signal, on all ranks at
        the same step, and no call waits on the network while there is work to do.
        """
        if not joined():
            return self.signal is not None
        if self._pending:
            (work, flag), self._pending = self._pending, None
            work.wait()
            if flag.item():  # a CPU tensor: no GPU sync
                return True
        flag = torch.tensor([0 if self.signal is None else 1], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return False
