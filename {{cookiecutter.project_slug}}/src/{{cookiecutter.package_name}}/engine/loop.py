"""The training loop: set up a run (data, model, optimizer, resume), then the outer loop of optimizer
steps with its cadence (log, validate, save, stop) decided by small named functions.

    train(cfg, SPEC, Task)   one process is world size 1 of the same code; under torchrun every rank runs it

The step itself (zero_grad, accumulate forward/backward, unscale, clip, step) is step.py's; what
a checkpoint holds is state.py's; the task (data, model, loss, validation) is the Task class and
TaskSpec the command hands in (seam.py declares both). Only the top of the loop holds the whole
config: each part below takes the sections it reads.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from . import provenance
from .ckpt.checkpoint import remove_stale_temporaries, resume_state
from .ckpt.sharded import ShardedSaver, holds_shards
from .config import Config, ConfigError, TrainerConfig, to_dict, to_yaml
from .ema import WeightAverage
from .errors import OutOfMemory, Preempted
from .loaders import DeviceTrainLoader, build_loaders, shut_down_workers
from .metrics import MetricsLogger, PerfMeter
from .monitor import benchmark_due, monitored
from .optim import build_optimizer, check_finite, warmup_cosine
from .parallel import distributed, state_dicts
from .preemption import StopRequest
from .profiler import StepProfiler
from .rundir import claim_output_dir, save_best, save_best_sharded, start_in_output_dir
from .seam import Task, TaskSpec
from .state import Progress, TrainState, checkpoint_format
from .step import StepResult, train_mode, train_step
from .torch_private import cpu_has_onednn_bf16, unwrap

log = logging.getLogger(__name__)


def train(cfg: Config, spec: TaskSpec, task_class: type[Task]) -> dict:
    """Train the task (its declaration spec, its class task_class) as configured; return the final
    validation metrics."""
    env = distributed.setup(cfg.run, cfg.distributed)
    logging.basicConfig(level=logging.INFO if env.is_main else logging.WARNING, format="%(asctime)s %(message)s")
    lock = None
    try:
        lock = distributed.on_main(claim_output_dir, Path(cfg.run.output_dir))  # a second run here exits 2
        with StopRequest() as stop, torch.autograd.set_detect_anomaly(cfg.trainer.detect_anomaly):
            result = fit(cfg, spec, task_class, env, stop)
        distributed.barrier()  # every rank is done with every collective before the group goes away
        return result
    except torch.OutOfMemoryError:
        advice = out_of_memory_advice(cfg.data.batch_size, cfg.trainer.grad_accum_steps, spec.memory_hint)
        raise OutOfMemory(advice) from None
    finally:
        if lock:
            lock.release()
        distributed.teardown()


def fit(cfg: Config, spec: TaskSpec, task_class: type[Task], env: distributed.DistEnv, stop: StopRequest) -> dict:
    """The recipe: set up the run, then the outer loop (step, log, validate, save, stop)."""
    run = Run.start(cfg, spec, task_class, env)
    progress, plan = run.state.progress, run.plan
    val: dict = {}
    completed = False
    try:
        while not plan.finished(progress) and not run.stopped_early():
            train_mode(run.model)
            for batches in run.epoch_steps():
                run.step(batches)
                stopping = stop.poll()  # a signal on any rank stops every rank after this same step
                # The end of an epoch (or of training) validates and saves below: saving here too would
                # leave a checkpoint of this step that predates its validation line.
                ends_loop = plan.finished(progress) or plan.epoch_done(progress)
                if plan.validates_at(progress.step) and not ends_loop:
                    val = run.validate()
                    if run.stopped_early():
                        break
                if stopping or (plan.saves_at(progress.step) and not ends_loop):
                    run.save(wait=stopping)
                if stopping:
                    raise Preempted(f"stopped by {stop.reason} after step {progress.step}; {run.saved_where()}")
                if plan.finished(progress):
                    break
            if run.stopped_early():  # mid-epoch: its checkpoint is this step's, right after that validation
                run.save(wait=True)
                break
            plan.next_epoch_if_done(progress)
            val = run.validate()
            run.save(wait=plan.finished(progress) or run.stopped_early())
        val = val or run.measure()  # resumed a finished run: report its metrics again
        run.say_if_stopped_early()
        run.state.finish_saves()
        completed = True
    finally:
        run.close(completed)
    return {**val, "best": progress.best, "monitor": run.monitor, "step": progress.step, "epoch": progress.epoch}


@dataclass
class Plan:
    """How long training runs and the cadence of its logs, validations and saves, in optimizer steps."""

    steps_per_epoch: int
    epochs: int
    total_steps: int
    accum: int  # micro-batches per optimizer step
    global_micro: int  # samples per micro-batch, all processes together
    log_every: int
    val_every: int | None
    checkpoint_every: int

    @classmethod
    def of(cls, tcfg: TrainerConfig, batch_size: int, batches_per_epoch: int, world_size: int) -> Plan:
        """The plan of the trainer section's settings for batches_per_epoch micro-batches of batch_size
        (data.batch_size) samples per process."""
        accum = tcfg.grad_accum_steps
        steps_per_epoch = batches_per_epoch // accum  # leftover micro-batches of an epoch are skipped
        if steps_per_epoch == 0:
            raise ConfigError(f"trainer.grad_accum_steps={accum} exceeds the {batches_per_epoch} batches of an epoch")
        total = min(steps_per_epoch * tcfg.max_epochs, tcfg.max_steps or math.inf)
        return cls(
            steps_per_epoch, tcfg.max_epochs, total, accum, batch_size * world_size, tcfg.log_every,
            tcfg.val_every, tcfg.checkpoint_every,
        )  # fmt: skip

    @property
    def epoch_samples(self) -> int:
        """Samples all processes consume in the steps an epoch takes."""
        return self.steps_per_epoch * self.accum * self.global_micro

    def finished(self, progress: Progress) -> bool:
        """trainer.max_steps or trainer.max_epochs reached, whichever comes first."""
        return progress.step >= self.total_steps or progress.epoch >= self.epochs

    def epoch_done(self, progress: Progress) -> bool:
        return progress.samples_done >= self.epoch_samples

    def next_epoch_if_done(self, progress: Progress) -> None:
        if self.epoch_done(progress):
            progress.epoch, progress.samples_done = progress.epoch + 1, 0

    def logs_at(self, step: int) -> bool:
        return step % self.log_every == 0

    def validates_at(self, step: int) -> bool:
        """trainer.val_every (validations also end every epoch and training)."""
        return bool(self.val_every) and step % self.val_every == 0

    def saves_at(self, step: int) -> bool:
        """trainer.checkpoint_every (checkpoints also end every epoch and training)."""
        return step % self.checkpoint_every == 0


def warn_of_slow_bf16() -> None:
    """bf16 on a CPU without oneDNN's bf16 kernels (on x86, one without AVX-512): torch computes bf16
    matrix products and convolutions in its slow reference kernels there. On such a machine a step of
    20 convolutions took 15.5 s against 0.23 s in fp32, and a linear layer of 64 to 50,257 features
    over 256 rows 1.7 s against 0.12 s."""
    if not cpu_has_onednn_bf16():
        log.warning(
            "trainer.precision=bf16: this CPU has no oneDNN bf16 kernels (on x86 they need AVX-512), so torch computes "
            "bf16 matrix products and convolutions in its slow reference kernels (ten to a hundred times slower "
            "than fp32); trainer.precision=fp32 trains faster here"
        )


@dataclass
class Run:
    """The pieces of one training run and what the outer loop asks of them."""

    cfg: Config
    spec: TaskSpec
    env: distributed.DistEnv
    task: Task
    model: torch.nn.Module
    state: TrainState
    plan: Plan
    train_loader: object
    val_loader: object
    logger: MetricsLogger
    record: dict
    perf: PerfMeter = field(init=False)
    profiler: StepProfiler = field(init=False)
    bar: tqdm | None = None

    def __post_init__(self):
        self.monitor, self.mode = monitored(self.cfg.trainer, self.spec)
        self.perf = PerfMeter(
            self.env.device, self.env.world_size, data_on_device=isinstance(self.train_loader, DeviceTrainLoader)
        )
        self.profiler = StepProfiler(
            self.cfg.trainer.profile_steps, self.output_dir / "profile", self.env.rank, self.env.device
        )

    @property
    def output_dir(self) -> Path:
        return Path(self.cfg.run.output_dir)

    @classmethod
    def start(cls, cfg: Config, spec: TaskSpec, task_class: type[Task], env: distributed.DistEnv) -> Run:
        """Data, model, optimizer and state, resumed from the newest checkpoint when there is one."""
        output_dir, tcfg = Path(cfg.run.output_dir), cfg.trainer
        use_deterministic_kernels(cfg.run.deterministic)
        seed_everything(cfg.run.seed)  # the same initial weights on every rank: FSDP does not broadcast them
        if env.is_main:
            remove_stale_temporaries(output_dir / "checkpoints")  # after claim_output_dir: no other run saves here

        # Data: each process gets its own slice; the global batch is batch_size x world_size x accum.
        task = task_class(cfg, env.device)
        train_set, val_set = task.datasets()
        train_loader, val_loader, loader_choice = build_loaders(cfg.data, cfg.run.seed, task, train_set, val_set, env)
        log.info(loader_choice)
        plan = Plan.of(tcfg, cfg.data.batch_size, len(train_loader), env.world_size)
        log.info(
            "global batch %d = %d per process x %d processes x %d accumulation steps; %d optimizer steps",
            plan.global_micro * plan.accum, cfg.data.batch_size, env.world_size, plan.accum, plan.total_steps,
        )  # fmt: skip

        # Model on its device (under FSDP built sharded), wrapped, then the optimizer over its parameters.
        model = distributed.build_model(
            task, env, cfg.distributed, tcfg.precision, recompute_activations=cfg.model.activation_checkpointing
        )
        if env.is_main and env.device.type == "cpu" and tcfg.precision == "bf16":
            warn_of_slow_bf16()
        seed_everything(cfg.run.seed + env.rank)  # per-rank streams (e.g. dropout); augmentation is seeded per sample
        if cfg.model.compile:
            model = torch.compile(model)
        optimizer = build_optimizer(model, cfg.optim, task.param_settings(unwrap(model), cfg.optim.layer_decay))
        schedule = partial(
            warmup_cosine, warmup=cfg.optim.warmup_steps, total=plan.total_steps, min_ratio=cfg.optim.min_lr_ratio
        )
        state = TrainState(
            model=model,
            optimizer=optimizer,
            scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
            scaler=torch.amp.GradScaler(env.device.type, enabled=tcfg.precision == "fp16"),  # fp16 only
            loader_generator=train_loader.generator,
            device=env.device,
            saver=ShardedSaver(tcfg.async_checkpoint)
            if checkpoint_format(tcfg, cfg.distributed) == "sharded"
            else None,
            ema=WeightAverage(model, cfg.optim.ema_decay) if cfg.optim.ema_decay else None,
            frozen=task.frozen_weights(),
        )

        found = resume_state(tcfg.resume, output_dir / "checkpoints", env.is_main)
        if found:
            task.check_model_files(output_dir)  # e.g. the data now prepared another way
            state.resume(*found, cfg, spec, env, global_batch=plan.global_micro * plan.accum)
        distributed.on_main(
            start_in_output_dir, output_dir, to_yaml(cfg), tcfg.resume, state.progress.step, bool(found),
            task.model_files(),
        )  # fmt: skip
        record = provenance.run_record(state.progress.step if found else None)  # versions, git commit, hosts
        distributed.on_main(provenance.append_record, output_dir, record, not found)
        logger = (
            distributed.on_main(MetricsLogger, output_dir, cfg.tracker, to_dict(cfg), True, record)
            or MetricsLogger.disabled()
        )
        return cls(cfg, spec, env, task, model, state, plan, train_loader, val_loader, logger, record)

    def epoch_steps(self) -> Iterator[Iterator]:
        """The rest of the current epoch, one group of grad_accum_steps micro-batches per optimizer step."""
        progress, plan = self.state.progress, self.plan
        self.train_loader.sampler.set_position(progress.epoch, progress.samples_done // self.env.world_size)
        left = plan.steps_per_epoch * plan.accum - progress.samples_done // plan.global_micro
        self.bar = tqdm(
            self.perf.timed(itertools.islice(self.train_loader, left)),
            total=left,
            disable=not (self.env.is_main and sys.stderr.isatty()),
            desc=f"epoch {progress.epoch}",
            leave=False,
        )
        batches = iter(self.bar)
        try:
            for _ in range(left // plan.accum):
                yield itertools.islice(batches, plan.accum)
        finally:
            self.bar.close()

    def step(self, batches: Iterator) -> None:
        """One optimizer step, and its train/loss line every trainer.log_every steps."""
        progress = self.state.progress
        self.profiler.before_step(progress.step + 1)
        tcfg, task = self.cfg.trainer, self.task
        result = train_step(self.state, batches, task.loss, tcfg, self.plan.global_micro, task.loss_weight)
        self.profiler.after_step(progress.step)
        self.perf.samples, self.perf.steps = self.perf.samples + result.samples, self.perf.steps + 1
        self.state.poll_save()  # an asynchronous save is committed once every rank wrote it
        if self.plan.logs_at(progress.step):
            train_loss = log_training(self.state, result, self.perf, self.logger, self.task, tcfg.precision)
            self.bar.set_postfix(loss=f"{train_loss:.4f}")

    def validated_weights(self):
        """Inside, the model holds the weights validation measures: the moving average under optim.ema_decay."""
        return self.state.ema.swapped_in(self.model) if self.state.ema else contextlib.nullcontext()

    def measure(self) -> dict:
        """The validation metrics; with a weight average, the trained weights' beside them as val_raw/*."""
        model = distributed.without_ddp(self.model)
        with self.validated_weights():
            val = self.task.validate(model, self.val_loader)
            if benchmark_due(self.cfg.trainer, self.state.progress.step):
                val |= self.task.benchmarks(model, self.cfg.trainer)
        if self.state.ema:
            raw = self.task.validate(model, self.val_loader)
            val.update({key.replace("val/", "val_raw/", 1): raw[key] for key in self.spec.metrics})
        return val

    def validate(self) -> dict:
        """Validate, keep best.safetensors, log; every rank runs it (FSDP forwards are collectives)."""
        progress = self.state.progress
        with self.perf.excluded():  # validation and saving are not training time
            val = self.measure()
            check_finite("val/loss", val["val/loss"], progress.step, self.cfg.trainer.precision)  # before any save
            if progress.record_validation(val[self.monitor], self.mode):  # the same on every rank: metrics are global
                self.save_best(val)
            val[best_key(self.monitor)] = progress.best
            distributed.on_main(self.logger.log, val, progress.step, progress.epoch)
            log.info("epoch %d step %d: %s", progress.epoch, progress.step, self.task.summary(val))
        train_mode(self.model)
        return val

    def save_best(self, val: dict) -> None:
        """best.safetensors and best.json of the weights just validated."""
        best = (self.output_dir, self.state.progress.step, val, (self.monitor, self.mode))
        kind = "ema" if self.state.ema else "trained"
        with self.validated_weights():
            if holds_shards(self.model):  # never the whole model on one process
                save_best_sharded(self.model, *best, kind)
            else:
                distributed.on_main(save_best, state_dicts.full_model_state(self.model), *best, kind)

    def save(self, wait: bool) -> None:
        """A checkpoint of this step (wait: until it is written, for a save that ends the run)."""
        with self.perf.excluded():
            self.state.save(self.output_dir / "checkpoints", to_dict(self.cfg), self.cfg.trainer, wait=wait)

    def saved_where(self) -> str:
        return f"checkpoint written in {self.output_dir / 'checkpoints'}"

    def stopped_early(self) -> bool:
        """trainer.early_stop_patience validations in a row without a better monitored metric."""
        patience = self.cfg.trainer.early_stop_patience
        return bool(patience) and self.state.progress.stale >= patience

    def say_if_stopped_early(self) -> None:
        if self.stopped_early():
            progress = self.state.progress
            log.info(
                "stopped early at step %d: %s has not improved on %.4f (step %d) in %d validations",
                progress.step, self.monitor, progress.best, progress.best_step, progress.stale,
            )  # fmt: skip

    def close(self, completed: bool) -> None:
        """Let saves finish, write the profile, tell the tracker how training ended, stop the workers."""
        if not completed:
            self.state.finish_saves(failed=True)  # a checkpoint every rank wrote still counts
        self.profiler.close()
        self.logger.close(sys.exc_info()[1])  # how training ended: the tracker records it (mlflow's run status)
        shut_down_workers(self.train_loader, self.val_loader)


def best_key(monitor: str) -> str:
    """The logged name of the monitored metric's best value so far: val/best_loss for val/loss,
    eval/best_hellaswag/acc_norm for eval/hellaswag/acc_norm, ..."""
    kind, name = monitor.split("/", 1)
    return f"{kind}/best_{name}"


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def use_deterministic_kernels(enabled: bool) -> None:
    """Only deterministic kernels (slower), or the fastest ones for fixed input sizes."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it to be deterministic
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = not enabled


def log_training(
    state: TrainState, result: StepResult, perf: PerfMeter, logger: MetricsLogger, task: Task, precision: str
) -> float:
    """A train/loss line (a host sync, so only every trainer.log_every steps); returns the loss."""
    state.check_updates()
    train_loss = state.running.global_mean()  # every rank gets it, so all stop together on NaN
    check_finite("train/loss", train_loss, state.progress.step, precision)
    metrics = {
        "train/loss": train_loss,
        "train/lr": result.lr,
        "train/grad_norm": result.grad_norm.item(),
        **perf.read(),
    }
    metrics.update(task.throughput(metrics["perf/samples_per_s"]))
    if state.scaler.is_enabled():
        metrics["train/skipped_steps"] = state.progress.skipped_steps
    distributed.on_main(logger.log, metrics, state.progress.step, state.progress.epoch)
    state.running.reset()
    return train_loss


def out_of_memory_advice(batch_size: int, accum: int, memory_hint: str) -> str:
    """What to change after the GPU ran out of memory: the same global batch in smaller pieces (memory_hint:
    the task's TaskSpec.memory_hint, for data.batch_size=1)."""
    if batch_size == 1:
        return f"CUDA out of memory at data.batch_size=1; try trainer.precision=bf16 or {memory_hint}"
    factor = next(f for f in range(2, batch_size + 1) if batch_size % f == 0)
    return (
        f"CUDA out of memory; lower data.batch_size and raise trainer.grad_accum_steps by the same factor, which "
        f"keeps the global batch: data.batch_size={batch_size // factor} trainer.grad_accum_steps={accum * factor}"
    )
