"""The task's configuration: the data and model sections, their allowed values and checks.

config.py holds the sections every task shares (run, optim, trainer, tracker, distributed) and
merges these in; a task's module files (task.py, data.py, model.py) read them from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    from .config import Config


@dataclass
class DataConfig:
    name: str = "synthetic"
    """synthetic (learnable images made in memory, no download), cifar10 or imagefolder."""
    root: str = "data"
    """Dataset folder. cifar10 downloads here; imagefolder reads root/train/<class>/* and root/val/<class>/*."""
    batch_size: int = 128
    """Samples per process per micro-batch; the global batch is batch_size x world size x grad_accum_steps."""
    loader: str = "auto"
    """device (each set on the training device as one uint8 tensor, batches gathered, cropped and flipped
    there, no workers), workers (a DataLoader, data.num_workers processes) or auto (device when the sets
    take at most a quarter of the device's memory, of RAM on a CPU, except imagefolder with augment; the
    log says which it chose)."""
    num_workers: int = 2
    """DataLoader worker processes per training process (0 loads in the main process)."""
    augment: bool = True
    """Random crop and horizontal flip on training images; validation images are never augmented."""
    image_size: int = 32
    """Side of the square images, in pixels (synthetic images are made at this size; cifar10 and imagefolder resize)."""
    num_classes: int = 10
    """Classes of the synthetic data set (cifar10 and imagefolder take theirs from the data)."""
    train_size: int = 4000
    """Training samples of the synthetic data set."""
    val_size: int = 1000
    """Validation samples of the synthetic data set."""
    download: bool = True
    """cifar10 only: download into data.root when it is not there yet."""


@dataclass
class ModelConfig:
    name: str = "resnet18"
    """A torchvision classification model: resnet18, resnet50, convnext_tiny, ... (ViTs need 224x224 images)."""
    norm: str = "batch"
    """ResNets only: batch (BatchNorm) or group (GroupNorm, independent of batch size)."""
    small_input: bool = True
    """ResNets only: 3x3 stride-1 stem that suits 32x32 images instead of the 7x7 stride-2 ImageNet stem."""
    pretrained: str | None = None
    """Local weights file (.safetensors or a .pt state_dict) to start from; the classifier head may differ."""
    freeze_backbone: bool = False
    """Train only the classifier head (needs model.pretrained); frozen BatchNorm stays in eval mode."""
    compile: bool = False
    """torch.compile the model (the first steps are slow while it compiles)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them: less memory, about a third
    more compute per step (ResNet blocks)."""
    channels_last: bool = False
    """channels_last memory format for model and inputs (faster convolutions on recent GPUs)."""


# The validation metrics trainer.monitor may name, and the direction in which each improves.
VAL_METRICS = {"val/loss": "min", "val/acc": "max"}

# Values a key may take, and keys that must be at least 1 (config.validate checks both).
CHOICES = {
    "data.loader": ("auto", "device", "workers"),
    "data.name": ("synthetic", "cifar10", "imagefolder"),
    "model.norm": ("batch", "group"),
}
AT_LEAST_ONE = ("data.batch_size", "data.image_size", "data.num_classes", "data.train_size", "data.val_size")

# Defaults of the shared sections that differ for this task (none: the dataclass defaults are its own).
DEFAULTS: dict = {}

# What a checkpoint's stored config may set in evaluate and export: what rebuilds the model and
# the data it was trained on. Nothing that names a place (run.output_dir, data.root,
# trainer.resume, model.pretrained) or says how to run (batch size, workers, device) comes from a
# file that may have been written elsewhere.
FROM_CHECKPOINT = {
    "model": ("name", "norm", "small_input", "channels_last"),
    "data": ("name", "image_size", "num_classes", "train_size", "val_size"),
    "trainer": ("precision",),
}
# Training-only settings of a --config file (a pretrained file, a resume path) may be gone there.
INFERENCE_ONLY = ["trainer.resume=never", "model.pretrained=null", "model.freeze_backbone=false"]


def validate(cfg: Config) -> None:
    """Combinations of data and model keys that cannot work, named."""
    if cfg.model.norm == "group" and not cfg.model.name.startswith(("resnet", "resnext", "wide_resnet")):
        raise ConfigError(f"model.norm=group works with ResNets only, not model.name={cfg.model.name}")
    if cfg.model.freeze_backbone and not cfg.model.pretrained:
        raise ConfigError("model.freeze_backbone=true needs model.pretrained (a frozen random backbone learns nothing)")
    if cfg.model.pretrained and not Path(cfg.model.pretrained).is_file():
        raise ConfigError(f"model.pretrained={cfg.model.pretrained!r}: no such file")
    if cfg.data.name == "imagefolder":
        for split in ("train", "val"):
            if not (Path(cfg.data.root) / split).is_dir():
                raise ConfigError(
                    f"data.root={cfg.data.root!r} has no {split}/ folder; imagefolder expects "
                    "root/train/<class>/<image> and root/val/<class>/<image>"
                )
