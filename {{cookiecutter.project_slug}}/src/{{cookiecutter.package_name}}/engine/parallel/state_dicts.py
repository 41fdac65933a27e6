"""The model's and the optimizer's state as checkpoints hold it: whole (gathered on the main process)
or checked by name, for one process, DDP or FSDP alike, without the frozen parameters of a model
whose task rebuilds them (a base under adapters: rebuilds_frozen).

torch.distributed.checkpoint's state-dict API is imported where it is used (about 0.1 s): a run
pays it at its first checkpoint rather than before its first step.
"""

from __future__ import annotations

import torch
from torch import nn

from ..torch_private import uncompiled, unwrap

# Set on a model whose task rebuilds its frozen parameters (seam.Task.frozen_weights is not None): they
# are left out of what is saved, and of what a restore expects.
REBUILDS_FROZEN = "_rebuilds_frozen"


def rebuilds_frozen(model: nn.Module, rebuilt: bool | None = None) -> bool:
    """Whether the model's frozen parameters (a base under adapters) are the task's to rebuild, and so
    never saved; rebuilt=True or False says so first (on the model inside DDP or compile)."""
    inner = unwrap(model)
    if rebuilt is not None:
        setattr(inner, REBUILDS_FROZEN, rebuilt)
    return getattr(inner, REBUILDS_FROZEN, False)


def saved(model: nn.Module, state: dict) -> dict:
    """A state dict of the model without the parameters it rebuilds (rebuilds_frozen), else as it is."""
    if not rebuilds_frozen(model):
        return state
    frozen = {name for name, param in unwrap(model).named_parameters() if not param.requires_grad}
    return {name: value for name, value in state.items() if name not in frozen}


def full_model_state(model: nn.Module) -> dict:
    """Unsharded weights keyed by parameter name, on rank 0's CPU (empty on other ranks); without the
    frozen parameters of a model whose task rebuilds them (rebuilds_frozen: a base under adapters).

    Every rank must call it (FSDP gathers the shards). The result is the same for one process,
    DDP or FSDP, so a checkpoint written by N processes resumes on M.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    leave_out = rebuilds_frozen(model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=leave_out)
    return get_model_state_dict(uncompiled(model), options=options)


def saved_names(model: nn.Module) -> set[str]:
    """The names full_model_state() holds (no module. / _orig_mod. prefix), read without a gather."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(ignore_frozen_params=rebuilds_frozen(model))
    return set(get_model_state_dict(uncompiled(model), options=options))


def check_names(expected: set[str], given: set[str]) -> None:
    """RuntimeError in torch's words (restore.mismatch quotes it) unless a state holds exactly the names expected."""
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing:
        raise RuntimeError(f"Missing key(s) in state_dict: {', '.join(missing[:3])}")
    if unexpected:
        raise RuntimeError(f"Unexpected key(s) in state_dict: {', '.join(unexpected[:3])}")


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Unsharded optimizer state keyed by parameter name, like full_model_state()."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(uncompiled(model), optimizer, options=options)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict, optim_state: dict) -> None:
    """Load what full_state() returned into this process's (possibly sharded) model and optimizer."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = uncompiled(model)
    check_names(saved_names(model), set(weights))
    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=rebuilds_frozen(model))
    set_model_state_dict(model, weights, options=options)  # note: both calls rewrite the dicts they get
    set_optimizer_state_dict(model, optimizer, optim_state, options=options)
