"""Sharded checkpoints: one directory that every process writes its own part of, in parallel.

    checkpoints/step_00000200/
        __0_0.distcp, __1_0.distcp, ...   each process's shards of the model and optimizer state
        .metadata                         torch.distributed.checkpoint's index of what lies where
        train_state.pt                    the rest (progress, scheduler, every rank's RNG, config)
        manifest.json                     size and CRC-32 of every file above, written last

Nothing is gathered: under FSDP each process writes the shards it holds, under DDP the replicated
tensors are written once, split between the processes (torch.distributed.checkpoint plans it). No
process ever holds the whole model and optimizer state, and the files are written in parallel.

The directory is written as .step_N.tmp. When a process has written its files it records their
sizes and CRC-32s in .rank<R>.json; once all are in, the main process merges them into
manifest.json, fsyncs, and renames the directory to step_N: a save killed at any point leaves
no step_N, and the previous checkpoints untouched. Loading checks every file against the manifest
(each process a share of the files), so a missing, truncated or damaged shard makes the whole
checkpoint unusable and resume falls back to the previous one.

With trainer.async_checkpoint=true, dcp.async_save copies the state to host memory and writes it
in a background thread while training goes on; at most one save is in flight, and it counts only
once committed as above. Its collectives run on a process group of their own, so they never
interleave with training's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..errors import CheckpointError, OutputError, why_not_written
from ..parallel import distributed, state_dicts
from ..torch_private import UnsynchronizedStager, uncompiled
from .files import atomic_write, fsync_dir, writing

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.pt"
DCP_INDEX = ".metadata"

# One process without a process group is what no_dist means here, not a mistake to warn about.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")


class ShardedWeights:
    """What a sharded checkpoint's "model" (and "ema") entry holds: where to read those weights from
    (read lazily, only the tensors a process needs: see load_weights_into and load_training_state)."""

    def __init__(self, path: Path, key: str = "model"):
        self.path, self.key = Path(path), key


def temporary_name(directory: Path, step: int) -> Path:
    return Path(directory) / f".step_{step:08d}.tmp"


def final_name(directory: Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}"


def crc32_of(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def failures() -> tuple[type[BaseException], ...]:
    """What a sharded save or load may raise: any Exception, and torch.distributed.checkpoint's
    CheckpointException (a BaseException). Imported on first use: torch.distributed.checkpoint takes
    0.8 s to import, which a run that never shards would pay at every start."""
    from torch.distributed.checkpoint.api import CheckpointException

    return Exception, CheckpointException


def root_cause(err: BaseException) -> BaseException:
    """The first rank's own exception inside torch.distributed.checkpoint's CheckpointException
    (a BaseException whose text is every rank's traceback)."""
    if isinstance(err, failures()[1]) and err.failures:
        first = next(iter(err.failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return err


def _rank_record(rank: int) -> str:
    return f".rank{rank}.json"


def record_own_files(folder: Path, rank: int) -> None:
    """After this process's write: the size and CRC-32 of each file it wrote, in .rank<R>.json."""
    names = [p.name for p in folder.iterdir() if p.name.startswith(f"__{rank}_")]
    if rank == 0:
        names += [name for name in (DCP_INDEX, TRAIN_STATE) if (folder / name).exists()]
    files = {name: {"bytes": (folder / name).stat().st_size, "crc32": crc32_of(folder / name)} for name in names}
    atomic_write(folder / _rank_record(rank), lambda tmp: tmp.write_text(json.dumps(files)))


@dataclass
class Pending:
    """A save this process started: its write (and record) finish in `done`."""

    folder: Path
    step: int
    keep_last: int
    done: Future
    committed: bool = False


def _finished(value=None) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class OneCopy(UnsynchronizedStager):
    """Stages a state dict for an asynchronous save as one host copy of this process's own data,
    into the same buffers save after save (so only the first save allocates them).

    torch 2.14's default stager deep-copies each DTensor and then copies it again into new memory:
    a 6.2 s stall per save for a 302M-parameter model's 1.8 GB share on 2 CPU cores, where one copy
    into memory already touched is 0.4 s. The buffers hold one more copy of this process's share
    for the whole run; a save reuses them only after the previous one was written (one in flight).
    """

    def __init__(self):
        self.staged = None

    def stage(self, state_dict: dict) -> dict:
        self.staged = _host_copy(state_dict, self.staged)
        return self.staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: stage() returns once the copy is made."""

    def close(self) -> None:
        """The buffers stay for the next save (released with the saver)."""


def _host_copy(value, into=None):
    """value with every tensor copied to host memory (a DTensor: its local shard, rewrapped), into
    the matching tensors of `into` (an earlier copy) where their shapes and types agree."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = value.to_local().detach()
        if isinstance(into, DTensor) and _fits(into.to_local(), local):
            into.to_local().copy_(local)
            return into
        return DTensor.from_local(
            local.to("cpu", copy=True), value.device_mesh, value.placements, run_check=False,
            shape=value.shape, stride=value.stride(),
        )  # fmt: skip
    if isinstance(value, torch.Tensor):
        if isinstance(into, torch.Tensor) and not isinstance(into, DTensor) and _fits(into, value):
            return into.copy_(value.detach())
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        earlier = into if isinstance(into, dict) else {}
        return {key: _host_copy(item, earlier.get(key)) for key, item in value.items()}
    if isinstance(value, list | tuple):
        earlier = into if isinstance(into, list | tuple) and len(into) == len(value) else [None] * len(value)
        return type(value)(_host_copy(item, old) for item, old in zip(value, earlier, strict=True))
    return value


def _fits(buffer: torch.Tensor, value: torch.Tensor) -> bool:
    return buffer.shape == value.shape and buffer.dtype == value.dtype and buffer.device.type == "cpu"


class ShardedSaver:
    """Starts sharded saves (every process), waits for them, and commits them (the main process)."""

    def __init__(self, use_async: bool):
        self.use_async = use_async
        self.pending: Pending | None = None
        self.stager = OneCopy()  # asynchronous saves: host buffers reused save after save
        self._group = None
        self._executor: ThreadPoolExecutor | None = None

    def _process_group(self):
        """A gloo group of its own for the checkpoint's collectives (made once, on every rank at once)."""
        if self._group is None and distributed.joined():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def start(self, directory: Path, step: int, tensors: dict, train_state: dict | None, keep_last: int) -> None:
        """Write step's checkpoint (every rank calls it; train_state on the main process only).

        Synchronous unless async: then it returns once the state is copied, and the write goes on.
        """
        from torch.distributed.checkpoint import FileSystemWriter, async_save, save

        self.finish()  # at most one in flight
        folder, rank = temporary_name(directory, step), distributed.rank()
        group = self._process_group()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)  # a save of this step that was killed
            folder.mkdir(parents=True)
            if train_state is not None:
                with open(folder / TRAIN_STATE, "wb") as f:
                    torch.save(train_state, f)
                    f.flush()
                    os.fsync(f.fileno())
        try:
            distributed.barrier()  # the folder exists before any rank writes into it
        except BaseException:  # a peer hung or died: this save never starts
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
            raise
        writer = FileSystemWriter(folder, sync_files=True)
        if self.use_async:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
            written = async_save(
                tensors, storage_writer=writer, process_group=group, no_dist=group is None, async_stager=self.stager
            )
            done = self._executor.submit(lambda: (written.result(), record_own_files(folder, rank)))
        else:
            try:
                save(tensors, storage_writer=writer, process_group=group, no_dist=group is None)
                record_own_files(folder, rank)
                done = _finished()
            except failures() as err:  # handed to finish(), which every rank reaches
                done = Future()
                done.set_exception(root_cause(err))
        self.pending = Pending(folder, step, keep_last, done)
        if not self.use_async:
            self.finish()

    def poll(self) -> Path | None:
        """Main process, every step: commit the save in flight if every rank's files are in (no
        collective, only a few file checks once its own write is done). Returns what it committed."""
        pending = self.pending
        if pending is None or pending.committed or distributed.rank() != 0 or not pending.done.done():
            return None
        if pending.done.exception() is not None or not self._all_recorded(pending.folder):
            return None
        return self._commit(pending)

    def finish(self) -> Path | None:
        """Every rank: wait for the save in flight, agree that all wrote it, commit it. Raises
        OutputError on every rank when any rank's write failed (the folder stays a .tmp, removed later)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        error = None
        try:
            pending.done.result()
        except failures() as err:
            error = why_not_written(root_cause(err), pending.folder.parent)
        errors = [e for e in distributed.all_gather_object(error) if e]
        if errors:
            if distributed.rank() == 0:
                shutil.rmtree(pending.folder, ignore_errors=True)  # never a checkpoint; nothing to keep
            raise OutputError(
                f"could not write the step {pending.step} checkpoint in {pending.folder.parent} ({errors[0]}); "
                "older ones are kept"
            )
        if distributed.rank() == 0 and not pending.committed:
            return self._commit(pending)
        return None

    def abandon(self) -> None:
        """After a failure elsewhere (no collective): let this rank's write end, and commit it on the
        main process only if every rank's files are already in."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.done.result()
        except failures():  # the failure being handled is the one to report
            return
        if distributed.rank() == 0 and not pending.committed and self._all_recorded(pending.folder):
            self._commit(pending)

    def _all_recorded(self, folder: Path) -> bool:
        return all((folder / _rank_record(r)).exists() for r in range(distributed.world_size()))

    def _commit(self, pending: Pending) -> Path:
        folder = pending.folder
        files: dict = {}
        for r in range(distributed.world_size()):
            files.update(json.loads((folder / _rank_record(r)).read_text()))
        if DCP_INDEX not in files or TRAIN_STATE not in files:
            raise CheckpointError(f"{folder}: the save did not write {DCP_INDEX} and {TRAIN_STATE}")
        manifest = json.dumps({"step": pending.step, "files": files}, indent=1)
        atomic_write(folder / MANIFEST, lambda tmp: tmp.write_text(manifest))
        for r in range(distributed.world_size()):
            (folder / _rank_record(r)).unlink()
        fsync_dir(folder)
        target = final_name(folder.parent, pending.step)
        if target.exists():  # a checkpoint of this step from a run that was set aside: keep it
            target.rename(target.with_name(f"{target.name}.replaced-{os.getpid()}"))
        os.replace(folder, target)
        fsync_dir(folder.parent)
        pending.committed = True
        from .names import prune

        prune(folder.parent, pending.step, pending.keep_last)
        return target

    def close(self) -> None:
        self.stager.staged = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def is_sharded(path: Path) -> bool:
    return Path(path).is_dir()


def verify(path: Path, rank: int = 0, world_size: int = 1) -> None:
    """Raise CheckpointError unless this process's share of the files (all for one process) match
    the manifest's sizes and CRC-32s; a checkpoint without a manifest never finished."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise CheckpointError(f"{path}: incomplete, no {MANIFEST} (the save did not finish)") from None
    except (ValueError, KeyError, TypeError, OSError) as err:
        raise CheckpointError(f"{path}: unreadable {MANIFEST} ({err})") from None
    for name in sorted(files)[rank::world_size]:
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path}: corrupt, {name} is missing")
        if file.stat().st_size != files[name]["bytes"]:
            raise CheckpointError(
                f"{path}: corrupt, {name} has {file.stat().st_size} bytes, not {files[name]['bytes']} (truncated?)"
            )
        if crc32_of(file) != files[name]["crc32"]:
            raise CheckpointError(f"{path}: corrupt, {name} does not match its CRC-32")


def _read_error(path: Path, err: BaseException) -> CheckpointError:
    reason = str(err).strip().splitlines()[0][:240] if str(err).strip() else type(err).__name__
    if "Missing key" in reason or "size" in reason.lower():
        return CheckpointError(f"{path}: does not fit the configured model ({reason})")
    return CheckpointError(f"{path}: cannot read its shards ({reason})")


def load_weights_into(model: nn.Module, path: Path, key: str = "model") -> None:
    """Read a sharded checkpoint's weights (key "ema": their average) into an unsharded model, and no
    optimizer state: each process reads on its own (evaluate, export, generate)."""
    from torch.distributed.checkpoint import load

    from ..ema import averaged_tensors

    if key == "model":  # what the checkpoint holds (no frozen base the task rebuilds: state_dicts.saved)
        weights = state_dicts.saved(model, model.state_dict())
    else:  # the average is read in place: parameters and floating-point buffers (integer ones are the model's)
        weights = {name: tensor.detach() for name, tensor in averaged_tensors(model).items()}
    try:
        load({key: weights}, checkpoint_id=str(path), no_dist=True)
    except failures() as err:
        raise _read_error(path, root_cause(err)) from None
    if key == "model":
        model.load_state_dict(weights, strict=not state_dicts.rebuilds_frozen(model))


# safetensors' names of the dtypes a model's state may hold.
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip


def holds_shards(model: nn.Module) -> bool:
    """Whether the model's parameters are sharded over processes (FSDP2's DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(param, DTensor) for param in model.parameters())


def write_weights_gathered(model: nn.Module, path: Path, metadata: dict[str, str]) -> None:
    """The sharded model's weights as one safetensors file written by the main process, gathered
    one tensor at a time: no process holds more than one whole tensor beyond its shards (gathering
    them all first would put the whole model on the main process's CPU). Every rank calls it; a
    failed write raises OutputError on every rank, and nothing is left behind."""
    from torch.distributed.tensor import DTensor

    from .names import strip_prefixes

    tensors = strip_prefixes(state_dicts.saved(model, uncompiled(model).state_dict()))

    def gather(tmp: Path | None) -> None:
        """Every rank gathers each tensor in turn (collectives); the main process writes them to tmp.
        A failed write does not stop the gathers, or the other ranks would wait for it forever."""
        out, error = None, None
        if tmp is not None:
            try:
                out = open(tmp, "wb")  # noqa: SIM115 (closed below, after every gather)
                out.write(_safetensors_header(tensors, metadata))
            except OSError as err:
                error = err
        try:
            for value in tensors.values():
                whole = value.full_tensor() if isinstance(value, DTensor) else value
                if out is not None and error is None:
                    try:
                        out.write(whole.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
                    except OSError as err:
                        error = err
        finally:
            if out is not None:
                out.close()
        if error is not None:
            raise error

    reason = None
    if distributed.rank() == 0:
        try:
            with writing(path):
                atomic_write(path, gather)
        except OutputError as err:
            reason = str(err)
    else:
        gather(None)
    reason = distributed.broadcast_object(reason)
    if reason:
        raise OutputError(reason)


def _safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The length-prefixed JSON header of a safetensors file holding tensors in this order."""
    import struct

    header, offset = {"__metadata__": metadata}, 0
    for name, value in tensors.items():
        size = value.numel() * value.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[value.dtype], "shape": list(value.shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This process's part of the model and optimizer state (FSDP: its shards), keyed by parameter
    name, with no copy and no gather."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(ignore_frozen_params=state_dicts.rebuilds_frozen(model))  # a base the task rebuilds
    weights, optim_state = get_state_dict(uncompiled(model), optimizer, options=options)
    return {"model": weights, "optimizer": optim_state}


def load_training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, path: Path, extra: dict | None = None
) -> None:
    """Read a sharded checkpoint into this process's model and optimizer, resharding as needed:
    a checkpoint written by N processes loads on M, under FSDP, DDP or one process. extra: more
    entries the checkpoint holds (the weight average), read in place into the tensors given."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = sharded_state(model, optimizer)  # the optimizer's state is created (zeros) to be filled
    state.update(extra or {})
    try:
        load(state, checkpoint_id=str(path), no_dist=not distributed.joined())
    except failures() as err:
        raise _read_error(path, root_cause(err)) from None
    inner = uncompiled(model)
    # A frozen base the task rebuilds is not in the state (the load above found every key the state has).
    leave_out = state_dicts.rebuilds_frozen(model)
    options = StateDictOptions(ignore_frozen_params=leave_out, strict=not leave_out)
    set_state_dict(
        inner, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options
    )
