"""The regression task: y = sin(2 x . w) + noise, learned by a small MLP with mean squared error.

The engine calls it only through engine/seam.py's Task, and it uses the engine only through
relative imports, so this folder works in any baked project whatever its package is called.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ..engine import seam
from ..engine.loaders import in_lockstep
from ..engine.parallel import distributed, meta_init
from ..engine.step import autocast

# The data does not follow run.seed: runs with other seeds then learn the same problem, and
# evaluate and export (which restore only SPEC.from_checkpoint's keys) rebuild the same samples.
DATA_SEED = 0
ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "tanh": nn.Tanh}


def make_data(features: int, noise: float, size: int, split: int) -> TensorDataset:
    """`size` samples (x, y) of the function; each split has its own generator, so changing one
    split's size leaves the other's samples as they were."""
    w = torch.randn(features, 1, generator=torch.Generator().manual_seed(DATA_SEED))
    w /= w.norm()  # x . w is then a standard normal whatever data.features is
    generator = torch.Generator().manual_seed(DATA_SEED + 1 + split)
    x = torch.randn(size, features, generator=generator)
    y = torch.sin(2 * x @ w) + noise * torch.randn(size, 1, generator=generator)
    return TensorDataset(x, y)


class ByKey(Dataset):
    """The training set, read by ResumableSampler's (epoch, index) keys. A sample here draws nothing
    at random; a task that does (augmentation, noise per epoch) seeds the draw from the key, so it
    is the same for any number of processes and after a resume."""

    def __init__(self, samples: Dataset):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: tuple[int, int]):
        _epoch, index = key
        return self.samples[index]


# meta_init builds the model on the meta device (no memory), lets FSDP shard it, then fills each
# module from a generator seeded by (run.seed, its name): the same weights on 1 or N processes.
INIT_TYPES = (nn.Linear,)  # the modules with weights that init_module knows


def init_module(name: str, module: nn.Module, generator: torch.Generator) -> None:
    """torch's own nn.Linear initialisation, drawn from `generator`."""
    nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5), generator=generator)
    bound = 1 / math.sqrt(module.in_features)
    nn.init.uniform_(module.bias, -bound, bound, generator=generator)


class Task(seam.Task):
    """Regression with an MLP: mean squared error, validated as val/loss (MSE) and val/mae."""

    def datasets(self) -> tuple[Dataset, Dataset]:
        """The training set (by (epoch, index) keys) and the validation set, both (x, y) pairs."""
        data = self.cfg.data
        train = make_data(data.features, data.noise, data.train_size, split=0)
        return ByKey(train), make_data(data.features, data.noise, data.val_size, split=1)

    def build_model(self, device: torch.device | None = None, shard: Callable | None = None):
        """An MLP on `device` (default CPU), initialised from run.seed; shard (FSDP) is applied by
        meta_init before any weight exists. An nn.Sequential: the engine's FSDP wrapping and
        activation checkpointing take its children with weights as the blocks."""
        data, model, seed = self.cfg.data, self.cfg.model, self.cfg.run.seed

        def architecture() -> nn.Module:
            widths = [data.features] + [model.hidden] * model.layers
            layers: list[nn.Module] = []
            for width_in, width_out in itertools.pairwise(widths):
                layers += [nn.Linear(width_in, width_out), ACTIVATIONS[model.activation]()]
            return nn.Sequential(*layers, nn.Linear(widths[-1], 1))

        device = device or torch.device("cpu")
        built, _ = meta_init.build(architecture, init_module, INIT_TYPES, device, seed, shard)
        return built

    def loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, int]:
        """Mean squared error of one micro-batch and its number of samples (the engine weights the
        running train/loss by samples). The batch comes as the loader made it: moving it is ours."""
        x, y = (tensor.to(self.device, non_blocking=True) for tensor in batch)
        return F.mse_loss(model(x).float(), y), len(y)  # in float32 under bf16 autocast too

    def validate(self, model: nn.Module, loader: DataLoader) -> dict:
        """val/loss (MSE), val/mae and val/samples over the whole validation set.

        Each process holds a disjoint slice of it, so sums (not means) are added over the
        processes and divided once: the same numbers for any number of processes and batch size.
        """
        model.eval()
        # Squared errors, absolute errors, samples.
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        x = None
        with torch.no_grad(), autocast(self.device, self.cfg.trainer.precision):
            # Under FSDP a forward is a collective: a process with one batch fewer runs an uncounted
            # forward (batch None) while the others run their last one.
            for batch in in_lockstep(loader, self.device):
                if batch is None:
                    model(x)
                    continue
                x, y = (tensor.to(self.device, non_blocking=True) for tensor in batch)
                error = model(x).float() - y
                sums[0] += error.square().sum()
                sums[1] += error.abs().sum()
                sums[2] += len(y)
        distributed.all_reduce_sum(sums)
        squared, absolute, samples = sums.tolist()  # one host sync for the whole pass
        return {
            "val/loss": squared / samples,
            "val/mae": absolute / samples,
            "val/samples": int(samples),
        }

    def export_example(self) -> tuple[tuple, tuple]:
        """Two samples, with a dynamic batch dimension. torch.export fixes a dimension whose example
        size is 0 or 1 to that size, so an example of one sample would accept only one."""
        x = torch.zeros(2, self.cfg.data.features)
        return (x,), ({0: torch.export.Dim("batch", min=1, max=4096)},)
