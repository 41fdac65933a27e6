"""Metric arithmetic: sample-weighted means and exact validation counts with an uneven last batch."""

import json
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from {{ cookiecutter.package_name }}.engine.config import TrackerConfig
from {{ cookiecutter.package_name }}.engine.metrics import MetricsLogger, PerfMeter, SampleMean
from {{ cookiecutter.package_name }}.task.data import DeviceImages
from {{ cookiecutter.package_name }}.task.validation import evaluate_model

from conftest import read_metrics


def test_sample_mean_weights_a_short_last_batch_by_its_size():
    """Batches of 4, 4 and 1 average to the mean over the 9 samples, not over the 3 batches."""
    values = torch.arange(9, dtype=torch.float32)
    mean = SampleMean()
    for batch in values.split(4):
        mean.update(batch.mean(), len(batch))
    assert mean.count == 9
    assert mean.mean == pytest.approx(values.mean().item())
    per_batch = torch.stack([b.mean() for b in values.split(4)]).mean().item()
    assert per_batch != pytest.approx(mean.mean)  # the naive average is wrong here


class FixedPredictions(nn.Module):
    """Predicts class 0 for even feature values, class 1 otherwise; has dropout to catch train mode."""

    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(p=0.9)
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        odd = x[:, 0] % 2
        logits = torch.stack([1 - odd, odd], dim=1) * 4.0 + self.bias
        return self.dropout(logits)


def test_evaluation_counts_every_sample_and_divides_by_samples():
    """101 samples in batches of 32: accuracy = correct / 101 and val/samples = 101, in eval mode."""
    x = torch.arange(101, dtype=torch.float32)[:, None]
    y = torch.zeros(101, dtype=torch.long)
    y[:30] = (x[:30, 0] % 2).long()  # the first 30 labels match the prediction, the rest are 0
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False)
    model = FixedPredictions().train()
    metrics = evaluate_model(model, loader, DeviceImages(torch.device("cpu")))
    expected_correct = 30 + int(((x[30:, 0] % 2) == 0).sum())
    assert metrics["val/samples"] == 101
    assert metrics["val/acc"] == pytest.approx(expected_correct / 101)
    logits = FixedPredictions().eval()(x)
    assert metrics["val/loss"] == pytest.approx(nn.functional.cross_entropy(logits, y).item())
    assert not model.training


def test_evaluation_builds_no_graph():
    """Validation runs under no_grad: no tensor it produces requires grad."""
    seen = []
    model = nn.Linear(1, 2)
    model.register_forward_hook(lambda m, i, out: seen.append(out.requires_grad))
    loader = DataLoader(TensorDataset(torch.randn(5, 1), torch.zeros(5, dtype=torch.long)), batch_size=2)
    evaluate_model(model, loader, DeviceImages(torch.device("cpu")))
    assert seen and not any(seen)


def test_metrics_logger_appends_json_lines(tmp_path):
    """Every record is one JSON line with step and epoch; a second logger appends (resume)."""
    for step in (1, 2):
        logger = MetricsLogger(tmp_path, TrackerConfig(name="none"), {})
        logger.log({"train/loss": 0.5}, step=step, epoch=0)
        logger.close()
    assert read_metrics(tmp_path) == [
        {"step": 1, "epoch": 0, "train/loss": 0.5},
        {"step": 2, "epoch": 0, "train/loss": 0.5},
    ]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


def test_disabled_logger_writes_nothing(tmp_path):
    """Ranks other than 0 get a disabled logger that touches no file."""
    logger = MetricsLogger(tmp_path / "other", TrackerConfig(name="none"), {}, enabled=False)
    logger.log({"train/loss": 1.0}, step=1, epoch=0)
    logger.close()
    assert not (tmp_path / "other").exists()


def test_global_mean_of_one_process_is_the_sample_mean():
    """global_mean() equals mean for one process (the all-reduce is a no-op without a process group)."""
    mean = SampleMean()
    mean.update(torch.tensor(2.0), 3)
    mean.update(torch.tensor(4.0), 1)
    assert mean.global_mean() == pytest.approx(2.5) == mean.mean


def test_perf_meter_measures_data_wait_and_leaves_out_excluded_time(monkeypatch):
    """Time blocked on the next batch is the data wait; validation inside excluded() is not training time."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def slow_batches():
        for batch in range(4):
            clock[0] += 1.0  # the loader takes 1 s to produce each batch
            yield batch

    meter = PerfMeter(torch.device("cpu"), world_size=2)
    for _ in meter.timed(slow_batches()):
        clock[0] += 3.0  # 3 s of compute per step
        meter.samples += 8
        meter.steps += 1
        with meter.excluded():
            clock[0] += 100.0  # a validation pass
    figures = meter.read()
    assert figures == {"perf/samples_per_s": 4.0, "perf/step_time_s": 4.0, "perf/data_wait": 0.25}
    assert meter.samples == meter.steps == 0  # the next window starts empty


def test_perf_meter_counts_gpu_made_batches_by_their_events_only(monkeypatch):
    """The CUDA-event path's arithmetic, on any machine: events stand in for CUDA's (milliseconds
    on the same fake clock); each batch counts once, in seconds, and the host clock adds nothing."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    class FakeEvent:
        def __init__(self, enable_timing: bool):
            assert enable_timing

        def record(self):
            self.at = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end) -> float:
            return (end.at - self.at) * 1000

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)

    def slow_batches():
        for batch in range(4):
            clock[0] += 1.0
            yield batch

    meter = PerfMeter(torch.device("cuda"), world_size=1, data_on_device=True)
    monkeypatch.setattr(meter, "device", torch.device("cpu"))  # read() asks no real CUDA device for memory
    for _ in meter.timed(slow_batches()):
        clock[0] += 3.0
        meter.samples, meter.steps = meter.samples + 8, meter.steps + 1
    assert len(meter.events) == 4
    assert meter.read()["perf/data_wait"] == 0.25
    assert meter.events == []  # the next window starts empty


@pytest.mark.gpu
def test_perf_meter_times_batches_made_on_the_gpu_with_events():
    """With the data on a CUDA device, a batch's GPU work counts as data wait, though the host only
    queues it (a host clock would see almost none of it), and reading the meter needs no sync."""
    device = torch.device("cuda")

    def gpu_made_batches():
        for _ in range(4):
            torch.cuda._sleep(50_000_000)  # tens of ms of GPU time, queued in microseconds
            yield torch.ones(8, device=device)

    for on_device in (True, False):
        meter = PerfMeter(device, world_size=1, data_on_device=on_device)
        for batch in meter.timed(gpu_made_batches()):
            meter.samples, meter.steps = meter.samples + len(batch), meter.steps + 1
        torch.cuda.synchronize()  # the training loop's loss read
        wait = meter.read()["perf/data_wait"]
        assert wait > 0.5 if on_device else wait < 0.1, (on_device, wait)
