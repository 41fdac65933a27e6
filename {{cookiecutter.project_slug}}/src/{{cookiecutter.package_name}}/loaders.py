"""Loaders shared by every task: a resumable, shuffled, per-process training loader and an exact
validation loader.

The training set is indexed by (epoch, index) keys, which ResumableSampler yields: shuffled with
(seed, epoch) over the whole set and split across processes, so that the global order of samples
does not depend on the number of processes and a resumed run can start part-way through an
epoch. A task whose samples are random (augmentation, random windows) draws them from those keys.
The validation set is split into disjoint strided slices, so across all processes every validation
sample is counted exactly once.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset

from . import distributed
from .errors import ConfigError, DataError


class ResumableSampler(DistributedSampler):
    """DistributedSampler (shuffled by seed and epoch) that can start part-way into an epoch.

    It yields (epoch, index) keys: the task's training set draws its randomness from them.
    """

    def __init__(self, dataset, num_replicas=1, rank=0, seed=0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.start = 0

    def set_position(self, epoch: int, samples_done: int) -> None:
        """Order of this epoch, skipping the samples this process already took."""
        self.set_epoch(epoch)
        self.start = samples_done

    def __iter__(self):
        return iter([(self.epoch, index) for index in list(super().__iter__())[self.start :]])

    def __len__(self):
        return self.num_samples - self.start


def seed_worker(worker_id: int) -> None:
    """Seed python and numpy in each DataLoader worker; leave stop signals to the training process.

    Schedulers signal every process of a job; a worker killed by SIGTERM or SIGUSR1 would crash
    the step that preemption is waiting to finish. Workers still exit when the trainer does.
    """
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def shut_down_workers(*loaders: DataLoader) -> None:
    """Stop the loaders' persistent workers now, through their queues.

    Left for garbage collection (which a traceback can delay to interpreter exit), workers would
    meet multiprocessing's exit handler, which stops them with the SIGTERM they ignore and then
    waits forever. DataLoader has no public close(); this is what its iterator's __del__ does.
    """
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        loader._iterator = None


def _loader_options(cfg, pin_memory: bool) -> dict:
    return dict(
        batch_size=cfg.batch_size,
        num_workers=cfg.num_workers,
        pin_memory=pin_memory,
        persistent_workers=cfg.num_workers > 0,
        worker_init_fn=seed_worker,
    )


def build_train_loader(cfg, train_set, *, seed, rank=0, world_size=1, pin_memory=False) -> DataLoader:
    """Shuffled by (seed, epoch), split across processes, resumable mid-epoch, seeded workers.

    train_set takes the (epoch, index) keys ResumableSampler yields (e.g. data.SeededAugmentation);
    cfg is the data section (batch_size, num_workers).
    """
    sampler = ResumableSampler(train_set, num_replicas=world_size, rank=rank, seed=seed)
    if len(sampler) < cfg.batch_size:
        raise ConfigError(
            f"data.batch_size={cfg.batch_size} is larger than the {len(sampler)} training samples each "
            f"of the {world_size} process(es) gets; lower data.batch_size"
        )
    generator = torch.Generator().manual_seed(seed + rank)  # seeds python/numpy in the workers
    return DataLoader(
        train_set,
        sampler=sampler,
        drop_last=True,
        generator=generator,
        **_loader_options(cfg, pin_memory),
    )


def build_val_loader(cfg, val_set, *, rank=0, world_size=1, pin_memory=False) -> DataLoader:
    """Never shuffled; process r takes samples r, r+W, r+2W, ... so each is counted exactly once."""
    if len(val_set) < world_size:
        raise DataError(f"the validation set has {len(val_set)} samples, fewer than the {world_size} processes")
    shard = Subset(val_set, range(rank, len(val_set), world_size))
    return DataLoader(shard, shuffle=False, drop_last=False, **_loader_options(cfg, pin_memory))


def in_lockstep(loader: DataLoader, device: torch.device) -> Iterator:
    """The loader's batches, then None until every process has had as many rounds as the one with
    the most batches: under FSDP a forward is a collective, so a process whose share of the
    validation set is one batch shorter must still run one (uncounted) forward for each of the others'."""
    rounds = distributed.max_over_ranks(len(loader), device)
    batches = iter(loader)
    for _ in range(rounds):
        yield next(batches, None)
