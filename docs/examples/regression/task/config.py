"""What the regression task declares to the engine (engine/seam.py's TaskSpec): its data: and
model: sections, their checks, its validation metrics and what a checkpoint restores.

The engine reads this module without running anything, so it imports no more than the seam needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..engine.errors import ConfigError
from ..engine.seam import DataBase, ModelBase, TaskSpec

if TYPE_CHECKING:
    from ..engine.config import Config


# Each field's docstring is its --help text and its line in the docs, so every key has one.
@dataclass
class DataConfig(DataBase):
    batch_size: int = 64  # the engine's key with this task's default; DataBase's docstring stays
    features: int = 8
    """Inputs per sample; y = sin(2 x . w) + noise, for a fixed random unit vector w."""
    noise: float = 0.1
    """Standard deviation of the noise on y; its square is the lowest reachable val/loss."""
    train_size: int = 4096
    """Training samples."""
    val_size: int = 1024
    """Validation samples (drawn apart from the training ones)."""


@dataclass
class ModelConfig(ModelBase):
    hidden: int = 64
    """Width of each hidden layer of the MLP."""
    layers: int = 2
    """Hidden layers of the MLP."""
    activation: str = "gelu"
    """gelu, relu or tanh."""


def validate(cfg: Config) -> None:
    """What `choices` and `at_least_one` cannot say; a ConfigError names the key (exit status 2)."""
    if not (math.isfinite(cfg.data.noise) and cfg.data.noise >= 0):
        raise ConfigError(f"data.noise={cfg.data.noise} must be a finite number, 0 or more")


SPEC = TaskSpec(
    data=DataConfig,
    model=ModelConfig,
    # Both are errors: lower is better. trainer.monitor may name either.
    metrics={"val/loss": "min", "val/mae": "min"},
    monitor="val/loss",
    validate=validate,
    choices={"model.activation": ("gelu", "relu", "tanh")},
    at_least_one=(
        "data.features",
        "data.train_size",
        "data.val_size",
        "model.hidden",
        "model.layers",
    ),
    # The shared sections' defaults suit a ResNet; a small MLP takes a higher learning rate, and
    # 64 steps an epoch a shorter warmup. 5 epochs end near the noise floor in seconds on a CPU.
    defaults={"optim": {"lr": 5e-3, "warmup_steps": 20}, "trainer": {"max_epochs": 5}},
    # evaluate and export rebuild the model and the validation set from these keys of the
    # checkpoint's stored config: a command line that omits them still measures the trained problem.
    from_checkpoint={
        "model": ("hidden", "layers", "activation"),
        "data": ("features", "noise", "train_size", "val_size"),
        "trainer": ("precision",),
    },
    # None: every key above changes the data or the model. A key that only says where the same
    # data lives (a folder that moved, say) would go here.
    resume_may_change=(),
    memory_hint="a smaller model.hidden",
    plot_panel=("mean absolute error", (("val/mae", "val MAE"),)),
)
