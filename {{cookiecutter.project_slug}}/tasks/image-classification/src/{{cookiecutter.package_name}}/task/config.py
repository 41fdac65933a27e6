"""What this task declares to the engine: SPEC (engine/seam.py's TaskSpec), with the data and model
config sections of the images and their classifier, their allowed values and checks, the
validation metrics, what a resume may change and what a checkpoint restores. engine/config.py
merges the sections in beside the shared ones (run, optim, trainer, tracker, distributed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.errors import ConfigError
from ..engine.seam import DataBase, ModelBase, TaskSpec

if TYPE_CHECKING:
    from ..engine.config import Config


@dataclass
class DataConfig(DataBase):
    name: str = "synthetic"
    """synthetic (learnable images made in memory, no download), cifar10 or imagefolder."""
    root: str = "data"
    """Dataset folder. cifar10 downloads here; imagefolder reads root/train/<class>/* and root/val/<class>/*."""
    batch_size: int = 128
    loader: str = "auto"
    """device (each set on the training device as one uint8 tensor, batches gathered, cropped and flipped
    there, no workers), workers (a DataLoader, data.num_workers processes) or auto (device when the sets
    take at most a quarter of the device's memory, of RAM on a CPU, except imagefolder with augment; the
    log says which it chose)."""
    num_workers: int = 2
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
class ModelConfig(ModelBase):
    name: str = "resnet18"
    """A torchvision classification model: resnet18, resnet50, convnext_tiny, ... (ViTs need 224x224 images), or
    timm:NAME for any timm model (the timm extra), e.g. timm:convnext_nano, timm:efficientnet_b0."""
    drop_path: float = 0.0
    """timm models: stochastic depth, the rate at which a residual block is skipped in training (0: off)."""
    label_smoothing: float = 0.0
    """Training's cross-entropy against (1 - e) on the labelled class and e spread over all classes (torchvision's
    2021 recipe: 0.1); val/loss stays the plain cross-entropy."""
    norm: str = "batch"
    """ResNets only: batch (BatchNorm) or group (GroupNorm, independent of batch size)."""
    small_input: bool = True
    """ResNets only: 3x3 stride-1 stem that suits 32x32 images instead of the 7x7 stride-2 ImageNet stem."""
    pretrained: str | None = None
    """Local weights file (.safetensors or a .pt state_dict) to start from; the classifier head may differ."""
    freeze_backbone: bool = False
    """Train only the classifier head (needs model.pretrained); frozen BatchNorm stays in eval mode."""
    channels_last: bool = False
    """channels_last memory format for model and inputs (faster convolutions on recent GPUs)."""


def validate(cfg: Config) -> None:
    """Combinations of data and model keys that cannot work, named."""
    if cfg.model.norm == "group" and not cfg.model.name.startswith(("resnet", "resnext", "wide_resnet")):
        raise ConfigError(f"model.norm=group works with ResNets only, not model.name={cfg.model.name}")
    if not 0.0 <= cfg.model.label_smoothing < 1.0:
        raise ConfigError(f"model.label_smoothing={cfg.model.label_smoothing} must be at least 0 and below 1")
    if not 0.0 <= cfg.model.drop_path < 1.0:
        raise ConfigError(f"model.drop_path={cfg.model.drop_path} must be at least 0 and below 1")
    if cfg.model.drop_path and not cfg.model.name.startswith("timm:"):
        raise ConfigError(
            f"model.drop_path={cfg.model.drop_path} applies to timm models (model.name=timm:NAME), "
            f"not to torchvision's {cfg.model.name}"
        )
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


SPEC = TaskSpec(
    data=DataConfig,
    model=ModelConfig,
    metrics={"val/loss": "min", "val/acc": "max"},
    monitor="val/acc",
    validate=validate,
    choices={"data.name": ("synthetic", "cifar10", "imagefolder"), "model.norm": ("batch", "group")},
    at_least_one=("data.image_size", "data.num_classes", "data.train_size", "data.val_size"),
    # What a checkpoint's stored config sets in evaluate and export: what rebuilds the model and the
    # data it was trained on. Nothing that names a place (data.root, model.pretrained) comes from a
    # file that may have been written elsewhere.
    from_checkpoint={
        "model": ("name", "norm", "small_input", "channels_last"),
        "data": ("name", "image_size", "num_classes", "train_size", "val_size"),
        "trainer": ("precision",),
    },
    # Training-only settings of a --config file (a pretrained file) may be gone where evaluate runs.
    inference_only=("model.pretrained=null", "model.freeze_backbone=false"),
    resume_may_change=(
        "data.root",
        "data.download",
        "model.pretrained",  # the initial weights only: a resumed run takes its weights from the checkpoint
        "model.channels_last",  # the same numbers in another memory layout
    ),
    memory_hint="a smaller data.image_size or model.name",
    plot_panel=("top-1 accuracy", (("val/acc", "val acc"),)),
)
