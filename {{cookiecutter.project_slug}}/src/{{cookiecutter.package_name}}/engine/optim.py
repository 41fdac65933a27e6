"""Optimizer, learning-rate schedule, and the checks that stop a run going non-finite."""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import OptimConfig
from .errors import Diverged

REMEDIES = (
    "lower optim.lr, keep trainer.grad_clip on, check the input data, "
    "or find the operation with trainer.detect_anomaly=true"
)


def check_finite(name: str, loss: float, step: int, precision: str) -> None:
    """Stop with the usual remedies when a loss is NaN or infinite."""
    if not math.isfinite(loss):
        hint = "use bf16 instead of fp16, " if precision == "fp16" else ""
        raise Diverged(f"{name} is {loss} at step {step}; {hint}{REMEDIES}")


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over trainable parameters only; biases and norm weights get no weight decay.

    fused=True: one kernel for the whole update (CPU and CUDA), markedly faster than the loop.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decayed, other = group_settings(cfg)
    groups = [
        {"params": [p for p in params if p.ndim > 1], **decayed},
        {"params": [p for p in params if p.ndim <= 1], **other},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, fused=True)


def group_settings(cfg: OptimConfig) -> tuple[dict, dict]:
    """The settings of build_optimizer's two parameter groups: matrices decay, biases and norms do not."""
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    return {"weight_decay": cfg.weight_decay, "betas": betas}, {"weight_decay": 0.0, "betas": betas}


def apply_optim_config(optimizer: torch.optim.Optimizer, scheduler, cfg: OptimConfig) -> None:
    """A resumed run with trainer.override_optim=true: the restored optimizer and scheduler take
    cfg's learning rate, weight decay and betas (its moments and step count are kept)."""
    for group, settings in zip(optimizer.param_groups, group_settings(cfg), strict=True):
        group.update(settings, initial_lr=cfg.lr)
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    refresh_learning_rate(scheduler)


def refresh_learning_rate(scheduler) -> None:
    """Set the learning rate the schedule (as configured now) gives at the restored step.

    A restored scheduler keeps the rate of the run that saved it until its next step; after a
    change of optim.* or of the run's length, the next step must already use the new schedule.
    """
    scheduler.last_epoch -= 1
    scheduler.step()


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warmup to 1, then cosine decay to min_ratio at total."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def gradient_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """The global gradient norm over all processes, clipped to max_norm when > 0 (a device tensor)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        norm = nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = nn.utils.get_total_norm([p.grad for p in params])
    full_tensor = getattr(norm, "full_tensor", None)  # a DTensor under FSDP: summed over the shards
    return full_tensor() if full_tensor else norm


def step_if_finite(optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor) -> None:
    """optimizer.step(), skipped on the device when nonfinite is true: no host sync per step.

    This is the protocol GradScaler uses with fused optimizers: a found_inf flag makes the fused
    AdamW kernel leave weights, moments and step count untouched.
    """
    if not optimizer.defaults.get("fused"):
        raise ValueError("step_if_finite needs a fused optimizer: others ignore found_inf and would apply NaN")
    optimizer.found_inf = nonfinite.float()
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
