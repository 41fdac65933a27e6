"""What this task declares to the engine: SPEC (engine/seam.py's TaskSpec), with the data and model
config sections of the images and their classifier, their allowed values and checks, the
validation metrics, what a resume may change and what a checkpoint restores. engine/config.py
merges the sections in beside the shared ones (run, optim, trainer, tracker, distributed).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.errors import ConfigError
from ..engine.seam import DataBase, ModelBase, TaskSpec
from .augment import augment_name, check_augment

if TYPE_CHECKING:
    from ..engine.config import Config


log = logging.getLogger(__name__)
DEFAULT_MODEL = "resnet18"
TIMM = "timm:"  # model.name=timm:NAME: the timm model NAME (the timm extra)
TIMM_EXTRA = "pip install -e '.[timm]'"


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
    augment: str = "flip_crop"
    """Training images only: none, flip_crop (random crop and horizontal flip; true means this), trivial (then
    TrivialAugmentWide, torchvision's 2021 recipe), randaugment (then RandAugment, 2 operations of magnitude 9)
    or a timm RandAugment string such as rand-m9-mstd0.5-inc1 (the timm extra; workers only)."""
    random_erase: float = 0.0
    """Probability of erasing a random rectangle (2-33% of the image) of a training image to the mean colour
    (torchvision's 2021 recipe: 0.1)."""
    mixup: float = 0.0
    """Mixup's Beta(a, a) alpha (0: off): a training image blended with another, and their labels alike (0.2)."""
    cutmix: float = 0.0
    """CutMix's Beta(a, a) alpha (0: off): a box of another image pasted in, labels by area (1.0)."""
    mix_prob: float = 1.0
    """Share of the training images that mixup or cutmix mixes."""
    mix_switch_prob: float = 0.5
    """With both mixup and cutmix on, the share mixed by cutmix."""
    mix_partner: str = "set"
    """What a training image is mixed with: set (an image drawn from the whole training set: the same pairs on any
    number of processes, at a second image to load per mixed image) or batch (its process's batch reversed, as timm
    and torchvision mix: nothing more to load, but N processes mix other pairs than 1; resumes stay exact)."""
    image_size: int | None = None
    """Side of the square images, in pixels (synthetic images are made at this size; cifar10 and imagefolder resize);
    null: the input size of model.init_from's folder, else 32."""
    val_image_size: int | None = None
    """Side of the validation images (the model's input in evaluate and export); null: data.image_size. Training on
    smaller crops than it validates on pays (FixRes; torchvision's 2021 recipe: 176 in training, 224 here)."""
    val_resize: int | None = None
    """imagefolder validation: the shorter side is resized to this, then the centre data.val_image_size is cut;
    null: model.init_from's crop_pct, else data.val_image_size (no margin). torchvision's recipe: 232 for 224."""
    mean: list[float] | None = None
    """Per-channel mean (0-1 scale) images are normalised with; null: model.init_from's, else the data set's."""
    std: list[float] | None = None
    """Per-channel standard deviation, as data.mean."""
    num_classes: int = 10
    """Classes of the synthetic data set (cifar10 and imagefolder take theirs from the data)."""
    train_size: int = 4000
    """Training samples of the synthetic data set."""
    val_size: int = 1000
    """Validation samples of the synthetic data set."""
    balance: str = "none"
    """Imbalanced classes: none, or weights (each training sample's loss weighted by N / (classes x its class's
    samples), so every class weighs alike in training and the mean weight is 1; validation stays unweighted)."""
    download: bool = True
    """cifar10 only: download into data.root when it is not there yet."""


@dataclass
class ModelConfig(ModelBase):
    name: str = DEFAULT_MODEL
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
    init_from: str | None = None
    """A timm model folder (config.json and model.safetensors: the hub's timm models, timm.models.save_for_hf) to
    start from: it sets model.name to timm:ITS_ARCHITECTURE, its weights load with a new classifier when the class
    count differs, and its input size, mean and std become data.image_size, data.mean and data.std unless set."""
    pretrained: str | None = None
    """Local weights file (.safetensors or a .pt state_dict) to start from; the classifier head may differ."""
    freeze_backbone: bool = False
    """Train only the classifier head (needs model.pretrained); frozen BatchNorm stays in eval mode."""
    channels_last: bool = False
    """channels_last memory format for model and inputs (faster convolutions on recent GPUs)."""


def validate(cfg: Config) -> None:
    """Combinations of data and model keys that cannot work, named; what model.init_from's folder sets."""
    data = cfg.data
    if cfg.model.pretrained and cfg.model.init_from:
        raise ConfigError("model.pretrained and model.init_from both name starting weights; keep one")
    if cfg.model.init_from:
        from_init_folder(cfg)
    if cfg.model.norm == "group" and not cfg.model.name.startswith(("resnet", "resnext", "wide_resnet")):
        raise ConfigError(f"model.norm=group works with ResNets only, not model.name={cfg.model.name}")
    if not 0.0 <= cfg.model.label_smoothing < 1.0:
        raise ConfigError(f"model.label_smoothing={cfg.model.label_smoothing} must be at least 0 and below 1")
    if not 0.0 <= cfg.model.drop_path < 1.0:
        raise ConfigError(f"model.drop_path={cfg.model.drop_path} must be at least 0 and below 1")
    if cfg.model.drop_path and not cfg.model.name.startswith(TIMM):
        raise ConfigError(
            f"model.drop_path={cfg.model.drop_path} applies to timm models (model.name=timm:NAME), "
            f"not to torchvision's {cfg.model.name}"
        )
    if cfg.optim.layer_decay != 1.0 and not cfg.model.name.startswith(TIMM):
        raise ConfigError(
            f"optim.layer_decay={cfg.optim.layer_decay}: torchvision's {cfg.model.name} does not say how its layers "
            "are ordered; use a timm model (model.name=timm:NAME or model.init_from), whose layers timm orders"
        )
    if data.image_size is None:
        data.image_size = 32
    if data.val_image_size is None:
        data.val_image_size = data.image_size
    if data.val_resize is None:
        data.val_resize = data.val_image_size
    if data.val_resize < data.val_image_size:
        raise ConfigError(
            f"data.val_resize={data.val_resize} is smaller than data.val_image_size={data.val_image_size}: "
            "the centre crop must fit in the resized image"
        )
    for key in ("mean", "std"):
        if getattr(data, key) is not None and len(getattr(data, key)) != 3:
            raise ConfigError(f"data.{key}={list(getattr(data, key))} must give 3 numbers, one per colour channel")
    data.augment = augment_name(data.augment)
    check_augment(data.augment)
    for key in ("random_erase", "mix_prob", "mix_switch_prob"):
        if not 0.0 <= getattr(data, key) <= 1.0:
            raise ConfigError(f"data.{key}={getattr(data, key)} is a probability: between 0 and 1")
    for key in ("mixup", "cutmix"):
        if getattr(data, key) < 0:
            raise ConfigError(f"data.{key}={getattr(data, key)} is a Beta distribution's alpha: positive, or 0 for off")
    if cfg.model.freeze_backbone and not (cfg.model.pretrained or cfg.model.init_from):
        raise ConfigError(
            "model.freeze_backbone=true needs model.pretrained or model.init_from "
            "(a frozen random backbone learns nothing)"
        )
    if cfg.model.pretrained and not Path(cfg.model.pretrained).is_file():
        raise ConfigError(f"model.pretrained={cfg.model.pretrained!r}: no such file")
    if cfg.data.name == "imagefolder":
        for split in ("train", "val"):
            if not (Path(cfg.data.root) / split).is_dir():
                raise ConfigError(
                    f"data.root={cfg.data.root!r} has no {split}/ folder; imagefolder expects "
                    "root/train/<class>/<image> and root/val/<class>/<image>"
                )


def import_timm(what: str):
    """The timm package, or a one-line ConfigError saying that what needs it and how to install it."""
    try:
        import timm
    except ImportError:
        raise ConfigError(f"{what} need timm ({TIMM_EXTRA})") from None
    return timm


def read_folder(path: str) -> dict:
    """The config.json of a timm model folder (model.init_from: what timm.models.save_for_hf writes and the
    hub's timm models hold, beside model.safetensors), checked: the architecture must be timm's."""
    folder = Path(path)
    where = f"model.init_from={path!r}"
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise ConfigError(f"{where}: not a timm model folder (config.json and model.safetensors)")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{where}: config.json cannot be read ({err})") from None
    if not isinstance(config, dict) or "architecture" not in config:
        found = config.get("architectures") if isinstance(config, dict) else None
        kind = f"a transformers model ({', '.join(found)})" if found else "not timm's"
        raise ConfigError(
            f"{where}: its config.json is {kind}; model.init_from takes timm folders, whose config.json names an "
            "architecture (timm/... models on the hub, or timm.models.save_for_hf)"
        )
    timm = import_timm(f"{where}: timm folders")
    if not timm.is_model(config["architecture"]):
        raise ConfigError(f"{where}: timm {timm.__version__} has no architecture {config['architecture']!r}")
    return config


def from_init_folder(cfg: Config) -> None:
    """model.init_from's architecture as model.name, its input size, mean and std as the data's unless set
    (said in the log)."""
    folder = read_folder(cfg.model.init_from)
    name = TIMM + folder["architecture"]
    if cfg.model.name not in (DEFAULT_MODEL, name):
        raise ConfigError(
            f"model.name={cfg.model.name} but model.init_from={cfg.model.init_from!r} holds {name}; "
            "leave model.name out"
        )
    cfg.model.name = name
    pretrained = folder.get("pretrained_cfg") or {}
    taken = [f"model.name={name}"]
    size = pretrained.get("input_size")
    if cfg.data.image_size is None and size:
        cfg.data.image_size = int(size[-1])
        taken.append(f"data.image_size={cfg.data.image_size}")
    crop = pretrained.get("crop_pct")
    if cfg.data.val_resize is None and crop and cfg.data.image_size:  # timm's evaluation: size / crop_pct
        cfg.data.val_resize = int(math.floor((cfg.data.val_image_size or cfg.data.image_size) / crop))
        taken.append(f"data.val_resize={cfg.data.val_resize}")
    for key in ("mean", "std"):
        if getattr(cfg.data, key) is None and pretrained.get(key):
            setattr(cfg.data, key, [float(v) for v in pretrained[key]])
            taken.append(f"data.{key}={getattr(cfg.data, key)}")
    log.info("model.init_from=%s: %s (from its config.json)", cfg.model.init_from, ", ".join(taken))


SPEC = TaskSpec(
    data=DataConfig,
    model=ModelConfig,
    metrics={"val/loss": "min", "val/acc": "max", "val/top5": "max"},
    monitor="val/acc",
    validate=validate,
    choices={
        "data.name": ("synthetic", "cifar10", "imagefolder"),
        "data.mix_partner": ("set", "batch"),
        "data.balance": ("none", "weights"),
        "model.norm": ("batch", "group"),
    },
    at_least_one=("data.image_size", "data.val_image_size", "data.num_classes", "data.train_size", "data.val_size"),
    # What a checkpoint's stored config sets in evaluate and export: what rebuilds the model and the
    # data it was trained on. Nothing that names a place (data.root, model.pretrained) comes from a
    # file that may have been written elsewhere.
    from_checkpoint={
        "model": ("name", "norm", "small_input", "channels_last"),
        "data": (
            *("name", "image_size", "val_image_size", "val_resize", "mean", "std"),
            *("num_classes", "train_size", "val_size"),
        ),
        "trainer": ("precision",),
    },
    # Training-only settings of a --config file (a pretrained file) may be gone where evaluate runs.
    inference_only=("model.init_from=null", "model.pretrained=null", "model.freeze_backbone=false"),
    resume_may_change=(
        "data.root",
        "data.download",
        "model.pretrained",  # the initial weights only: a resumed run takes its weights from the checkpoint
        "model.init_from",  # likewise (its architecture, size and statistics are in the stored model and data keys)
        "model.channels_last",  # the same numbers in another memory layout
    ),
    memory_hint="a smaller data.image_size or model.name",
    plot_panel=("accuracy", (("val/acc", "val top-1"), ("val/top5", "val top-5"))),
    evaluate_flags={"--tta": "test-time augmentation: each image's prediction averages it and its mirror image"},
)
