"""The weight average (optim.ema_decay): its update rule, validation and best.safetensors on the
average with the trained weights' metrics beside them, and which weights evaluate and export use.
Its exact resume (one process, DDP, FSDP shards, asynchronous saves) is in the fault matrix."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import latest_checkpoint
from {{ cookiecutter.package_name }}.engine.ema import WeightAverage
from {{ cookiecutter.package_name }}.evaluate import main as evaluate
from {{ cookiecutter.package_name }}.export import main as export
from {{ cookiecutter.package_name }}.task.config import SPEC
from {{ cookiecutter.package_name }}.train import main

from conftest import in_full, read_metrics

EMA = "optim.ema_decay=0.9"


def test_the_average_follows_the_ramped_decay_and_swaps_back_exactly():
    """average <- d * average + (1 - d) * weights with d = min(decay, (1 + step) / (10 + step)), for
    parameters and BatchNorm statistics; inside swapped_in the model holds the average, after it its
    own weights, bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ema = WeightAverage(model, decay=0.5)
    assert set(ema.average) == {"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var"}
    expected = {name: tensor.detach().clone() for name, tensor in ema.average.items()}
    for step in (1, 2, 3):
        model.train()(torch.randn(8, 3))  # moves the running statistics
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param))
        ema.update(step)
        d = min(0.5, (1 + step) / (10 + step))
        assert d == ema.decay_at(step)
        live = dict(model.state_dict())
        for name in expected:
            expected[name] = d * expected[name] + (1 - d) * live[name]
            torch.testing.assert_close(ema.average[name], expected[name], rtol=1e-6, atol=1e-7)
    trained = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    averaged = {name: tensor.clone() for name, tensor in ema.average.items()}
    with ema.swapped_in(model):
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, averaged.get(name, trained[name])), name
    assert all(torch.equal(tensor, trained[name]) for name, tensor in model.state_dict().items())
    assert all(torch.equal(tensor, averaged[name]) for name, tensor in ema.average.items())
    assert ema.decay_at(1) == pytest.approx(2 / 11) and ema.decay_at(10**6) == 0.5


@pytest.mark.slow
def test_validation_uses_the_average_and_logs_the_trained_weights_beside(tiny, run_dir):
    """With optim.ema_decay, val/* measure the average and val_raw/* the trained weights (they differ);
    best.safetensors holds the average (best.json says so); the checkpoint keeps both."""
    assert main([*tiny, EMA]) == 0
    vals = [record for record in read_metrics(run_dir) if "val/loss" in record]
    assert vals and all(f"val_raw/{name.split('/')[1]}" in record for record in vals for name in SPEC.metrics)
    assert vals[-1]["val/loss"] != vals[-1]["val_raw/loss"]
    state = in_full(latest_checkpoint(run_dir / "checkpoints")[1])
    best = load_file(run_dir / "best.safetensors")
    assert json.loads((run_dir / "best.json").read_text())["weights"] == "ema"
    assert state["ema"].keys() <= best.keys()
    assert all(torch.equal(best[name], state["ema"][name]) for name in state["ema"])
    assert any(not torch.equal(state["ema"][name], state["model"][name]) for name in state["ema"])


@pytest.mark.slow
def test_evaluate_and_export_use_the_average_unless_asked_for_the_trained_weights(tiny, run_dir, capsys):
    """evaluate measures the average (the val/* training logged, same batches) and export writes it;
    --weights raw gives the trained weights' metrics and tensors; --weights ema on a checkpoint
    without an average exits 2 with one line."""
    assert main([*tiny, EMA]) == 0
    logged = [record for record in read_metrics(run_dir) if "val/loss" in record][-1]
    state = in_full(latest_checkpoint(run_dir / "checkpoints")[1])
    capsys.readouterr()

    measured = {}
    for weights in ("ema", "raw"):
        assert evaluate([*tiny, "--weights", weights]) == 0
        measured[weights] = json.loads(capsys.readouterr().out)
    assert measured["ema"]["val/loss"] == pytest.approx(logged["val/loss"], rel=1e-6)
    assert measured["raw"]["val/loss"] == pytest.approx(logged["val_raw/loss"], rel=1e-6)

    assert export(tiny) == 0
    exported = load_file(run_dir / "export" / "model.safetensors")
    assert all(torch.equal(exported[name], state["ema"][name]) for name in state["ema"])
    assert export([*tiny, "--weights=raw"]) == 0
    exported = load_file(run_dir / "export" / "model.safetensors")
    assert all(torch.equal(exported[name], state["model"][name]) for name in state["ema"])

    plain = run_dir.parent / "plain"
    assert main([*tiny, "trainer.max_steps=2", f"run.output_dir={plain}"]) == 0
    capsys.readouterr()
    assert evaluate([*tiny, f"run.output_dir={plain}", "--weights", "ema"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --weights ema:") and "optim.ema_decay=0" in err and "\n" not in err


@pytest.mark.slow
@pytest.mark.core  # the average's restore: the same for every task
def test_turning_the_average_on_at_resume_starts_it_at_the_restored_weights(tiny, run_dir, caplog):
    """optim.ema_decay may change on resume: turned on, the average starts at the checkpoint's weights
    (not at the initial ones), so the first validation after it measures something trained."""
    assert main([*tiny, "trainer.max_steps=4", "trainer.checkpoint_every=4"]) == 0
    trained = in_full(latest_checkpoint(run_dir / "checkpoints")[1])["model"]
    caplog.set_level("INFO")
    assert main([*tiny, "trainer.max_steps=5", EMA]) == 0
    assert "the weight average starts at step 4's weights" in caplog.text
    state = in_full(latest_checkpoint(run_dir / "checkpoints")[1])
    assert state["progress"]["step"] == 5
    # One update after the start: d x the restored weights + (1 - d) x step 5's, d = decay_at(5) = 6 / 15.
    name = next(name for name in state["ema"] if name.endswith("weight"))
    d = 6 / 15
    torch.testing.assert_close(state["ema"][name], d * trained[name] + (1 - d) * state["model"][name])
