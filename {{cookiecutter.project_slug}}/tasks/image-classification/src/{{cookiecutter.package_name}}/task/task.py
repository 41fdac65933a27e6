"""The task: what this project trains, image classification. The engine calls it through the
interface engine/seam.py declares (seam.Task).

The training set takes the (epoch, index) keys of loaders.ResumableSampler, so its random draws
(augmentation here) are the same for any number of processes and after a resume. config.py
(its SPEC), data.py, model.py and validation.py are this task's own building blocks.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..engine import seam
from ..engine.config import Config
from ..engine.errors import ConfigError
from ..engine.parallel import meta_init
from .augment import POLICIES, TIMM_POLICY, Mixing, crops_and_flips, draws, mix, soft_cross_entropy, soft_targets
from .config import TIMM
from .data import DeviceImages, SeededAugmentation, build_datasets, class_weights, device_bytes, device_image_set
from .model import (
    INIT_TYPES,
    architecture,
    build_model,
    classification_loss,
    folder_model,
    freeze_backbone,
    init_module,
    timm_param_settings,
    write_timm_folder,
)
from .validation import confusion_json, confusion_png, confusion_report, evaluate_model

log = logging.getLogger(__name__)


class Task(seam.Task):
    """Image classification: uint8 images normalised on the device, cross-entropy, accuracy."""

    def __init__(self, cfg: Config, device: torch.device):
        super().__init__(cfg, device)
        stats = (cfg.data.mean, cfg.data.std)
        self.inputs = DeviceImages(device, cfg.data.name, cfg.model.channels_last, stats)  # normalised on the device
        self.num_classes: int | None = None
        self.mixing = Mixing.of(cfg.data)
        self.class_weights: torch.Tensor | None = None  # data.balance=weights
        self.sizes = (cfg.data.image_size, cfg.data.val_image_size)  # training and validation image sizes

    def datasets(self) -> tuple[Dataset, Dataset]:
        """The training set (by (epoch, index) keys, augmented per sample) and the validation set:
        uint8 images and integer labels."""
        train_set, val_set, self.num_classes = build_datasets(self.cfg.data)
        self.class_names = [str(name) for name in val_set.classes]
        if self.cfg.data.balance == "weights":
            self.class_weights = class_weights(train_set, self.num_classes).to(self.device)
        return SeededAugmentation(train_set, self.cfg.run.seed, self.cfg.data.augment, self.mixing), val_set

    def device_bytes(self, train_set: Dataset, val_set: Dataset) -> tuple[int, str | None]:
        """Bytes both sets take on the device (uint8 images), and what speaks against data.loader=auto
        choosing the device (None: nothing)."""
        data = self.cfg.data
        nbytes = device_bytes(train_set, data.image_size) + device_bytes(val_set, data.val_image_size)
        if data.name == "imagefolder" and crops_and_flips(data.augment):
            return nbytes, "imagefolder trains on random resized crops, which the device loader does not make"
        if data.augment.startswith(TIMM_POLICY):
            return nbytes, f"data.augment={data.augment} is timm's, on PIL images, which only workers make"
        if data.augment in POLICIES:
            return nbytes, f"data.augment={data.augment} transforms image by image, which workers do in parallel"
        return nbytes, None

    def device_sets(self, train_set: Dataset, val_set: Dataset) -> tuple:
        """Both sets on the training device (data.loader=device): the training set augmented there."""
        data = self.cfg.data
        if data.augment.startswith(TIMM_POLICY):
            raise ConfigError(
                f"data.loader=device: data.augment={data.augment} is timm's RandAugment, which works on PIL images "
                "in DataLoader workers; use data.loader=workers (or data.augment=randaugment, torchvision's)"
            )
        augmentation = dict(seed=self.cfg.run.seed, augment=data.augment, mixing=self.mixing)
        train = device_image_set(train_set, data, self.device, data.image_size, **augmentation)
        return train, device_image_set(val_set, data, self.device, data.val_image_size, data.val_resize)

    def build_model(self, device: torch.device | None = None, shard: Callable | None = None) -> nn.Module:
        """The classifier for the data's classes on `device` (default CPU) in the training memory
        format, initialised from run.seed; shard(model) (FSDP) is applied on the meta device, before
        any weight exists (meta_init.py). A timm folder's weights (model.init_from) go into each
        process's shards, and a new classifier is drawn from run.seed, so 1 and N processes start
        alike; a model meta_init cannot fill (a tensor made in its constructor), and a weights file
        (model.pretrained), load into the whole model first."""
        device = device or torch.device("cpu")
        if self.cfg.model.init_from:
            model, weights = folder_model(self.cfg.model, self.num_classes, self.sizes)
            if meta_init.loadable(model, weights, INIT_TYPES):  # else built whole, below
                if self.cfg.model.freeze_backbone:
                    freeze_backbone(model)
                model = model.to(memory_format=self.inputs.memory_format)
                model = shard(model) if shard else model
                model.to_empty(device=device)
                meta_init.load(model, weights, self.cfg.run.seed, init_module)
                return model
            del weights
        if self.cfg.model.pretrained or self.cfg.model.init_from:
            model = build_model(self.cfg.model, self.num_classes, self.sizes)
            model = model.to(device, memory_format=self.inputs.memory_format)
            return shard(model) if shard else model
        layout = self.inputs.memory_format
        model, _ = meta_init.build(
            lambda: architecture(self.cfg.model, self.num_classes, self.sizes).to(memory_format=layout),
            init_module,
            INIT_TYPES,
            device,
            self.cfg.run.seed,
            shard,
        )
        return model

    def loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, int]:
        """Mean cross-entropy of one micro-batch (with model.label_smoothing) and its number of samples;
        with mixup, cutmix or random erasing, the batch is mixed here, on the device, and the loss is
        the cross-entropy against the mixed labels."""
        images, targets, *mixing = batch
        images = self.inputs(images)
        targets = targets.to(self.device, non_blocking=True)  # the whole batch moves, not just inputs
        smoothing = self.cfg.model.label_smoothing
        if not mixing:
            return classification_loss(model(images), targets, smoothing, self.class_weights), len(targets)
        (epochs, indices), *others = mixing
        epoch = int(epochs[0])  # on the host: a batch never spans two epochs
        drawn = draws(self.mixing, self.cfg.run.seed, epoch, indices.to(self.device), *images.shape[-2:])
        partners, partner_targets = images, targets  # random erasing alone mixes nothing
        if others:  # data.mix_partner=set: each sample's partner came with it
            partners, partner_targets = self.inputs(others[0]), others[1].to(self.device, non_blocking=True)
        elif self.mixing.mixes:  # data.mix_partner=batch: the batch reversed
            partners, partner_targets = images.flip(0), targets.flip(0)
        logits = model(mix(images, partners, drawn))
        soft = soft_targets(targets, partner_targets, drawn["lam"], logits.shape[-1], smoothing)
        return soft_cross_entropy(logits, soft, self.class_weights), len(targets)

    def validate(self, model: nn.Module, loader: DataLoader) -> dict:
        """val/loss, val/acc and val/samples over the whole validation set."""
        return evaluate_model(model, loader, self.inputs, self.cfg.trainer.precision)

    def evaluate(self, model: nn.Module, loader: DataLoader, options: dict[str, str | None]) -> tuple[dict, dict]:
        """The evaluate command: validate's metrics (with --tta, of each image and its mirror image), the
        balanced accuracy, and reports confusion.json (the confusion matrix, each class's accuracy) and,
        with matplotlib (the plot extra), confusion.png."""
        tta = "--tta" in options
        metrics = evaluate_model(
            model, loader, self.inputs, self.cfg.trainer.precision, tta=tta, confusion=self.num_classes
        )
        balanced, report = confusion_report(metrics.pop("confusion"), self.class_names)
        reports = {"confusion.json": lambda path: path.write_text(confusion_json(report))}
        if importlib.util.find_spec("matplotlib") is not None:
            reports["confusion.png"] = lambda path: confusion_png(report, path)
        else:
            log.info("evaluate: no confusion.png without matplotlib (pip install -e '.[plot]')")
        return {**metrics, **balanced, "tta": tta}, reports

    def summary(self, metrics: dict) -> str:
        return f"val/loss {metrics['val/loss']:.4f} val/acc {metrics['val/acc']:.4f} ({metrics['val/samples']} samples)"

    def throughput(self, samples_per_s: float) -> dict:
        """No figures beyond perf/samples_per_s: a sample is an image."""
        return {}

    def param_settings(self, model: nn.Module, layer_decay: float) -> dict:
        """timm models: timm's layer order for optim.layer_decay and its no-decay list (torchvision's models:
        the engine's defaults; config.py refuses a layer decay for them)."""
        if not self.cfg.model.name.startswith(TIMM):
            return super().param_settings(model, layer_decay)
        return timm_param_settings(model, layer_decay)

    EXPORT_FORMATS = {
        "timm": "a timm model folder (export/timm: timm.create_model('local-dir:...') loads it; model.name=timm:NAME)"
    }

    def export_as(self, fmt: str, model: nn.Module, folder: Path) -> Path:
        """export --format timm: config.json and model.safetensors in folder/timm."""
        out = Path(folder) / fmt
        size, (mean, std) = self.cfg.data.val_image_size, self.inputs.stats
        crop = size / self.cfg.data.val_resize if self.cfg.data.name == "imagefolder" else 1.0
        preprocessing = {"input_size": [3, size, size], "mean": mean, "std": std, "crop_pct": crop}
        write_timm_folder(model, self.cfg.model.name, out, preprocessing)
        return out

    def export_example(self) -> tuple[tuple, tuple]:
        """Two images of the configured size, with a dynamic batch dimension (1 to 4096 images).

        torch.export specialises a dimension of size 0 or 1 to that constant, so an example batch
        of one would fix the batch size the program accepts."""
        size = self.cfg.data.val_image_size  # the size the model sees in inference
        images = torch.zeros(2, 3, size, size)
        return (images,), ({0: torch.export.Dim("batch", min=1, max=4096)},)
