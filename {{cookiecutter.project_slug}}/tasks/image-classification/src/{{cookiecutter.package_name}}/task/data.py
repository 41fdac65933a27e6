"""Image data sets: synthetic (default), CIFAR-10 and ImageFolder, their transforms, and the
normalisation on the device. The loaders that split them across processes are in loaders.py.

With data.loader=device a whole set lives on the training device as one uint8 tensor
(DeviceImageSet): training batches are cropped (reflect padding) and flipped there as a whole,
drawn per (seed, epoch, sample). ImageFolder's images (and CIFAR-10's at another size) are decoded
once, resized and centre-cropped (the training set to data.image_size, the validation set to
data.val_image_size), and cached beside the data.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, get_worker_info
from torchvision import datasets
from torchvision.transforms import v2

from ..engine.errors import DataError
from ..engine.loaders import sample_bits
from ..engine.parallel import distributed
from .augment import Mixing, augment_name, crops_and_flips, partner, policy, seeded
from .config import DataConfig

log = logging.getLogger(__name__)

MEAN_STD = {
    "synthetic": ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # ImageNet statistics
}


class SyntheticImages(Dataset):
    """Learnable images made in memory: each class is a smooth colour pattern; samples are noisy copies.

    The same (seed, split) always gives the same images; train and val share the class patterns
    but not the samples. Images are uint8 CHW tensors, like decoded real images.
    """

    def __init__(self, size, num_classes=10, image_size=32, split="train", seed=0, transform=None):
        patterns = torch.Generator().manual_seed(seed)
        prototypes = torch.rand(num_classes, 3, 4, 4, generator=patterns)
        prototypes = torch.nn.functional.interpolate(prototypes, size=image_size, mode="bicubic")
        samples = torch.Generator().manual_seed(seed + {"train": 1, "val": 2}[split])
        self.targets = torch.randint(num_classes, (size,), generator=samples)
        contrast = 0.2 + 0.4 * torch.rand(size, 1, 1, 1, generator=samples)
        noise = 0.3 * torch.randn(size, 3, image_size, image_size, generator=samples)
        images = (0.5 + contrast * (prototypes[self.targets] - 0.5) + noise).clamp(0, 1)
        self.images = (images * 255).round().to(torch.uint8)
        self.classes = [f"class_{i}" for i in range(num_classes)]
        self.transform = transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        image = self.images[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.targets[index])


def build_transforms(cfg: DataConfig, train: bool) -> v2.Compose:
    """Training: a random crop and horizontal flip unless data.augment=none, then data.augment's policy
    (TrivialAugmentWide, RandAugment, timm's); validation: a plain resize to data.val_image_size
    (imagefolder: the shorter side to data.val_resize, then the centre crop).

    The images stay uint8: scaling and normalising happen batched on the device (DeviceImages).
    """
    if not train:
        return plain_transforms(cfg, cfg.val_image_size or cfg.image_size, cfg.val_resize)
    augment = augment_name(cfg.augment)
    if not crops_and_flips(augment):
        return plain_transforms(cfg, cfg.image_size)
    steps: list = [v2.ToImage()]
    if cfg.name == "imagefolder":
        steps.append(v2.RandomResizedCrop(cfg.image_size, scale=(0.35, 1.0), antialias=True))
    else:
        if cfg.name == "cifar10" and cfg.image_size != 32:
            steps.append(v2.Resize(cfg.image_size, antialias=True))
        steps.append(v2.RandomCrop(cfg.image_size, padding=cfg.image_size // 8, padding_mode="reflect"))
    steps.append(v2.RandomHorizontalFlip())
    if (per_image := policy(augment, cfg.image_size)) is not None:
        steps.append(per_image)
    return v2.Compose(steps)


def plain_transforms(cfg: DataConfig, size: int, resize: int | None = None) -> v2.Compose:
    """Images of side size without a random draw: imagefolder's shorter side resized to resize (default size)
    and the centre cropped; CIFAR-10's and the synthetic images (made at data.image_size) resized."""
    steps: list = [v2.ToImage()]
    if cfg.name == "imagefolder":
        steps += [v2.Resize(resize or size, antialias=True), v2.CenterCrop(size)]
    elif size != {"cifar10": 32}.get(cfg.name, cfg.image_size):
        steps.append(v2.Resize(size, antialias=True))
    return v2.Compose(steps)


class DeviceImages:
    """Moves a batch of images to the device and turns uint8 images into normalised floats there.

    The workers hand over uint8 images: no per-sample float work for them, and a quarter of
    float32's bytes through shared memory, pinned memory and the bus. Float images (from a dataset
    of your own that normalises them) are moved unchanged.
    """

    def __init__(self, device: torch.device, data_name: str | None = None, channels_last: bool = False, stats=None):
        mean, std = MEAN_STD[data_name] if data_name else ((0.0,), (1.0,))  # None: only scale to [0, 1]
        if stats is not None:  # data.mean and data.std where set (null: the data set's)
            mean = stats[0] if stats[0] is not None else mean
            std = stats[1] if stats[1] is not None else std
        self.device = device
        self.stats = [float(m) for m in mean], [float(s) for s in std]  # on the 0-1 scale
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        # Made once: a tensor built from Python numbers in the step would be a host-to-device copy.
        self.mean = torch.tensor(mean, device=device).mul(255).view(1, -1, 1, 1)
        self.std = torch.tensor(std, device=device).mul(255).view(1, -1, 1, 1)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        layout = {"memory_format": self.memory_format} if images.dim() == 4 else {}
        images = images.to(self.device, non_blocking=True, **layout)
        if images.dtype != torch.uint8:
            return images
        return images.float().sub_(self.mean).div_(self.std)  # (x / 255 - mean) / std; keeps the layout


def build_datasets(cfg: DataConfig, seed: int = 0) -> tuple[Dataset, Dataset, int]:
    """The training and validation sets and their number of classes."""
    train_tf, val_tf = build_transforms(cfg, train=True), build_transforms(cfg, train=False)
    if cfg.name == "synthetic":
        common = dict(num_classes=cfg.num_classes, image_size=cfg.image_size, seed=seed)
        train_set = SyntheticImages(cfg.train_size, split="train", transform=train_tf, **common)
        val_set = SyntheticImages(cfg.val_size, split="val", transform=val_tf, **common)
    elif cfg.name == "cifar10":
        train_set, val_set = _cifar10(cfg, train_tf, val_tf)
    else:
        train_set, val_set = _imagefolder(cfg, train_tf, val_tf)
    return train_set, val_set, len(train_set.classes)


def _cifar10(cfg, train_tf, val_tf):
    """CIFAR-10 from data.root, downloaded first by one process per node when data.download is on.

    Processes downloading into one folder at once write the same files at once and can leave them
    corrupt, so local rank 0 downloads while the others wait for its outcome, which every process
    then shares: a failed download stops all of them at once with the same error. The wait counts
    against distributed.timeout_s; nodes that share data.root's file system still download once
    each, so on a cluster download beforehand (or point data.root at node-local storage).
    """
    train_set, failure = None, None
    # LOCAL_RANK is set by the launcher; without a process group every process is on its own.
    if cfg.download and (os.environ.get("LOCAL_RANK", "0") == "0" or not distributed.joined()):
        try:
            train_set = datasets.CIFAR10(cfg.root, train=True, transform=train_tf, download=True)
        except Exception as err:  # whatever failed (network, checksum, archive), the waiting ranks must hear it
            failure = str(err) or type(err).__name__
    if cfg.download:  # the same on every process, so all of them join this collective
        failure = next((f for f in distributed.all_gather_object(failure) if f), None)
    if failure:
        raise _cifar10_missing(cfg, failure)
    try:
        if train_set is None:
            train_set = datasets.CIFAR10(cfg.root, train=True, transform=train_tf, download=False)
        val_set = datasets.CIFAR10(cfg.root, train=False, transform=val_tf, download=False)
    except (OSError, RuntimeError) as err:
        raise _cifar10_missing(cfg, str(err)) from None
    return train_set, val_set


def _cifar10_missing(cfg: DataConfig, reason: str) -> DataError:
    return DataError(
        f"data.name=cifar10: CIFAR-10 is not in data.root={cfg.root!r} and could not be downloaded "
        f"({reason}); download it on a machine with internet or point data.root at cifar-10-batches-py's parent"
    )


def read_image(path: str) -> Image.Image:
    """Open an image file as RGB; an unreadable file is named instead of a worker traceback."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    # DecompressionBombError (more than twice Image.MAX_IMAGE_PIXELS) is not an OSError.
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise DataError(f"data.root: cannot read image {path} ({err}); remove or replace the file") from None


def _imagefolder(cfg, train_tf, val_tf):
    root = Path(cfg.root)
    try:
        train_set = datasets.ImageFolder(str(root / "train"), transform=train_tf, loader=read_image)
        val_set = datasets.ImageFolder(str(root / "val"), transform=val_tf, loader=read_image)
    except (FileNotFoundError, OSError) as err:
        raise DataError(f"data.root={cfg.root!r}: {err}") from None
    if train_set.classes != val_set.classes:
        raise DataError(
            f"data.root={cfg.root!r}: train/ and val/ hold different class folders "
            f"({train_set.classes} vs {val_set.classes})"
        )
    return train_set, val_set


def class_weights(dataset: Dataset, num_classes: int) -> torch.Tensor:
    """N / (classes x samples of the class) for each class of a training set (data.balance=weights), the
    classes counted being those with samples: a sample's mean weight is 1, so the loss keeps its scale.
    A class without training samples weighs 0 (it is never trained on anyway)."""
    counts = torch.bincount(torch.as_tensor(dataset.targets), minlength=num_classes).double()
    present = (counts > 0).sum()
    weights = torch.where(counts > 0, counts.sum() / (present * counts.clamp(min=1)), 0.0)
    return weights.float()


class SeededAugmentation(Dataset):
    """Random transforms seeded by (seed, epoch, sample index) instead of by worker or iterator state.

    A resumed run, another num_workers or another number of processes augments every sample of
    every epoch exactly as an uninterrupted run would. Items are fetched by (epoch, index) keys,
    which ResumableSampler yields.

    With mixing on (mixup, cutmix, random erasing: augment.Mixing), an item also carries its key, for
    the draws made on the device, and with mixup or cutmix from the whole set (data.mix_partner=set)
    its partner's image and label (the partner as augmented in this epoch; the sample itself when it
    is not mixed).
    """

    def __init__(self, dataset: Dataset, seed: int, augment: object = "flip_crop", mixing: Mixing | None = None):
        self.dataset, self.seed = dataset, seed
        self.augment = augment_name(augment) != "none"
        self.mixing = mixing if mixing is not None and mixing.active else None

    def __len__(self):
        return len(self.dataset)

    def augmented(self, epoch: int, index: int):
        if not self.augment:  # data.augment=none: the transforms draw no random numbers
            return self.dataset[index]
        with seeded(self.seed, epoch, index, restore=get_worker_info() is None):
            return self.dataset[index]

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        image, target = self.augmented(epoch, index)
        if self.mixing is None:
            return image, target
        if not self.mixing.ships_partners:
            return image, target, (epoch, index)
        other, mixed = partner(self.seed, epoch, torch.tensor([index]), len(self), self.mixing.prob)
        other_image, other_target = self.augmented(epoch, int(other)) if mixed else (image, target)
        return image, target, (epoch, index), other_image, other_target

    def __getitems__(self, keys: list[tuple[int, int]]) -> list:
        """A whole batch in one call (DataLoader fetches batches through it when it exists)."""
        return [self[key] for key in keys]


class DeviceImageSet:
    """A data set's images (uint8, N x C x H x W) and labels on the training device.

    batch(epoch, indices) gathers a batch there. For training (an epoch given, data.augment not none)
    each image is cropped from its reflect-padded copy at an offset in [-padding, padding] and flipped
    with probability 1/2, both drawn from sample_bits(seed, epoch, index): one gather for the whole
    batch, the same crops for any number of processes and after a resume. A policy (data.augment=
    trivial or randaugment) then runs image by image on the device, seeded per sample as in the
    workers. The batch comes out in channels_last layout (what the gather writes); DeviceImages turns
    it into the model's layout. With mixing on, a batch carries what SeededAugmentation's items carry.
    """

    def __init__(
        self,
        images: torch.Tensor,
        targets: torch.Tensor,
        device: torch.device,
        *,
        seed: int = 0,
        augment: object = "none",
        mixing: Mixing | None = None,
    ):
        augment = augment_name(augment)
        self.device, self.seed, self.augment = device, seed, crops_and_flips(augment)
        self.policy = policy(augment, min(images.shape[-2:]))
        self.mixing = mixing if mixing is not None and mixing.active else None
        self.images = images.to(device)
        self.targets = targets.to(device, torch.int64)
        height, width = images.shape[-2:]
        self.padding = min(height, width) // 8  # as the workers' RandomCrop pads
        self.rows = torch.arange(height, device=device)
        self.cols = torch.arange(width, device=device)

    def __len__(self) -> int:
        return len(self.targets)

    @property
    def nbytes(self) -> int:
        return self.images.nbytes + self.targets.nbytes

    def batch(self, epoch: int | None, indices: torch.Tensor) -> tuple:
        if epoch is None:
            return self.images[indices], self.targets[indices]
        batch = self.augmented(epoch, indices), self.targets[indices]
        if self.mixing is None:
            return batch
        keys = (torch.full((len(indices),), epoch), indices)
        if not self.mixing.ships_partners:
            return *batch, keys
        others, mixed = partner(self.seed, epoch, indices, len(self), self.mixing.prob)
        others = torch.where(mixed, others, indices)
        return *batch, keys, self.augmented(epoch, others), self.targets[others]

    def augmented(self, epoch: int, indices: torch.Tensor) -> torch.Tensor:
        """The images of indices as training sees them in epoch."""
        if not self.augment or self.padding == 0:
            return self.images[indices]
        bits = sample_bits(self.seed, epoch, indices)
        span = 2 * self.padding + 1
        dy = bits % span - self.padding
        dx = (bits >> 20) % span - self.padding
        flip = ((bits >> 40) & 1).bool()
        rows = _reflect(dy[:, None] + self.rows, len(self.rows))
        cols = _reflect(dx[:, None] + self.cols, len(self.cols))
        cols = torch.where(flip[:, None], cols.flip(1), cols)
        crops = self.images[indices[:, None, None], :, rows[:, :, None], cols[:, None, :]]  # B x H x W x C
        crops = crops.permute(0, 3, 1, 2)
        if self.policy is not None:
            for row, index in enumerate(indices.tolist()):  # one host sync a batch, then image by image
                with seeded(self.seed, epoch, index):
                    crops[row] = self.policy(crops[row])
        return crops


def _reflect(position: torch.Tensor, size: int) -> torch.Tensor:
    """Index of a padded position in the unpadded image, as reflect padding (no edge repeat) maps it."""
    position = position.abs()
    return torch.where(position >= size, 2 * (size - 1) - position, position)


def device_bytes(dataset: Dataset, size: int) -> int:
    """What a data set takes as a DeviceImageSet: uint8 images of side size and int64 labels."""
    return len(dataset) * (3 * size**2 + 8)


def device_image_set(
    dataset: Dataset, cfg: DataConfig, device: torch.device, size: int, resize: int | None = None, **augmentation
) -> DeviceImageSet:
    """A DeviceImageSet of dataset (the un-augmented images) at side size (imagefolder: the centre crop of
    the shorter side resized to resize), decoding (once, then cached) where needed."""
    dataset = getattr(dataset, "dataset", dataset)  # SeededAugmentation's
    if isinstance(dataset, SyntheticImages):
        images, targets = dataset.images, dataset.targets
        if images.shape[-1] != size:
            images = v2.functional.resize(images, [size, size], antialias=True)
    elif isinstance(dataset, datasets.CIFAR10) and size == 32:
        images, targets = torch.from_numpy(dataset.data).permute(0, 3, 1, 2), torch.tensor(dataset.targets)
    else:
        images, targets = decoded(dataset, cfg, size, resize or size)
    return DeviceImageSet(images, targets, device, **augmentation)


def decoded(dataset, cfg: DataConfig, size: int, resize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image of an ImageFolder (or CIFAR-10 at another size) decoded, its shorter side resized to
    resize and the centre size x size cropped, as uint8 N x 3 x size x size, with its labels.

    The result is cached in the data's folder (`.decoded-<split>-<size>px[-<resize>].pt`, keyed by the
    files' names, sizes and times), so the next run skips decoding; a folder that cannot be written to
    only costs the decoding again."""
    files = [path for path, _ in getattr(dataset, "samples", [])]
    split = Path(dataset.root).name if files else ("train" if dataset.train else "val")
    key = hashlib.sha256(f"{size} {resize} {len(dataset)}".encode())
    for path in files:
        stat = os.stat(path)
        key.update(f"{path} {stat.st_size} {stat.st_mtime_ns}".encode())
    name = f"{size}px" if resize == size else f"{size}px-{resize}"
    cache = Path(dataset.root) / f".decoded-{split}-{name}.pt"
    if cache.is_file():
        try:
            stored = torch.load(cache, weights_only=True)
            if stored["key"] == key.hexdigest():
                return stored["images"], stored["targets"]
        except Exception as err:  # a damaged cache is decoded again, whatever its damage
            log.warning("data.loader=device: ignoring the cache %s (%s)", cache, err)
    log.info("data.loader=device: decoding %d images of %s once (cached in %s)", len(dataset), dataset.root, cache)
    previous, dataset.transform = dataset.transform, plain_transforms(cfg, size, resize)
    try:
        loader = DataLoader(dataset, batch_size=256, num_workers=cfg.num_workers)
        images, targets = zip(*loader, strict=True)
    finally:
        dataset.transform = previous
    images, targets = torch.cat(images), torch.cat(targets)
    if os.environ.get("LOCAL_RANK", "0") == "0":  # one writer per node; the others decode for themselves
        from ..engine.ckpt.files import atomic_write

        stored = {"key": key.hexdigest(), "images": images, "targets": targets}
        try:
            atomic_write(cache, lambda tmp: torch.save(stored, tmp))
        except OSError as err:
            log.warning("data.loader=device: could not cache the decoded images in %s (%s)", cache, err.strerror)
    return images, targets
