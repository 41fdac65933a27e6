"""One optimizer step: zero_grad, the accumulated forward/backward passes, unscale, clip, step.

    for micro_batch in micro_batches:            # grad_accum_steps of them
        loss, samples = loss_fn(model, micro_batch)
        (loss / grad_accum_steps).backward()     # all-reduced on the last one only
    clip; step (skipped on the device when the gradient norm is not finite); scheduler.step()

With a weight per micro-batch (weight_fn: what its mean loss is taken over, e.g. its counted
targets when a task masks some), each loss is scaled by its share of the step's total weight over
all micro-batches and processes instead of by 1 / grad_accum_steps: the update is then that of one
large batch however the counted targets fall into micro-batches and processes (a mean of
micro-batch means would weigh a target in a sparse micro-batch more).

loss_fn(model, batch) -> (mean loss of the batch, samples in it) moves the batch to the device and
runs the model; it is the only part that knows what is trained, so a test can call train_step
with its own.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from .config import TrainerConfig
from .optim import Diverged, gradient_norm, step_if_finite
from .parallel import distributed
from .state import TrainState

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str):
    """torch.autocast for bf16/fp16; a no-op context for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


def train_mode(model: nn.Module) -> None:
    """model.train(), but normalisation layers whose parameters are frozen stay in eval mode.

    A frozen BatchNorm in train mode would still update its running statistics.
    """
    model.train()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._NormBase):
            params = list(module.parameters(recurse=False))
            if params and not any(p.requires_grad for p in params):
                module.eval()


LossFn = Callable[[nn.Module, object], tuple[torch.Tensor, int]]
WeightFn = Callable[[object], "int | None"]


def loss_weights(micro_batches: Iterable, weight_fn: WeightFn | None, device: torch.device) -> tuple:
    """(the micro-batches, each one's weight, world size / the step's weight summed over every micro-batch and
    process). A micro-batch's mean loss x its weight x that factor is its share of the step's mean (x world
    size: DDP and FSDP average gradients over processes). The sum is one all-reduce of one number, kept on
    the device (no host sync); the step's micro-batches are loaded before the first forward to count them.
    Without weights (weight_fn None, or None for the first micro-batch): (the micro-batches, [], None),
    still streamed."""
    batches = iter(micro_batches)
    first = next(batches, None)
    weight = None if first is None or weight_fn is None else weight_fn(first)
    if weight is None:
        return itertools.chain([] if first is None else [first], batches), [], None
    batches = [first, *batches]
    weights = [weight, *(weight_fn(batch) for batch in batches[1:])]
    total = distributed.all_reduce_sum(torch.tensor(float(sum(weights)), dtype=torch.float64, device=device))
    return batches, weights, (distributed.world_size() / total.clamp(min=1)).float()


@dataclass
class StepResult:
    grad_norm: torch.Tensor  # the global gradient norm before clipping, on the device
    lr: float  # the learning rate this step used
    samples: int  # samples this process trained on


def train_step(
    state: TrainState,
    micro_batches: Iterable,
    loss_fn: LossFn,
    tcfg: TrainerConfig,
    global_micro: int,
    weight_fn: WeightFn | None = None,
) -> StepResult:
    """One optimizer step over tcfg.grad_accum_steps micro-batches (global_micro samples each, all processes)."""
    model, optimizer, scaler, progress = state.model, state.optimizer, state.scaler, state.progress
    accum, samples = tcfg.grad_accum_steps, 0
    batches, weights, per_weight = loss_weights(micro_batches, weight_fn, state.device)
    optimizer.zero_grad(set_to_none=True)
    for micro, batch in enumerate(batches):
        with distributed.gradient_sync(model, enabled=micro == accum - 1):  # one all-reduce per step
            with autocast(state.device, tcfg.precision):
                loss, n = loss_fn(model, batch)
            try:
                if weights:
                    scaled = loss * (per_weight * weights[micro])
                else:
                    scaled = loss / accum if accum > 1 else loss
                scaler.scale(scaled).backward()
            except RuntimeError as err:
                if not tcfg.detect_anomaly:
                    raise
                reason = str(err).strip().splitlines()[0]  # names the backward op; the warning shows where
                raise Diverged(f"autograd anomaly at step {progress.step + 1}: {reason}") from None
        state.running.update(loss, weights[micro] if weights else n)  # stays on the device: no host sync per step
        samples += n
        progress.samples_done += global_micro
    scaler.unscale_(optimizer)  # true gradients for the norm (a no-op unless fp16)
    grad_norm = gradient_norm(model, tcfg.grad_clip)  # the same on every rank
    # norm - norm is 0 when finite and NaN for inf or NaN: 2 ops, no host sync; read by check_updates.
    bad = (grad_norm - grad_norm).ne_(0)
    state.nonfinite.append(bad)
    lr = state.scheduler.get_last_lr()[0]
    if scaler.is_enabled():  # fp16
        scaler.step(optimizer)  # skips the step itself on inf/NaN gradients
        scaler.update()
    else:
        step_if_finite(optimizer, bad)
    state.scheduler.step()  # per optimizer step, not per micro-batch
    distributed.broadcast_buffers(model, ddp=state.ema is not None)  # one set of BatchNorm statistics
    progress.step += 1
    if state.ema is not None:  # optim.ema_decay: the moving average follows the updated weights
        state.ema.update(progress.step)
    return StepResult(grad_norm, lr, samples)
