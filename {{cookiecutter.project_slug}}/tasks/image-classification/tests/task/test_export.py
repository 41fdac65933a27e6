"""Export: clean safetensors weights and a torch.export program that runs without this code."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import latest_checkpoint
from {{ cookiecutter.package_name }}.engine.config import load_config
from {{ cookiecutter.package_name }}.evaluate import main as evaluate_main
from {{ cookiecutter.package_name }}.export import main as export_main
from {{ cookiecutter.package_name }}.task.config import SPEC, ModelConfig
from {{ cookiecutter.package_name }}.task.data import DeviceImages, build_datasets
from {{ cookiecutter.package_name }}.task.model import build_model
from {{ cookiecutter.package_name }}.train import main as train_main


@pytest.mark.slow
def test_evaluate_and_export_a_trained_run(tiny, run_dir, capsys):
    """evaluate reports every validation sample; export writes weights and a program with the same outputs."""
    assert train_main([*tiny, "trainer.max_steps=3"]) == 0
    assert evaluate_main([f"run.output_dir={run_dir}", "data.num_workers=0"]) == 0
    assert '"val/samples": 101' in capsys.readouterr().out
    assert export_main([f"run.output_dir={run_dir}"]) == 0

    weights = load_file(str(run_dir / "export" / "model.safetensors"))
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in weights)
    model = build_model(ModelConfig(), num_classes=10).eval()
    model.load_state_dict(weights)
    program = torch.export.load(str(run_dir / "export" / "model.pt2")).module()
    images = torch.randn(5, 3, 16, 16)  # a batch size other than the one traced
    with torch.no_grad():
        assert torch.allclose(program(images), model(images), atol=1e-5)


# Runs in a fresh interpreter that cannot import this project (-I drops PYTHONPATH): plain torch only.
PLAIN_TORCH = """
import sys, torch
program = torch.export.load(sys.argv[1]).module()
images = torch.load(sys.argv[2], weights_only=True)
with torch.no_grad():
    torch.save(program(images), sys.argv[3])
assert not [name for name in sys.modules if name.split(".")[0] == "img"]
"""


def test_exported_program_runs_with_plain_torch_and_matches_the_trained_model(tiny, run_dir, tmp_path):
    """model.pt2 loads in a Python that cannot import this project and gives the checkpoint's outputs."""
    assert train_main([*tiny, "trainer.max_steps=3"]) == 0
    assert export_main([f"run.output_dir={run_dir}"]) == 0

    data = load_config(SPEC, [], tiny).data
    _, val_set, num_classes = build_datasets(data)
    images = torch.stack([val_set[i][0] for i in range(7)])  # real validation images, another batch size
    images = DeviceImages(torch.device("cpu"), data.name)(images)  # normalised, as training sees them
    torch.save(images, tmp_path / "images.pt")
    command = [sys.executable, "-I", "-c", PLAIN_TORCH, str(run_dir / "export" / "model.pt2")]
    command += [str(tmp_path / "images.pt"), str(tmp_path / "logits.pt")]
    completed = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]

    _, state = latest_checkpoint(run_dir / "checkpoints")
    model = build_model(ModelConfig(), num_classes).eval()
    model.load_state_dict(state["model"])
    with torch.no_grad():
        expected = model(images)
    logits = torch.load(tmp_path / "logits.pt", weights_only=True)
    assert torch.allclose(logits, expected, atol=1e-5)
    assert torch.equal(logits.argmax(1), expected.argmax(1))


@pytest.mark.slow
def test_export_cleans_prefixes_from_a_wrapped_checkpoint(tiny, run_dir):
    """A checkpoint written from a DDP-and-compiled model exports plain key names."""
    assert train_main([*tiny, "trainer.max_steps=1"]) == 0
    path, state = latest_checkpoint(run_dir / "checkpoints")
    state["model"] = {f"_orig_mod.module.{k}": v for k, v in state["model"].items()}
    torch.save(state, path)
    assert export_main(["--checkpoint", str(path)]) == 0
    weights = load_file(str(run_dir / "export" / "model.safetensors"))
    assert "conv1.weight" in weights and not any(k.startswith(("module.", "_orig_mod.")) for k in weights)


def test_evaluate_without_checkpoint_is_a_clear_error(tmp_path, capsys):
    """Evaluating a directory with no checkpoint exits 2 and says what to do."""
    assert evaluate_main([f"run.output_dir={tmp_path}"]) == 2
    assert "holds no usable checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_export_works_with_a_one_sample_validation_set(tiny, run_dir):
    """The traced example comes from the input shape, not the data: one validation sample is enough,
    and the program still takes a batch of 1 as well as larger ones."""
    assert train_main([*tiny, "data.val_size=1", "trainer.max_steps=1"]) == 0
    assert export_main([f"run.output_dir={run_dir}"]) == 0

    program = torch.export.load(str(run_dir / "export" / "model.pt2")).module()
    _, state = latest_checkpoint(run_dir / "checkpoints")
    model = build_model(ModelConfig(), num_classes=10).eval()
    model.load_state_dict(state["model"])
    for batch in (1, 3):
        images = torch.randn(batch, 3, 16, 16)
        with torch.no_grad():
            assert torch.allclose(program(images), model(images), atol=1e-5)


def test_a_timm_model_trains_and_exports_a_folder_timm_loads(tiny, run_dir, capsys):
    """model.name=timm:NAME (timm's tiny test ConvNeXt, with stochastic depth, on 32x32 images: it
    downsamples 32 times) trains on the synthetic images; export --format timm writes a folder that
    timm.create_model('local-dir:...', pretrained=True) loads with the trained head and our logits, and
    with the run's image size, mean and std as its preprocessing. A name timm lacks is refused in one line
    that suggests its own."""
    import timm

    model = ["model.name=timm:test_convnext", "model.drop_path=0.1"]
    args = [*tiny, "data.image_size=32", *model, f"run.output_dir={run_dir}"]
    assert train_main([*args, "trainer.max_epochs=1"]) == 0
    assert export_main([f"run.output_dir={run_dir}", "--format", "timm"]) == 0
    loaded = timm.create_model(f"local-dir:{run_dir / 'export' / 'timm'}", pretrained=True).eval()
    path, state = latest_checkpoint(run_dir / "checkpoints")
    ours = build_model(load_config(SPEC, [], [*args, "model.drop_path=0.0"]).model, num_classes=10).eval()
    ours.load_state_dict(state["model"])
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(images), ours(images), rtol=1e-5, atol=1e-5)
    assert loaded.get_classifier().out_features == 10
    prepared = timm.data.resolve_data_config(model=loaded)  # timm prepares images as training did
    assert tuple(prepared["input_size"]) == (3, 32, 32) and prepared["crop_pct"] == 1.0
    assert tuple(prepared["mean"]) == (0.5, 0.5, 0.5) and tuple(prepared["std"]) == (0.25, 0.25, 0.25)
    capsys.readouterr()
    assert train_main([*tiny, "model.name=timm:test_convnxt", f"run.output_dir={run_dir}_bad"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "timm has no such model; did you mean timm:test_convnext" in err[0], err
