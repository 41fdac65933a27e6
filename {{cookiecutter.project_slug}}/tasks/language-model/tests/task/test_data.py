"""Token data: the synthetic source's floor, windows by (seed, epoch, index), exact validation
windows for any number of processes, and token files read as one stream (test_prepare.py tests the
prepare command that writes them)."""

import math

import numpy as np
import pytest
import torch

from {{ cookiecutter.package_name }}.engine.loaders import ResumableSampler, build_train_loader, build_val_loader
from {{ cookiecutter.package_name }}.task.config import DataConfig
from {{ cookiecutter.package_name }}.task.data import IGNORE, MarkovSource, Tokens, TrainWindows, ValWindows, build_datasets


def test_entropy_rate_is_the_cross_entropy_of_the_true_chain():
    """The logged floor is the source's entropy rate: the true chain's own mean cross-entropy on a
    long sample of its text equals it (to sampling noise), and it lies below what the last symbol
    alone predicts."""
    source = MarkovSource(vocab_size=8, order=2, concentration=0.3, context_concentration=0.5, seed=3)
    text = source.sample(400_000, streams=16, seed=4).astype(np.int64).reshape(16, -1)
    contexts = text[:, :-2] * 8 + text[:, 1:-1]
    empirical = -np.log(source.next_probs[contexts, text[:, 2:]]).mean()
    assert empirical == pytest.approx(source.entropy_rate(), rel=0.01)
    pairs = np.zeros((8, 8))
    np.add.at(pairs, (text[:, 1:-1].ravel(), text[:, 2:].ravel()), 1)
    by_last = pairs / pairs.sum(axis=1, keepdims=True)
    bigram = -(pairs / pairs.sum() * np.log(np.where(by_last > 0, by_last, 1))).sum()
    assert bigram > source.entropy_rate() * 1.02


def test_synthetic_data_is_the_same_for_every_run_seed():
    """The source's text does not change with run.seed (it is the data, not the run)."""
    cfg = DataConfig(train_tokens=5000, val_tokens=500, seq_len=16)
    a, b = build_datasets(cfg, seed=0), build_datasets(cfg, seed=7)
    assert np.array_equal(a[0].tokens.read(0, 10**9), b[0].tokens.read(0, 10**9))
    assert np.array_equal(a[1].tokens.read(0, 10**9), b[1].tokens.read(0, 10**9))
    assert a[2].loss_floor == b[2].loss_floor and 0 < a[2].loss_floor < math.log(cfg.vocab_size)


def test_training_windows_depend_on_seed_epoch_and_index_only():
    """The same (epoch, index) is the same window; another epoch shifts the cut; windows are seq_len + 1
    consecutive tokens of the split."""
    tokens = Tokens(np.arange(1000, dtype=np.uint16))
    windows = TrainWindows(tokens, seq_len=10, seed=0)
    assert len(windows) == 98
    first = windows[(0, 5)]
    assert torch.equal(first, TrainWindows(tokens, 10, seed=0)[(0, 5)])
    assert torch.equal(first, torch.arange(first[0], first[0] + 11))
    offsets = {TrainWindows(tokens, 10, seed=0).offset(epoch) for epoch in range(20)}
    assert len(offsets) > 3 and all(0 <= o < 10 for o in offsets)
    assert all(windows[(e, len(windows) - 1)][-1] < 1000 for e in range(20))  # the last window fits every epoch


def test_the_token_stream_does_not_depend_on_the_number_of_processes():
    """Two processes' micro-batches, interleaved, are the one process's batch of twice the size."""
    cfg = DataConfig(batch_size=4, num_workers=0)
    windows = TrainWindows(Tokens(np.arange(2000, dtype=np.uint16)), seq_len=8, seed=3)
    one = next(iter(build_train_loader(DataConfig(batch_size=8), windows, seed=3)))
    two = [next(iter(build_train_loader(cfg, windows, seed=3, rank=r, world_size=2))) for r in (0, 1)]
    assert sorted(map(tuple, one.tolist())) == sorted(map(tuple, torch.cat(two).tolist()))


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_validation_counts_every_target_once_for_any_world_size(world_size):
    """The validation windows of all processes together predict each token after the first exactly once."""
    n, seq_len = 1000, 16
    val = ValWindows(Tokens(np.arange(n, dtype=np.uint32)), seq_len)
    counted = []
    for rank in range(world_size):
        for windows, skip in build_val_loader(DataConfig(batch_size=5), val, rank=rank, world_size=world_size):
            targets = windows[:, 1:].clone()
            targets[torch.arange(seq_len) < skip[:, None]] = IGNORE
            counted += targets[targets != IGNORE].tolist()
    assert sorted(counted) == list(range(1, n))


def test_sampler_resumes_mid_epoch():
    """Starting part-way into an epoch yields exactly the rest of that epoch's keys."""
    full, part = ResumableSampler(range(50), seed=3), ResumableSampler(range(50), seed=3)
    full.set_position(2, 0)
    part.set_position(2, 20)
    assert list(part) == list(full)[20:]


def test_token_files_read_as_one_stream(tmp_path):
    """A split in several files (prepare's shards) reads as their concatenation: a window that spans
    two files, and the same windows as from one file."""
    tokens = np.arange(1000, dtype=np.uint16)
    for index, start in enumerate(range(0, 1000, 300)):
        tokens[start : start + 300].tofile(tmp_path / f"train_{index:06d}.bin")
    tokens.tofile(tmp_path / "one.bin")
    sharded = Tokens(paths=sorted(tmp_path.glob("train_*.bin")))
    whole = Tokens(paths=[tmp_path / "one.bin"])
    assert len(sharded) == len(whole) == 1000
    assert torch.equal(sharded.window(295, 10), torch.arange(295, 305))  # across files 0 and 1
    assert np.array_equal(sharded.read(0, 1000), tokens) and np.array_equal(sharded.read(599, 901), tokens[599:901])
    a, b = TrainWindows(sharded, seq_len=16, seed=3), TrainWindows(whole, seq_len=16, seed=3)
    assert all(torch.equal(a[(epoch, i)], b[(epoch, i)]) for epoch in (0, 1) for i in range(len(a)))
