"""Write deployable artifacts from a checkpoint.

    python -m PACKAGE.export run.output_dir=runs/demo      # newest checkpoint of that run
    python -m PACKAGE.export --checkpoint runs/demo/checkpoints/step_00000120.pt
    python -m PACKAGE.export run.output_dir=runs/demo --format NAME   # a format of the task's own

Writes <output_dir>/export/model.safetensors (plain weights, keys without module. / _orig_mod.
prefixes, the same for a DDP, FSDP or compiled run; for a run with optim.ema_decay > 0 the weights'
moving average, unless --weights raw: its header's "weights" says which) and <output_dir>/export/model.pt2, a
torch.export program that runs the model without this project's code, on inputs like the task's
Task.export_example (task/task.py says what they are):

    program = torch.export.load("model.pt2").module()
    outputs = program(*inputs)

--format names one of the task's own formats instead (Task.EXPORT_FORMATS, written by
Task.export_as under <output_dir>/export; an unknown name lists them).

The model is rebuilt and output_dir chosen as for evaluate (see evaluate.py): the checkpoint gives
the model's and the task's shape only; output_dir is run.output_dir from the command line or,
for --checkpoint PATH alone, the run directory holding checkpoints/ (else the checkpoint's
folder), never a directory named in the checkpoint. Errors are one `error: ...` line: exit 2 for
bad input, 1 when a file cannot be written.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from .engine import PACKAGE, cli
from .engine.ckpt.checkpoint import save_weights
from .engine.ckpt.files import atomic_write, writing
from .engine.ckpt.restore import beside, load_model_weights, restore_trained, take_options
from .engine.config import Config
from .engine.errors import ConfigError
from .engine.rundir import write_model_files
from .task.config import SPEC

DEFAULT = "pt2"  # model.safetensors and model.pt2


def task_class():
    """The task's Task (imported on first use: it brings the task's libraries, which --help does without)."""
    from .task.task import Task

    return Task


def export_program(model: nn.Module, args: tuple, dynamic_shapes: tuple) -> torch.export.ExportedProgram:
    """torch.export the model in eval mode with the task's example input and dynamic dimensions."""
    return torch.export.export(model.eval(), args, dynamic_shapes=dynamic_shapes)


def export_checkpoint(cfg: Config, path: Path, state: dict, fmt: str = DEFAULT) -> Path:
    """Write model.safetensors and model.pt2 of a checkpoint under output_dir/export (or, for a task's
    format, what Task.export_as writes); return what was written."""
    task = task_class()(cfg, torch.device("cpu"))
    if not task.use_model_files(beside(path)):  # what the run saved of its data (its input encoding), else the data
        task.datasets()  # the model's shape follows the data (its number of classes)
    model = task.build_model()
    load_model_weights(model, state, path, task.frozen_weights())
    out = Path(cfg.run.output_dir) / "export"
    if fmt != DEFAULT:
        with writing(out / fmt):
            return task.export_as(fmt, model.eval(), out)
    unusual = {type(t).__name__ for t in model.state_dict().values() if type(t) not in (torch.Tensor, nn.Parameter)}
    if unusual:  # a quantized base (NF4): safetensors and torch.export take plain tensors
        formats = ", ".join(task.EXPORT_FORMATS) or "none"
        raise ConfigError(
            f"export: this model holds {', '.join(sorted(unusual))} weights (a quantized base), which "
            f"model.safetensors and model.pt2 cannot hold; use --format NAME, one of the task's: {formats}"
        )
    kind = {"weights": "ema" if "ema" in state else "trained"}  # restore.py: the average unless --weights raw
    with writing(out / "model.safetensors"):
        save_weights(model.state_dict(), out / "model.safetensors", metadata=kind)
    write_model_files(out, task.model_files())
    program = export_program(model, *task.export_example())
    with writing(out / "model.pt2"):
        atomic_write(out / "model.pt2", lambda tmp: torch.export.save(program, str(tmp)))
    return out


def format_option(argv: list[str]) -> tuple[str, list[str]]:
    """--format NAME (default pt2), checked against the task's formats, and the other arguments."""
    found, rest = take_options(argv, ("--format",))
    fmt = found["--format"] or DEFAULT
    formats = {DEFAULT: "model.safetensors and model.pt2 (torch.export)", **task_class().EXPORT_FORMATS}
    if fmt not in formats:
        listed = "; ".join(f"{name}: {what}" for name, what in formats.items())
        raise ConfigError(f"--format {fmt!r}: choose one of {listed}")
    return fmt, rest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return cli.run(lambda: _export(argv))


def _export(argv: list[str]) -> int:
    fmt, argv = format_option(argv)
    cfg, path, state = restore_trained(SPEC, argv, f"{PACKAGE}.export")
    out = export_checkpoint(cfg, path, state, fmt)
    if fmt != DEFAULT:
        print(f"exported {path}'s {'weight average' if 'ema' in state else 'weights'} as {fmt} to {out}")
        return 0
    which = "weight average (optim.ema_decay)" if "ema" in state else "weights"
    print(f"exported {path}'s {which} to {out}/model.safetensors and {out}/model.pt2")
    return 0


if __name__ == "__main__":
    sys.exit(main())
