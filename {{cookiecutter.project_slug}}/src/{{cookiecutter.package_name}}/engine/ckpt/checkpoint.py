"""Checkpoints: complete training state, written atomically, verified, loaded with weights_only=True.

A checkpoint is checkpoints/step_<N>.pt (trainer.checkpoint_format=full: one file, gathered on the
main process) or the directory checkpoints/step_<N>/ (sharded: every process writes its own
shards, see sharded.py). Either is written under a temporary name, checked against the CRC-32 of
every record or file, fsynced and renamed, so a crash mid-save leaves the previous checkpoints
untouched and never a half-written newest one. Loading checks the CRCs again, so a file damaged
on disk later is reported as corrupt instead of loading wrong numbers. Listing, pruning, resume
and setting aside treat both formats alike.
"""

from __future__ import annotations

import logging
import pickle
import random
import re
import shutil
import zipfile
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError
from ..parallel import distributed
from . import sharded
from .files import atomic_write, move_aside
from .names import list_checkpoints, prune, step_of, strip_prefixes

log = logging.getLogger(__name__)


def verify(path: Path) -> None:
    """Raise CheckpointError unless every record of a torch zip file matches its CRC-32.

    torch.load does not check the CRCs, so a flipped bit would otherwise load as a wrong weight.
    Files that are not zip archives are left to torch.load to judge.
    """
    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise CheckpointError(f"{path}: unreadable, truncated or corrupt ({err})") from None
    if bad is not None:
        raise CheckpointError(f"{path}: corrupt, record {bad} does not match its CRC-32")


def save_checkpoint(directory: Path, state: dict, step: int, keep_last: int) -> Path:
    """Write state as directory/step_<step>.pt atomically, verify it, then prune older checkpoints.

    Only once the new file is verified and in place are the oldest deleted, leaving keep_last in
    all: the newest good checkpoint is never the one pruned.
    """
    path = Path(directory) / f"step_{step:08d}.pt"
    atomic_write(path, lambda tmp: torch.save(state, tmp), check=verify)
    prune(directory, step, keep_last)
    return path


def remove_stale_temporaries(directory: Path) -> None:
    """Delete temporary files and directories a killed save left behind (never a finished checkpoint)."""
    directory = Path(directory)
    if directory.is_dir():
        for tmp in directory.glob(".step_*.tmp*"):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)


def load_checkpoint(path: Path, map_location="cpu", rank: int = 0, world_size: int = 1) -> dict:
    """Load a checkpoint with weights_only=True: tensors and plain types only, never arbitrary code.

    A sharded checkpoint's files are verified (this process's share of them when rank and
    world_size say so) and its "model" entry is a sharded.ShardedWeights: the tensors are read
    later, each process the parts it needs.
    """
    path = Path(path)
    if sharded.is_sharded(path):
        sharded.verify(path, rank, world_size)
        state = _torch_load(path / sharded.TRAIN_STATE, map_location)
        if not isinstance(state, dict) or "progress" not in state:
            raise CheckpointError(f"{path}: not a training checkpoint of this project (no progress entry)")
        if state.pop("ema", False):  # the shards hold the weight average too
            state["ema"] = sharded.ShardedWeights(path, "ema")
        return {**state, "model": sharded.ShardedWeights(path)}
    verify(path)
    state = _torch_load(path, map_location)
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path}: not a training checkpoint of this project (no 'model' entry)")
    return state


def _torch_load(path: Path, map_location):
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        if "global" not in str(err).lower():  # random bytes fail the unpickler too, but are not code
            raise CheckpointError(f"{path}: unreadable, truncated or corrupt (not a torch checkpoint)") from None
        culprit = re.search(r"[Uu]nsupported global: GLOBAL ([\w.]+)", str(err))
        what = f" ({culprit[1]})" if culprit else ""
        raise CheckpointError(f"{path}: refused, it holds code or objects{what}, not only tensors and data") from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        reason = str(err).strip().splitlines()[0]
        raise CheckpointError(f"{path}: unreadable, truncated or corrupt ({reason})") from None
    return state


def latest_checkpoint(directory: Path, map_location="cpu") -> tuple[Path, dict] | None:
    """The newest checkpoint that loads; broken newer ones are skipped with a warning."""
    for path in reversed(list_checkpoints(directory)):
        try:
            return path, load_checkpoint(path, map_location)
        except CheckpointError as err:
            log.warning("skipping checkpoint: %s", err)
    return None


def save_weights(state_dict: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Plain weights with clean keys as safetensors (string metadata in its header), written atomically."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in strip_prefixes(state_dict).items()}
    atomic_write(Path(path), lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def weights_metadata(path: Path) -> dict[str, str]:
    """The metadata save_weights stored in a safetensors header ({} when none or unreadable)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception:  # safetensors raises its own error types for bad headers
        return {}


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Model weights from a .safetensors file, a state_dict .pt file or a training checkpoint."""
    path = Path(path)
    if path.suffix == ".safetensors":
        try:
            weights = load_file(str(path))
        except Exception as err:  # safetensors raises its own error types for bad headers
            raise CheckpointError(f"{path}: not a valid safetensors file ({str(err).strip()[:200]})") from None
    else:
        try:
            weights = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(f"{path}: cannot load weights ({str(err).strip().splitlines()[0]})") from None
        if isinstance(weights, dict) and isinstance(weights.get("model"), dict):
            weights = weights["model"]
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        kind = type(weights).__name__ if not isinstance(weights, dict) else "a dict holding non-tensor values"
        raise CheckpointError(f"{path}: not a state_dict of tensors (it holds {kind}); save model.state_dict()")
    return strip_prefixes(weights)


def rng_state() -> dict:
    """python, numpy and torch RNG states as tensors and plain types, which weights_only can load."""
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    """Restore what rng_state() returned."""
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resume_state(resume: str, checkpoints: Path, is_main: bool) -> tuple[Path, dict] | None:
    """The checkpoint to continue from (resume: trainer.resume): auto takes the newest valid one.

    Rank 0 chooses and tells the others, so every rank continues from the same file.
    """
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        state, error = _load_on_every_rank(path)
        if error:
            raise CheckpointError(error)
        return path, state
    candidates = distributed.broadcast_object([str(p) for p in list_checkpoints(checkpoints)] if is_main else None)
    for name in reversed(candidates):  # newest first
        state, error = _load_on_every_rank(Path(name))
        if not error:
            return Path(name), state
        if is_main:
            log.warning("skipping checkpoint: %s", error)
    if candidates:
        raise CheckpointError(
            f"{checkpoints}: checkpoints exist but none loads; refusing to restart from step 0 "
            "(move them away or set trainer.resume=never)"
        )
    return None


def _load_on_every_rank(path: Path) -> tuple[dict | None, str | None]:
    """(state, None) when the checkpoint loads on every process, else (None, the first error).

    Each process checks its share of a sharded checkpoint's files, so reading them is parallel."""
    state, error = None, None
    try:
        state = load_checkpoint(path, rank=distributed.rank(), world_size=distributed.world_size())
    except CheckpointError as err:
        error = str(err)
    errors = [e for e in distributed.all_gather_object(error) if e]
    return (None, errors[0]) if errors else (state, None)


def set_aside_later_checkpoints(checkpoints: Path, start_step: int, resume: str) -> None:
    """Checkpoints after the step this run starts from are not its own: rename them, never delete.

    With trainer.resume=auto they are the ones that failed to load; otherwise they belong to the
    run this one replaces. Left in place, a later auto-resume would jump back to them.
    """
    later = [p for p in list_checkpoints(checkpoints) if step_of(p) > start_step]
    if resume == "auto":
        move_aside(later, "corrupt", "it does not load")
    else:
        why = f"this run continues from step {start_step} instead" if start_step else "this run starts afresh"
        move_aside(later, "superseded", why)
