"""Typed configuration: dataclasses with a doc per field, YAML files and dotted overrides.

    python -m PACKAGE.train --config configs/default.yaml trainer.max_epochs=5 data.batch_size=64

Later sources win: dataclass defaults < each --config file in order < key=value overrides.
Any mistake (unknown key, wrong type, value not allowed, impossible combination, missing data)
raises ConfigError, which the entry points turn into one line on stderr and exit status 2.

The engine's sections are declared here; the task's data: and model: sections, its allowed values,
checks and defaults come from the TaskSpec a command passes in (load_config(SPEC, ...)): this module
never looks the task up. config_class(spec) is the whole config's type for that spec, made once.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import itertools
import math
import os
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .errors import ConfigError
from .monitor import check_monitor
from .seam import DataBase, ModelBase, TaskSpec

DEFAULT_TRACKER = "{{ cookiecutter.tracker }}"


@dataclass
class RunConfig:
    output_dir: str = "runs/default"
    """Directory for everything this run writes: metrics.jsonl, checkpoints/, config.yaml, export/."""
    seed: int = 0
    """One seed for python, numpy, torch and the DataLoader workers."""
    deterministic: bool = False
    """Deterministic kernels only (cudnn.deterministic, use_deterministic_algorithms); slower."""
    device: str = "auto"
    """auto (CUDA when available, else CPU), cpu or cuda."""
    cache_cpu_memory: bool = True
    """CPU on Linux: reuse freed memory in the next step, not return it to the system (faster; keeps the peak)."""


@dataclass
class OptimConfig:
    lr: float = 2e-3
    """Peak learning rate of AdamW, reached after the warmup."""
    weight_decay: float = 0.05
    """AdamW decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW's (beta1, beta2): decay rates of the running mean of the gradients and of their squares.
    torch's default (0.9, 0.999) averages the squares over about 1000 steps; a smaller beta2 (0.95, or
    0.99 for small models) remembers fewer steps, so the step size shrinks quickly when a rarely seen
    parameter's gradient spikes instead of dividing it by a stale, small average. Each task's
    configs/default.yaml sets its own default and says why."""
    warmup_steps: int = 50
    """Optimizer steps of linear warmup from 0 to optim.lr; cosine decay follows."""
    min_lr_ratio: float = 0.01
    """Learning rate at the end of the cosine decay, as a fraction of optim.lr."""
    layer_decay: float = 1.0
    """Layer-wise learning-rate decay: the output layer trains at optim.lr, each layer below it at layer_decay
    times the rate of the one above (fine-tuning pretrained models: 0.65-0.85); 1: off. Needs a model whose
    layers the task can order."""
    ema_decay: float = 0.0
    """0: off. Otherwise keep an exponential moving average of the weights (decay per optimizer step, ramped
    up as min(ema_decay, (1 + step) / (10 + step))); validation, best.safetensors, evaluate and export use it."""


@dataclass
class TrainerConfig:
    max_epochs: int = 3
    """Stop after this many epochs (or at trainer.max_steps, whichever comes first)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps; null means no limit."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; each micro-batch loss is scaled by 1/grad_accum_steps."""
    precision: str = "fp32"
    """fp32, bf16 (autocast) or fp16 (autocast with a gradient scaler; CUDA only)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off."""
    checkpoint_every: int = 500
    """Optimizer steps between checkpoints (one is also written after every epoch)."""
    keep_last: int = 3
    """Checkpoints kept in output_dir/checkpoints; older ones are deleted once a newer one is verified."""
    resume: str = "auto"
    """auto (newest valid checkpoint in output_dir, if any), never, or a checkpoint path; later ones are renamed.
    A resumed run may change only the keys rundir.may_change allows (docs: configuration)."""
    override_optim: bool = False
    """On resume, apply this config's optim.* and trainer.grad_clip to the restored optimizer and scheduler
    (e.g. a lower optim.lr after a divergence) instead of refusing the change."""
    log_every: int = 10
    """Optimizer steps between train/loss lines in metrics.jsonl."""
    val_every: int | None = None
    """Optimizer steps between validations; null: after every epoch only. One also runs at the end of
    every epoch and of training."""
    detect_anomaly: bool = False
    """Autograd anomaly detection: a NaN names the operation that made it (slow; for debugging only)."""
    monitor: str | None = None
    """The validation metric that picks best.safetensors and best.json (and early stopping); null: the
    task's own (its TaskSpec.monitor)."""
    monitor_mode: str | None = None
    """max (higher is better) or min; null: the metric's own direction (TaskSpec.metrics)."""
    early_stop_patience: int = 0
    """Stop after this many validations in a row without a better trainer.monitor (0: never stop early)."""
    eval_tasks: list[str] = field(default_factory=list)
    """Benchmarks scored at validation time, for a task that has them (lm-evaluation-harness task names, e.g.
    [hellaswag,arc_easy]), logged as eval/TASK/METRIC beside val/loss; trainer.monitor may name one."""
    eval_every: int | None = None
    """Optimizer steps between benchmark scorings, a multiple of trainer.val_every; null: every validation."""
    eval_limit: float | None = None
    """Items per benchmark task: a count, or a fraction below 1; null: all of them."""
    eval_include: str | None = None
    """A folder of your own task YAMLs for trainer.eval_tasks (the harness's include path)."""
    eval_task_data: dict[str, str] = field(default_factory=dict)
    """Local copies of trainer.eval_tasks' data, {TASK: PATH}: a save_to_disk folder, .jsonl or .parquet."""
    checkpoint_format: str = "auto"
    """sharded (a directory checkpoints/step_N/: every process writes its own shards in parallel, no full
    gather), full (one file checkpoints/step_N.pt gathered on the main process) or auto (sharded under
    FSDP, full otherwise). Either format resumes on any number of processes."""
    async_checkpoint: bool = False
    """Write checkpoints in the background while training goes on (at most one in flight; sharded only)."""
    profile_steps: list[int] | None = None
    """[a, b]: record optimizer steps a..b (counted from 1) with torch.profiler, one Chrome/Perfetto trace per
    process under run.output_dir/profile/ (on CUDA also a memory snapshot); null: off."""


@dataclass
class TrackerConfig:
    name: str = DEFAULT_TRACKER
    """none, wandb, tensorboard or mlflow; metrics.jsonl is written in every case."""
    project: str | None = None
    """wandb project or MLflow experiment (defaults to the package name)."""
    entity: str | None = None
    """wandb team or user that owns the project (defaults to your wandb default entity); wandb only."""
    run_name: str | None = None
    """Run name shown by the tracker (defaults to the output_dir's name)."""
    tags: list[str] = field(default_factory=list)
    """Run tags, e.g. tracker.tags=[baseline,v2]; MLflow also takes key=value. The wandb mode comes
    from WANDB_MODE (online, offline, disabled) and the API key from WANDB_API_KEY or `wandb login`, the
    MLflow store from MLFLOW_TRACKING_URI (else output_dir/mlruns/), never from here."""


@dataclass
class DistributedConfig:
    strategy: str = "auto"
    """auto (fsdp under accelerate's FSDP config, else ddp when more than one process, none when one),
    none, ddp or fsdp."""
    backend: str = "auto"
    """auto (nccl on CUDA, gloo on CPU), nccl or gloo."""
    timeout_s: int = 600
    """Seconds a collective may wait before the job fails, so a dead peer cannot hang it."""
    sync_batchnorm: bool = False
    """BatchNorm statistics over the global batch (torch's SyncBatchNorm needs CUDA)."""
    replicate_degree: int = 1
    """FSDP only: HSDP, sharding within groups of world_size / replicate_degree processes (one node, say)
    and replicating across replicate_degree groups; 1 is plain FSDP."""


@dataclass
class Config:
    """The whole configuration: the engine's sections and the task's data: and model: (see config_class)."""

    run: RunConfig = field(default_factory=RunConfig)
    data: DataBase = field(default_factory=DataBase)
    model: ModelBase = field(default_factory=ModelBase)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


@functools.cache  # one class per spec (TaskSpec hashes by identity), so configs of one task compare equal
def config_class(spec: TaskSpec) -> type[Config]:
    """Config with the task's data: and model: sections (spec.data, spec.model) in place of the bases."""
    sections = [(name, cls, field(default_factory=cls)) for name, cls in (("data", spec.data), ("model", spec.model))]
    return dataclasses.make_dataclass("Config", sections, bases=(Config,), namespace={"__module__": __name__})


CHOICES = {
    "run.device": ("auto", "cpu", "cuda"),
    "trainer.precision": ("fp32", "bf16", "fp16"),
    "tracker.name": ("none", "wandb", "tensorboard", "mlflow"),
    "distributed.strategy": ("auto", "none", "ddp", "fsdp"),
    "distributed.backend": ("auto", "nccl", "gloo"),
    "trainer.checkpoint_format": ("auto", "sharded", "full"),
    "data.loader": ("auto", "device", "workers"),
}
MAX_WORKERS = 256  # DataLoader worker processes per training process
MAX_TIMEOUT_S = 7 * 24 * 3600
AT_LEAST_ONE = (
    "data.batch_size",
    "trainer.max_epochs",
    "trainer.grad_accum_steps",
    "trainer.checkpoint_every",
    "trainer.keep_last",
    "trainer.log_every",
    "distributed.timeout_s",
    "distributed.replicate_degree",
)


def choices(spec: TaskSpec) -> dict[str, tuple]:
    """The values each key may take: the engine's CHOICES and the task's."""
    return {**CHOICES, **spec.choices}


def at_least_one(spec: TaskSpec) -> tuple[str, ...]:
    """The keys that must be at least 1: the engine's AT_LEAST_ONE and the task's (after data.batch_size,
    so that the data section's keys are checked, and listed, together)."""
    return (AT_LEAST_ONE[0], *spec.at_least_one, *AT_LEAST_ONE[1:])


def with_stored_defaults(stored: dict, defaults: dict[str, object]) -> dict:
    """A checkpoint's stored config, with defaults (TaskSpec.stored_defaults) for the keys it predates."""
    filled = {section: dict(values) if isinstance(values, dict) else values for section, values in stored.items()}
    for key, value in defaults.items():
        section, leaf = key.split(".")
        if isinstance(filled.get(section), dict):
            filled[section].setdefault(leaf, value)
    return filled


def load_config(
    spec: TaskSpec, config_files: list[str | Path] = (), overrides: list[str] = (), base: dict | None = None
) -> Config:
    """Merge defaults, base (a stored config), YAML files and key=value overrides into a validated config of
    the task that spec declares."""
    merged = _defaults(spec)
    try:
        if base:
            merged = OmegaConf.merge(merged, base)
        for path in config_files:
            merged = OmegaConf.merge(merged, read_yaml(Path(path)))
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r}: write it as key=value, e.g. trainer.max_epochs=5")
            try:
                dotted = OmegaConf.from_dotlist([item])
            except yaml.YAMLError as err:  # e.g. tracker.tags=[a,b
                problem = getattr(err, "problem", None) or str(err).splitlines()[0]
                raise ConfigError(f"override {item!r}: not a valid YAML value ({problem})") from None
            merged = OmegaConf.merge(merged, dotted)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(_explain(err, spec)) from None
    validate(cfg, spec)
    return cfg


def _defaults(spec: TaskSpec):
    """The dataclass defaults with the task's own defaults for the shared sections (TaskSpec.defaults)."""
    return OmegaConf.merge(OmegaConf.structured(config_class(spec)), spec.defaults)


def read_yaml(path: Path, sections: str = "run:, data:, ..."):
    """A YAML file of sections as an OmegaConf mapping; ConfigError naming the file otherwise."""
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        loaded = OmegaConf.load(path)
    except Exception as err:  # yaml's errors are several classes; all mean the same to the user
        first_line = str(err).strip().splitlines()[0]
        raise ConfigError(f"--config {path}: not valid YAML ({first_line})") from None
    if not OmegaConf.is_dict(loaded):
        raise ConfigError(f"--config {path}: expected a mapping of sections ({sections})")
    return loaded


def _explain(err: OmegaConfBaseException, spec: TaskSpec) -> str:
    key = getattr(err, "full_key", None) or "config"
    first_line = str(getattr(err, "msg", None) or err).splitlines()[0]
    if "not in" in first_line:
        keys = all_keys(spec)
        close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
        if not close:  # e.g. "lr=0.1" for "optim.lr"
            leaf = key.rsplit(".", 1)[-1]
            close = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
        hint = f"did you mean {close[0]}?" if close else f"known sections: {', '.join(SECTIONS)}"
        if key.startswith("tracker.") and "key" in key.lower():
            return f"{key}: unknown key; the wandb API key is read from WANDB_API_KEY or `wandb login`, never config"
        return f"{key}: unknown key; {hint}"
    expected = _field_type(key, spec)
    if expected:
        return f"{key}: expected {expected} ({first_line})"
    return f"{key}: {first_line}"


SECTIONS = tuple(f.name for f in dataclasses.fields(Config))


def leaves(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field, type]]:
    """(dotted key, field, the dataclass declaring it) of every leaf under a config dataclass: a field
    whose default is itself a dataclass (model.lora) is a group of keys, listed leaf by leaf."""
    found = []
    for leaf in dataclasses.fields(cls):
        if dataclasses.is_dataclass(leaf.default_factory):
            found += leaves(leaf.default_factory, f"{prefix}{leaf.name}.")
        else:
            found.append((f"{prefix}{leaf.name}", leaf, cls))
    return found


def all_keys(spec: TaskSpec) -> list[str]:
    """Every dotted key of the task's config, e.g. data.batch_size, model.lora.r."""
    return [key for key, _, _ in leaves(config_class(spec))]


def _field_type(key: str, spec: TaskSpec) -> str | None:
    return next((str(leaf.type) for name, leaf, _ in leaves(config_class(spec)) if name == key), None)


def _get(cfg: Config, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def validate(cfg: Config, spec: TaskSpec) -> None:
    """Refuse values that are not allowed and combinations that cannot work, naming the key."""
    for key, allowed in choices(spec).items():
        if _get(cfg, key) not in allowed:
            listed = ", ".join("null" if choice is None else str(choice) for choice in allowed)
            raise ConfigError(f"{key}={_get(cfg, key)!r} is not allowed; choose one of {listed}")
    for key in at_least_one(spec):
        if _get(cfg, key) is not None and _get(cfg, key) < 1:  # null: the task's validate sets it
            raise ConfigError(f"{key}={_get(cfg, key)} must be at least 1")
    if not 0 <= cfg.run.seed < 2**31:
        raise ConfigError(f"run.seed={cfg.run.seed} must be between 0 and 2**31 - 1")
    for key in ("optim.lr", "optim.weight_decay", "optim.min_lr_ratio", "trainer.grad_clip"):
        if not math.isfinite(_get(cfg, key)):
            raise ConfigError(f"{key}={_get(cfg, key)} must be a finite number")
    if cfg.data.num_workers < 0:
        raise ConfigError(f"data.num_workers={cfg.data.num_workers} must be 0 or more")
    if cfg.data.num_workers > MAX_WORKERS:
        raise ConfigError(
            f"data.num_workers={cfg.data.num_workers} is too many (each is a process); use at most {MAX_WORKERS}, "
            f"typically the CPU cores per process ({os.cpu_count()} cores here)"
        )
    if cfg.distributed.timeout_s > MAX_TIMEOUT_S:
        raise ConfigError(
            f"distributed.timeout_s={cfg.distributed.timeout_s} is longer than {MAX_TIMEOUT_S} s (7 days); "
            "a hung peer would hold the job that long"
        )
    if not cfg.run.output_dir.strip():
        raise ConfigError("run.output_dir is empty; name a directory, e.g. run.output_dir=runs/exp1")
    for key in ("trainer.max_steps", "trainer.val_every"):
        if _get(cfg, key) is not None and _get(cfg, key) < 1:
            raise ConfigError(f"{key}={_get(cfg, key)} must be at least 1, or null")
    if cfg.optim.lr <= 0 or cfg.optim.weight_decay < 0 or cfg.optim.warmup_steps < 0:
        raise ConfigError("optim.lr must be > 0, optim.weight_decay and optim.warmup_steps >= 0")
    betas = cfg.optim.betas
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ConfigError(
            f"optim.betas={list(betas)} must be two numbers in [0, 1): (beta1, beta2), e.g. optim.betas=[0.9,0.95]"
        )
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} must be between 0 and 1")
    if cfg.trainer.grad_clip < 0:
        raise ConfigError("trainer.grad_clip must be >= 0 (0 turns clipping off)")
    check_monitor(cfg.trainer, spec)
    if not 0.0 < cfg.optim.layer_decay <= 1.0:
        raise ConfigError(f"optim.layer_decay={cfg.optim.layer_decay} must be above 0 and at most 1 (1: off)")
    if not 0.0 <= cfg.optim.ema_decay < 1.0:
        raise ConfigError(f"optim.ema_decay={cfg.optim.ema_decay} must be 0 (off) or between 0 and 1, e.g. 0.999")
    profile = cfg.trainer.profile_steps
    if profile is not None and (len(profile) != 2 or not 1 <= profile[0] <= profile[1]):
        raise ConfigError(
            f"trainer.profile_steps={list(profile)} must be two optimizer steps [a, b] with 1 <= a <= b, "
            "e.g. trainer.profile_steps=[10,15], or null"
        )
    if cfg.trainer.early_stop_patience < 0:
        raise ConfigError(f"trainer.early_stop_patience={cfg.trainer.early_stop_patience} must be 0 (off) or more")
    if cfg.trainer.async_checkpoint and cfg.trainer.checkpoint_format == "full":
        raise ConfigError(
            "trainer.async_checkpoint=true writes sharded checkpoints; set trainer.checkpoint_format=sharded or auto"
        )
    if cfg.trainer.resume not in ("auto", "never") and not Path(cfg.trainer.resume).exists():
        raise ConfigError(f"trainer.resume={cfg.trainer.resume!r}: no such file; use auto, never or a checkpoint path")

    cuda = torch.cuda.is_available()
    if cfg.run.device == "cuda" and not cuda:
        raise ConfigError("run.device=cuda but no CUDA device is visible; use run.device=auto or cpu")
    on_cuda = cuda and cfg.run.device != "cpu"
    if cfg.trainer.precision == "fp16" and not on_cuda:
        raise ConfigError("trainer.precision=fp16 needs a CUDA device; use bf16 or fp32 on CPU")
    if cfg.distributed.sync_batchnorm and not on_cuda:
        raise ConfigError("distributed.sync_batchnorm=true needs CUDA (torch's SyncBatchNorm refuses CPU tensors)")
    if cfg.distributed.backend == "nccl" and not on_cuda:
        raise ConfigError("distributed.backend=nccl needs CUDA; use gloo or auto on CPU")
    spec.validate(cfg)


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (what config.yaml in the run directory holds)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    """The resolved config as plain Python types (safe to store in a checkpoint)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg))


@functools.cache  # read from the source once per class (--help asks per key)
def field_docs(cls) -> dict[str, str]:
    """The docstring written under each field of a config dataclass (a subclass's wins over its base's)."""
    docs = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        docs.update(
            (node.target.id, doc.value.value)
            for node, doc in itertools.pairwise(body)
            if isinstance(node, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
        )
    return docs


def help_text(spec: TaskSpec, program: str) -> str:
    """Usage plus every key with its default and documentation."""
    checkpoint = " [--checkpoint PATH]" if not program.endswith(".train") else ""
    lines = [
        f"usage: python -m {program}{checkpoint} [--config FILE.yaml ...] [section.key=value ...]",
        "",
        "Keys (default) and meaning:",
    ]
    defaults = OmegaConf.to_object(_defaults(spec))
    for key, leaf, owner in leaves(config_class(spec)):
        lines.append(f"  {key} ({_get(defaults, key)!r})\n      {field_docs(owner).get(leaf.name, '')}")
    if program.endswith(".evaluate") and (spec.evaluate_flags or spec.evaluate_options):
        lines += ["", "Options of this task:"]
        lines += [f"  {name}\n      {text}" for name, text in spec.evaluate_flags.items()]
        lines += [f"  {name} VALUE\n      {text}" for name, text in spec.evaluate_options.items()]
    return "\n".join(lines)


def parse_args(spec: TaskSpec, argv: list[str], program: str) -> tuple[list[str], list[str]]:
    """Split argv into --config files and key=value overrides; --help prints every key of the task's config."""
    files, overrides = [], []
    args = iter(argv)
    for arg in args:
        if arg in ("-h", "--help"):
            try:
                print(help_text(spec, program), flush=True)
            except BrokenPipeError:  # `--help | head` stopped reading: not an error
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(0)
        if arg == "--config":
            path = next(args, None)
            if path is None:
                raise ConfigError("--config needs a file name")
            files.append(path)
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg}; options are --config FILE and key=value overrides")
        else:
            overrides.append(arg)
    return files, overrides
