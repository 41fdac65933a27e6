"""Faults inside one training process, injected for real on CPU, and what must hold afterwards.

| fault                                             | must hold                                           |
|---------------------------------------------------|-----------------------------------------------------|
| NaN gradient                                      | exit 1 naming the step; update skipped; no NaN saved|
| corrupt, truncated or bit-flipped newest file     | warned, renamed aside, previous one used            |
| disk full while saving                            | exit 1, older checkpoints intact                    |
| pickle payload given to train or evaluate         | refused, exit 2, the payload never runs             |

Faults across processes (SIGKILL, signals, a hung or dead peer, restarts) are test_faults.py's.
"""

import errno
import os
from pathlib import Path

import pytest
import torch

from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from {{ cookiecutter.package_name }}.evaluate import main as evaluate_main
from {{ cookiecutter.package_name }}.export import main as export_main
from {{ cookiecutter.package_name }}.task.task import Task
from {{ cookiecutter.package_name }}.train import main

from conftest import newest, read_metrics


@pytest.mark.slow
@pytest.mark.core  # checkpoint damage and failed steps: the same for every task
def test_nan_gradient_stops_before_the_update_and_saves_nothing(tiny, run_dir, monkeypatch, capsys):
    """A NaN loss at step 3 (so NaN gradients): that update is skipped, the run stops with exit 1
    naming step 3 and the remedies, and nothing after the step-2 checkpoint is saved."""
    real_loss, real_build, calls, built = Task.loss, Task.build_model, [], []

    def nan_at_step_3(self, model, batch):
        calls.append(1)
        loss, samples = real_loss(self, model, batch)
        return loss * (float("nan") if len(calls) == 3 else 1.0), samples

    monkeypatch.setattr(Task, "loss", nan_at_step_3)
    monkeypatch.setattr(Task, "build_model", lambda self, *a: built.append(real_build(self, *a)) or built[-1])
    assert main([*tiny, "trainer.checkpoint_every=2", "trainer.log_every=3"]) == 1
    err = capsys.readouterr().err
    assert "gradient norm is not finite at step 3" in err and "lower optim.lr" in err
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000002.pt"]
    saved = newest(run_dir)["model"]
    for name, param in built[0].named_parameters():  # the skipped update left every weight as it was
        assert torch.equal(param.detach(), saved[name]), name


@pytest.mark.slow
@pytest.mark.core  # checkpoint damage and failed steps: the same for every task
def test_the_first_non_finite_step_of_a_log_window_is_named(tiny, run_dir, monkeypatch, capsys):
    """NaN losses at steps 2 and 3 of a 4-step log window: both updates are skipped on the device,
    and the check at the log line (one host read per window) names step 2, the first of them."""
    real_loss, calls = Task.loss, []

    def nan_at_steps_2_and_3(self, model, batch):
        calls.append(1)
        loss, samples = real_loss(self, model, batch)
        return loss * (float("nan") if len(calls) in (2, 3) else 1.0), samples

    monkeypatch.setattr(Task, "loss", nan_at_steps_2_and_3)
    assert main([*tiny, "trainer.log_every=4", "trainer.checkpoint_every=100"]) == 1
    err = capsys.readouterr().err
    assert "gradient norm is not finite at step 2 " in err, err[-2000:]
    assert not list_checkpoints(run_dir / "checkpoints")


@pytest.mark.gpu
def test_fp16_overflow_steps_are_skipped_counted_and_not_fatal(tiny, run_dir, monkeypatch):
    """fp16 on a GPU: a loss scaled up 1e6x at step 3 overflows the fp16 gradients, so the GradScaler
    skips that step; the run goes on, counts it in train/skipped_steps and exits 0."""
    on_gpu = [o for o in tiny if o != "run.device=cpu"] + ["trainer.precision=fp16", "trainer.log_every=1"]
    real_loss, calls = Task.loss, []

    def overflow_at_step_3(self, model, batch):
        calls.append(1)
        loss, samples = real_loss(self, model, batch)
        return loss * (1e6 if len(calls) == 3 else 1.0), samples

    monkeypatch.setattr(Task, "loss", overflow_at_step_3)
    assert main(on_gpu) == 0
    skipped = {r["step"]: r["train/skipped_steps"] for r in read_metrics(run_dir) if "train/skipped_steps" in r}
    assert skipped[3] == skipped[2] + 1
    assert all(torch.isfinite(v).all() for v in newest(run_dir)["model"].values() if v.is_floating_point())


def test_anomaly_detection_names_the_operation(tiny, monkeypatch, capsys):
    """trainer.detect_anomaly=true turns a NaN gradient into an error naming the backward operation."""
    real_loss = Task.loss

    def sqrt_of_zero(self, model, batch):  # d sqrt(x) / dx is inf at 0, and inf x 0 is NaN
        loss, samples = real_loss(self, model, batch)
        return loss + (loss * 0).sqrt() * -1, samples

    monkeypatch.setattr(Task, "loss", sqrt_of_zero)
    assert main([*tiny, "trainer.detect_anomaly=true", "trainer.max_steps=1"]) == 1
    err = capsys.readouterr().err
    assert "Backward" in err and "nan" in err.lower()


def _two_checkpoints(tiny, run_dir) -> list[Path]:
    assert main([*tiny, "trainer.checkpoint_every=2", "trainer.max_steps=4", "trainer.keep_last=5"]) == 0
    return list_checkpoints(run_dir / "checkpoints")  # steps 2 and 4 (the end-of-run one is step 4 too)


@pytest.mark.slow
@pytest.mark.core  # checkpoint damage and failed steps: the same for every task
@pytest.mark.parametrize("damage", ["truncate", "flip-a-bit"])
def test_damaged_newest_checkpoint_is_set_aside_and_the_previous_one_used(damage, tiny, run_dir, caplog):
    """A truncated or bit-flipped newest checkpoint is named in a warning, renamed *.corrupt (kept),
    and the run resumes from the previous one instead of step 0."""
    first, second = _two_checkpoints(tiny, run_dir)
    data = bytearray(second.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01  # torch.load alone would load this as a wrong weight
    second.write_bytes(bytes(data))
    with caplog.at_level("INFO"):
        assert main([*tiny, "trainer.checkpoint_every=2", "trainer.max_steps=4", "trainer.keep_last=5"]) == 0
    assert second.name in caplog.text and "resumed from" in caplog.text and first.name in caplog.text
    assert second.with_name(second.name + ".corrupt").exists()
    assert newest(run_dir)["progress"]["step"] == 4  # redone from step 2


@pytest.mark.slow
@pytest.mark.core  # checkpoint damage and failed steps: the same for every task
def test_an_older_starting_point_renames_later_checkpoints_instead_of_deleting_them(tiny, run_dir):
    """Resuming from an explicit older checkpoint renames the later ones *.superseded (kept), so a
    later auto-resume cannot jump back to the replaced run."""
    first, second = _two_checkpoints(tiny, run_dir)
    kept = second.read_bytes()
    assert main([*tiny, "trainer.checkpoint_every=2", "trainer.max_steps=3", f"trainer.resume={first}"]) == 0
    assert second.with_name(second.name + ".superseded").read_bytes() == kept
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == [first.name, "step_00000003.pt"]


def test_keep_last_one_never_deletes_the_only_good_checkpoint(tmp_path, monkeypatch):
    """With keep_last=1, a save that fails verification leaves the previous checkpoint in place."""
    good = save_checkpoint(tmp_path, {"model": {"w": torch.ones(3)}}, step=1, keep_last=1)
    real_save = torch.save

    def corrupting_save(obj, path):
        real_save(obj, path)
        data = bytearray(Path(path).read_bytes())
        data[len(data) // 2] ^= 0x01
        Path(path).write_bytes(bytes(data))

    monkeypatch.setattr(torch, "save", corrupting_save)
    with pytest.raises(CheckpointError, match="CRC"):
        save_checkpoint(tmp_path, {"model": {"w": torch.zeros(1000)}}, step=2, keep_last=1)
    assert [p.name for p in tmp_path.iterdir()] == [good.name]


@pytest.mark.slow
@pytest.mark.core  # checkpoint damage and failed steps: the same for every task
@pytest.mark.parametrize("failure", ["ENOSPC", "torch-write-failed"])
def test_disk_full_while_saving_exits_1_and_keeps_older_checkpoints(failure, tiny, run_dir, monkeypatch, capsys):
    """A full disk during a save (an OSError, or torch.save's own RuntimeError when it writes to a
    full device) exits 1 with one line naming the folder; the earlier checkpoint is intact."""
    real_save, saves = torch.save, []

    def full_disk(obj, path):
        saves.append(path)
        if len(saves) == 2 and failure == "ENOSPC":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, "/dev/full" if len(saves) == 2 else path)  # /dev/full: every write fails with ENOSPC

    monkeypatch.setattr(torch, "save", full_disk)
    assert main([*tiny, "trainer.checkpoint_every=2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "could not write the step 4 checkpoint" in err and "older ones are kept" in err
    if failure == "ENOSPC":
        assert "no space left" in err
    monkeypatch.setattr(torch, "save", real_save)
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000002.pt"]
    assert load_checkpoint(run_dir / "checkpoints" / "step_00000002.pt")["progress"]["step"] == 2


class Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("command", ["train", "evaluate", "export"])
def test_pickle_payload_is_refused_by_train_evaluate_and_export(command, tiny, run_dir, monkeypatch, capsys):
    """A checkpoint that carries code, given to train (resume), evaluate or export, exits 2 and never runs it."""
    monkeypatch.chdir(run_dir.parent)
    (run_dir / "checkpoints").mkdir(parents=True)
    path = run_dir / "checkpoints" / "step_00000002.pt"
    torch.save({"model": {}, "progress": Payload()}, path)  # a zip checkpoint with valid CRCs
    if command == "train":
        code = main([*tiny, f"trainer.resume={path}"])
    elif command == "evaluate":
        code = evaluate_main(["--checkpoint", str(path), *tiny])
    else:
        code = export_main(["--checkpoint", str(path), *tiny])
    assert code == 2
    assert "refused" in capsys.readouterr().err
    assert not (run_dir.parent / "PWNED").exists()
