"""The sweep file (configs/sweep.yaml): what to search, checked before any trial starts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..config import load_config, read_yaml
from ..errors import ConfigError, error_line
from ..monitor import monitored

if TYPE_CHECKING:
    from ..seam import TaskSpec

TYPES = ("float", "int", "categorical")
SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "none")


@dataclass
class SearchSpace:
    type: str = "float"
    """float, int or categorical."""
    low: float | None = None
    """float and int: the smallest value."""
    high: float | None = None
    """float and int: the largest value (included)."""
    step: float | None = None
    """float and int: values low, low + step, ... only (int: 1 when null)."""
    log: bool = False
    """float and int: sample the logarithm uniformly (learning rates); not with step."""
    choices: list[Any] | None = None
    """categorical: the values to choose from (numbers, strings, booleans or null)."""


@dataclass
class SamplerConfig:
    name: str = "tpe"
    """tpe (a model of good and bad values, after startup_trials random ones) or random."""
    seed: int = 0
    """Seed of the sampler; a resumed sweep continues with seed + the trials so far."""
    startup_trials: int = 4
    """tpe: random trials before the model chooses."""


@dataclass
class PrunerConfig:
    name: str = "median"
    """median (stop a trial worse than the median of the completed ones at the same validation) or none."""
    startup_trials: int = 2
    """Completed trials before any trial is pruned."""
    warmup_validations: int = 1
    """Validations of each trial that are never pruned (early ones say little)."""


@dataclass
class SweepConfig:
    study: str = "sweep"
    """Name of the study (in the journal)."""
    output_dir: str | None = None
    """Directory of the journal, summary.json and the trials' run directories; null: runs/sweep/<study>."""
    trials: int = 8
    """Trials that complete or are pruned; failed ones do not count."""
    config: list[str] = field(default_factory=lambda: ["configs/default.yaml"])
    """The training --config files every trial starts from."""
    overrides: list[str] = field(default_factory=list)
    """key=value overrides every trial gets (e.g. a shorter schedule)."""
    params: dict[str, SearchSpace] = field(default_factory=dict)
    """The search space: a dotted training key and its distribution."""
    enqueue: list[dict[str, Any]] = field(default_factory=list)
    """Values to try first, e.g. the current defaults as a baseline ({key: value} each)."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    pruner: PrunerConfig = field(default_factory=PrunerConfig)
    nproc_per_node: int | None = None
    """Processes per trial under torchrun (one per GPU); null: one plain process."""


def load_sweep(path: Path, overrides: list[str]) -> SweepConfig:
    """The sweep file merged with key=value overrides (trials=20, pruner.name=none), checked."""
    loaded = read_yaml(path, "study:, trials:, params:, ...")
    where = f"--config {path}"  # what an error is about: the file, or the override being merged
    try:
        merged = OmegaConf.merge(OmegaConf.structured(SweepConfig), loaded)
        for item in overrides:
            where = f"override {item!r}"
            if "=" not in item:
                raise ConfigError(f"{where}: write it as key=value, e.g. trials=20")
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        sweep = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "sweep"
        raise ConfigError(f"{where}: {key}: {str(err).splitlines()[0]}") from None
    sweep.output_dir = sweep.output_dir or f"runs/sweep/{sweep.study}"
    check(sweep)
    return sweep


def check(sweep: SweepConfig) -> None:
    """Refuse values the sweep cannot run, naming the key."""
    if sweep.trials < 1:
        raise ConfigError(f"trials={sweep.trials} must be at least 1")
    if sweep.nproc_per_node is not None and sweep.nproc_per_node < 1:
        raise ConfigError(f"nproc_per_node={sweep.nproc_per_node} must be at least 1, or null")
    if sweep.sampler.name not in SAMPLERS:
        raise ConfigError(f"sampler.name={sweep.sampler.name!r} is not allowed; choose one of {', '.join(SAMPLERS)}")
    if sweep.pruner.name not in PRUNERS:
        raise ConfigError(f"pruner.name={sweep.pruner.name!r} is not allowed; choose one of {', '.join(PRUNERS)}")
    for key in ("sampler.startup_trials", "pruner.startup_trials", "pruner.warmup_validations"):
        section, leaf = key.split(".")
        if getattr(getattr(sweep, section), leaf) < 0:
            raise ConfigError(f"{key} must be 0 or more")
    if not sweep.params:
        raise ConfigError("params is empty; name at least one training key to search, e.g. optim.lr")
    for item in sweep.overrides:
        if item.split("=", 1)[0].strip() == "run.output_dir":
            raise ConfigError(f"overrides: {item!r}: the sweep sets run.output_dir (output_dir/trial_N)")
    if "run.output_dir" in sweep.params:
        raise ConfigError("params: run.output_dir cannot be searched (the sweep sets it)")
    for key, space in sweep.params.items():
        check_space(f"params.{key}", space)
    for point in sweep.enqueue:
        unknown = set(point) - set(sweep.params)
        if unknown:
            raise ConfigError(f"enqueue: {', '.join(sorted(unknown))} not in params; enqueue only searched keys")


def check_space(where: str, space: SearchSpace) -> None:
    """One key's distribution: complete, consistent and accepted by Optuna."""
    if space.type not in TYPES:
        raise ConfigError(f"{where}.type={space.type!r} is not allowed; choose one of {', '.join(TYPES)}")
    ranged = {"low": space.low, "high": space.high, "step": space.step, "log": space.log or None}
    if space.type == "categorical":
        if not space.choices:
            raise ConfigError(f"{where}: categorical needs choices: [a, b, ...]")
        if any(value is not None for value in ranged.values()):
            extra = ", ".join(key for key, value in ranged.items() if value is not None)
            raise ConfigError(f"{where}: categorical takes choices only, not {extra}")
        if any(value is not None and not isinstance(value, (bool, int, float, str)) for value in space.choices):
            raise ConfigError(f"{where}.choices: each must be a number, a string, true, false or null")
        return
    if space.choices is not None:
        raise ConfigError(f"{where}: choices belong to type: categorical")
    if space.low is None or space.high is None:
        raise ConfigError(f"{where}: {space.type} needs low and high")
    if not space.low < space.high:
        raise ConfigError(f"{where}: low={space.low} must be below high={space.high}")
    if space.log and (space.low <= 0 or space.step is not None):
        raise ConfigError(f"{where}: log needs low > 0 and no step")
    if space.step is not None and space.step <= 0:
        raise ConfigError(f"{where}.step={space.step} must be above 0")
    if space.type == "int" and any(v is not None and v != int(v) for v in (space.low, space.high, space.step)):
        raise ConfigError(f"{where}: int needs whole numbers for low, high and step")


def as_override(key: str, value: Any) -> str:
    """key=value as the training command line reads it (null, true, 1e-05, ...)."""
    if value is None or isinstance(value, bool):
        return f"{key}={json.dumps(value)}"
    return f"{key}={value!r}" if isinstance(value, float) else f"{key}={value}"


def probes(space: SearchSpace) -> list[Any]:
    """The values that bound what a trial may sample: the ends of a range, every choice."""
    if space.type == "categorical":
        return list(space.choices)
    return [int(space.low), int(space.high)] if space.type == "int" else [space.low, space.high]


def check_training(sweep: SweepConfig, spec: TaskSpec) -> tuple[str, str]:
    """Load the training config (of the task spec declares) with every bound of the search space, so that a
    typo in a key or a value the training refuses stops the sweep now rather than in trial 7; returns the
    metric and direction."""
    try:
        cfg = load_config(spec, sweep.config, sweep.overrides)
    except ConfigError as err:
        raise ConfigError(f"the training config of the sweep: {error_line(err)}") from None
    points = [{key: value} for key, space in sweep.params.items() for value in probes(space)] + sweep.enqueue
    for point in points:
        sampled = [as_override(key, value) for key, value in point.items()]
        try:
            load_config(spec, sweep.config, [*sweep.overrides, *sampled])
        except ConfigError as err:
            raise ConfigError(f"{' '.join(sampled)} (from the sweep file): {error_line(err)}") from None
    metric, mode = monitored(cfg.trainer, spec)
    return metric, "maximize" if mode == "max" else "minimize"
