"""The recipe's augmentations: the policies per image, and mixup, cutmix and random erasing per batch."""

import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import default_collate

from {{ cookiecutter.package_name }}.engine.config import ConfigError, load_config
from {{ cookiecutter.package_name }}.task.augment import (
    Mixing,
    beta,
    draws,
    mix,
    partner,
    policy,
    soft_cross_entropy,
    soft_targets,
    uniforms,
)
from {{ cookiecutter.package_name }}.task.config import SPEC, DataConfig
from {{ cookiecutter.package_name }}.task.data import DeviceImageSet, SeededAugmentation, SyntheticImages, build_transforms
from {{ cookiecutter.package_name }}.task.task import Task

from tiny import TINY

INDICES = torch.arange(512)


@pytest.mark.parametrize("mixing", [Mixing(mixup=0.2), Mixing(cutmix=1.0), Mixing(mixup=0.8, cutmix=1.0, prob=0.7)])
def test_mixed_targets_sum_to_one_and_match_the_mixed_image_areas(mixing):
    """Mixing black images with white partners: each pixel's share of white is 1 - lam for mixup, and the
    pasted box covers exactly 1 - lam of a cutmix image; the soft targets put lam (smoothed) on the own
    label, the rest on the partner's, and sum to one."""
    drawn = draws(mixing, seed=0, epoch=3, index=INDICES, height=24, width=20)
    lam, cut = drawn["lam"], drawn["cutmix"]
    mixed = mix(torch.zeros(512, 3, 24, 20), torch.ones(512, 3, 24, 20), drawn)
    white = mixed.mean(dim=(1, 2, 3)).double()
    assert torch.allclose(white, 1 - lam, atol=1e-6)
    assert set(mixed[cut].unique().tolist()) <= {0.0, 1.0}  # cutmix pastes, never blends
    assert 0 < cut.sum() < 512 if mixing.mixup and mixing.cutmix else cut.any() == bool(mixing.cutmix)
    unmixed = lam == 1
    assert (unmixed.double().mean() - (1 - mixing.prob)).abs() < 0.06  # each sample is mixed with mix_prob

    own, other = torch.randint(10, (512,)), torch.randint(10, (512,))
    soft = soft_targets(own, other, lam, 10, smoothing=0.1)
    assert torch.allclose(soft.sum(dim=1), torch.ones(512, dtype=torch.float64))
    different = own != other
    assert torch.allclose(soft[different, own[different]], lam[different] * 0.9 + 0.01)
    logits = torch.randn(512, 10)
    by_label = lam * F.cross_entropy(logits, own, reduction="none", label_smoothing=0.1).double()
    by_label += (1 - lam) * F.cross_entropy(logits, other, reduction="none", label_smoothing=0.1).double()
    assert torch.allclose(soft_cross_entropy(logits, soft).double(), by_label.mean(), atol=1e-5)


@pytest.mark.parametrize("alpha", [0.2, 2.0])
def test_mixing_weights_follow_the_beta_distribution(alpha):
    """lam drawn for 20,000 samples has Beta(alpha, alpha)'s mean 1/2 and variance 1 / (4 (2 alpha + 1))."""
    u = uniforms(0, 0, torch.arange(20_000))
    lam = beta(alpha, u[:, 8 : 8 + 74])
    assert lam.min() >= 0 and lam.max() <= 1
    assert abs(lam.mean().item() - 0.5) < 0.01
    variance = 1 / (4 * (2 * alpha + 1))
    assert abs(lam.var().item() / variance - 1) < 0.04


def test_draws_depend_on_seed_epoch_and_sample_only():
    """A sample's partner, mixing and erasing are the same in any batch it lands in (so on any process and
    after a resume), and change with the epoch and the seed."""
    mixing = Mixing(mixup=0.2, cutmix=1.0, erase=0.5)
    whole = draws(mixing, 7, 2, INDICES, 16, 16)
    some = torch.tensor([300, 5, 77])
    alone = draws(mixing, 7, 2, some, 16, 16)
    assert torch.equal(alone["lam"], whole["lam"][some])
    boxes = zip(alone["erase"] + alone["box"], whole["erase"] + whole["box"], strict=True)
    assert all(torch.equal(a, w[some]) for a, w in boxes)
    assert torch.equal(partner(7, 2, some, 1000, 1.0)[0], partner(7, 2, INDICES, 1000, 1.0)[0][some])
    assert not torch.equal(draws(mixing, 7, 3, INDICES, 16, 16)["lam"], whole["lam"])
    assert not torch.equal(draws(mixing, 8, 2, INDICES, 16, 16)["lam"], whole["lam"])


def test_random_erasing_boxes_are_torchvisions():
    """Erased boxes take 2-33% of the image at aspect ratios 0.3-3.3, lie inside it, and are drawn for
    data.random_erase of the samples."""
    drawn = draws(Mixing(erase=0.4), 0, 0, torch.arange(4000), 32, 32)
    y0, y1, x0, x1 = drawn["erase"]
    erased = (y1 > y0) & (x1 > x0)
    assert abs(erased.double().mean().item() - 0.4) < 0.03
    h, w = (y1 - y0)[erased].double(), (x1 - x0)[erased].double()
    assert h.mul(w).min() >= 0.02 * 1024 - 2 * 32 and h.mul(w).max() <= 0.33 * 1024 + 2 * 32  # rounding of sides
    assert (h / w).min() > 0.3 * 0.6 and (h / w).max() < 3.3 / 0.6
    assert y0.min() >= 0 and x0.min() >= 0 and y1.max() <= 32 and x1.max() <= 32
    images = mix(torch.ones(4000, 3, 32, 32), torch.ones(4000, 3, 32, 32), drawn)
    assert torch.equal((images == 0).sum(dim=(1, 2, 3)), 3 * (y1 - y0) * (x1 - x0))


@pytest.mark.parametrize("augment", ["trivial", "randaugment", "rand-m9-mstd0.5-inc1"])
def test_each_policy_is_deterministic_for_a_seed_and_leaves_the_callers_generators_alone(augment):
    """The same (seed, epoch, sample) gives the same image, another epoch another one, and drawing it changes
    neither torch's, Python's nor numpy's generator of the training process."""
    cfg = DataConfig(augment=augment, image_size=32)
    images = SyntheticImages(16, transform=build_transforms(cfg, train=True))
    train = SeededAugmentation(images, seed=0, augment=augment)
    generators = torch.manual_seed, random.seed, np.random.seed
    [seed(1) for seed in generators]
    expected = torch.rand(3), random.random(), np.random.rand()
    [seed(1) for seed in generators]
    first = [train[(0, i)][0] for i in range(16)]
    assert torch.equal(torch.rand(3), expected[0]) and (random.random(), np.random.rand()) == expected[1:]
    assert all(torch.equal(a, train[(0, i)][0]) for i, a in enumerate(first))
    assert sum(not torch.equal(a, train[(1, i)][0]) for i, a in enumerate(first)) >= 12


def test_timms_randaugment_runs_at_its_top_magnitude():
    """timm's increasing posterize keeps 0 bits at magnitude 10, which rand-m9-mstd0.5 reaches; Pillow 13
    refuses 0 bits, so the timm extra keeps Pillow below 13. 300 images at magnitude 10 meet it."""
    transform = policy("rand-m10-inc1", 8)
    random.seed(0)
    np.random.seed(0)
    images = torch.randint(256, (300, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert all(transform(image).shape == (3, 8, 8) for image in images)


def test_workers_and_the_device_mix_each_sample_with_the_same_partner():
    """A training item (workers) and a device batch carry the same partner for each sample, or the sample
    itself when it is not mixed; random erasing alone ships no partner."""
    synthetic = SyntheticImages(64)
    mixing = Mixing(cutmix=1.0, prob=0.5)
    items = SeededAugmentation(synthetic, seed=3, augment="none", mixing=mixing)
    device = DeviceImageSet(synthetic.images, synthetic.targets, torch.device("cpu"), seed=3, mixing=mixing)
    indices = torch.arange(64)
    _, targets, (epochs, keys), others, other_targets = device.batch(5, indices)
    assert torch.equal(epochs, torch.full((64,), 5)) and torch.equal(keys, indices)
    chosen, mixed = partner(3, 5, indices, 64, 0.5)
    assert 16 < mixed.sum() < 48
    for i in range(64):
        image, target, key, other, other_target = items[(5, i)]
        assert key == (5, i) and target == targets[i]
        j = int(chosen[i]) if mixed[i] else i
        assert torch.equal(other, synthetic.images[j]) and torch.equal(others[i], synthetic.images[j])
        assert other_target == synthetic.targets[j] == other_targets[i]
    erasing = SeededAugmentation(synthetic, seed=3, augment="none", mixing=Mixing(erase=0.5))
    assert len(erasing[(0, 0)]) == 3


def test_batch_partners_mix_each_batch_with_itself_reversed():
    """data.mix_partner=batch: items carry no partner, and the loss mixes the batch with itself reversed,
    against labels mixed alike."""
    cfg = load_config(SPEC, [], [*TINY, "data.cutmix=1.0", "data.mix_partner=batch", "data.augment=none"])
    task = Task(cfg, torch.device("cpu"))
    train, _ = task.datasets()
    batch = default_collate([train[(2, i)] for i in range(8)])
    assert len(batch) == 3
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 10))
    loss, samples = task.loss(model, batch)
    images, targets = task.inputs(batch[0]), batch[1]
    drawn = draws(task.mixing, cfg.run.seed, 2, torch.arange(8), 16, 16)
    assert drawn["cutmix"].all() and (drawn["lam"] < 1).any()
    soft = soft_targets(targets, targets.flip(0), drawn["lam"], 10, 0.0)
    assert torch.equal(loss, soft_cross_entropy(model(mix(images, images.flip(0), drawn)), soft)) and samples == 8


def test_a_timm_policy_on_the_device_loader_is_refused_in_one_line():
    cfg = load_config(SPEC, [], [*TINY, "data.augment=rand-m9-mstd0.5-inc1", "data.loader=device"])
    task = Task(cfg, torch.device("cpu"))
    with pytest.raises(ConfigError, match="data.loader=device: data.augment=rand-m9-mstd0.5-inc1 is timm's"):
        task.device_sets(*task.datasets())
