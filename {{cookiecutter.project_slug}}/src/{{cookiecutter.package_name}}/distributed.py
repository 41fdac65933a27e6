"""Process group, device and model wrapping. One process is world size 1 of the same code.

Rank, local rank and world size come from the launcher's environment (torchrun and accelerate
launch set RANK, LOCAL_RANK and WORLD_SIZE); the process group uses the launcher's env://
rendezvous, which keeps torchrun restarts working.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .config import Config, ConfigError


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Only the main process (rank 0) writes files, logs and progress bars."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} must be an integer (set by the launcher)") from None


def setup(cfg: Config) -> DistEnv:
    """Read the launcher's variables, pick this process's device and join the process group."""
    world_size = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if world_size > 1 and ("MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ):
        raise ConfigError("WORLD_SIZE > 1 but MASTER_ADDR/MASTER_PORT are not set; start with torchrun")
    if torch.cuda.is_available() and cfg.run.device != "cpu":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1:
        backend = cfg.distributed.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.distributed.timeout_s))
    return DistEnv(rank, local_rank, world_size, device)


def teardown() -> None:
    """Leave the process group (safe to call when none was joined)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: nn.Module, cfg: Config, env: DistEnv) -> nn.Module:
    """DistributedDataParallel when more than one process trains; the model itself otherwise."""
    strategy = cfg.distributed.strategy
    if strategy == "fsdp":
        raise ConfigError("distributed.strategy=fsdp is not available yet; use ddp")
    if env.world_size == 1:
        return model
    if strategy == "none":
        raise ConfigError(
            f"distributed.strategy=none with {env.world_size} processes would train independent models; use ddp"
        )
    if cfg.distributed.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside torch.compile and DDP wrappers (its state_dict has clean keys)."""
    model = getattr(model, "_orig_mod", model)
    model = getattr(model, "module", model) if isinstance(model, DistributedDataParallel) else model
    return getattr(model, "_orig_mod", model)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all processes in place (no-op for one process)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier() -> None:
    """Wait for every process (no-op for one process)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
