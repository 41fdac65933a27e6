"""Every private PyTorch name the project touches, in one place, each where no public API does the job.

Checked on torch 2.14.1 (the release the template's tests pin); tests/engine/test_torch_private.py
fails if one of them moves or changes meaning, so an upgrade breaks here, loudly, rather than
somewhere in a run. Everything else in the project uses public APIs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader


def uncompiled(model: nn.Module) -> nn.Module:
    """The module a torch.compile wrapper holds (the model itself when not compiled).

    torch.compile returns an OptimizedModule that keeps the original in `_orig_mod` and offers no
    public accessor; its state_dict keys carry the `_orig_mod.` prefix because of it."""
    return getattr(model, "_orig_mod", model)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside torch.compile's and DDP's wrappers (DDP's `.module` is public)."""
    inner = uncompiled(model)
    return inner.module if isinstance(inner, nn.parallel.DistributedDataParallel) else inner


def forget_mesh_groups(mesh) -> None:
    """Drop the process groups a DeviceMesh keeps in its `_pg_registry`, so destroy_process_group
    really frees them (there is no public way to release a mesh's groups)."""
    getattr(mesh, "_pg_registry", {}).clear()


def shut_down_loader_workers(loader: DataLoader) -> None:
    """Stop a DataLoader's persistent workers now, through their queues: what its iterator's __del__
    does (`_shutdown_workers`); DataLoader has no public close()."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None


class UnsynchronizedStager:
    """Base of a stager for torch.distributed.checkpoint.async_save whose stage() returns only once
    the copy is made, so DCP need not wait for it again after the save starts: DCP reads the
    private `_synchronize_after_execute` through the public `should_synchronize_after_execute`."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False


def cpu_has_onednn_bf16() -> bool:
    """Whether torch computes bf16 on this CPU with oneDNN's kernels, which need AVX-512 on x86:
    torch's own check, reached only through the underscored mkldnn op. Without them bf16 matrix
    products and convolutions run in torch's slow reference kernels (a convolution's gradients in
    aten::_slow_conv2d_backward)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def record_cuda_memory_history(enabled: bool) -> None:
    """Start (or stop) recording CUDA allocations for a memory snapshot; torch documents the
    underscored torch.cuda.memory._record_memory_history as the way to do it."""
    if enabled:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def dump_cuda_memory_snapshot(path: Path) -> None:
    """Write the recorded CUDA memory snapshot (open it at pytorch.org/memory_viz)."""
    torch.cuda.memory._dump_snapshot(str(path))
