"""Building the model: on the meta device, sharded before it holds any memory, then initialised.

Each module's own parameters and buffers are drawn from a generator seeded by (run.seed, the
module's name), one module at a time, by the task's rule (Task.init_module). The values are
therefore the same whether the model is whole or sharded, on any number of processes: under FSDP
each process materialises only its shards (plus one module's whole tensors at a time on the CPU),
and the weights equal those of the one-process build with the same seed.

A model with a module the task's rule does not know (Task.INIT_TYPES) is built whole with its
library's own initialisation instead, and under FSDP sharded after that, as before.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

from . import distributed


def module_seed(seed: int, name: str) -> int:
    """A generator seed for one module: its name and run.seed, independent of the build order."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def own_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def initialisable(model: nn.Module, known: tuple[type, ...]) -> bool:
    """Whether every module that holds parameters or buffers is of a type the task's rule initialises."""
    return all(isinstance(module, known) for module in model.modules() if own_tensors(module))


@contextmanager
def _whole(module: nn.Module):
    """Swap the module's own (possibly sharded) parameters and buffers for whole CPU tensors of the
    same shape; yields {name: (real, whole)} so the caller copies the whole values back."""
    pairs = {}
    for name, param in list(module.named_parameters(recurse=False)):
        pairs[name] = (param, torch.empty(param.shape, dtype=param.dtype))
        setattr(module, name, nn.Parameter(pairs[name][1], requires_grad=False))
    for name, buffer in list(module.named_buffers(recurse=False)):
        pairs[name] = (buffer, torch.empty(buffer.shape, dtype=buffer.dtype))
        setattr(module, name, pairs[name][1])  # keeps whether the buffer is persistent
    try:
        yield pairs
    finally:
        for name, (real, _) in pairs.items():
            setattr(module, name, real)


def copy_into(real: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy whole values into a tensor, or into this process's shard of a sharded one."""
    if distributed.is_dtensor(real):  # a shard: this process's part of the whole values
        from torch.distributed.tensor import distribute_tensor

        mine = distribute_tensor(whole, real.device_mesh, real.placements, src_data_rank=None).to_local()
        real.to_local().copy_(mine)
    else:
        real.copy_(whole)


@torch.no_grad()
def initialise(model: nn.Module, seed: int, init_module: Callable[[str, nn.Module, torch.Generator], None]) -> None:
    """Initialise every module's own tensors by init_module(name, module, generator), module by module."""
    for name, module in model.named_modules():
        if not own_tensors(module):
            continue
        generator = torch.Generator().manual_seed(module_seed(seed, name))
        with _whole(module) as pairs:
            init_module(name, module, generator)
        for real, whole in pairs.values():
            copy_into(real, whole)


def _own(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))


def loadable(model: nn.Module, weights: dict[str, torch.Tensor], known: tuple[type, ...]) -> bool:
    """Whether `load` can fill the model: each module's own tensors are all in weights (by their
    names in the model), or the module is of a type the task's rule initialises."""
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if not isinstance(module, known) and any(prefix + key not in weights for key in _own(module)):
            return False
    return True


@torch.no_grad()
def load(
    model: nn.Module,
    weights: dict[str, torch.Tensor],
    seed: int,
    init_module: Callable[[str, nn.Module, torch.Generator], None],
) -> None:
    """Fill a model materialised from the meta device (model.to_empty) from whole weights, each
    process copying in its shards; a module weights lacks a tensor of (a new output layer) is drawn
    by init_module from its (run.seed, name) generator first, as `initialise` draws it."""
    for name, module in model.named_modules():
        tensors = _own(module)
        prefix = f"{name}." if name else ""
        if any(prefix + key not in weights for key in tensors):
            generator = torch.Generator().manual_seed(module_seed(seed, name))
            with _whole(module) as pairs:
                init_module(name, module, generator)
            for real, whole in pairs.values():
                copy_into(real, whole)
        for key, real in tensors.items():
            if prefix + key in weights:
                copy_into(real, weights[prefix + key].to(real.dtype))


def build(
    architecture: Callable[[], nn.Module],
    init_module: Callable[[str, nn.Module, torch.Generator], None],
    known: tuple[type, ...],
    device: torch.device,
    seed: int,
    shard: Callable[[nn.Module], nn.Module] | None = None,
) -> tuple[nn.Module, bool]:
    """The model on device, initialised, sharded by shard() when given; and whether it was built on
    the meta device (False: built whole, with its library's initialisation)."""
    with torch.device("meta"):
        model = architecture()
    if not initialisable(model, known):
        model = architecture().to(device)
        return (shard(model) if shard else model), False
    if shard:
        model = shard(model)
    model.to_empty(device=device)
    initialise(model, seed, init_module)
    return model, True
