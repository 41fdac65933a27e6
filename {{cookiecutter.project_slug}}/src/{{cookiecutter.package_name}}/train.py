"""Train (and resume) the task's model. One process is world size 1 of the same code.

    python -m PACKAGE.train                                        # one CPU or GPU, synthetic data
    python -m PACKAGE.train --config configs/default.yaml trainer.max_epochs=10 data.batch_size=64
    torchrun --nproc_per_node=4 -m PACKAGE.train --config configs/default.yaml
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml -m PACKAGE.train --config configs/default.yaml
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \\
        -m PACKAGE.train --config configs/default.yaml          # on each node

Resume: run the same command again; trainer.resume=auto continues from the newest valid
checkpoint in run.output_dir, bit-exact. SIGTERM or SIGUSR1 stops after the current optimizer
step with a checkpoint and exit status 75 (see preemption.py). `python -m PACKAGE.train --help`
lists every key.

Exit status (errors.py): 0 done, 1 failed (diverged, out of memory, a peer hung or died, an output
could not be written), 2 bad configuration, data or checkpoint, 75 stopped by a signal after
writing a checkpoint (run the same command again).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import random
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .engine import provenance
from .engine.ckpt.checkpoint import remove_stale_temporaries, resume_state
from .engine.ckpt.sharded import ShardedSaver, holds_shards
from .engine.config import TASK, Config, ConfigError, load_config, parse_args, to_dict
from .engine.ema import WeightAverage
from .engine.errors import PREEMPTED_EXIT, RUNTIME_FAILURE, Preempted, exit_status, report
from .engine.launcher import check_accelerate_fsdp
from .engine.loaders import DeviceTrainLoader, build_loaders, shut_down_workers
from .engine.metrics import MetricsLogger, PerfMeter
from .engine.optim import build_optimizer, check_finite, warmup_cosine
from .engine.parallel import distributed
from .engine.preemption import StopRequest
from .engine.profiler import StepProfiler
from .engine.provenance import append_record, run_record
from .engine.rundir import claim_output_dir, save_best, save_best_sharded, start_in_output_dir
from .engine.state import TrainState, checkpoint_format
from .engine.step import StepResult, train_mode, train_step
from .task.task import Task

log = logging.getLogger(__package__)


def monitored(cfg: Config) -> tuple[str, str]:
    """trainer.monitor and trainer.monitor_mode, null meaning the task's metric and the metric's direction."""
    name = cfg.trainer.monitor or TASK.monitor
    return name, cfg.trainer.monitor_mode or TASK.metrics[name]


def best_key(monitor: str) -> str:
    """The logged name of the monitored metric's best value so far: val/best_acc for val/acc, ..."""
    return "val/best_" + monitor.split("/", 1)[1]


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def use_deterministic_kernels(enabled: bool) -> None:
    """Only deterministic kernels (slower), or the fastest ones for fixed image sizes."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it to be deterministic
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = not enabled


def train(cfg: Config) -> dict:
    """Train as configured and return the final validation metrics."""
    env = distributed.setup(cfg)
    logging.basicConfig(level=logging.INFO if env.is_main else logging.WARNING, format="%(asctime)s %(message)s")
    lock = None
    try:
        lock = distributed.on_main(claim_output_dir, Path(cfg.run.output_dir))  # a second run here exits 2
        with StopRequest() as stop, torch.autograd.set_detect_anomaly(cfg.trainer.detect_anomaly):
            result = fit(cfg, env, stop)
        distributed.barrier()  # every rank is done with every collective before the group goes away
        return result
    finally:
        if lock:
            lock.release()
        distributed.teardown()


def fit(cfg: Config, env: distributed.DistEnv, stop: StopRequest) -> dict:
    """The recipe: data, model, optimizer, resume, then the outer loop (step, log, validate, save, stop)."""
    output_dir, tcfg = Path(cfg.run.output_dir), cfg.trainer
    checkpoints = output_dir / "checkpoints"
    use_deterministic_kernels(cfg.run.deterministic)
    seed_everything(cfg.run.seed)  # the same initial weights on every rank: FSDP does not broadcast them
    if env.is_main:
        remove_stale_temporaries(checkpoints)  # after claim_output_dir: no other run is saving here

    # Data: each process gets its own slice; the global batch is batch_size x world_size x accum.
    task = Task(cfg, env.device)
    train_set, val_set = task.datasets()
    train_loader, val_loader, loader_choice = build_loaders(cfg, task, train_set, val_set, env)
    log.info(loader_choice)
    accum = tcfg.grad_accum_steps
    global_micro = cfg.data.batch_size * env.world_size  # samples per micro-batch, all processes
    steps_per_epoch = len(train_loader) // accum  # leftover micro-batches of an epoch are skipped
    if steps_per_epoch == 0:
        raise ConfigError(f"trainer.grad_accum_steps={accum} exceeds the {len(train_loader)} batches of an epoch")
    total_steps = min(steps_per_epoch * tcfg.max_epochs, tcfg.max_steps or math.inf)
    epoch_samples = steps_per_epoch * accum * global_micro  # all processes, in the steps an epoch takes
    log.info(
        "global batch %d = %d per process x %d processes x %d accumulation steps; %d optimizer steps",
        global_micro * accum, cfg.data.batch_size, env.world_size, accum, total_steps,
    )  # fmt: skip

    # Model on its device (under FSDP built sharded), wrapped, then the optimizer over its parameters.
    model = distributed.build_model(task, cfg, env)
    seed_everything(cfg.run.seed + env.rank)  # per-rank streams (e.g. dropout); augmentation is seeded per sample
    if cfg.model.compile:
        model = torch.compile(model)
    optimizer = build_optimizer(model, cfg.optim)
    schedule = partial(
        warmup_cosine, warmup=cfg.optim.warmup_steps, total=total_steps, min_ratio=cfg.optim.min_lr_ratio
    )
    state = TrainState(
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
        scaler=torch.amp.GradScaler(env.device.type, enabled=tcfg.precision == "fp16"),  # fp16 only
        loader_generator=train_loader.generator,
        device=env.device,
        saver=ShardedSaver(tcfg.async_checkpoint) if checkpoint_format(cfg) == "sharded" else None,
        ema=WeightAverage(model, cfg.optim.ema_decay) if cfg.optim.ema_decay else None,
    )
    progress = state.progress

    found = resume_state(cfg, checkpoints, env.is_main)
    if found:
        state.resume(*found, cfg, env, global_batch=global_micro * accum)
    distributed.on_main(start_in_output_dir, output_dir, cfg, progress.step, bool(found))
    record = run_record(progress.step if found else None)  # provenance: versions, git commit, hosts
    distributed.on_main(append_record, output_dir, record, not found)
    logger = (
        distributed.on_main(MetricsLogger, output_dir, cfg.tracker, to_dict(cfg), True, record)
        or MetricsLogger.disabled()
    )

    monitor, mode = monitored(cfg)
    patience = tcfg.early_stop_patience

    def validated_weights():
        """Inside, the model holds the weights validation measures: the moving average under optim.ema_decay."""
        return state.ema.swapped_in(model) if state.ema else contextlib.nullcontext()

    def measure() -> dict:
        """The validation metrics; with a weight average, the trained weights' beside them as val_raw/*."""
        with validated_weights():
            val = task.validate(distributed.without_ddp(model), val_loader)
        if state.ema:
            raw = task.validate(distributed.without_ddp(model), val_loader)
            val.update({key.replace("val/", "val_raw/", 1): raw[key] for key in TASK.metrics})
        return val

    def validate() -> dict:
        """Validate, keep best.safetensors, log; every rank runs it (FSDP forwards are collectives)."""
        with perf.excluded():  # validation and saving are not training time
            val = measure()
            check_finite("val/loss", val["val/loss"], progress.step, tcfg.precision)  # before anything is saved
            if progress.record_validation(val[monitor], mode):  # the same on every rank: metrics are global
                best = (output_dir, progress.step, val, (monitor, mode), "ema" if state.ema else "trained")
                with validated_weights():
                    if holds_shards(model):  # never the whole model on one process
                        save_best_sharded(model, *best)
                    else:
                        distributed.on_main(save_best, distributed.full_model_state(model), *best)
            val[best_key(monitor)] = progress.best
            distributed.on_main(logger.log, val, progress.step, progress.epoch)
            log.info("epoch %d step %d: %s", progress.epoch, progress.step, task.summary(val))
        return val

    def stopped_early() -> bool:
        """trainer.early_stop_patience validations in a row without a better monitored metric."""
        return bool(patience) and progress.stale >= patience

    val: dict = {}
    perf = PerfMeter(env.device, env.world_size, data_on_device=isinstance(train_loader, DeviceTrainLoader))
    profiler = StepProfiler(tcfg.profile_steps, output_dir / "profile", env.rank, env.device)
    finished = False
    try:
        while progress.epoch < tcfg.max_epochs and progress.step < total_steps and not stopped_early():
            train_mode(model)
            done = progress.samples_done // global_micro  # micro-batches of this epoch already taken
            train_loader.sampler.set_position(progress.epoch, progress.samples_done // env.world_size)
            left = steps_per_epoch * accum - done
            bar = tqdm(
                perf.timed(itertools.islice(train_loader, left)),
                total=left,
                disable=not (env.is_main and sys.stderr.isatty()),
                desc=f"epoch {progress.epoch}",
                leave=False,
            )
            batches = iter(bar)
            for _ in range(left // accum):
                profiler.before_step(progress.step + 1)
                result = train_step(state, itertools.islice(batches, accum), task.loss, tcfg, global_micro)
                profiler.after_step(progress.step)
                perf.samples, perf.steps = perf.samples + result.samples, perf.steps + 1
                state.poll_save()  # an asynchronous save is committed once every rank wrote it
                if progress.step % tcfg.log_every == 0:
                    train_loss = log_training(state, result, perf, logger, task)
                    bar.set_postfix(loss=f"{train_loss:.4f}")
                stopping = stop.poll()  # a signal on any rank stops every rank after this same step
                # At the end of the epoch (or of training) validation and a save follow: saving here too
                # would leave a checkpoint of this step that predates its validation line.
                ends_loop = progress.step >= total_steps or progress.samples_done == epoch_samples
                if tcfg.val_every and progress.step % tcfg.val_every == 0 and not ends_loop:
                    val = validate()
                    train_mode(model)
                    if stopped_early():
                        break
                if stopping or (progress.step % tcfg.checkpoint_every == 0 and not ends_loop):
                    with perf.excluded():
                        state.save(checkpoints, cfg, wait=stopping)
                if stopping:
                    raise Preempted(
                        f"stopped by {stop.signal.name if stop.signal else 'a signal to another process'} "
                        f"after step {progress.step}; checkpoint written in {checkpoints}"
                    )
                if progress.step >= total_steps:
                    break
            bar.close()
            if stopped_early():  # mid-epoch: its checkpoint is this step's, right after that validation
                with perf.excluded():
                    state.save(checkpoints, cfg, wait=True)
                break
            if progress.samples_done >= epoch_samples:
                progress.epoch, progress.samples_done = progress.epoch + 1, 0
            val = validate()
            with perf.excluded():
                state.save(checkpoints, cfg, wait=progress.step >= total_steps or stopped_early())
        if not val:  # resumed a finished run: report its metrics again
            val = measure()
        if stopped_early():
            log.info(
                "stopped early at step %d: %s has not improved on %.4f (step %d) in %d validations",
                progress.step, monitor, progress.best, progress.best_step, progress.stale,
            )  # fmt: skip
        state.finish_saves()
        finished = True
    finally:
        if not finished:
            state.finish_saves(failed=True)  # a checkpoint every rank wrote still counts
        profiler.close()
        logger.close(sys.exc_info()[1])  # how training ended: the tracker records it (mlflow's run status)
        shut_down_workers(train_loader, val_loader)
    return {**val, "best": progress.best, "monitor": monitor, "step": progress.step, "epoch": progress.epoch}


def log_training(state: TrainState, result: StepResult, perf: PerfMeter, logger: MetricsLogger, task: Task) -> float:
    """A train/loss line (a host sync, so only every trainer.log_every steps); returns the loss."""
    state.check_updates()
    train_loss = state.running.global_mean()  # every rank gets it, so all stop together on NaN
    check_finite("train/loss", train_loss, state.progress.step, task.cfg.trainer.precision)
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


def out_of_memory_advice(batch_size: int, accum: int) -> str:
    """What to change after the GPU ran out of memory: the same global batch in smaller pieces."""
    if batch_size == 1:
        return f"CUDA out of memory at data.batch_size=1; try trainer.precision=bf16 or {TASK.memory_hint}"
    factor = next(f for f in range(2, batch_size + 1) if batch_size % f == 0)
    return (
        f"CUDA out of memory; lower data.batch_size and raise trainer.grad_accum_steps by the same factor, which "
        f"keeps the global batch: data.batch_size={batch_size // factor} trainer.grad_accum_steps={accum * factor}"
    )


def main(argv: list[str] | None = None) -> int:
    code = _main(sys.argv[1:] if argv is None else argv)
    # A run that an exception stopped left its model to the garbage collector only once the exception
    # was handled; under FSDP the model still holds the process group's threads (distributed.teardown).
    distributed.free_finished_models()
    return code


def _main(argv: list[str]) -> int:
    """The command line: parse, train, and turn the expected failures into a message and an exit status."""
    provenance.command_line[:] = [Path(sys.executable).name, "-m", f"{__package__}.train", *argv]
    try:
        files, overrides = parse_args(argv, f"{__package__}.train")
        # accelerate launch's FSDP options, as keys between the --config files and the command line's.
        honoured = [f"{key}={str(value).lower()}" for key, value in check_accelerate_fsdp().items()]
        cfg = load_config(files, [*honoured, *overrides])
        result = train(cfg)
    except torch.OutOfMemoryError:
        print(f"error: {out_of_memory_advice(cfg.data.batch_size, cfg.trainer.grad_accum_steps)}", file=sys.stderr)
        return RUNTIME_FAILURE
    except Preempted as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{err}; run the same command to resume (exit status {PREEMPTED_EXIT})", file=sys.stderr)
        return PREEMPTED_EXIT
    except Exception as err:
        if exit_status(err) is not None:  # errors.EXIT_STATUS: bad input 2, a failed write or divergence 1
            return report(err)
        if not distributed.is_peer_failure(err):
            raise  # a bug: its traceback is what helps
        reason = str(err).strip().splitlines()[0][:300]
        print(
            f"error: a collective failed or waited longer than distributed.timeout_s: another process hung or died "
            f"(its log says why); this process stops ({reason})",
            file=sys.stderr,
        )
        return RUNTIME_FAILURE
    if int(os.environ.get("RANK", "0")) == 0:
        shown = dict.fromkeys([result["monitor"], "val/loss"])  # the monitored metric first, each once
        print(
            f"final {' '.join(f'{key}={result[key]:.4f}' for key in shown)} "
            f"(best {result['monitor']}={result['best']:.4f}) after {result['step']} steps; "
            f"outputs in {cfg.run.output_dir}/ (metrics.jsonl, config.yaml, checkpoints/, best.safetensors)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
