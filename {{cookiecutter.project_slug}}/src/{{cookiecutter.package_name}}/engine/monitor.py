"""What validation watches: the monitored metric and its direction (trainer.monitor, trainer.monitor_mode),
and the benchmarks scored at validation (trainer.eval_tasks, eval_every, eval_limit, eval_include,
eval_task_data) for a task that has them (TaskSpec.benchmarks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    from .config import TrainerConfig
    from .seam import TaskSpec


def check_monitor(trainer: TrainerConfig, spec: TaskSpec) -> None:
    """trainer.monitor names a validation metric of the task or a benchmark's eval/TASK/METRIC scored at every
    validation; trainer.monitor_mode is max, min or null; the trainer.eval_* keys can work."""
    check_benchmarks(trainer, spec)
    if trainer.monitor is not None and trainer.monitor not in spec.metrics:
        if not benchmark_metric(trainer.monitor, trainer):
            raise ConfigError(
                f"trainer.monitor={trainer.monitor!r} is not a validation metric of this task; choose one of "
                f"{', '.join(spec.metrics)}"
                + (", or eval/TASK/METRIC of trainer.eval_tasks" if spec.benchmarks else "")
            )
        if trainer.eval_every is not None and trainer.eval_every != trainer.val_every:
            raise ConfigError(
                f"trainer.monitor={trainer.monitor} is scored every trainer.eval_every={trainer.eval_every} "
                "steps, not at every validation; set trainer.eval_every=null to monitor it"
            )
    if trainer.monitor_mode not in (None, "max", "min"):
        raise ConfigError(f"trainer.monitor_mode={trainer.monitor_mode!r} is not allowed; choose max or min")


def monitored(trainer: TrainerConfig, spec: TaskSpec) -> tuple[str, str]:
    """trainer.monitor and trainer.monitor_mode, null meaning the task's metric and the metric's direction (a
    benchmark's as TaskSpec.benchmarks gives it)."""
    name = trainer.monitor or spec.monitor
    if name in spec.metrics:
        return name, trainer.monitor_mode or spec.metrics[name]
    return name, trainer.monitor_mode or spec.benchmarks(name.split("/")[2])


def benchmark_metric(name: str, trainer: TrainerConfig) -> bool:
    """Whether name is eval/TASK/METRIC for a task of trainer.eval_tasks."""
    parts = name.split("/")
    return len(parts) == 3 and parts[0] == "eval" and parts[1] in trainer.eval_tasks and bool(parts[2])


def benchmark_due(trainer: TrainerConfig, step: int) -> bool:
    """Whether a validation at step scores trainer.eval_tasks too."""
    return bool(trainer.eval_tasks) and (trainer.eval_every is None or step % trainer.eval_every == 0)


def check_benchmarks(trainer: TrainerConfig, spec: TaskSpec) -> None:
    """trainer.eval_* keys: a task that scores benchmarks (TaskSpec.benchmarks), and values that can work."""
    given = [key for key in ("eval_every", "eval_limit", "eval_include") if getattr(trainer, key) is not None]
    given += ["eval_task_data"] * bool(trainer.eval_task_data)
    if not trainer.eval_tasks:
        if given:
            raise ConfigError(f"trainer.{given[0]} goes with trainer.eval_tasks, which names no task")
        return
    if spec.benchmarks is None:
        raise ConfigError("trainer.eval_tasks: this task scores no benchmarks; leave it empty")
    every, val_every = trainer.eval_every, trainer.val_every
    if every is not None and (every < 1 or (val_every and every % val_every)):
        raise ConfigError(f"trainer.eval_every={every} must be a multiple of trainer.val_every={val_every}")
    if trainer.eval_limit is not None and trainer.eval_limit <= 0:
        raise ConfigError(f"trainer.eval_limit={trainer.eval_limit} must be above 0")
    if unknown := sorted(set(trainer.eval_task_data) - set(trainer.eval_tasks)):
        raise ConfigError(f"trainer.eval_task_data names {', '.join(unknown)}, which trainer.eval_tasks does not")
