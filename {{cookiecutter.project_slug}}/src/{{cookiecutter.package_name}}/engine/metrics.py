"""Metrics: sample-weighted means, speed, and metrics.jsonl with its copy to the tracker (trackers.py)."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from .ckpt.files import atomic_write
from .config import TrackerConfig
from .errors import OutputError, why_not_written
from .parallel.distributed import all_reduce_sum
from .trackers import open_tracker

log = logging.getLogger(__name__)


class SampleMean:
    """Mean of per-sample values fed batch by batch: sum(batch_mean * n) / sum(n).

    The sum stays on the tensor's device; reading .mean syncs with the host, so read it only
    when logging (a .item() per step would stall the GPU every step).
    """

    def __init__(self):
        self.total = 0.0
        self.count = 0

    def update(self, batch_mean: torch.Tensor | float, n: int) -> None:
        if torch.is_tensor(batch_mean):
            batch_mean = batch_mean.detach()
        if torch.is_tensor(self.total):
            self.total = torch.add(self.total, batch_mean, alpha=n)  # one op: total + mean * n
        else:
            self.total = self.total + batch_mean * n
        self.count += n

    @property
    def mean(self) -> float:
        total = self.total.item() if torch.is_tensor(self.total) else self.total
        return total / self.count if self.count else math.nan

    def global_mean(self) -> float:
        """The mean over every process's samples; all processes must call it together."""
        total = self.total if torch.is_tensor(self.total) else torch.tensor(self.total)
        stats = torch.stack(
            [total.double().reshape(()), torch.tensor(self.count, dtype=torch.float64).to(total.device)]
        )
        all_reduce_sum(stats)
        total, count = stats.tolist()
        return total / count if count else math.nan

    def reset(self) -> None:
        self.total, self.count = 0.0, 0

    def state_dict(self) -> dict:
        """What a checkpoint keeps, so a window of logged losses spanning a resume comes out the same."""
        total = self.total.detach().cpu() if torch.is_tensor(self.total) else torch.tensor(self.total)
        return {"total": total, "count": self.count}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        self.total, self.count = state["total"].to(device), state["count"]


class PerfMeter:
    """Speed over one log window: samples/s, seconds per optimizer step, the share of time spent
    waiting for the next batch, and on CUDA the peak memory so far.

    Nothing here syncs with the device. A window ends where the loop reads the loss (a host sync),
    so queued GPU work is inside the window that queued it. Validation and checkpoint writing go
    through excluded() and do not count as training time.

    The data wait is host time spent in the loader, except with the data on a CUDA device
    (data_on_device): there a batch is GPU work that the host only queues, and once the launch
    queue is full the host waits in every launch, the batch's included, while the GPU never waits
    for data. There CUDA events time the stream from before a batch's kernels to after them: the
    GPU's time making batches, and any time it sat idle waiting for them to be queued.
    """

    def __init__(self, device: torch.device, world_size: int, data_on_device: bool = False):
        self.device, self.world_size = device, world_size
        self.gpu_timed = data_on_device and device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.started, self.samples, self.steps, self.waited = time.perf_counter(), 0, 0, 0.0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def timed(self, batches: Iterable) -> Iterator:
        """Yield from batches, adding the time spent waiting for each one to the data wait."""
        batches = iter(batches)
        while True:
            if self.gpu_timed:
                began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                began.record()
            asked = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            if self.gpu_timed:
                ended.record()
                self.events.append((began, ended))
            else:
                self.waited += time.perf_counter() - asked
            yield batch

    @contextmanager
    def excluded(self):
        """Leave the time spent inside out of the window (validation, checkpoints)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.started += time.perf_counter() - began

    def read(self) -> dict[str, float]:
        """This window's figures (samples/s counts every process); starts the next window."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        if self.events:  # the loss read before this ended the window's GPU work: no wait here
            self.events[-1][1].synchronize()
            self.waited += sum(began.elapsed_time(ended) for began, ended in self.events) / 1000
        figures = {
            "perf/samples_per_s": self.samples * self.world_size / elapsed,
            "perf/step_time_s": elapsed / max(self.steps, 1),
            "perf/data_wait": min(self.waited / elapsed, 1.0),
        }
        if self.device.type == "cuda":
            figures["perf/max_mem_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            figures["perf/max_mem_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        self.reset()
        return figures


class MetricsLogger:
    """Appends one JSON object per call to output_dir/metrics.jsonl and forwards it to the tracker.

    Create it on rank 0 only (enabled=False elsewhere makes every call a no-op).
    """

    def __init__(
        self, output_dir: Path, tracker: TrackerConfig, config: dict, enabled: bool = True, run_info: dict | None = None
    ):
        self.enabled = enabled
        self.tracker = None
        if not enabled:
            return
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(output_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.tracker = open_tracker(output_dir, tracker, config, run_info)

    @classmethod
    def disabled(cls) -> MetricsLogger:
        """A logger whose calls do nothing (the other ranks')."""
        return cls(Path(), TrackerConfig(name="none"), {}, enabled=False)

    def log(self, metrics: dict, step: int, epoch: int) -> None:
        if not self.enabled:
            return
        record = {"step": step, "epoch": epoch, **metrics}
        try:
            self.file.write(json_line(record))
            self.file.flush()
        except OSError as err:
            why = why_not_written(err, Path(self.file.name))
            raise OutputError(f"could not append to {self.file.name} ({why})") from None
        if self.tracker is not None:
            self.tracker.log(metrics, step)

    def close(self, error: BaseException | None = None) -> None:
        """Close metrics.jsonl and end the tracker's run; `error` is what stopped training, if anything
        (MLflow records the run as FINISHED, KILLED when preempted or interrupted, or FAILED)."""
        if not self.enabled:
            return
        self.file.close()
        if self.tracker is not None:
            self.tracker.close(error)


def json_line(record: dict) -> str:
    """One line of strict JSON: a non-finite number (NaN, inf), which JSON cannot represent, is null."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


def truncate_metrics(output_dir: Path, step: int) -> None:
    """Drop records logged after `step` (and a line a kill cut short): a resumed run logs them again.

    The file is rewritten atomically: a kill during the rewrite leaves the old file, never half of it.
    """
    path = Path(output_dir) / "metrics.jsonl"
    if path.exists():
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        text = "".join(f"{line}\n" for line in kept)
        atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
