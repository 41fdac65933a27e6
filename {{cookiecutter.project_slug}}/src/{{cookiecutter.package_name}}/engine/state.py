"""The training state: everything a checkpoint holds, and the one place that writes and reads it.

A checkpoint is the dict TrainState.state_dict() returns, with a format version key. Nothing else
indexes into it: saving, resuming (with the run directory's rules on what may change) and the
progress counters live here.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from .ckpt.checkpoint import rng_state, save_checkpoint, set_rng_state
from .ckpt.restore import check_frozen, mismatch
from .ckpt.sharded import ShardedSaver, ShardedWeights, load_training_state, sharded_state
from .config import Config, DistributedConfig, TrainerConfig, to_dict, with_stored_defaults
from .ema import WeightAverage
from .errors import CheckpointError, OutputError, why_not_written
from .metrics import SampleMean
from .optim import REMEDIES, Diverged, apply_optim_config, check_finite, refresh_learning_rate
from .parallel import distributed, state_dicts
from .rundir import check_resume_changes, config_changes

if TYPE_CHECKING:
    from .seam import TaskSpec

log = logging.getLogger(__name__)

# The layout of the dict state_dict() returns. Checkpoints without the key predate it and have
# layout 1; a newer layout than this code knows is refused rather than half-read.
# 2: progress.best (the best value of the monitored metric) replaced progress.best_acc.
FORMAT_VERSION = 2


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # epochs completed
    samples_done: int = 0  # samples all processes together consumed in the current epoch
    best: float | None = None  # the best value of the monitored metric so far; None before the first validation
    best_step: int = -1
    stale: int = 0  # validations since the monitored metric last improved (trainer.early_stop_patience)
    skipped_steps: int = 0  # fp16 steps the gradient scaler skipped (inf/NaN gradients)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        if "best_acc" in state:  # format 1 named it best_acc, -1 for none yet
            best_acc = state.pop("best_acc")
            state["best"] = best_acc if best_acc >= 0 else None
        for key, value in state.items():
            setattr(self, key, value)

    def improves(self, value: float, mode: str) -> bool:
        """Whether a validation value beats the best so far (mode max: higher is better, min: lower)."""
        return self.best is None or (value > self.best if mode == "max" else value < self.best)

    def record_validation(self, value: float, mode: str) -> bool:
        """Count a validation of the monitored metric; returns whether it is the best so far."""
        if self.improves(value, mode):
            self.best, self.best_step, self.stale = value, self.step, 0
            return True
        self.stale += 1
        return False


@dataclass
class TrainState:
    """Model, optimizer, scheduler, scaler, progress, the running train/loss and the data position.

    `nonfinite` holds one device flag per optimizer step since the last check (1 = the gradient
    norm was inf or NaN); it is read at log and save time only, so no step waits for the host.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    loader_generator: torch.Generator
    device: torch.device
    progress: Progress = field(default_factory=Progress)
    running: SampleMean = field(default_factory=SampleMean)  # train/loss since the last log line
    nonfinite: list[torch.Tensor] = field(default_factory=list)
    saver: ShardedSaver | None = None  # trainer.checkpoint_format=sharded: writes checkpoints/step_N/
    ema: WeightAverage | None = None  # optim.ema_decay > 0: the weights' moving average
    frozen: dict | None = None  # what rebuilds the frozen parameters, which checkpoints leave out (Task.frozen_weights)

    def check_updates(self) -> None:
        """At log and save time only (a host sync): stop if any update was non-finite (fp16: count it)."""
        if not self.nonfinite:
            return
        flags = torch.stack(self.nonfinite).tolist()  # one host read for the whole window
        bad = [self.progress.step - len(flags) + 1 + i for i, flag in enumerate(flags) if flag]
        self.nonfinite.clear()
        if self.scaler.is_enabled():  # fp16: the scaler skipped those steps and lowered its scale
            self.progress.skipped_steps += len(bad)
        elif bad:
            raise Diverged(f"the gradient norm is not finite at step {bad[0]} (that update was skipped; nothing "
                           f"non-finite was saved); {REMEDIES}")  # fmt: skip

    def state_dict(self, config: dict, tensors: bool = True) -> dict | None:
        """The checkpoint: full (unsharded) tensors on the main process, None on the others.

        Every rank must call it: FSDP gathers the shards, and each rank's RNG and loader state is
        gathered too, so a run saved by N processes resumes on M. With tensors=False, everything
        but the model and optimizer (what a sharded checkpoint keeps beside its shards).
        """
        if tensors:
            weights = state_dicts.full_model_state(self.model)
            optim_state = state_dicts.full_optimizer_state(self.model, self.optimizer)
            average = self.ema.full_state_dict() if self.ema else None
        mine = {
            "rng": rng_state(),
            "loader": self.loader_generator.get_state(),
            "running": self.running.state_dict(),
        }
        per_rank = distributed.all_gather_object(mine)
        if not distributed.is_main():
            return None
        state = {
            "format": FORMAT_VERSION,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "progress": self.progress.state_dict(),
            "ranks": per_rank,
            "config": config,
        }
        if self.frozen is not None:  # the checkpoint holds what trains only: name the base it trained over
            state["frozen"] = self.frozen
        if not tensors:  # the shards hold the tensors; this says whether they include the average
            return {**state, "ema": True} if self.ema else state
        state.update(model=weights, optimizer=optim_state)
        return {**state, "ema": average} if self.ema else state

    def load_state_dict(self, state: dict, path: Path, rank: int, world_size: int) -> None:
        """Restore what state_dict() returned; a rank the checkpoint did not have keeps its fresh seed."""
        if state.get("format", 1) > FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: checkpoint format {state['format']} is newer than this project's "
                f"({FORMAT_VERSION}); update the project to resume it"
            )
        self.progress.load_state_dict(state["progress"])
        average = state.get("ema") if self.ema else None
        try:
            if isinstance(state["model"], ShardedWeights):  # each process reads the parts it holds
                extra = {"ema": self.ema.state_dict()} if average is not None else None
                load_training_state(self.model, self.optimizer, state["model"].path, extra)
            else:
                state_dicts.load_full_state(self.model, self.optimizer, state["model"], state["optimizer"])
                if average is not None:
                    self.ema.load_full_state_dict(average)
            self.scheduler.load_state_dict(state["scheduler"])
            self.scaler.load_state_dict(state["scaler"])
        except (RuntimeError, KeyError, ValueError) as err:
            raise CheckpointError(f"{path}: does not fit the configured model ({mismatch(err)})") from None
        if self.ema and average is None:
            self.ema.reset()
            log.info("optim.ema_decay turned on: the weight average starts at step %d's weights", self.progress.step)
        elif "ema" in state and not self.ema:
            log.info("optim.ema_decay=0: the checkpoint's weight average is not kept")
        if rank < len(state["ranks"]):
            mine = state["ranks"][rank]
            set_rng_state(mine["rng"])
            self.loader_generator.set_state(mine["loader"])
            if len(state["ranks"]) == world_size and "running" in mine:
                self.running.load_state_dict(mine["running"], self.device)

    def save(self, checkpoints: Path, config: dict, tcfg: TrainerConfig, wait: bool = False) -> None:
        """Write a verified checkpoint of this step (every rank calls it); all ranks learn the outcome.
        config is what the checkpoint stores of the run's configuration (config.to_dict); tcfg the trainer
        section (its precision, for the message of a non-finite loss, and keep_last).

        Sharded and asynchronous: returns once the state is copied, and the write goes on (see
        poll_save); wait=True (preemption, the end of training) returns once it is committed.
        """
        self.check_updates()  # never checkpoint a state that went non-finite
        if self.running.count:  # the same on every rank: all check, or none does
            check_finite("train/loss", self.running.global_mean(), self.progress.step, tcfg.precision)
        if self.saver is not None:
            tensors = sharded_state(self.model, self.optimizer)
            if self.ema:
                tensors["ema"] = self.ema.state_dict()
            self.saver.start(
                checkpoints,
                self.progress.step,
                tensors,
                self.state_dict(config, tensors=False),
                tcfg.keep_last,
            )
            if wait:
                self.saver.finish()
            return
        state = self.state_dict(config)
        error = None
        if state is not None:
            try:
                save_checkpoint(checkpoints, state, self.progress.step, tcfg.keep_last)
            except (OSError, RuntimeError, CheckpointError) as err:  # torch.save: RuntimeError on a full disk
                error = (
                    f"could not write the step {self.progress.step} checkpoint in {checkpoints} "
                    f"({why_not_written(err, checkpoints)}); older ones are kept"
                )
        error = distributed.broadcast_object(error)  # it counts once written and verified; all ranks learn it
        if error:
            raise OutputError(error)

    def poll_save(self) -> None:
        """Every step (cheap): commit an asynchronous save once every rank has written it."""
        if self.saver is not None:
            self.saver.poll()

    def finish_saves(self, failed: bool = False) -> None:
        """Before the run ends: wait for a save in flight and commit it (failed=True: without a
        collective, committing only what every rank already wrote)."""
        if self.saver is None:
            return
        if failed:
            self.saver.abandon()
        else:
            self.saver.finish()
        self.saver.close()

    def resume(self, path: Path, state: dict, cfg: Config, spec: TaskSpec, env, global_batch: int) -> None:
        """Continue from a checkpoint: refuse config changes it cannot honour (the whole config compared with
        the stored one, under the engine's rules and spec.resume_may_change), then restore everything."""
        stored = with_stored_defaults(state.get("config") or {}, spec.stored_defaults)
        stored_batch = stored.get("data", {}).get("batch_size", cfg.data.batch_size)
        stored_accum = stored.get("trainer", {}).get("grad_accum_steps", cfg.trainer.grad_accum_steps)
        changed = check_resume_changes(
            config_changes(stored, to_dict(cfg)),
            path,
            stored_global_batch=stored_batch * len(state.get("ranks") or [None]) * stored_accum,
            global_batch=global_batch,
            override_optim=cfg.trainer.override_optim,
            task_may_change=spec.resume_may_change,
        )
        stored_progress = Progress()
        stored_progress.load_state_dict(state["progress"])
        check_resumable(stored_progress, global_batch, path)  # before anything is loaded
        check_frozen(state.get("frozen"), self.frozen, path)  # adapters resume over the base they trained on
        self.load_state_dict(state, path, env.rank, env.world_size)
        if changed:
            log.info("resuming with changed %s", ", ".join(changed))
        if cfg.trainer.override_optim:
            apply_optim_config(self.optimizer, self.scheduler, cfg.optim)
        elif {"trainer.max_epochs", "trainer.max_steps"} & set(changed):
            refresh_learning_rate(self.scheduler)  # the schedule now ends where the new config says
        log.info("resumed from %s at step %d, epoch %d", path, self.progress.step, self.progress.epoch)


def checkpoint_format(tcfg: TrainerConfig, dcfg: DistributedConfig) -> str:
    """trainer.checkpoint_format, with auto meaning sharded under FSDP (distributed.strategy) or for
    asynchronous saves."""
    if tcfg.checkpoint_format != "auto":
        return tcfg.checkpoint_format
    fsdp = distributed.resolve_strategy(dcfg) == "fsdp" and distributed.joined()
    return "sharded" if fsdp or tcfg.async_checkpoint else "full"


def check_resumable(progress: Progress, global_batch: int, path: Path) -> None:
    """A mid-epoch checkpoint continues only where it ends on one of this run's optimizer steps."""
    if progress.samples_done % global_batch:
        raise CheckpointError(
            f"{path}: stopped {progress.samples_done} samples into epoch {progress.epoch}, not a whole number "
            f"of this run's global batches ({global_batch} = data.batch_size x processes x grad_accum_steps); "
            "resume with the same global batch"
        )
