"""Sharded checkpoints (trainer.checkpoint_format=sharded): a directory every process writes its
part of, committed once complete, verified file by file on load, pruned and resumed like a file.

Under FSDP they are the default, so the fault matrix (test_faults.py) and the N-to-M resume tests
(test_train.py) run on them; these tests cover what is particular to the format on one process.
"""

import errno
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import latest_checkpoint, list_checkpoints
from {{ cookiecutter.package_name }}.engine.ckpt.sharded import MANIFEST
from {{ cookiecutter.package_name }}.evaluate import main as evaluate_main
from {{ cookiecutter.package_name }}.export import main as export_main
from {{ cookiecutter.package_name }}.train import main

from conftest import in_full

pytestmark = pytest.mark.core  # task-independent: the template runs it in one task's bake

SHARDED = ["trainer.checkpoint_format=sharded", "trainer.checkpoint_every=2", "trainer.max_steps=4"]


@pytest.mark.slow
def test_a_sharded_checkpoint_is_a_directory_whose_manifest_covers_every_file(tiny, run_dir):
    """Each save is a step_N directory with a manifest of every file's size and CRC-32 beside the
    shards, the index and the training state; keep_last prunes whole directories, and no temporary
    directory is left."""
    assert main([*tiny, *SHARDED, "trainer.max_steps=6", "trainer.keep_last=2"]) == 0
    found = list_checkpoints(run_dir / "checkpoints")
    assert [p.name for p in found] == ["step_00000004", "step_00000006"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000004", "step_00000006"]
    for folder in found:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        on_disk = {p.name: p.stat().st_size for p in folder.iterdir() if p.name != MANIFEST}
        assert {name: entry["bytes"] for name, entry in files.items()} == on_disk
        assert {".metadata", "train_state.pt", "__0_0.distcp"} <= set(files)


def _damage(folder, how: str) -> None:
    shard = folder / "__0_0.distcp"
    if how == "truncate-a-shard":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif how == "flip-a-bit-in-a-shard":  # loads fine without the manifest's CRC: a wrong weight
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif how == "delete-a-shard":
        shard.unlink()
    else:  # no manifest: a directory that was never committed, copied in by hand
        (folder / MANIFEST).unlink()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncate-a-shard", "flip-a-bit-in-a-shard", "delete-a-shard", "no-manifest"])
def test_a_damaged_sharded_checkpoint_is_set_aside_and_the_previous_one_used(how, tiny, run_dir, caplog):
    """A sharded checkpoint with a damaged or missing file is named in a warning, renamed
    *.corrupt (kept, not deleted) and the run resumes from the previous one."""
    assert main([*tiny, *SHARDED, "trainer.keep_last=5"]) == 0
    first, second = list_checkpoints(run_dir / "checkpoints")
    _damage(second, how)
    with caplog.at_level("INFO"):
        assert main([*tiny, *SHARDED, "trainer.keep_last=5"]) == 0
    assert f"skipping checkpoint: {second}" in caplog.text and f"resumed from {first}" in caplog.text
    assert second.with_name(second.name + ".corrupt").is_dir()
    assert latest_checkpoint(run_dir / "checkpoints")[1]["progress"]["step"] == 4  # redone from step 2


@pytest.mark.slow
def test_a_failed_sharded_write_exits_1_and_keeps_the_older_checkpoints(tiny, run_dir, monkeypatch, capsys):
    """A full disk while the shards are written exits 1 with one line; the step-2 checkpoint is intact
    and the unfinished directory never becomes a checkpoint."""
    from torch.distributed.checkpoint import filesystem

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    assert main([*tiny, *SHARDED, "trainer.max_steps=2"]) == 0
    real_write = filesystem._write_item
    monkeypatch.setattr(filesystem, "_write_item", full_disk)  # every shard write of the next save fails
    capsys.readouterr()
    assert main([*tiny, *SHARDED, "trainer.max_steps=4"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "could not write the step 4 checkpoint" in err and "older ones are kept" in err
    assert "no space left" in err
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000002"]
    assert not list((run_dir / "checkpoints").glob(".*tmp*"))  # the unfinished directory is gone
    monkeypatch.setattr(filesystem, "_write_item", real_write)
    assert in_full(latest_checkpoint(run_dir / "checkpoints")[1])["progress"]["step"] == 2


@pytest.mark.slow
def test_export_and_evaluate_read_a_sharded_checkpoint(tiny, run_dir):
    """export writes the sharded checkpoint's weights as model.safetensors (the same tensors as the
    checkpoint holds), and evaluate reads them too."""
    assert main([*tiny, *SHARDED]) == 0
    path, state = latest_checkpoint(run_dir / "checkpoints")
    assert export_main(["--checkpoint", str(path), "run.device=cpu"]) == 0
    exported = load_file(str(run_dir / "export" / "model.safetensors"))
    weights = in_full(state)["model"]
    assert exported.keys() == weights.keys()
    assert all(torch.equal(exported[k], weights[k]) for k in weights)
    assert evaluate_main(["--checkpoint", str(path), "run.device=cpu"]) == 0
    assert json.loads((run_dir / "eval.json").read_text())["step"] == 4
