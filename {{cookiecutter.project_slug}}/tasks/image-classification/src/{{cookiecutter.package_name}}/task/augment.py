"""The training recipe's augmentations beyond crop and flip: an augmentation policy per image
(data.augment: TrivialAugmentWide, RandAugment or a timm rand-... string), and mixup, cutmix and
random erasing per batch on the device (data.mixup, data.cutmix, data.random_erase), with the
soft-target cross-entropy they train against.

Every random draw depends on (run.seed, epoch, sample index) only, never on a worker, a process or
a batch: a resumed run, another data.num_workers and another number of processes augment each
sample exactly alike. A mixed sample's partner is a sample of the whole training set drawn from the
same numbers (not its neighbour in a batch, which depends on how the batch is split over processes);
data.mix_partner=batch mixes each process's batch with itself reversed instead, as timm and
torchvision do: no second image to load, but N processes mix other pairs than 1 does.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.nn import functional as F
from torchvision.transforms import v2

from ..engine.errors import ConfigError
from ..engine.loaders import sample_bits

if TYPE_CHECKING:
    from .config import DataConfig

POLICIES = ("trivial", "randaugment")  # torchvision's, on uint8 tensors (workers or device)
AUGMENTS = ("none", "flip_crop", *POLICIES)  # and timm's rand-... strings (PIL images, workers only)
TIMM_POLICY = "rand-"


def augment_name(value: object) -> str:
    """data.augment as one of AUGMENTS or a timm string; the booleans of earlier releases keep their meaning
    (true: flip_crop, false: none), however the config file spelled them."""
    text = str(value).strip()
    return {"true": "flip_crop", "false": "none"}.get(text.lower(), text)


def check_augment(value: str) -> None:
    """A data.augment this release cannot run is refused in one line."""
    if value in AUGMENTS:
        return
    if not value.startswith(TIMM_POLICY):
        raise ConfigError(
            f"data.augment={value!r}: choose one of {', '.join(AUGMENTS)} or a timm RandAugment string "
            "such as rand-m9-mstd0.5-inc1 (true and false mean flip_crop and none)"
        )
    timm_policy(value, 224)  # timm parses it now, not in a worker


def crops_and_flips(value: str) -> bool:
    """Every data.augment but none crops and flips first, as torchvision's and timm's recipes do."""
    return value != "none"


def timm_policy(value: str, image_size: int):
    """timm's RandAugment of a rand-... string, on PIL images, with the settings timm's own training gives it
    (translations up to 45% of the side, fill with ImageNet's mean colour)."""
    try:
        from timm.data.auto_augment import rand_augment_transform
    except ImportError:
        raise ConfigError(
            f"data.augment={value}: timm's RandAugment strings need timm (pip install -e '.[timm]')"
        ) from None
    try:
        return rand_augment_transform(value, {"translate_const": int(image_size * 0.45), "img_mean": (124, 116, 104)})
    except Exception as err:  # timm raises AssertionError, KeyError or ValueError for a bad string
        raise ConfigError(f"data.augment={value!r}: timm cannot parse it ({err or type(err).__name__})") from None


def policy(value: str, image_size: int):
    """The per-image policy of data.augment (after the crop and flip), or None: on uint8 CHW tensors."""
    if value == "trivial":
        return v2.TrivialAugmentWide()
    if value == "randaugment":
        return v2.RandAugment()  # torchvision's defaults: 2 operations of magnitude 9 (of 31)
    if value.startswith(TIMM_POLICY):
        return v2.Compose([v2.ToPILImage(), timm_policy(value, image_size), v2.PILToTensor()])
    return None


@contextmanager
def seeded(seed: int, epoch: int, index: int, *, restore: bool = True) -> Iterator[None]:
    """Seed the generators the per-image transforms draw from (torch's CPU generator; Python's and
    numpy's global ones, which timm's policies use) for one sample of one epoch, and restore them after
    (restore=False: a DataLoader worker, whose generators serve only these transforms).

    The CPU generator only: torch.manual_seed would also seed every CUDA device, which before CUDA
    starts records a stack trace (about 1 ms a sample)."""
    value = ((seed * 1_000_003 + epoch) * 1_000_000_007 + index) % 2**63
    if not restore:
        _seed_all(value)
        yield
        return
    state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        _seed_all(value)
        try:
            yield
        finally:
            random.setstate(state[0])
            np.random.set_state(state[1])


def _seed_all(value: int) -> None:
    torch.default_generator.manual_seed(value)
    random.seed(value)
    np.random.seed(value % 2**32)


@dataclass(frozen=True)
class Mixing:
    """data.mixup, data.cutmix (Beta alphas; 0 off), data.mix_prob, data.mix_switch_prob and
    data.random_erase, applied on the device to normalised batches."""

    mixup: float = 0.0
    cutmix: float = 0.0
    prob: float = 1.0
    switch_prob: float = 0.5
    erase: float = 0.0
    partner: str = "set"  # data.mix_partner: set (a drawn sample of the whole set) or batch (the batch reversed)

    @classmethod
    def of(cls, data: DataConfig) -> Mixing:
        return cls(data.mixup, data.cutmix, data.mix_prob, data.mix_switch_prob, data.random_erase, data.mix_partner)

    @property
    def mixes(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0

    @property
    def ships_partners(self) -> bool:
        """Whether each sample comes with its partner (data.mix_partner=set), not mixed within its batch."""
        return self.mixes and self.partner == "set"

    @property
    def active(self) -> bool:
        return self.mixes or self.erase > 0


SALT = 0x5EED_1DEA  # the mixing draws' own stream, apart from the device loader's crop bits
STREAMS = 128  # uniform numbers per sample: see draws()
ERASE_TRIES = 10  # as torchvision's RandomErasing
GAMMA_TRIES = 12  # Marsaglia-Tsang accepts at least 95% of its tries for shape >= 1


def uniforms(seed: int, epoch: int, index: torch.Tensor) -> torch.Tensor:
    """STREAMS uniform numbers in [0, 1) per sample (float64, on index's device) from (seed, epoch, index)."""
    keys = index.to(torch.int64)[:, None] * STREAMS + torch.arange(STREAMS, device=index.device)
    return (sample_bits(seed + SALT, epoch, keys) >> 9).double() * 2.0**-53


def partner(seed: int, epoch: int, index: torch.Tensor, size: int, prob: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The sample each sample is mixed with (an index of the training set's size samples) and whether it is
    mixed at all (probability prob), from the same numbers as draws()."""
    u = uniforms(seed, epoch, index)
    return (u[:, 0] * size).long().clamp_(max=size - 1), u[:, 1] < prob


def beta(alpha: float, u: torch.Tensor) -> torch.Tensor:
    """Beta(alpha, alpha) from uniforms u (N x 6 * GAMMA_TRIES + 2): two Gamma(alpha) draws by
    Marsaglia and Tsang's method, vectorised over a fixed number of tries."""
    gammas = [_gamma(alpha, part) for part in u.split(u.shape[1] // 2, dim=1)]
    total = gammas[0] + gammas[1]
    return torch.where(total > 0, gammas[0] / total.clamp(min=1e-300), torch.full_like(total, 0.5))


def _gamma(alpha: float, u: torch.Tensor) -> torch.Tensor:
    boost = alpha < 1  # Gamma(a) = Gamma(a + 1) * U ** (1 / a)
    shape = alpha + 1 if boost else alpha
    d = shape - 1 / 3
    c = 1 / math.sqrt(9 * d)
    u1, u2, u3 = u[:, : 3 * GAMMA_TRIES].view(-1, GAMMA_TRIES, 3).unbind(-1)
    x = torch.sqrt(-2 * torch.log1p(-u1)) * torch.cos(2 * math.pi * u2)  # Box-Muller normals
    v = (1 + c * x) ** 3
    accepted = (v > 0) & (torch.log1p(-u3) < 0.5 * x * x + d - d * v + d * torch.log(v.clamp(min=1e-300)))
    first = accepted.float().argmax(dim=1, keepdim=True)  # the first accepted try (0 if none was)
    value = (d * v).gather(1, first).squeeze(1)
    if boost:
        value = value * (1 - u[:, 3 * GAMMA_TRIES]) ** (1 / alpha)
    return value


def draws(mixing: Mixing, seed: int, epoch: int, index: torch.Tensor, height: int, width: int) -> dict:
    """Each sample's mixing and erasing, drawn from (seed, epoch, index):

    lam (the share of the sample's own label), cutmix (a cutmix box rather than a mixup blend), box
    (y0, y1, x0, x1 of the partner's pasted region: the cutmix box, with lam its exact area share)
    and erase (y0, y1, x0, x1 of the region set to 0, the mean after normalisation; empty if none).
    """
    u = uniforms(seed, epoch, index)
    n = len(index)
    zero = torch.zeros(n, dtype=torch.long, device=index.device)
    mixed = (u[:, 1] < mixing.prob) & mixing.mixes
    if mixing.mixup > 0 and mixing.cutmix > 0:
        cutmix = u[:, 2] < mixing.switch_prob
    else:
        cutmix = torch.full_like(mixed, mixing.cutmix > 0)
    cutmix &= mixed
    gamma_u = u[:, 8 : 8 + 2 * (3 * GAMMA_TRIES + 1)]
    lam = torch.ones(n, dtype=torch.float64, device=index.device)
    if mixing.mixup > 0:
        lam = torch.where(mixed & ~cutmix, beta(mixing.mixup, gamma_u), lam)
    box = (zero, zero, zero, zero)
    if mixing.cutmix > 0:
        # timm's rand_bbox: a box of sides sqrt(1 - lam) times the image's around a uniform centre,
        # clipped to the image; lam is then the share the box leaves to the sample's own pixels.
        ratio = torch.sqrt(1 - beta(mixing.cutmix, gamma_u))
        cut_h, cut_w = (height * ratio).long(), (width * ratio).long()
        cy, cx = (u[:, 3] * height).long(), (u[:, 4] * width).long()
        y0, y1 = (cy - cut_h // 2).clamp(0, height), (cy + cut_h // 2).clamp(0, height)
        x0, x1 = (cx - cut_w // 2).clamp(0, width), (cx + cut_w // 2).clamp(0, width)
        box = tuple(torch.where(cutmix, side, zero) for side in (y0, y1, x0, x1))
        area = (box[1] - box[0]) * (box[3] - box[2])
        lam = torch.where(cutmix, 1 - area.double() / (height * width), lam)
    erase = (zero, zero, zero, zero)
    if mixing.erase > 0:
        erase = _erase_boxes(u[:, 5] < mixing.erase, u[:, 8 + 2 * (3 * GAMMA_TRIES + 1) :], height, width)
    return {"lam": lam, "cutmix": cutmix, "box": box, "erase": erase}


def _erase_boxes(on: torch.Tensor, u: torch.Tensor, height: int, width: int) -> tuple:
    """torchvision's RandomErasing boxes (area 2-33% of the image, aspect ratio 0.3-3.3, up to 10 tries
    for one that fits), vectorised; samples where `on` is false or no try fits get an empty box."""
    area, log_ratio, ty, tx = u[:, : 4 * ERASE_TRIES].view(-1, ERASE_TRIES, 4).unbind(-1)
    target = height * width * (0.02 + area * (0.33 - 0.02))
    aspect = torch.exp(math.log(0.3) + log_ratio * (math.log(3.3) - math.log(0.3)))
    h = torch.sqrt(target * aspect).round().long()
    w = torch.sqrt(target / aspect).round().long()
    fits = (h < height) & (w < width)
    first = fits.float().argmax(dim=1, keepdim=True)
    h, w = h.gather(1, first).squeeze(1), w.gather(1, first).squeeze(1)
    y0 = (ty.gather(1, first).squeeze(1) * (height - h + 1)).long()
    x0 = (tx.gather(1, first).squeeze(1) * (width - w + 1)).long()
    on = on & fits.any(dim=1)
    zero = torch.zeros_like(h)
    return tuple(torch.where(on, side, zero) for side in (y0, y0 + h, x0, x0 + w))


def _inside(box: tuple, height: int, width: int, device: torch.device) -> torch.Tensor:
    """N x 1 x H x W: whether each pixel lies in its sample's box."""
    y0, y1, x0, x1 = (side[:, None, None, None] for side in box)
    rows = torch.arange(height, device=device)[None, None, :, None]
    cols = torch.arange(width, device=device)[None, None, None, :]
    return (rows >= y0) & (rows < y1) & (cols >= x0) & (cols < x1)


def mix(images: torch.Tensor, partners: torch.Tensor, drawn: dict) -> torch.Tensor:
    """The batch mixed with its partners (normalised float images, N x C x H x W) and then erased."""
    height, width = images.shape[-2:]
    own = drawn["lam"].to(images.dtype)[:, None, None, None]
    pasted = _inside(drawn["box"], height, width, images.device)
    own = torch.where(drawn["cutmix"][:, None, None, None], (~pasted).to(images.dtype), own)
    images = images * own + partners * (1 - own)
    return images.masked_fill(_inside(drawn["erase"], height, width, images.device), 0.0)


def soft_targets(
    targets: torch.Tensor, partner_targets: torch.Tensor, lam: torch.Tensor, num_classes: int, smoothing: float
) -> torch.Tensor:
    """lam of the own label and 1 - lam of the partner's, each label smoothed as timm's mixup_target
    does (1 - e + e / C on the class, e / C elsewhere): every row sums to one."""
    off = smoothing / num_classes
    own = F.one_hot(targets, num_classes).double() * (1 - smoothing) + off
    other = F.one_hot(partner_targets, num_classes).double() * (1 - smoothing) + off
    lam = lam.double()[:, None]
    return own * lam + other * (1 - lam)


def soft_cross_entropy(logits: torch.Tensor, soft: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy against soft targets (N x C, rows summing to one); weight: a weight per class,
    as torch's cross_entropy applies it (data.balance=weights)."""
    soft = soft.to(torch.float32) if weight is None else soft.to(torch.float32) * weight
    return -(soft * F.log_softmax(logits.float(), dim=-1)).sum(dim=-1).mean()
