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


def build_optimizer(model: nn.Module, cfg: OptimConfig, settings: dict | None = None) -> torch.optim.AdamW:
    """AdamW over trainable parameters only; biases and norm weights get no weight decay.

    settings (the task's Task.param_settings): {parameter: (lr_scale, decays)} for parameters that differ
    from the default (1.0, whether it is a matrix), e.g. a layer-wise learning-rate decay. One parameter
    group per (lr_scale, decays), each with its rate optim.lr x lr_scale; the first two are always the
    full rate's, with and without decay (what every run without such settings has).
    fused=True: one kernel for the whole update (CPU and CUDA), markedly faster than the loop.
    """
    settings = settings or {}
    grouped: dict[tuple[float, bool], list] = {(1.0, True): [], (1.0, False): []}
    for param in model.parameters():
        if param.requires_grad:
            grouped.setdefault(settings.get(param, (1.0, param.ndim > 1)), []).append(param)
    order = sorted(grouped, key=lambda key: (key != (1.0, True), key != (1.0, False), not key[1], -key[0]))
    groups = [{"params": grouped[key], **group_settings(cfg, *key)} for key in order]
    return torch.optim.AdamW(groups, lr=cfg.lr, fused=True)


def group_settings(cfg: OptimConfig, lr_scale: float, decays: bool) -> dict:
    """A parameter group's settings: its rate, weight decay (none for biases and norms) and betas."""
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    weight_decay = cfg.weight_decay if decays else 0.0
    return {
        "lr": cfg.lr * lr_scale,
        "lr_scale": lr_scale,
        "decays": decays,
        "weight_decay": weight_decay,
        "betas": betas,
    }


def apply_optim_config(optimizer: torch.optim.Optimizer, scheduler, cfg: OptimConfig) -> None:
    """A resumed run with trainer.override_optim=true: the restored optimizer and scheduler take
    cfg's learning rate, weight decay and betas (its moments and step count are kept). Groups saved
    before they recorded their scale and decay are the two of that time: with and without decay."""
    for index, group in enumerate(optimizer.param_groups):
        settings = group_settings(cfg, group.get("lr_scale", 1.0), group.get("decays", index == 0))
        group.update(settings, initial_lr=settings["lr"])
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
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
