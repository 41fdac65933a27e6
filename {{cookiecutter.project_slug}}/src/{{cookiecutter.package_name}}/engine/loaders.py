"""Loaders shared by every task: a resumable, shuffled, per-process training loader and an exact
validation loader.

The training set is indexed by (epoch, index) keys, which ResumableSampler yields: shuffled with
(seed, epoch) over the whole set and split across processes, so that the global order of samples
does not depend on the number of processes and a resumed run can start part-way through an
epoch. A task whose samples are random (augmentation, random windows) draws them from those keys.
The validation set is split into disjoint strided slices, so across all processes every validation
sample is counted exactly once.

data.loader=device keeps both sets on the training device as tensors (DeviceTrainLoader,
DeviceValLoader): each batch is gathered by index there, with the same order of samples, and a
task's random draws come from sample_bits(seed, epoch, index) on the device. No worker processes.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset

from .errors import ConfigError, DataError
from .parallel import distributed
from .torch_private import shut_down_loader_workers

if TYPE_CHECKING:
    from .seam import DataBase


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

    def indices(self) -> list[int]:
        """This process's sample indices of the epoch, from the set position on."""
        return list(super().__iter__())[self.start :]

    def __iter__(self):
        return iter([(self.epoch, index) for index in self.indices()])

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
        if not isinstance(loader, DataLoader):  # a DeviceLoader has no workers
            continue
        shut_down_loader_workers(loader)


def _loader_options(data: DataBase, pin_memory: bool) -> dict:
    return dict(
        batch_size=data.batch_size,
        num_workers=data.num_workers,
        pin_memory=pin_memory,
        persistent_workers=data.num_workers > 0,
        worker_init_fn=seed_worker,
    )


def training_sampler(train_set, batch_size: int, *, seed: int, rank: int, world_size: int) -> ResumableSampler:
    """This process's ResumableSampler; a batch larger than its share of the set is a ConfigError."""
    sampler = ResumableSampler(train_set, num_replicas=world_size, rank=rank, seed=seed)
    if len(sampler) < batch_size:
        raise ConfigError(
            f"data.batch_size={batch_size} is larger than the {len(sampler)} training samples each "
            f"of the {world_size} process(es) gets; lower data.batch_size"
        )
    return sampler


def build_train_loader(data: DataBase, train_set, *, seed, rank=0, world_size=1, pin_memory=False) -> DataLoader:
    """Shuffled by (seed, epoch), split across processes, resumable mid-epoch, seeded workers.

    train_set takes the (epoch, index) keys ResumableSampler yields (e.g. data.SeededAugmentation);
    data is the data section (batch_size, num_workers).
    """
    sampler = training_sampler(train_set, data.batch_size, seed=seed, rank=rank, world_size=world_size)
    generator = torch.Generator().manual_seed(seed + rank)  # seeds python/numpy in the workers
    return DataLoader(
        train_set,
        sampler=sampler,
        drop_last=True,
        generator=generator,
        **_loader_options(data, pin_memory),
    )


def build_val_loader(data: DataBase, val_set, *, rank=0, world_size=1, pin_memory=False) -> DataLoader:
    """Never shuffled; process r takes samples r, r+W, r+2W, ... so each is counted exactly once."""
    if len(val_set) < world_size:
        raise DataError(f"the validation set has {len(val_set)} samples, fewer than the {world_size} processes")
    shard = Subset(val_set, range(rank, len(val_set), world_size))
    return DataLoader(shard, shuffle=False, drop_last=False, **_loader_options(data, pin_memory))


def in_lockstep(loader: DataLoader, device: torch.device) -> Iterator:
    """The loader's batches, then None until every process has had as many rounds as the one with
    the most batches: under FSDP a forward is a collective, so a process whose share of the
    validation set is one batch shorter must still run one (uncounted) forward for each of the others'."""
    rounds = distributed.max_over_ranks(len(loader), device)
    batches = iter(loader)
    for _ in range(rounds):
        yield next(batches, None)


# data.loader=auto keeps the data on the training device when it takes at most this share of the
# device's memory (of RAM on the CPU): the rest is the model's, its activations' and the optimizer's.
DEVICE_BUDGET = 0.25
MASK_62 = 2**62 - 1


def sample_bits(seed: int, epoch: int, index: torch.Tensor) -> torch.Tensor:
    """62 random bits per sample (int64, on index's device) that depend on (seed, epoch, index) only:
    the same on any device, for any number of processes, and after a resume."""
    x = index.to(torch.int64) + ((seed * 1_000_003 + epoch) * 1_000_000_007 % MASK_62)
    for multiplier in (0x3F4A7C15F39CC060, 0x2F58476D1CE4E5B9, 0x14D049BB133111EB):  # splitmix64's, < 2**62
        x = ((x ^ (x >> 31)) * multiplier) & MASK_62
    return x ^ (x >> 29)


def device_budget(device: torch.device) -> int:
    """Bytes the data may take on the device under data.loader=auto."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total * DEVICE_BUDGET)


class DeviceTrainLoader:
    """Training batches gathered on the device from a set held there: the samples and the order of
    ResumableSampler (so the same as the workers pipeline's, and resumable mid-epoch), whole batches
    only, no worker processes and no host-to-device copy but one index tensor an epoch.

    source.batch(epoch, indices) returns a batch for a 1-D index tensor on the device.
    """

    def __init__(self, source, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1):
        self.source, self.batch_size = source, batch_size
        self.sampler = training_sampler(source, batch_size, seed=seed, rank=rank, world_size=world_size)
        # Seeds nothing here (no workers); kept so that a checkpoint holds the same loader state
        # whichever pipeline wrote it.
        self.generator = torch.Generator().manual_seed(seed + rank)

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def __iter__(self) -> Iterator:
        batches = len(self)
        order = torch.tensor(self.sampler.indices()[: batches * self.batch_size], dtype=torch.int64)
        if self.source.device.type == "cuda":  # from pinned memory the copy queues behind the GPU's work
            order = order.pin_memory()
        order = order.to(self.source.device, non_blocking=True)
        epoch = self.sampler.epoch
        for start in range(0, batches * self.batch_size, self.batch_size):
            yield self.source.batch(epoch, order[start : start + self.batch_size])


class DeviceValLoader:
    """Validation batches gathered on the device: process r takes samples r, r+W, r+2W, ..., in
    order, so each is counted exactly once; source.batch(None, indices) returns a batch."""

    def __init__(self, source, batch_size: int, *, rank: int = 0, world_size: int = 1):
        if len(source) < world_size:
            raise DataError(f"the validation set has {len(source)} samples, fewer than the {world_size} processes")
        self.source, self.batch_size = source, batch_size
        self.indices = torch.arange(rank, len(source), world_size, device=source.device)

    def __len__(self) -> int:
        return -(-len(self.indices) // self.batch_size)

    def __iter__(self) -> Iterator:
        for chunk in self.indices.split(self.batch_size):
            yield self.source.batch(None, chunk)


def choose_loader(loader: str, task, train_set, val_set, device: torch.device) -> tuple[str, str]:
    """data.loader (loader), with auto resolved, and the reason (for the log).

    auto chooses device when the task's data may live there (task.device_bytes says how much it
    takes and whether anything speaks against it) and takes at most DEVICE_BUDGET of the device's
    memory; workers otherwise."""
    nbytes, against = task.device_bytes(train_set, val_set)
    size = f"{nbytes / 2**20:.1f} MiB"
    if loader != "auto":
        return loader, f"data.loader={loader} (the data sets: {size})"
    budget = device_budget(device)
    memory = "GPU" if device.type == "cuda" else "RAM"
    where = f"{round(DEVICE_BUDGET * 100)}% of the {memory}: {budget / 2**20:.0f} MiB"
    if against:
        return "workers", f"data.loader=auto chose workers: {against}"
    if nbytes > budget:
        return "workers", f"data.loader=auto chose workers: the data sets take {size}, more than {where}"
    return "device", f"data.loader=auto chose device: the data sets take {size} of {where}"


def build_loaders(data: DataBase, seed: int, task, train_set, val_set, env) -> tuple:
    """The training and validation loaders of data.loader, and the log line that says which. data is the
    data section (loader, batch_size, num_workers); seed is run.seed (the order of the samples)."""
    kind, reason = choose_loader(data.loader, task, train_set, val_set, env.device)
    shard = dict(rank=env.rank, world_size=env.world_size)
    if kind == "device":
        train_source, val_source = task.device_sets(train_set, val_set)
        train_loader = DeviceTrainLoader(train_source, data.batch_size, seed=seed, **shard)
        return train_loader, DeviceValLoader(val_source, data.batch_size, **shard), reason
    pin_memory = env.device.type == "cuda"
    train_loader = build_train_loader(data, train_set, seed=seed, pin_memory=pin_memory, **shard)
    return train_loader, build_val_loader(data, val_set, pin_memory=pin_memory, **shard), reason
