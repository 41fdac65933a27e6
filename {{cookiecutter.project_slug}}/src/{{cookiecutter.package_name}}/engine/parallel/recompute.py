"""Activation checkpointing: each block recomputes its activations in backward instead of keeping them.

A block is what FSDP shards on its own (see `blocks`): one of the repeated layers of the task's model.
`enable` keeps every parameter's and buffer's name: the block itself stays in the model and only
its forward changes, so checkpoints, optimizer state and pretrained weights, all keyed by name,
do not see it (torch's checkpoint_wrapper would add `_checkpoint_wrapped_module.` to each name).
Apply it before DDP or fully_shard: their hooks then stay outside the recomputed region, as with
torch's own wrapper, and FSDP2 gathers a block's parameters again before its backward recomputes.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every child with parameters of every nn.Sequential or nn.ModuleList in the model (the stages of
    repeated blocks), by name, in module order. A stage inside a block already taken (a block's own
    nn.Sequential, say its shortcut) gives no blocks, unless the block is itself that stage (an
    nn.Sequential of blocks gives itself and its blocks)."""
    taken: list[tuple[str, nn.Module]] = []
    for name, stage in model.named_modules():
        if not isinstance(stage, nn.Sequential | nn.ModuleList) or any(
            name.startswith(f"{done}.") for done, _ in taken
        ):
            continue  # not a stage, or inside a block already taken
        for child, block in stage.named_children():
            if any(True for _ in block.parameters()):
                taken.append((f"{name}.{child}" if name else child, block))
    return taken


def enable(model: nn.Module) -> int:
    """Make every innermost block of the model recompute its activations in backward; returns how many.

    A block holding other blocks (a stage of blocks in its own nn.Sequential) is left to its inner ones:
    recomputing it as well would run their forward a third time. Names, outputs and gradients stay
    the same, dropout draws the same numbers when recomputed, and BatchNorm updates its running
    statistics once per forward, not again when recomputed. Without gradients (evaluation) a block
    runs as before. Calling it again changes nothing.
    """
    found = blocks(model)
    innermost = [block for name, block in found if not any(inner.startswith(f"{name}.") for inner, _ in found)]
    for block in innermost:
        if not isinstance(block.__dict__.get("forward"), _Recomputed):
            # The instance attribute shadows the class's forward; a partial of the block (not a
            # closure) is copied with it by copy.deepcopy, and pickles.
            block.forward = _Recomputed(_recomputed_forward, block, block.__dict__.get("forward"))
    return len(innermost)


class _Recomputed(functools.partial):
    """A block's forward that recomputes (a partial of `_recomputed_forward`, marked as ours)."""


def _recomputed_forward(block: nn.Module, own_forward, *args, **kwargs):
    forward = own_forward or functools.partial(type(block).forward, block)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)  # nothing to save or recompute
    norms = [m for m in block.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
    if not norms:  # torch.compile traces checkpoint with its default contexts; with BatchNorm's
        # own it breaks the graph there and runs checkpoint eagerly, which is as correct
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    context = functools.partial(_batchnorm_contexts, norms)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)


def _batchnorm_contexts(norms: list[_BatchNorm]):
    """checkpoint's (forward, recompute) contexts: the recomputation updates copies of the running
    statistics (and num_batches_tracked) that it then drops, so they move once per step, in the forward.

    Switching track_running_stats off instead would recompute a different kernel, one that saves
    fewer tensors, which checkpoint refuses. In training mode BatchNorm normalises by the batch's own
    statistics, and its backward does not read the running ones, so nothing else changes.
    """
    return contextlib.nullcontext(), _scratch_running_stats(norms)


RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


@contextlib.contextmanager
def _scratch_running_stats(norms: list[_BatchNorm]):
    kept = [(norm, name, getattr(norm, name)) for norm in norms for name in RUNNING_STATS]
    for norm, name, buffer in kept:
        if buffer is not None:
            setattr(norm, name, buffer.clone())
    try:
        yield
    finally:
        for norm, name, buffer in kept:
            setattr(norm, name, buffer)
