"""The rules of a run directory (run.output_dir).

- One run writes into it at a time: the main process holds a lock file naming its host and pid;
  a second run exits 2 naming the first. A lock whose process died is taken over (the kernel
  releases its flock), so a crash never leaves the directory locked.
- A fresh start loses no earlier file: what an earlier run wrote there (metrics.jsonl,
  best.safetensors, config.yaml, ...) is renamed *.superseded, under a name no other file has.
- A resumed run trains what its configuration says: keys in RESUME_MAY_CHANGE (and the task's
  TaskSpec.resume_may_change) may differ from the
  checkpoint's stored configuration and are applied; any other difference stops the run (exit 2)
  naming each key, unless trainer.override_optim=true applies new optimizer settings.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from torch import nn

from .ckpt.checkpoint import save_weights, set_aside_later_checkpoints, weights_metadata
from .ckpt.files import atomic_write, move_aside, writing
from .ckpt.sharded import write_weights_gathered
from .errors import ConfigError, OutputError, RunDirectoryBusy, write_failure
from .metrics import truncate_metrics
from .parallel import distributed

log = logging.getLogger(__name__)

LOCK_NAME = "run.lock"

# Keys a resumed run may change: stop conditions, cadence, where and how it runs, the tracker.
# Each leaves the optimization itself (model, data, batch, optimizer, precision, seed) as it was.
RESUME_MAY_CHANGE = (
    "run.output_dir",
    "run.device",
    "run.deterministic",
    "run.cache_cpu_memory",
    "data.num_workers",
    "data.loader",  # the same samples in the same order (a random draw per sample is made otherwise)
    "model.compile",
    "model.activation_checkpointing",  # recomputes the same activations
    "trainer.max_epochs",
    "trainer.max_steps",
    "trainer.checkpoint_every",
    "trainer.keep_last",
    "trainer.resume",
    "trainer.log_every",
    "trainer.detect_anomaly",
    "trainer.override_optim",
    "trainer.early_stop_patience",
    "trainer.checkpoint_format",  # both formats resume on any layout
    "trainer.async_checkpoint",
    "trainer.profile_steps",
    "optim.ema_decay",  # the average only (validation, export): the weights train the same
    "distributed.strategy",
    "distributed.replicate_degree",
    "distributed.backend",
    "distributed.timeout_s",
    "tracker.*",
)
# May change when the global batch (batch_size x processes x grad_accum_steps) stays the same,
# e.g. 2 processes x 32 resumed on 1 process x 64.
GLOBAL_BATCH_KEYS = ("data.batch_size", "trainer.grad_accum_steps")
# Applied to the restored optimizer and scheduler with trainer.override_optim=true.
OPTIM_KEYS = (
    *("optim.lr", "optim.weight_decay", "optim.betas", "optim.warmup_steps", "optim.min_lr_ratio"),
    "trainer.grad_clip",
)

# What a run writes at the top of its directory; a fresh start sets these aside (checkpoints are
# set aside by checkpoint.set_aside_later_checkpoints).
RUN_FILES = (
    "metrics.jsonl", "config.yaml", "run_info.json", "best.safetensors", "best.json", "wandb_run_id", "tensorboard",
    "mlflow_run_id", "profile", "eval.json", "eval", "export",
)  # fmt: skip


def _flat(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _may_change(key: str, task_may_change: tuple[str, ...]) -> bool:
    allowed = (*RESUME_MAY_CHANGE, *task_may_change)
    return key in allowed or f"{key.split('.')[0]}.*" in allowed


def config_changes(stored: dict, current: dict) -> dict[str, tuple]:
    """{key: (stored value, current value)} for every key whose value differs.

    Keys that only one side has (a checkpoint from an older version of the project) are not compared.
    """
    old, new = _flat(stored or {}), _flat(current)
    return {key: (old[key], new[key]) for key in new if key in old and old[key] != new[key]}


def check_resume_changes(
    changes: dict[str, tuple],
    path: Path,
    stored_global_batch: int,
    global_batch: int,
    override_optim: bool,
    task_may_change: tuple[str, ...] = (),
) -> list[str]:
    """Refuse changes a resumed run cannot honour (ConfigError naming each); return the allowed ones.
    task_may_change: the task's keys that may change too (TaskSpec.resume_may_change)."""
    refused = {}
    for key, (old, new) in changes.items():
        if _may_change(key, task_may_change) or (key in OPTIM_KEYS and override_optim):
            continue
        if key in GLOBAL_BATCH_KEYS and stored_global_batch == global_batch:
            continue
        refused[key] = (old, new)
    if refused:
        listed = ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in refused.items())
        if any(key in GLOBAL_BATCH_KEYS for key in refused):
            listed += f" (global batch {stored_global_batch} -> {global_batch})"
        optim = [key for key in refused if key in OPTIM_KEYS]
        back = " ".join(
            f"{key}={_as_override(was)}" for key, (was, _) in refused.items() if key not in GLOBAL_BATCH_KEYS
        )
        remedy = f"resume with {back}, or " if back else ""
        remedy += "start a new run.output_dir (or trainer.resume=never)"
        if optim and len(optim) == len(refused):
            remedy += (
                ", or add trainer.override_optim=true to apply the new "
                f"{', '.join(optim)} to the restored optimizer and scheduler"
            )
        raise ConfigError(
            f"resuming from {path} with a changed configuration: {listed}; these must match the checkpoint: {remedy}"
        )
    return sorted(changes)


def _as_override(value) -> str:
    """A stored value as a command-line override writes it (null, true, [0.9,0.95], text)."""
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def set_aside_run_files(output_dir: Path, names=RUN_FILES) -> None:
    """A fresh start: rename an earlier run's files *.superseded (kept, never overwritten or appended to)."""
    found = [Path(output_dir) / name for name in names]
    move_aside([p for p in found if p.exists() or p.is_symlink()], "superseded", "it belongs to an earlier run")


def claim_output_dir(output_dir: Path) -> RunLock:
    """Create run.output_dir if needed and lock it for this run (main process only)."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"run.output_dir={str(output_dir)!r} cannot be created ({err.strerror})") from None
    return RunLock(output_dir).acquire()


def start_in_output_dir(
    output_dir: Path,
    config_yaml: str,
    resume: str,
    start_step: int,
    resumed: bool,
    model_files: dict[str, bytes] | None = None,
) -> None:
    """Before the first step (main process only): keep every earlier file, then write config.yaml (the
    whole resolved config, config_yaml) and the task's model files (Task.model_files: what turns inputs
    into the model's, say). resume is trainer.resume.

    A resumed run keeps the metrics logged up to its checkpoint; a fresh start sets the earlier
    run's files aside. Either way, checkpoints and a best model of steps after start_step belong
    to a run this one replaces: renamed, never deleted, so no later resume jumps back to them.
    """
    model_files = model_files or {}
    if resumed:
        truncate_metrics(output_dir, start_step)  # lines logged after this checkpoint are redone
        best = output_dir / "best.safetensors"
        if best.exists() and int(weights_metadata(best).get("step", -1)) > start_step:
            set_aside_run_files(output_dir, ["best.safetensors", "best.json"])
    else:
        set_aside_run_files(output_dir, (*RUN_FILES, *sorted({name.split("/")[0] for name in model_files})))
    set_aside_later_checkpoints(output_dir / "checkpoints", start_step, resume)
    config_file = output_dir / "config.yaml"
    with writing(config_file):
        atomic_write(config_file, lambda tmp: tmp.write_text(config_yaml, encoding="utf-8"))
    write_model_files(output_dir, model_files)


def write_model_files(folder: Path, files: dict[str, bytes]) -> None:
    """Write the task's model files (path relative to folder -> bytes), each atomically."""
    for name, content in files.items():
        path = Path(folder) / name
        with writing(path):
            atomic_write(path, lambda tmp, content=content: tmp.write_bytes(content))


def save_best(
    weights: dict, output_dir: Path, step: int, metrics: dict, monitor: tuple[str, str], kind: str = "trained"
) -> None:
    """best.safetensors, with the step and validation metrics that made it best in its header, and
    best.json saying the same (monitor: the metric and its mode; kind: trained weights or their
    moving average, "ema")."""
    path = output_dir / "best.safetensors"
    with writing(path):
        save_weights(weights, path, metadata=best_metadata(step, metrics, kind))
    write_best_json(output_dir, step, metrics, monitor, kind)


def save_best_sharded(
    model: nn.Module, output_dir: Path, step: int, metrics: dict, monitor: tuple[str, str], kind: str = "trained"
) -> None:
    """save_best for a sharded model (every rank calls it): gathered one tensor at a time."""
    write_weights_gathered(model, output_dir / "best.safetensors", best_metadata(step, metrics, kind))
    distributed.on_main(write_best_json, output_dir, step, metrics, monitor, kind)


def write_best_json(output_dir: Path, step: int, metrics: dict, monitor: tuple[str, str], kind: str) -> None:
    """best.json: which step best.safetensors holds, by which metric and mode, which weights, and its validation."""
    name, mode = monitor
    record = {"step": step, "monitor": name, "mode": mode, "value": metrics[name], "weights": kind, "metrics": metrics}
    path = output_dir / "best.json"
    with writing(path):
        atomic_write(path, lambda tmp: tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8"))


def best_metadata(step: int, metrics: dict, kind: str) -> dict[str, str]:
    return {"step": str(step), "weights": kind, **{k: str(v) for k, v in metrics.items()}}


class RunLock:
    """An exclusive lock on a run directory, held by the main process for the whole run (the sweep
    locks its output_dir with another name and message).

    The lock file says who holds it (host, pid, start time). flock releases it when the holder's
    process ends, however it ends, so a stale file is simply taken over.
    """

    BUSY = (
        "run.output_dir={dir!r} is in use by another run ({holder}); wait for it to finish, or choose another "
        "run.output_dir"
    )

    def __init__(self, output_dir: Path, name: str = LOCK_NAME, busy: str = BUSY):
        self.path = Path(output_dir) / name
        self.busy = busy  # the refusal: {dir} is the directory, {holder} who holds it
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock or raise RunDirectoryBusy naming the run that holds it."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise OutputError(f"cannot create the lock file {self.path} ({write_failure(err)})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise RunDirectoryBusy(self.busy.format(dir=str(self.path.parent), holder=holder)) from None
            # The holder may have removed the file between our open and our flock: lock the file
            # that is at the path now, not an unlinked one.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = _read_holder(fd)
        if previous != "unknown":
            log.info("took over the lock of a run that has ended (%s)", previous)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file and let go of the lock (a no-op when not held)."""
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {record['pid']} on host {record['host']}, started {record['started']}"
    except (ValueError, KeyError, OSError):
        return "unknown"
