"""torch.profiler traces of chosen optimizer steps: trainer.profile_steps=[a, b].

    python -m PACKAGE.train trainer.profile_steps=[10,12]

records optimizer steps 10, 11 and 12 (counted from 1, as metrics.jsonl counts them) on every
process: CPU and CUDA activity, operator input shapes and memory allocations. Each process writes
run.output_dir/profile/rank<R>.json, a Chrome trace-event file that ui.perfetto.dev and
chrome://tracing open, with one ProfilerStep#N span per optimizer step. On CUDA each also writes
rank<R>.memory.pickle, a snapshot of the CUDA allocator's history over those steps, for
pytorch.org/memory_viz. Validation or a checkpoint falling inside the window is recorded too.

Pick steps after the first few: the first steps include one-off work (kernel selection,
torch.compile, the DataLoader's workers starting). A resumed run profiles what is left of the
window; when the window lies before its start, nothing. Off (null, the default), the loop's two
calls per step return at once.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .ckpt.files import atomic_write, writing
from .torch_private import dump_cuda_memory_snapshot, record_cuda_memory_history

log = logging.getLogger(__name__)


class StepProfiler:
    """Starts torch.profiler before optimizer step a and writes its trace after step b."""

    def __init__(self, steps: list[int] | None, directory: Path, rank: int, device: torch.device):
        self.first, self.last = steps if steps else (0, -1)
        self.directory, self.rank, self.device = Path(directory), rank, device
        self.profiler: torch.profiler.profile | None = None
        self.span: torch.profiler.record_function | None = None
        self.recorded: list[int] = []  # the optimizer steps profiled

    def before_step(self, step: int) -> None:
        """Called before optimizer step `step` runs: starts recording at the window's first step (or at
        a resumed run's first step inside the window)."""
        if not self.first <= step <= self.last:
            return
        if self.profiler is not None:
            self._mark(step)
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            record_cuda_memory_history(True)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self.profiler.start()
        self._mark(step)

    def _mark(self, step: int) -> None:
        """Open a ProfilerStep#N span around optimizer step N (torch's own name for a step in a trace)."""
        self.span = torch.profiler.record_function(f"ProfilerStep#{step}")
        self.span.__enter__()
        self.recorded.append(step)

    def _end_span(self) -> None:
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None

    def after_step(self, step: int) -> None:
        """Called after optimizer step `step`: closes its span, and writes the trace after the window's last."""
        if self.profiler is None:
            return
        self._end_span()
        if step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write what was recorded (the window's end, or a run that ended inside it)."""
        if self.profiler is None:
            return
        self._end_span()  # a step an error interrupted
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        trace = self.directory / f"rank{self.rank}.json"
        with writing(trace):
            atomic_write(trace, lambda tmp: profiler.export_chrome_trace(str(tmp)))
        if self.device.type == "cuda":
            snapshot = self.directory / f"rank{self.rank}.memory.pickle"
            with writing(snapshot):
                atomic_write(snapshot, dump_cuda_memory_snapshot)
            record_cuda_memory_history(False)
        log.info("profile of steps %d-%d written to %s", self.recorded[0], self.recorded[-1], trace)
