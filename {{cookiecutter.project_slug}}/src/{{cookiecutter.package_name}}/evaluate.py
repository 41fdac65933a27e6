"""Evaluate a checkpoint on the validation set.

    python -m PACKAGE.evaluate run.output_dir=runs/demo           # newest checkpoint of that run
    python -m PACKAGE.evaluate --checkpoint runs/demo/checkpoints/step_00000120.pt
    torchrun --nproc_per_node=4 -m PACKAGE.evaluate run.output_dir=runs/demo

The model is rebuilt from the checkpoint: its stored config gives only the model's and the
task's shape (FROM_CHECKPOINT: model name, norm, stem and memory format; data set name, image
size, classes, synthetic set sizes; precision). --config files and key=value overrides win.
Everything else, places above all, comes from the command line or the defaults: a checkpoint
copied from elsewhere never decides where data is read from or anything is written.

Prints the metrics as JSON (`step` is null for weights saved without training progress) and
writes them to <output_dir>/eval.json, where output_dir is run.output_dir as given on the command
line (an override or a --config file) or, for --checkpoint PATH alone, the folder beside it: the
run directory for a run's checkpoints/step_N.pt (so a run's eval.json sits next to its
metrics.jsonl, as with run.output_dir), else the checkpoint's own folder.

Errors are one `error: ...` line on stderr: exit 2 for bad input (configuration, data,
checkpoint), 1 when an output cannot be written or CUDA runs out of memory.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.nn import functional as F

from . import distributed
from .checkpoint import atomic_write, latest_checkpoint, load_checkpoint, strip_prefixes, writing
from .config import Config, load_config, parse_args
from .data import DeviceImages, build_datasets, build_val_loader, shut_down_workers
from .errors import CheckpointError, ConfigError, exit_status, report
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


# What a checkpoint's stored config may set: what rebuilds the model and the data it was trained on.
# Nothing that names a place (run.output_dir, data.root, trainer.resume, model.pretrained) or says
# how to run (batch size, workers, device) comes from a file that may have been written elsewhere.
FROM_CHECKPOINT = {
    "model": ("name", "norm", "small_input", "channels_last"),
    "data": ("name", "image_size", "num_classes", "train_size", "val_size"),
    "trainer": ("precision",),
}
# Training-only settings of a --config file (a pretrained file, a resume path) may be gone here.
INFERENCE_ONLY = ["trainer.resume=never", "model.pretrained=null", "model.freeze_backbone=false"]


def restore_trained(argv: list[str], program: str) -> tuple[Config, Path, dict]:
    """Config, checkpoint path and checkpoint state for --checkpoint PATH or the run's newest one.

    Defaults < the checkpoint's FROM_CHECKPOINT keys < --config files < key=value overrides.
    run.output_dir is the command line's; with --checkpoint PATH alone, the folder beside it.
    """
    checkpoint_arg, rest = _checkpoint_option(argv)
    files, overrides = parse_args(rest, program)
    overrides = [*INFERENCE_ONLY, *overrides]
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
    cfg = load_config(files, overrides, base=model_and_task(state, path))
    if checkpoint_arg and not _output_dir_given(files, overrides):
        cfg.run.output_dir = str(beside(path))  # set here, not as an override: a path is never parsed
    return cfg, path, state


def _checkpoint_option(argv: list[str]) -> tuple[str | None, list[str]]:
    checkpoint, rest = None, []
    args = iter(argv)
    for arg in args:
        if arg == "--checkpoint":
            checkpoint = next(args, None)
            if checkpoint is None:
                raise ConfigError("--checkpoint needs a file name")
        elif arg.startswith("--checkpoint="):
            checkpoint = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return checkpoint, rest


def model_and_task(state: dict, path: Path) -> dict:
    """The FROM_CHECKPOINT part of a checkpoint's stored config, as {section: {key: value}}."""
    stored = state.get("config") if isinstance(state.get("config"), dict) else {}
    taken: dict = {}
    for section, keys in FROM_CHECKPOINT.items():
        values = stored.get(section) if isinstance(stored.get(section), dict) else {}
        for key in keys:
            if key in values:
                taken.setdefault(section, {})[key] = _plain(values[key], f"{section}.{key}", path)
    return taken


def _plain(value, key: str, path: Path):
    """A stored value as data, never as configuration to evaluate.

    OmegaConf would resolve "${...}" in a stored string, and "${oc.env:HOME}" reads the
    environment: a checkpoint written elsewhere must not run resolvers here.
    """
    if isinstance(value, str) and "${" in value:
        raise CheckpointError(f"{path}: stored {key}={value!r} is an interpolation, which is never resolved")
    if not isinstance(value, str | int | float | bool):
        raise CheckpointError(f"{path}: stored {key}={value!r} is not a number, flag or string")
    return value


def _output_dir_given(files: list[str], overrides: list[str]) -> bool:
    """Whether run.output_dir was set by a key=value override or a --config file."""
    if any(item.split("=", 1)[0] == "run.output_dir" for item in overrides):
        return True
    return any("output_dir" in (OmegaConf.load(file).get("run") or {}) for file in files)


def beside(checkpoint: Path) -> Path:
    """Where --checkpoint PATH alone writes: the run directory for a run's checkpoints/step_N.pt
    (where train wrote metrics.jsonl and where evaluate would write given run.output_dir), else
    the checkpoint's own folder."""
    folder = checkpoint.parent
    return folder.parent if folder.name == "checkpoints" else folder


def trained_step(state: dict) -> int | None:
    """The optimizer step a checkpoint was written at; None for weights saved without progress."""
    progress = state.get("progress")
    return progress.get("step") if isinstance(progress, dict) else None


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


def evaluate_checkpoint(cfg: Config, path: Path, state: dict) -> tuple[dict, bool]:
    """The validation metrics of a checkpoint (on every process), and whether this is the main process."""
    env = distributed.setup(cfg)
    try:
        _, val_set, num_classes = build_datasets(cfg.data)
        val_loader = build_val_loader(cfg.data, val_set, rank=env.rank, world_size=env.world_size)
        try:
            inputs = DeviceImages(env.device, cfg.data.name, cfg.model.channels_last)
            model = build_model(cfg.model, num_classes).to(env.device, memory_format=inputs.memory_format)
            load_model_weights(model, state["model"], path)
            return evaluate_model(model, val_loader, inputs, cfg.trainer.precision), env.is_main
        finally:
            shut_down_workers(val_loader)
    finally:
        distributed.teardown()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg, path, state = restore_trained(argv, f"{__package__}.evaluate")
        metrics, is_main = evaluate_checkpoint(cfg, path, state)
        if is_main:
            text = json.dumps({"checkpoint": str(path), "step": trained_step(state), **metrics}, indent=2)
            print(text)
            eval_json = Path(cfg.run.output_dir) / "eval.json"
            with writing(eval_json):
                atomic_write(eval_json, lambda tmp: tmp.write_text(text + "\n"))
    except torch.OutOfMemoryError:
        print(f"error: CUDA out of memory; lower data.batch_size (now {cfg.data.batch_size})", file=sys.stderr)
        return 1
    except Exception as err:
        if exit_status(err) is None:
            raise  # a bug: its traceback is what helps
        return report(err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
