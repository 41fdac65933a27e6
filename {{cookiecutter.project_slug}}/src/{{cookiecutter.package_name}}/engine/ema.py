"""An exponential moving average of the weights (optim.ema_decay), kept in the model's own layout.

    ema = WeightAverage(model, decay)   # after the model is built (sharded under FSDP) and restored
    ema.update(step)                    # after every optimizer step, on every rank
    with ema.swapped_in(model):         # the model holds the averaged weights: validate, save best
        ...

After each optimizer step, average <- d * average + (1 - d) * weights, with d = min(decay,
(1 + step) / (10 + step)) (TensorFlow's ExponentialMovingAverage with num_updates): the average
follows the weights closely in the first steps, when the initial ones would otherwise dominate it
for about 1 / (1 - decay) steps. Parameters and floating-point buffers (BatchNorm's running
statistics) are averaged, as timm's ModelEmaV3 does; integer buffers are the model's own.

Under FSDP each process averages its own shards (DTensors with the parameters' placement): no
gather, one more copy of its share. Under DDP and one process every rank keeps the same whole
copy. One fused foreach kernel per step, no host sync. Checkpoints hold the average beside the
weights ("ema"), and a resumed run continues it bit-exactly. Validation, best.safetensors and the
evaluate/export/generate commands use the average (`--weights raw` picks the trained weights).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .parallel import distributed, state_dicts
from .torch_private import unwrap


def averaged_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What is averaged, by state-dict name (no module. / _orig_mod. prefix): every parameter (but a
    frozen base the task rebuilds: state_dicts.rebuilds_frozen) and every persistent floating-point
    buffer."""
    inner = unwrap(model)
    tensors = state_dicts.saved(inner, dict(inner.named_parameters()))
    persistent = inner.state_dict(keep_vars=True).keys()  # a non-persistent buffer is not in the state dict
    for name, buffer in inner.named_buffers():
        if buffer.is_floating_point() and name in persistent:
            tensors[name] = buffer
    return tensors


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: a DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if distributed.is_dtensor(tensor) else tensor


class WeightAverage:
    """The exponential moving average of a model's weights, one tensor per averaged tensor."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.live = averaged_tensors(model)
        with torch.no_grad():
            self.average = {name: tensor.detach().clone() for name, tensor in self.live.items()}
        self._live_local = [_local(t) for t in self.live.values()]
        self._average_local = [_local(t) for t in self.average.values()]

    def decay_at(self, step: int) -> float:
        """The decay of the update after optimizer step `step` (1 for the first)."""
        return min(self.decay, (1 + step) / (10 + step))

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Move the average towards the weights after optimizer step `step`."""
        torch._foreach_lerp_(self._average_local, self._live_local, 1.0 - self.decay_at(step))

    @torch.no_grad()
    def reset(self) -> None:
        """Start the average at the current weights (a resumed run that turned optim.ema_decay on)."""
        torch._foreach_copy_(self._average_local, self._live_local)

    @contextlib.contextmanager
    def swapped_in(self, model: nn.Module) -> Iterator[None]:
        """The model holds the averaged weights inside, its own again after (exactly: values are swapped,
        one tensor's temporary copy at a time)."""
        _reshard(model)
        self._swap()
        try:
            yield
        finally:
            _reshard(model)
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for live, average in zip(self._live_local, self._average_local, strict=True):
            kept = live.clone()
            live.copy_(average)
            average.copy_(kept)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The average in the model's layout (DTensors under FSDP), for a sharded checkpoint."""
        return self.average

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole average on the CPU, gathered one tensor at a time (every rank calls it; the
        other ranks' copies are dropped by the caller)."""
        return {name: _full(tensor).cpu() for name, tensor in self.average.items()}

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore from whole tensors (every rank holds them): each rank copies its own part."""
        _check_names(self.average, state)
        for name, average in self.average.items():
            whole = state[name].to(_local(average).device)
            if hasattr(average, "device_mesh"):  # a DTensor: this rank's chunk, no communication
                from torch.distributed.tensor import distribute_tensor

                whole = distribute_tensor(whole, average.device_mesh, average.placements, src_data_rank=None)
            _local(average).copy_(_local(whole))


@torch.no_grad()
def load_average_into(model: nn.Module, average: dict[str, torch.Tensor]) -> None:
    """Put a checkpoint's whole weight average into an unsharded model (evaluate, export, generate)."""
    tensors = averaged_tensors(model)
    _check_names(tensors, average)
    for name, tensor in tensors.items():
        tensor.copy_(average[name])


def _check_names(expected: dict, given: dict) -> None:
    if set(expected) != set(given):
        missing, unexpected = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
        raise KeyError(f"weight average: missing {missing[:3]}, unexpected {unexpected[:3]}")


def _reshard(model: nn.Module) -> None:
    """FSDP: drop gathered parameters, so the next forward gathers the shards' current values.

    FSDP keeps the root module's parameters gathered after a forward without gradients (validation);
    swapping the shards under them would leave the other weights in use.
    """
    for module in model.modules():
        if distributed.is_fsdp(module):
            module.reshard()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(tensor, "full_tensor", None)  # a DTensor: gathered from every rank
    return full_tensor() if full_tensor else tensor
