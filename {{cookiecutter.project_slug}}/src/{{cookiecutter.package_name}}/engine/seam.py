"""The one interface between the engine and a task, declared once.

A task is the folder PACKAGE/task/. It declares two things, and the engine reads nothing else from
it; nothing in engine/ imports task/. The command modules (PACKAGE/train.py, evaluate.py, ...) are
the one place that names both: they import the two and hand them to the engine as arguments
(load_config(SPEC, ...), train(cfg, SPEC, Task), ...):

- task/config.py's ``SPEC``, a `TaskSpec`: what the task declares without running anything,
  its data: and model: config sections (subclasses of `DataBase` and `ModelBase`, whose keys the
  engine itself reads), allowed values and checks, its validation metrics and their directions,
  the keys a resumed run may change, what a checkpoint restores, its plot panel and its
  out-of-memory hint;
- task/task.py's ``Task``, a subclass of `Task` below: the data sets, the model, the loss of a
  micro-batch, validation and an export example. The methods without a body here are the ones
  every task writes; the others have defaults.

docs/tasks.md walks through a complete task; the template's tests bake it and train it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from .errors import ConfigError

if TYPE_CHECKING:
    from pathlib import Path

    from torch.utils.data import DataLoader, Dataset

    from .config import Config


@dataclass
class DataBase:
    """The data: keys the engine reads; a task's data config subclasses it (and may change the defaults)."""

    batch_size: int = 32
    """Samples per process per micro-batch; the global batch is batch_size x world size x grad_accum_steps."""
    loader: str = "auto"
    """device (both sets on the training device, batches gathered there, no workers), workers (a DataLoader,
    data.num_workers processes) or auto (device when the task's sets take at most a quarter of the device's
    memory, of RAM on a CPU; the log says which it chose)."""
    num_workers: int = 0
    """DataLoader worker processes per training process (0 loads in the main process)."""


@dataclass
class ModelBase:
    """The model: keys the engine reads; a task's model config subclasses it."""

    compile: bool = False
    """torch.compile the model (the first steps are slow while it compiles)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them: less memory, about a third
    more compute per step."""


@dataclass(frozen=True, eq=False)  # one object per task: equal and hashed by identity (config_class caches on it)
class TaskSpec:
    """What a task declares about itself without running anything (task/config.py's SPEC)."""

    data: type[DataBase]
    """The data: section, a dataclass with a docstring under each field (they drive --help and the docs)."""
    model: type[ModelBase]
    """The model: section, likewise."""
    metrics: dict[str, str]
    """Validation metrics trainer.monitor may name, each with the direction it improves in (min or max)."""
    monitor: str
    """The metric that picks best.safetensors when trainer.monitor is null; one of `metrics`."""
    validate: Callable[[Config], None] = lambda cfg: None
    """Refuse combinations of the task's keys that cannot work (raise ConfigError naming the key)."""
    choices: dict[str, tuple] = field(default_factory=dict)
    """Values a task key may take, e.g. {"data.name": ("synthetic", "folder")}."""
    at_least_one: tuple[str, ...] = ()
    """Task keys that must be at least 1."""
    defaults: dict = field(default_factory=dict)
    """Defaults of the shared sections that differ for this task, e.g. {"optim": {"lr": 6e-3}}."""
    from_checkpoint: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """What a checkpoint's stored config sets in evaluate and export (section -> keys): what rebuilds the
    model and the data it was trained on, never a place or how to run."""
    inference_only: tuple[str, ...] = ()
    """Overrides evaluate and export apply to a --config file: training-only settings that may be gone."""
    resume_may_change: tuple[str, ...] = ()
    """Task keys a resumed run may change (a data folder moved, say): none may change what is trained."""
    stored_defaults: dict[str, object] = field(default_factory=dict)
    """Values of task keys newer than some checkpoints, as those checkpoints were trained ("section.key" ->
    value): a stored config that lacks the key is read with this value, not with today's default."""
    memory_hint: str = "a smaller model"
    """What else to try when even data.batch_size=1 runs out of memory (names task keys)."""
    plot_panel: tuple[str, tuple[tuple[str, str], ...]] = ("Validation", ())
    """PACKAGE.plot's validation panel: (y label, ((metrics.jsonl key, line label), ...))."""
    evaluate_flags: dict[str, str] = field(default_factory=dict)
    """The evaluate command's own switches of this task ({"--switch": "what it does"}), handed to Task.evaluate."""
    benchmarks: Callable[[str], str] | None = None
    """For a task whose Task.benchmarks scores trainer.eval_tasks: the direction (min or max) a benchmark's
    metric improves in, by its name (trainer.monitor may name eval/TASK/METRIC); None: no benchmarks (the
    trainer.eval_* keys are refused)."""
    evaluate_options: dict[str, str] = field(default_factory=dict)
    """The evaluate command's own options that take a value ({"--option": "what it sets"}: --option VALUE or
    --option=VALUE), handed to Task.evaluate."""

    def __post_init__(self):
        if self.monitor not in self.metrics:
            raise ValueError(f"TaskSpec.monitor={self.monitor!r} is not one of its metrics {list(self.metrics)}")


class Task(abc.ABC):
    """What the engine calls on the task while training, evaluating and exporting (task/task.py's Task).

        task = Task(cfg, device)
        train_set, val_set = task.datasets()        # also learns what the model's shape depends on
        model = task.build_model(device, shard)     # on that device, initialised from run.seed; shard: FSDP
        loss, samples = task.loss(model, batch)     # one micro-batch: to the device, forward, loss
        weight = task.loss_weight(batch)            # optional: what that loss is a mean over
        metrics = task.validate(model, loader)      # exact over every process; SPEC.metrics among them
        args, shapes = task.export_example()        # the model's input and its dynamic dimensions

    The training set is indexed by the (epoch, index) keys of loaders.ResumableSampler, so a random draw
    made per sample (augmentation, a window's offset) is the same for any number of processes and
    after a resume.
    """

    def __init__(self, cfg: Config, device: torch.device):
        self.cfg, self.device = cfg, device

    @abc.abstractmethod
    def datasets(self) -> tuple[Dataset, Dataset]:
        """The training set (by (epoch, index) keys) and the validation set."""

    @abc.abstractmethod
    def build_model(self, device: torch.device | None = None, shard: Callable | None = None) -> nn.Module:
        """The model on `device` (default CPU), initialised from run.seed. Under FSDP, shard(model) must be
        applied on the meta device before any weight exists (meta_init.build does both)."""

    @abc.abstractmethod
    def loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, int]:
        """The mean loss of one micro-batch (moved to self.device here) and its number of samples."""

    def loss_weight(self, batch) -> int | None:
        """What loss(model, batch)'s mean is taken over (its counted targets, say), when an optimizer step should
        weigh its micro-batches by it: the engine then scales each micro-batch's loss by its share of the
        step's total over every micro-batch and process, so that accumulation and processes give one large
        batch's update. None (the default): every micro-batch weighs 1 / grad_accum_steps."""
        return None

    @abc.abstractmethod
    def validate(self, model: nn.Module, loader: DataLoader) -> dict:
        """The validation metrics over the whole set, exact for any number of processes: at least
        val/loss and every metric of SPEC.metrics. The model is in eval mode, under no_grad."""

    @abc.abstractmethod
    def export_example(self) -> tuple[tuple, tuple]:
        """An example input of the model and its dynamic dimensions, for torch.export."""

    def device_bytes(self, train_set: Dataset, val_set: Dataset) -> tuple[int, str | None]:
        """Bytes both sets would take on the device, and what speaks against data.loader=auto putting
        them there (None: nothing). By default the sets stay with DataLoader workers."""
        return 0, "this task keeps its data in DataLoader workers"

    def device_sets(self, train_set: Dataset, val_set: Dataset) -> tuple:
        """Both sets on the training device (data.loader=device), each with .batch(epoch, indices)."""
        raise ConfigError("data.loader=device: this task's data does not go on the device; use data.loader=workers")

    def param_settings(self, model: nn.Module, layer_decay: float) -> dict:
        """{parameter: (lr_scale, decays)} for the trainable parameters of the built model (outside DDP's and
        torch.compile's wrappers: its own parameter names) whose learning-rate scale or weight decay differ
        from the default (1.0; decay for matrices, none for biases and norms). optim.layer_decay below 1
        needs a task that can order its model's layers."""
        if layer_decay != 1.0:
            raise ConfigError(f"optim.layer_decay={layer_decay}: this task cannot order its model's layers; use 1")
        return {}

    def frozen_weights(self) -> dict | None:
        """After build_model: what identifies its frozen parameters (adapters over a frozen base), or None (the
        default) when every parameter trains. A dict {"config": {dotted key: value} that rebuilds them,
        "sha256": a hash of their values}. Checkpoints and best.safetensors then hold the trainable tensors
        only, with this entry: a resume, evaluate or export builds the base again from those keys (unless the
        command line names others) and refuses one whose hash differs."""
        return None

    def evaluate(
        self, model: nn.Module, loader, options: dict[str, str | None]
    ) -> tuple[dict, dict[str, Callable[[Path], None]]]:
        """The evaluate command's metrics (by default validate's) and its reports: {file name: write(path)},
        written by the main process into RUN/eval/. options: the TaskSpec.evaluate_flags given (value None)
        and the TaskSpec.evaluate_options given, with their values."""
        return self.validate(model, loader), {}

    def benchmarks(self, model: nn.Module, trainer) -> dict:
        """Scores of trainer.eval_tasks for the model (with trainer.eval_limit, eval_include, eval_task_data),
        as {eval/TASK/METRIC: value}, equal on every process; every process calls it (forwards of a sharded
        model are collectives), at validations trainer.eval_every names, and must leave the random
        generators as it found them. Only tasks with a TaskSpec.benchmarks are asked."""
        raise NotImplementedError

    def summary(self, metrics: dict) -> str:
        """The log line after a validation."""
        return " ".join(f"{key} {value:.4f}" for key, value in metrics.items() if isinstance(value, float))

    def throughput(self, samples_per_s: float) -> dict:
        """More perf/ figures for a training log line than perf/samples_per_s (e.g. perf/<unit>_per_s)."""
        return {}

    def model_files(self) -> dict[str, bytes]:
        """Files a trained model needs beside its weights (class names, an input encoding), by path relative to
        the run directory: written there when training starts (after datasets()) and into export/.
        By default none."""
        return {}

    def check_model_files(self, folder: Path) -> None:
        """Refuse (ConfigError, naming both) a run directory whose model files came from other data than
        datasets() read now: called before a resume and by evaluate. By default nothing to check."""
        return None

    def use_model_files(self, folder: Path) -> bool:
        """Learn what build_model needs from the model files under folder instead of from the data, so that
        export needs only a run directory; False (the default) when it cannot, and export calls datasets()."""
        return False

    # More formats for `export --format NAME` than the default (model.safetensors and model.pt2):
    # name -> what it writes, one line. export calls export_as for them.
    EXPORT_FORMATS: dict[str, str] = {}

    def export_as(self, fmt: str, model: nn.Module, folder: Path) -> Path:
        """Write the trained model (on the CPU, eval mode) in format fmt, one of EXPORT_FORMATS, under
        folder (the run's export/); return the path written."""
        raise ConfigError(f"export --format {fmt}: this task writes no such format")
