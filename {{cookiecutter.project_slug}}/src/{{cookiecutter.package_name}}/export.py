"""Write deployable artifacts from a checkpoint.

    python -m PACKAGE.export run.output_dir=runs/demo      # newest checkpoint of that run
    python -m PACKAGE.export --checkpoint runs/demo/checkpoints/step_00000120.pt

Writes <output_dir>/export/model.safetensors (plain weights, keys without module. / _orig_mod.
prefixes, the same for a DDP, FSDP or compiled run) and <output_dir>/export/model.pt2, a
torch.export program that classifies a batch of normalised images without this project's code:

    program = torch.export.load("model.pt2").module()
    logits = program(images)   # images: float32 (N, 3, H, W), (pixels / 255 - mean) / std

with data.name's mean and std from data.MEAN_STD, as training normalises them (data.DeviceImages).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from .checkpoint import atomic_write, save_weights
from .config import ConfigError, error_line
from .data import DeviceImages, build_datasets
from .evaluate import load_model_weights, restore_trained
from .model import build_model


def export_program(model: nn.Module, example: torch.Tensor) -> torch.export.ExportedProgram:
    """torch.export the model in eval mode with a dynamic batch dimension."""
    batch = torch.export.Dim("batch", min=1, max=4096)
    return torch.export.export(model.eval(), (example,), dynamic_shapes=({0: batch},))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg, path, state, _ = restore_trained(argv, f"{__package__}.export")
        _, val_set, num_classes = build_datasets(cfg.data)
        model = build_model(cfg.model, num_classes)
        load_model_weights(model, state["model"], path)
    except ConfigError as err:
        print(f"error: {error_line(err)}", file=sys.stderr)
        return 2
    out = Path(cfg.run.output_dir) / "export"
    save_weights(model.state_dict(), out / "model.safetensors")
    example = DeviceImages(torch.device("cpu"), cfg.data.name)(torch.stack([val_set[i][0] for i in range(2)]))
    program = export_program(model, example)
    atomic_write(out / "model.pt2", lambda tmp: torch.export.save(program, str(tmp)))
    print(f"exported {path} to {out}/model.safetensors and {out}/model.pt2")
    return 0


if __name__ == "__main__":
    sys.exit(main())
