"""Preemption: SIGTERM and SIGUSR1 ask training to stop cleanly after the current optimizer step.

The signal handler only sets a flag. Once per optimizer step every rank shares its flag with a
small non-blocking all-reduce on the CPU; a stop asked of any rank stops all of them after the same
step. Training then writes one checkpoint and exits with PREEMPTED_EXIT, so a scheduler knows to
run the same command again (which resumes). Schedulers send these signals: SLURM sends SIGUSR1
ahead of the time limit (--signal), Kubernetes and torchrun send SIGTERM (torchrun forwards it to
its workers and kills them 30 s later).

A launcher that dies without a word stops its workers the same way. torchrun (and accelerate
launch, which runs the same agent) starts every worker in a session of its own, so a `kill -9` of
torchrun, or the kernel's OOM killer, leaves them training on under init, holding the run
directory's lock. A worker the agent started (TORCHELASTIC_RUN_ID is set) therefore checks about
once a second whether its parent is still the process that started it. A plain `python -m ...`
process does not: its parent is a shell that may go away on purpose (nohup).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from .errors import PREEMPTED_EXIT, Preempted  # noqa: F401 - the names of the stop protocol, used with it
from .parallel.distributed import joined

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
LAUNCHER_CHECK_S = 1.0  # seconds between checks that the launcher is alive
# The flag each rank shares names what asked it to stop (the all-reduce keeps the largest), so a rank
# stopped by another one can say why: 0 is no request, another (a signal a sweep also handles) is 1.
CODES = {"SIGINT": 2, "SIGUSR1": 3, "SIGTERM": 4, "launcher": 5}
FROM_ANOTHER = {
    1: "a stop request of another process",
    **{code: f"{name} to another process" for name, code in CODES.items() if name.startswith("SIG")},
    CODES["launcher"]: "the loss of another process's launcher",
}


class StopRequest:
    """A stop requested by SIGTERM or SIGUSR1 (or the loss of the launcher) on any rank, agreed on by all ranks.

    Use as a context manager around training: it installs the handlers and puts the previous
    ones back. poll() is called once per optimizer step on every rank. The sweep uses it with its
    own signals and on_stop, which passes the stop on to the running trial.
    """

    def __init__(self, signals: Iterable[signal.Signals] = SIGNALS, on_stop: Callable[[], None] | None = None):
        self.signal: signal.Signals | None = None  # the signal this process received, if any
        self.reason: str | None = None  # what asked this process to stop, for "stopped by ...": "SIGTERM", ...
        self._signals, self._on_stop = tuple(signals), on_stop
        self._previous: dict = {}
        self._group = None
        self._code = 0  # the kind of this process's request, from CODES
        self._launcher: int | None = None  # the pid of torchrun's agent, when it started this process
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self._closed = threading.Event()
        self._watch: threading.Thread | None = None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # Python only allows handlers there
            for sig in self._signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # started by torchrun's agent
            self._launcher = os.getppid()
            self._watch = threading.Thread(target=self._watch_launcher, daemon=True)
            self._watch.start()
        if joined() and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")  # a CPU flag: no device sync in the step
        return self

    def __exit__(self, *exc) -> None:
        self._closed.set()
        if self._watch:
            self._watch.join()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._pending and exc[0] is None:
            self._pending[0].wait()  # every rank launched the same all-reduces; leave none in flight

    def _handle(self, signum, frame) -> None:
        self.signal = signal.Signals(signum)
        self.request(self.signal.name, CODES.get(self.signal.name, 1))

    def _watch_launcher(self) -> None:
        """A thread: once the parent is no longer the launcher (it died; init or a subreaper adopted us), stop."""
        while not self._closed.wait(LAUNCHER_CHECK_S):
            if self._launcher_lost():
                return

    def _launcher_lost(self) -> bool:
        """Whether the launcher is gone, asking to stop if so."""
        lost = self._launcher is not None and os.getppid() != self._launcher
        if lost:
            self.request(f"the loss of its launcher (pid {self._launcher})", CODES["launcher"])
        return lost

    def request(self, reason: str, code: int = 1) -> None:
        """Ask to stop, as a signal does (the first reason is the one kept)."""
        if self.reason is None:
            self.reason, self._code = reason, code
        if self._on_stop:
            self._on_stop()

    def poll(self) -> bool:
        """Whether every rank stops now. Without a process group: whether a stop was requested.

        With one, each call starts an all-reduce of this rank's flag and reads the one started by
        the previous call, so a stop lands one optimizer step after the signal, on all ranks at
        the same step, and no call waits on the network while there is work to do. A rank stopped
        by another one takes its reason from the flag, unless it finds its own launcher gone too
        (the ranks' watchers check it at different moments).
        """
        if not joined():
            return self.reason is not None
        if self._pending:
            (work, flag), self._pending = self._pending, None
            work.wait()
            if code := int(flag.item()):  # a CPU tensor: no GPU sync
                if self.reason is None and not self._launcher_lost():
                    self.reason = FROM_ANOTHER[code]
                return True
        flag = torch.tensor([self._code], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return False
