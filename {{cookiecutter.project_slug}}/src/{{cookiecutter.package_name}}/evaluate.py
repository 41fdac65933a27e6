"""Evaluate a checkpoint on the validation set.

    python -m PACKAGE.evaluate run.output_dir=runs/demo           # newest checkpoint of that run
    python -m PACKAGE.evaluate --checkpoint runs/demo/checkpoints/step_00000120.pt
    torchrun --nproc_per_node=4 -m PACKAGE.evaluate run.output_dir=runs/demo

The run's own configuration (stored in the checkpoint) is the base; overrides on the command line
win. Prints the metrics as JSON and writes them to <output_dir>/eval.json.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from . import distributed
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, strip_prefixes
from .config import Config, ConfigError, error_line, load_config, parse_args
from .data import DeviceImages, build_datasets, build_val_loader, shut_down_workers
from .model import build_model

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str):
    """torch.autocast for bf16/fp16; a no-op context for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


def evaluate_model(model: nn.Module, loader, inputs: DeviceImages, precision: str = "fp32") -> dict:
    """Validation loss and accuracy over every sample, summed over all processes.

    val/loss is the sample-weighted mean loss, val/acc = correct / samples counted (not / batches),
    and val/samples the number of samples counted. Runs under eval() and no_grad(). `inputs` moves
    each batch's images to the device and normalises them, as in training.
    """
    model.eval()
    device = inputs.device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    rounds = distributed.max_over_ranks(len(loader), device)  # FSDP forwards are collectives: run as many
    batches, images = iter(loader), None
    with torch.no_grad(), autocast(device, precision):
        for _ in range(rounds):
            batch = next(batches, None)
            if batch is None:
                model(images)  # keeps step with processes that have one more batch; not counted
                continue
            images, targets = batch
            images = inputs(images)
            targets = targets.to(device, non_blocking=True)
            logits = model(images)
            sums[0] += F.cross_entropy(logits.float(), targets, reduction="sum")
            sums[1] += (logits.argmax(dim=1) == targets).sum()
            sums[2] += targets.numel()
    distributed.all_reduce_sum(sums)
    loss_sum, correct, samples = sums.tolist()  # one host sync for the whole pass
    return {"val/loss": loss_sum / samples, "val/acc": correct / samples, "val/samples": int(samples)}


def restore_trained(argv: list[str], program: str) -> tuple[Config, Path, dict, list[str]]:
    """Config, checkpoint path and checkpoint state for --checkpoint PATH or the run's newest one."""
    checkpoint_arg = None
    rest = []
    args = iter(argv)
    for arg in args:
        if arg == "--checkpoint":
            checkpoint_arg = next(args, None)
            if checkpoint_arg is None:
                raise ConfigError("--checkpoint needs a file name")
        elif arg.startswith("--checkpoint="):
            checkpoint_arg = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    files, overrides = parse_args(rest, program)
    cfg = load_config(files, overrides)
    if checkpoint_arg:
        path, state = Path(checkpoint_arg), load_checkpoint(Path(checkpoint_arg))
    else:
        found = latest_checkpoint(Path(cfg.run.output_dir) / "checkpoints")
        if found is None:
            raise ConfigError(
                f"run.output_dir={cfg.run.output_dir!r} holds no usable checkpoint; train first "
                "or pass --checkpoint PATH"
            )
        path, state = found
    # The run's own settings are the base, so the model is rebuilt exactly as it was trained.
    # Training-only paths (resume, pretrained weights) may be gone; the checkpoint replaces them.
    inference_only = ["trainer.resume=never", "model.pretrained=null", "model.freeze_backbone=false"]
    cfg = load_config(files, inference_only + overrides, base=state.get("config"))
    return cfg, path, state, overrides


def load_model_weights(model: nn.Module, weights: dict, source: Path) -> None:
    """Load weights saved by any wrapper (DDP, compile) into a plain model, naming the file on mismatch."""
    try:
        model.load_state_dict(strip_prefixes(weights))
    except RuntimeError as err:
        raise CheckpointError(f"{source}: does not fit the configured model ({mismatch(err)})") from None


def mismatch(err: Exception) -> str:
    """The informative part of torch's state-dict error: the first missing, unexpected or mis-sized key."""
    for line in str(err).splitlines():
        if "Missing key" in line or "Unexpected key" in line or "size mismatch" in line:
            return line.strip()[:240]
    return str(err).strip().splitlines()[-1][:240]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg, path, state, _ = restore_trained(argv, f"{__package__}.evaluate")
        env = distributed.setup(cfg)
        try:
            _, val_set, num_classes = build_datasets(cfg.data)
            val_loader = build_val_loader(cfg.data, val_set, rank=env.rank, world_size=env.world_size)
            try:
                inputs = DeviceImages(env.device, cfg.data.name, cfg.model.channels_last)
                model = build_model(cfg.model, num_classes).to(env.device, memory_format=inputs.memory_format)
                load_model_weights(model, state["model"], path)
                metrics = evaluate_model(model, val_loader, inputs, cfg.trainer.precision)
            finally:
                shut_down_workers(val_loader)
        finally:
            distributed.teardown()
    except ConfigError as err:
        print(f"error: {error_line(err)}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError:
        print(f"error: CUDA out of memory; lower data.batch_size (now {cfg.data.batch_size})", file=sys.stderr)
        return 1
    if env.is_main:
        metrics = {"checkpoint": str(path), "step": state["progress"]["step"], **metrics}
        print(json.dumps(metrics, indent=2))
        out = Path(cfg.run.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
