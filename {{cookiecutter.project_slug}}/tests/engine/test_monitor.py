"""The monitored metric (trainer.monitor, trainer.monitor_mode): best.safetensors and best.json follow
it, and trainer.early_stop_patience stops the run at the right validation, across a resume too."""

import json

import pytest
from safetensors.torch import load_file

from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import weights_metadata
from {{ cookiecutter.package_name }}.train import main

from conftest import killed_when, read_metrics

# A validation after every step; the loss monitored as if higher were better, so that it stops improving.
WATCHING = ["trainer.val_every=1", "trainer.checkpoint_every=1", "trainer.keep_last=10", "trainer.max_steps=6",
            "trainer.monitor=val/loss", "trainer.monitor_mode=max", "trainer.early_stop_patience=2"]  # fmt: skip


def expected_stop(records: list[dict], patience: int) -> int | None:
    """The step of the validation after which `patience` validations in a row did not raise val/loss."""
    best, stale = None, 0
    for record in records:
        if "val/loss" not in record:
            continue
        if best is None or record["val/loss"] > best:
            best, stale = record["val/loss"], 0
        else:
            stale += 1
        if stale >= patience:
            return record["step"]
    return None


def validations(run_dir) -> list[tuple]:
    return [(r["step"], r["val/loss"], r["val/best_loss"]) for r in read_metrics(run_dir) if "val/loss" in r]


@pytest.mark.slow
def test_early_stopping_stops_at_the_right_validation_and_says_so(tiny, run_dir, capsys, caplog):
    """The run ends at the validation where val/loss has not risen for 2 validations in a row, as
    its own log shows; best.json and best.safetensors hold the best step, by the metric and mode
    configured."""
    with caplog.at_level("INFO"):
        assert main([*tiny, *WATCHING]) == 0
    records = read_metrics(run_dir)
    stop = expected_stop(records, patience=2)
    assert stop is not None and stop < 6, validations(run_dir)
    assert max(r["step"] for r in records) == stop  # no step after the stopping validation
    assert f"stopped early at step {stop}" in caplog.text
    best = json.loads((run_dir / "best.json").read_text())
    losses = {step: loss for step, loss, _ in validations(run_dir)}
    assert best["monitor"] == "val/loss" and best["mode"] == "max"
    assert best["value"] == max(losses.values()) and losses[best["step"]] == best["value"]
    assert weights_metadata(run_dir / "best.safetensors")["step"] == str(best["step"])
    assert load_file(str(run_dir / "best.safetensors"))  # a readable safetensors file

    assert main([*tiny, *WATCHING]) == 0  # run again: it stopped, so it does not train on
    assert max(r["step"] for r in read_metrics(run_dir)) == stop
    assert main([*tiny, *WATCHING, "trainer.early_stop_patience=3"]) == 0  # more patience: it goes on
    assert max(r["step"] for r in read_metrics(run_dir)) > stop


@pytest.mark.slow
def test_early_stopping_survives_a_resume(tiny, tmp_path):
    """Killed at the second validation and resumed, the run stops at the same validation as an
    uninterrupted one: the count of validations without improvement is in the checkpoint."""
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert main([*tiny, *WATCHING, f"run.output_dir={straight}"]) == 0

    def second_validation(metrics, step):
        return "val/loss" in metrics and step == 2

    killed_when(second_validation, [*tiny, *WATCHING, f"run.output_dir={crashed}"])
    assert main([*tiny, *WATCHING, f"run.output_dir={crashed}"]) == 0
    assert validations(crashed) == validations(straight)
    assert json.loads((crashed / "best.json").read_text()) == json.loads((straight / "best.json").read_text())


def test_a_metric_the_task_does_not_log_is_refused(tiny, capsys):
    """trainer.monitor must name one of the task's validation metrics; the error lists them."""
    assert main([*tiny, "trainer.monitor=val/f1"]) == 2
    err = capsys.readouterr().err
    assert "trainer.monitor='val/f1' is not a validation metric of this task; choose one of val/loss" in err
