"""Data: deterministic synthetic images, seeded loaders, unshuffled validation, imagefolder."""

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from {{ cookiecutter.package_name }}.engine.config import ConfigError, load_config
from {{ cookiecutter.package_name }}.engine.errors import DataError
from {{ cookiecutter.package_name }}.engine.loaders import ResumableSampler, build_train_loader, build_val_loader, sample_bits
from {{ cookiecutter.package_name }}.task.config import SPEC, DataConfig
from {{ cookiecutter.package_name }}.task.data import (
    MEAN_STD,
    DeviceImages,
    DeviceImageSet,
    SeededAugmentation,
    SyntheticImages,
    build_datasets,
    build_transforms,
    device_image_set,
)

from conftest import torchrun


def small(**changes) -> DataConfig:
    return DataConfig(
        **{"image_size": 16, "train_size": 96, "val_size": 41, "batch_size": 16, "num_workers": 0, **changes}
    )


def test_synthetic_data_is_deterministic_and_splits_differ():
    """The same split always gives the same images; train and val hold different samples."""
    a, b = SyntheticImages(64, split="train"), SyntheticImages(64, split="train")
    assert torch.equal(a.images, b.images) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.images, SyntheticImages(64, split="val").images)
    assert a.images.dtype == torch.uint8 and a.images.shape == (64, 3, 32, 32)


def test_synthetic_classes_are_separable():
    """Each class has its own mean image, so the default run has something to learn."""
    data = SyntheticImages(2000, num_classes=10)
    means = torch.stack([data.images[data.targets == c].float().mean(0) for c in range(10)])
    distances = torch.cdist(means.flatten(1), means.flatten(1))
    assert distances[~torch.eye(10, dtype=torch.bool)].min() > 100  # in uint8 pixel units, summed


def test_validation_loader_never_shuffles():
    """Two passes over the validation loader see the samples in dataset order."""
    _, val_set, _ = build_datasets(small())
    loader = build_val_loader(small(), val_set)
    first = torch.cat([t for _, t in loader])
    assert torch.equal(first, torch.cat([t for _, t in loader]))
    assert torch.equal(first, val_set.targets)


def test_validation_shards_cover_every_sample_once():
    """Split over 3 processes, the validation shards hold each sample exactly once (no padding)."""
    _, val_set, _ = build_datasets(small())
    seen = [i for rank in range(3) for i in build_val_loader(small(), val_set, rank=rank, world_size=3).dataset.indices]
    assert sorted(seen) == list(range(len(val_set)))


def test_loaders_hand_over_uint8_that_the_device_step_normalises_like_torchvision():
    """Workers pass uint8 images; DeviceImages gives what per-sample ToDtype + Normalize gave."""
    train_set, val_set, _ = build_datasets(small(num_workers=2))
    train_loader = build_train_loader(small(num_workers=2), SeededAugmentation(train_set, seed=0), seed=0)
    for loader in (train_loader, build_val_loader(small(), val_set)):
        images, _ = next(iter(loader))
        assert images.dtype == torch.uint8 and images.shape == (16, 3, 16, 16)
    for name, (mean, std) in MEAN_STD.items():
        reference = torch.stack([v2.Normalize(mean, std)(v2.ToDtype(torch.float32, scale=True)(i)) for i in images])
        normalised = DeviceImages(torch.device("cpu"), name)(images)
        assert normalised.dtype == torch.float32
        torch.testing.assert_close(normalised, reference, atol=1e-6, rtol=1e-6)
        assert not torch.equal(normalised, images.float() / 255)  # the statistics were applied


def test_device_images_keep_channels_last_and_pass_float_batches_through():
    """channels_last reaches the model from the copy on; a dataset's own float images move unchanged."""
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    moved = DeviceImages(torch.device("cpu"), "synthetic", channels_last=True)(images)
    assert moved.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous(
        memory_format=torch.channels_last
    )
    torch.testing.assert_close(moved, DeviceImages(torch.device("cpu"), "synthetic")(images))
    floats = torch.randn(4, 3, 8, 8)
    assert torch.equal(DeviceImages(torch.device("cpu"), "synthetic")(floats), floats)
    assert torch.equal(DeviceImages(torch.device("cpu"))(images), images.float() / 255)  # no statistics: [0, 1]


def test_training_order_depends_on_seed_and_epoch_only():
    """Same seed and epoch give the same batches (augmentation included); a new epoch reshuffles."""

    def first_batch(epoch: int, seed: int = 0):
        torch.manual_seed(0)
        train_set, _, _ = build_datasets(small())
        loader = build_train_loader(small(), SeededAugmentation(train_set, seed), seed=seed)
        loader.sampler.set_position(epoch, 0)
        return next(iter(loader))

    x0, y0 = first_batch(0)
    x1, y1 = first_batch(0)
    assert torch.equal(x0, x1) and torch.equal(y0, y1)
    assert not torch.equal(y0, first_batch(1)[1])
    assert not torch.equal(y0, first_batch(0, seed=1)[1])


def test_sampler_resumes_mid_epoch():
    """Starting part-way into an epoch yields exactly the rest of that epoch's order."""
    full = ResumableSampler(range(50), seed=3)
    full.set_position(2, 0)
    part = ResumableSampler(range(50), seed=3)
    part.set_position(2, 20)
    assert list(part) == list(full)[20:] and len(part) == 30


def test_workers_are_seeded_differently_and_reproducibly():
    """Each DataLoader worker gets its own numpy seed, the same on every run with the same seed."""

    class Draws(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.random.randint(1 << 30)

    def draws():
        loader = build_train_loader(small(batch_size=1, num_workers=2), Draws(), seed=0)
        loader.sampler.set_position(0, 0)
        return [int(x) for x in loader]

    first = draws()
    assert first == draws()
    assert len(set(first)) == len(first)


def _write_imagefolder(root, per_class=(12, 5)):
    """Two visually different classes as real PNG files: dark and bright noisy squares."""
    rng = np.random.default_rng(0)
    for split, count in zip(("train", "val"), per_class, strict=True):
        for label, base in (("dark", 60), ("bright", 190)):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = np.clip(base + rng.normal(0, 25, (24, 20, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")


def test_imagefolder_reads_train_and_val(tmp_path):
    """imagefolder takes classes from the folders and resizes to data.image_size."""
    _write_imagefolder(tmp_path)
    cfg = small(name="imagefolder", root=str(tmp_path))
    train_set, val_set, num_classes = build_datasets(cfg)
    assert (len(train_set), len(val_set), num_classes) == (24, 10, 2)
    assert val_set[0][0].shape == (3, 16, 16)


def test_validation_images_take_their_own_size_after_a_resize_with_margin(tmp_path):
    """FixRes: training crops of data.image_size, validation images of data.val_image_size, imagefolder's
    validation cut from the centre of the image resized to data.val_resize; the device holds the same."""
    _write_imagefolder(tmp_path)
    cfg = small(name="imagefolder", root=str(tmp_path), val_image_size=12, val_resize=18, augment="none")
    train_set, val_set, _ = build_datasets(cfg)
    assert train_set[0][0].shape == (3, 16, 16)
    original = v2.functional.pil_to_tensor(Image.open(val_set.samples[0][0]).convert("RGB"))
    expected = v2.functional.center_crop(v2.functional.resize(original, 18, antialias=True), [12, 12])
    assert torch.equal(val_set[0][0], expected)
    on_device = device_image_set(val_set, cfg, torch.device("cpu"), 12, 18)
    assert torch.equal(on_device.images[0], expected)
    assert (tmp_path / "val" / ".decoded-val-12px-18.pt").is_file()

    cfg = small(val_image_size=24)
    _, val_set, _ = build_datasets(cfg)
    assert val_set[0][0].shape == (3, 24, 24)
    on_device = device_image_set(val_set, cfg, torch.device("cpu"), 24)
    assert torch.equal(on_device.images[0], val_set[0][0])


def test_imagefolder_class_mismatch_is_refused(tmp_path):
    """train/ and val/ with different class folders is a configuration error."""
    _write_imagefolder(tmp_path)
    (tmp_path / "val" / "bright").rename(tmp_path / "val" / "other")
    with pytest.raises(ConfigError, match="different class folders"):
        build_datasets(small(name="imagefolder", root=str(tmp_path)))


def test_cifar10_missing_offline_is_a_clear_error(tmp_path):
    """cifar10 without the files (and without download) names data.root instead of a traceback."""
    cfg = load_config(SPEC, [], ["data.name=cifar10", f"data.root={tmp_path}", "data.download=false"])
    with pytest.raises(ConfigError, match="CIFAR-10 is not in data.root"):
        build_datasets(cfg.data)


def test_decompression_bomb_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    """An image over PIL's decompression-bomb limit is a DataError naming it, and training exits 2 with one line."""
    from {{ cookiecutter.package_name }}.train import main

    _write_imagefolder(tmp_path / "images")
    Image.new("RGB", (100, 100)).save(tmp_path / "images" / "train" / "dark" / "huge.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)  # the others (480 pixels) pass; huge.png is over twice
    train_set, _, _ = build_datasets(small(name="imagefolder", root=str(tmp_path / "images")))
    with pytest.raises(DataError, match="huge.png"):
        [train_set[i] for i in range(len(train_set))]

    overrides = ["run.device=cpu", "data.name=imagefolder", f"data.root={tmp_path / 'images'}", "data.batch_size=8"]
    overrides += ["data.num_workers=0", "data.image_size=16", "tracker.name=none", f"run.output_dir={tmp_path / 'run'}"]
    assert main(overrides) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "huge.png" in err[0], err


# Under torchrun: a stand-in for CIFAR10.download that records each call and writes a tiny CIFAR-10
# (or fails, "offline"); then every rank builds the data sets and writes what happened to it.
FAKE_CIFAR_DOWNLOAD = """
import os, pickle, sys, time
from datetime import timedelta

import numpy as np
import torch.distributed as dist
from torchvision.datasets import CIFAR10, cifar

from {{ cookiecutter.package_name }}.engine.config import load_config
from {{ cookiecutter.package_name }}.task.config import SPEC
from {{ cookiecutter.package_name }}.task.data import build_datasets
from {{ cookiecutter.package_name }}.engine.errors import DataError

report, root, mode = sys.argv[1:4]
rank = int(os.environ["RANK"])


def download(self):
    open(os.path.join(report, f"download-by-rank{rank}-{time.monotonic_ns()}"), "w").close()
    if mode == "offline":
        raise OSError("network unreachable")
    folder = os.path.join(self.root, self.base_folder)
    os.makedirs(folder, exist_ok=True)
    time.sleep(1)  # slow, like a real download: a rank that did not wait would find no files
    for name, _ in self.train_list + self.test_list:
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump({"data": np.zeros((4, 3072), np.uint8), "labels": [0, 1, 2, 3]}, f)
    with open(os.path.join(folder, "batches.meta"), "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)


CIFAR10.download = download
cifar.check_integrity = lambda path, md5=None: os.path.isfile(path)  # the fake files have other checksums
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
data = load_config(SPEC, [], ["data.name=cifar10", f"data.root={root}"]).data
start = time.monotonic()
try:
    train_set, val_set, classes = build_datasets(data)
    outcome = f"loaded {len(train_set)} {len(val_set)} {classes}"
except DataError as err:
    outcome = f"DataError: {err}"
with open(os.path.join(report, f"rank{rank}"), "w") as f:
    f.write(f"{time.monotonic() - start:.1f}\\n{outcome}")
dist.destroy_process_group()
"""


def run_fake_cifar_download(tmp_path, mode: str) -> tuple[list[str], list[tuple[float, str]]]:
    """The download calls and each rank's (seconds, outcome) of two processes building CIFAR-10."""
    driver, report = tmp_path / "driver.py", tmp_path / "report"
    driver.write_text(FAKE_CIFAR_DOWNLOAD)
    report.mkdir()
    torchrun(2, [str(report), str(tmp_path / "cifar"), mode], script=[str(driver)])
    calls = sorted(p.name.rsplit("-", 1)[0] for p in report.glob("download-*"))
    outcomes = [(report / f"rank{rank}").read_text().split("\n", 1) for rank in range(2)]
    return calls, [(float(seconds), outcome) for seconds, outcome in outcomes]


@pytest.mark.slow
def test_cifar10_is_downloaded_once_per_node_then_loaded_by_every_rank(tmp_path):
    """Two processes on one node: local rank 0 downloads once, the other waits, and both load the files."""
    calls, outcomes = run_fake_cifar_download(tmp_path, "online")
    assert calls == ["download-by-rank0"]
    assert [outcome for _, outcome in outcomes] == ["loaded 20 4 10"] * 2


@pytest.mark.slow
def test_a_failed_cifar10_download_stops_every_rank_at_once_with_the_same_error(tmp_path):
    """The downloading rank's failure reaches the waiting rank promptly (not after the timeout), as one DataError."""
    calls, outcomes = run_fake_cifar_download(tmp_path, "offline")
    assert calls == ["download-by-rank0"]
    (_, first), (seconds, second) = outcomes
    assert first == second and first.startswith("DataError:") and "network unreachable" in first
    assert seconds < 30  # the process group's timeout is 60 s


@pytest.mark.parametrize("workers", [0, 2])
def test_unreadable_image_stops_training_with_one_line(tmp_path, capsys, workers):
    """A corrupt file in an imagefolder exits 2 with one line naming it, also from a DataLoader worker."""
    from {{ cookiecutter.package_name }}.train import main

    _write_imagefolder(tmp_path / "images")
    (tmp_path / "images" / "val" / "dark" / "broken.png").write_bytes(b"not a png")
    overrides = [
        "run.device=cpu",
        "data.name=imagefolder",
        f"data.root={tmp_path / 'images'}",
        "data.batch_size=8",
        f"data.num_workers={workers}",
        "data.image_size=16",
        "trainer.max_epochs=1",
        "tracker.name=none",
        f"run.output_dir={tmp_path / 'run'}",
    ]
    assert main(overrides) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot read image" in err[0] and "broken.png" in err[0], err


def test_a_failed_run_leaves_no_worker_processes(tiny, monkeypatch):
    """Workers stop when training fails, even while the error's traceback keeps the loaders alive
    (they ignore SIGTERM, so multiprocessing's exit handler would otherwise wait for them forever)."""
    import multiprocessing

    from {{ cookiecutter.package_name }} import train as train_module
    from {{ cookiecutter.package_name }}.engine.errors import Diverged
    from {{ cookiecutter.package_name }}.task import task as task_module

    kept = []

    def fail_at_step_2(logits, targets, *settings):
        if len(kept) == 1:
            error = Diverged("injected at step 2")
            kept.append(error)  # like pytest's sys.last_traceback: the frames holding the loaders live on
            raise error
        kept.append(None)
        return torch.nn.functional.cross_entropy(logits, targets)

    monkeypatch.setattr(task_module, "classification_loss", fail_at_step_2)
    assert train_module.main([*tiny, "data.loader=workers", "data.num_workers=2"]) == 1
    assert kept[-1].__traceback__ is not None
    assert multiprocessing.active_children() == []


def test_device_crops_and_flips_are_reflect_padding_then_a_crop():
    """Each image of a device batch is the crop of its reflect-padded copy at the offset its bits
    draw, flipped when they say so: what RandomCrop(padding, reflect) + RandomHorizontalFlip make."""
    images = torch.randint(0, 256, (6, 3, 16, 16), dtype=torch.uint8)
    data = DeviceImageSet(images, torch.arange(6), torch.device("cpu"), seed=3, augment=True)
    indices = torch.tensor([5, 0, 3, 3, 1, 2, 4, 0])
    crops, targets = data.batch(2, indices)
    assert crops.shape == (8, 3, 16, 16) and crops.dtype == torch.uint8 and torch.equal(targets, indices)
    bits = sample_bits(3, 2, indices)
    padded = torch.nn.functional.pad(images.float(), (2, 2, 2, 2), mode="reflect")
    for crop, index, draw in zip(crops, indices.tolist(), bits.tolist(), strict=True):
        dy, dx, flip = draw % 5, (draw >> 20) % 5, (draw >> 40) & 1
        expected = padded[index, :, dy : dy + 16, dx : dx + 16]
        assert torch.equal(crop.float(), expected.flip(-1) if flip else expected)
    unaugmented, _ = data.batch(None, indices)  # validation: the images as they are
    assert torch.equal(unaugmented, images[indices])


def test_device_augmentation_depends_on_seed_epoch_and_sample_only():
    """A sample's crop and flip do not depend on the batch it is in (so not on the number of processes
    or a resume), change with the epoch and the seed, and cover every offset and both flips evenly."""
    images = torch.randint(0, 256, (64, 3, 16, 16), dtype=torch.uint8)
    data = DeviceImageSet(images, torch.zeros(64), torch.device("cpu"), seed=0, augment=True)
    alone = torch.stack([data.batch(1, torch.tensor([i]))[0][0] for i in range(8)])
    together = data.batch(1, torch.arange(8).flip(0))[0].flip(0)
    assert torch.equal(alone, together)
    assert not torch.equal(data.batch(2, torch.arange(8))[0], alone)
    other_seed = DeviceImageSet(images, torch.zeros(64), torch.device("cpu"), seed=1, augment=True)
    assert not torch.equal(other_seed.batch(1, torch.arange(8))[0], alone)
    bits = sample_bits(0, 0, torch.arange(20_000))
    offsets = torch.stack([bits % 5, (bits >> 20) % 5]).flatten()
    assert torch.bincount(offsets, minlength=5).div(40_000).sub(0.2).abs().max() < 0.01
    assert abs(((bits >> 40) & 1).float().mean().item() - 0.5) < 0.01


def test_device_sets_hold_the_decoded_images_and_cache_imagefolder_decoding(tmp_path, caplog):
    """Synthetic images go to the device as they are; an ImageFolder is decoded once (resized and centre
    cropped like its validation images), cached beside the data, and read from the cache the next time
    (a changed file decodes again)."""
    cfg = small()
    train_set, _, _ = build_datasets(cfg)
    assert torch.equal(device_image_set(train_set, cfg, torch.device("cpu"), 16).images, train_set.images)
    for split in ("train", "val"):
        for label in ("a", "b"):
            (tmp_path / split / label).mkdir(parents=True)
            for i in range(3):
                color = (40 * i, 200 if label == "a" else 10, 90)
                Image.new("RGB", (20 + i, 24), color).save(tmp_path / split / label / f"{i}.png")
    cfg = small(name="imagefolder", root=str(tmp_path), image_size=16)
    _, val_set, _ = build_datasets(cfg)
    with caplog.at_level("INFO"):
        first = device_image_set(val_set, cfg, torch.device("cpu"), 16)
    assert "decoding 6 images" in caplog.text and (tmp_path / "val" / ".decoded-val-16px.pt").is_file()
    resize = build_transforms(cfg, train=False)
    expected = torch.stack([resize(Image.open(path).convert("RGB")) for path, _ in val_set.samples])
    assert torch.equal(first.images, expected) and first.targets.tolist() == [0, 0, 0, 1, 1, 1]
    caplog.clear()
    with caplog.at_level("INFO"):
        again = device_image_set(val_set, cfg, torch.device("cpu"), 16)
    assert "decoding" not in caplog.text and torch.equal(again.images, first.images)
    Image.new("RGB", (20, 24), (1, 2, 3)).save(tmp_path / "val" / "a" / "0.png")
    with caplog.at_level("INFO"):
        changed = device_image_set(val_set, cfg, torch.device("cpu"), 16)
    assert "decoding 6 images" in caplog.text and not torch.equal(changed.images, first.images)
