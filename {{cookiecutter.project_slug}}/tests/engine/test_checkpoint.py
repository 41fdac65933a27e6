"""Checkpoints: complete state, atomic writes, pruning, fallback past corrupt files, safe loading."""

import logging
import pickle
import random

import numpy as np
import pytest
import torch
from torch import nn

from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_weights,
    rng_state,
    save_checkpoint,
    set_rng_state,
    strip_prefixes,
)
from {{ cookiecutter.package_name }}.train import main


def _state(step: int) -> dict:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "progress": {"step": step, "epoch": 0, "batches_done": 3},
        "rng": rng_state(),
        "config": {"run": {"seed": 0}},
    }


def test_round_trip_keeps_the_complete_state(tmp_path):
    """Everything saved (model, optimizer, scheduler, scaler, progress, RNG, config) loads back with weights_only."""
    state = _state(step=5)
    path = save_checkpoint(tmp_path, state, step=5, keep_last=3)
    loaded = load_checkpoint(path)
    assert loaded.keys() == state.keys()
    for key in state["model"]:
        assert torch.equal(loaded["model"][key], state["model"][key])
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert loaded["progress"] == state["progress"] and loaded["config"] == state["config"]


def test_rng_state_restores_python_numpy_and_torch():
    """After set_rng_state, all three generators repeat the same numbers."""
    saved = rng_state()
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(saved)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_interrupted_save_leaves_the_newest_good_checkpoint(tmp_path, monkeypatch):
    """A crash half-way through writing leaves no new checkpoint, no temp file, the old one intact."""
    good = save_checkpoint(tmp_path, _state(1), step=1, keep_last=3)
    good_bytes = good.read_bytes()

    def crash(obj, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, _state(2), step=2, keep_last=3)
    assert [p.name for p in tmp_path.iterdir()] == [good.name]
    assert good.read_bytes() == good_bytes


def test_keep_last_prunes_oldest(tmp_path):
    """Only the newest keep_last checkpoints remain, ordered by step, not by name."""
    for step in (1, 2, 10, 100):
        save_checkpoint(tmp_path, _state(step), step=step, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000010.pt", "step_00000100.pt"]


def test_corrupt_newest_checkpoint_falls_back_with_a_warning(tmp_path, caplog):
    """A truncated newest checkpoint is skipped, named in a warning, and the previous one is used."""
    save_checkpoint(tmp_path, _state(1), step=1, keep_last=3)
    newest = save_checkpoint(tmp_path, _state(2), step=2, keep_last=3)
    newest.write_bytes(newest.read_bytes()[:200])
    with caplog.at_level(logging.WARNING):
        path, state = latest_checkpoint(tmp_path)
    assert state["progress"]["step"] == 1 and path.name == "step_00000001.pt"
    assert newest.name in caplog.text


class Payload:
    def __reduce__(self):
        return (open, ("PWNED", "w"))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickle_payload_is_refused_and_never_runs(tmp_path, monkeypatch):
    """A checkpoint carrying code is refused by weights_only loading and its payload does not run."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "step_00000001.pt"
    with open(path, "wb") as f:
        pickle.dump({"model": Payload()}, f)
    with pytest.raises(CheckpointError, match="refused"):
        load_checkpoint(path)
    assert not (tmp_path / "PWNED").exists()


def test_random_bytes_are_called_corrupt_not_malicious(tmp_path):
    """A file of random bytes is reported as corrupt, not as a refused pickle."""
    path = tmp_path / "step_00000001.pt"
    path.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(CheckpointError, match="unreadable, truncated or corrupt"):
        load_checkpoint(path)


def test_stale_temporary_files_are_removed(tmp_path):
    """Temporary files of a killed save are deleted; finished checkpoints stay."""
    from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import remove_stale_temporaries

    good = save_checkpoint(tmp_path, _state(1), step=1, keep_last=3)
    (tmp_path / ".step_00000002.tmp-999.pt").write_bytes(b"half")
    remove_stale_temporaries(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [good.name]


def test_prefixes_of_wrapped_and_compiled_models_are_stripped(tmp_path):
    """module. (DDP) and _orig_mod. (torch.compile) prefixes load into a plain model."""
    plain = nn.Linear(3, 2).state_dict()
    wrapped = {f"_orig_mod.module.{k}": v for k, v in plain.items()}
    assert strip_prefixes(wrapped).keys() == plain.keys()
    torch.save({"model": wrapped}, tmp_path / "ckpt.pt")
    assert load_weights(tmp_path / "ckpt.pt").keys() == plain.keys()


def test_resume_refuses_to_restart_when_every_checkpoint_is_broken(tiny, run_dir, capsys):
    """Checkpoints that exist but all fail to load stop the run instead of silently starting at step 0."""
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000004.pt").write_bytes(b"garbage")
    assert main(tiny) == 2
    assert "refusing to restart from step 0" in capsys.readouterr().err
