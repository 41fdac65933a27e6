"""Evaluate and export: a checkpoint rebuilds the model, but never decides where anything is written."""

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from torch.nn import functional as F
from torchvision import datasets

from {{ cookiecutter.package_name }}.engine.ckpt import checkpoint as checkpoint_module
from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import latest_checkpoint
from {{ cookiecutter.package_name }}.engine.ckpt.restore import restore_trained
from {{ cookiecutter.package_name }}.engine.config import config_class
from {{ cookiecutter.package_name }}.evaluate import main as evaluate_main
from {{ cookiecutter.package_name }}.export import main as export_main
from {{ cookiecutter.package_name }}.task.config import SPEC
from {{ cookiecutter.package_name }}.task.task import Task
from {{ cookiecutter.package_name }}.train import main as train_main

from conftest import TINY


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A checkpoint of a one-step tiny run (trained once for this module's tests)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert train_main([*TINY, f"run.output_dir={run}", "trainer.max_steps=1"]) == 0
    return latest_checkpoint(run / "checkpoints")[0]


def place(checkpoint: Path, folder: Path, stored: dict | None = None, drop: tuple = ()) -> Path:
    """A copy of checkpoint in folder, with keys of its stored config changed ({"run.output_dir": ...})."""
    state = torch.load(checkpoint, weights_only=True)
    for key, value in (stored or {}).items():
        section, leaf = key.split(".")
        state["config"][section][leaf] = value
    for entry in drop:
        del state[entry]
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / checkpoint.name)
    return folder / checkpoint.name


def evaluate_and_export(*args: str) -> None:
    assert evaluate_main([*args, "data.num_workers=0"]) == 0
    assert export_main(list(args)) == 0


@pytest.mark.slow
def test_outputs_go_beside_the_checkpoint_never_where_its_config_says(trained, tmp_path):
    """--checkpoint alone writes into the run directory holding checkpoints/ (or the checkpoint's own
    folder), not into the run.output_dir or data.root stored in the checkpoint."""
    elsewhere = tmp_path / "elsewhere"
    stored = {"run.output_dir": str(elsewhere / "out"), "data.root": str(elsewhere / "data")}

    in_run = place(trained, tmp_path / "run" / "checkpoints", stored)
    evaluate_and_export("--checkpoint", str(in_run))
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["val/samples"] == 101
    assert (tmp_path / "run" / "export" / "model.pt2").is_file()

    loose = place(trained, tmp_path / "downloads", stored)
    evaluate_and_export("--checkpoint", str(loose))
    assert (tmp_path / "downloads" / "eval.json").is_file()
    assert (tmp_path / "downloads" / "export" / "model.safetensors").is_file()
    assert not elsewhere.exists()


@pytest.mark.slow
def test_output_dir_on_the_command_line_wins(trained, tmp_path):
    """run.output_dir given as an override or in a --config file is where eval.json and export/ go."""
    path = place(trained, tmp_path / "run" / "checkpoints", {"run.output_dir": str(tmp_path / "stored")})
    evaluate_and_export("--checkpoint", str(path), f"run.output_dir={tmp_path / 'chosen'}")
    assert (tmp_path / "chosen" / "eval.json").is_file() and (tmp_path / "chosen" / "export" / "model.pt2").is_file()

    config = tmp_path / "eval.yaml"
    config.write_text(f"run:\n  output_dir: {tmp_path / 'from_file'}\n")
    evaluate_and_export("--checkpoint", str(path), "--config", str(config))
    assert (tmp_path / "from_file" / "eval.json").is_file()
    assert not (tmp_path / "run" / "eval.json").exists() and not (tmp_path / "stored").exists()


def test_stored_interpolations_are_never_resolved(trained, tmp_path, monkeypatch, capsys):
    """${oc.env:...} in a checkpoint's stored config reads no environment and writes nothing there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("ELSEWHERE", str(elsewhere))
    monkeypatch.setenv("MODEL", "resnet18")
    stored = {key: "${oc.env:ELSEWHERE}/x" for key in ("run.output_dir", "data.root", "trainer.resume")}
    path = place(trained, tmp_path / "run" / "checkpoints", stored)
    evaluate_and_export("--checkpoint", str(path))
    assert list(elsewhere.iterdir()) == []

    path = place(trained, tmp_path / "other" / "checkpoints", {**stored, "model.name": "${oc.env:MODEL}"})
    capsys.readouterr()
    assert evaluate_main(["--checkpoint", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.name" in err[0] and "interpolation" in err[0], err
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "other" / "eval.json").exists()


def test_the_checkpoint_does_not_choose_where_data_is_read_or_downloaded(trained, tmp_path, monkeypatch):
    """data.root comes from the command line or the default, never from the checkpoint."""
    roots = []

    def offline(dataset):
        roots.append(str(dataset.root))
        raise OSError("network unreachable")

    monkeypatch.setattr(datasets.CIFAR10, "download", offline)
    monkeypatch.chdir(tmp_path)
    stored = {"data.name": "cifar10", "data.root": str(tmp_path / "elsewhere"), "data.download": True}
    path = place(trained, tmp_path / "run" / "checkpoints", stored)
    assert evaluate_main(["--checkpoint", str(path)]) == 2
    assert evaluate_main(["--checkpoint", str(path), f"data.root={tmp_path / 'given'}"]) == 2
    assert roots == ["data", str(tmp_path / "given")]
    assert not (tmp_path / "elsewhere").exists()


def test_only_model_and_task_keys_come_from_the_checkpoint(tmp_path):
    """The stored config gives the model's and the task's shape; batch size, seed, paths and the rest
    are the command line's or the defaults, and command-line overrides still win."""
    stored = config_class(SPEC)()
    stored.model.name, stored.model.norm, stored.model.small_input = "resnet50", "group", False
    stored.data.image_size, stored.data.num_classes, stored.data.val_size = 24, 7, 9
    stored.trainer.precision = "bf16"
    stored.data.batch_size, stored.data.num_workers, stored.data.augment = 3, 5, False
    stored.run.seed, stored.optim.lr, stored.model.compile = 9, 0.5, True
    stored.data.root, stored.run.output_dir = str(tmp_path / "data"), str(tmp_path / "out")
    torch.save({"model": {}, "config": asdict(stored)}, tmp_path / "weights.pt")

    cfg = restore_trained(SPEC, ["--checkpoint", str(tmp_path / "weights.pt"), "data.val_size=11"], "test")[0]
    assert (cfg.model.name, cfg.model.norm, cfg.model.small_input) == ("resnet50", "group", False)
    assert (cfg.data.image_size, cfg.data.num_classes, cfg.trainer.precision) == (24, 7, "bf16")
    assert cfg.data.val_size == 11  # the command line wins
    default = config_class(SPEC)()
    assert (cfg.data.batch_size, cfg.data.num_workers, cfg.data.augment) == (
        default.data.batch_size,
        default.data.num_workers,
        default.data.augment,
    )
    assert (cfg.run.seed, cfg.optim.lr, cfg.model.compile) == (default.run.seed, default.optim.lr, False)
    assert cfg.data.root == default.data.root and cfg.run.output_dir == str(tmp_path)


def test_checkpoint_without_progress_is_evaluated_without_a_step(trained, tmp_path):
    """A checkpoint with weights but no training progress evaluates (step null) and exports."""
    path = place(trained, tmp_path / "weights", drop=("progress",))
    evaluate_and_export("--checkpoint", str(path))
    report = json.loads((tmp_path / "weights" / "eval.json").read_text())
    assert report["step"] is None and report["val/samples"] == 101


@pytest.mark.parametrize("command", [evaluate_main, export_main], ids=["evaluate", "export"])
def test_an_output_that_cannot_be_written_exits_1_with_one_line(command, trained, tmp_path, capsys):
    """An output folder that cannot be made (a file is in the way) is exit 1 and one line, no traceback."""
    path = place(trained, tmp_path / "run" / "checkpoints")
    (tmp_path / "taken").write_text("a file, not a folder")
    assert command(["--checkpoint", str(path), f"run.output_dir={tmp_path / 'taken'}", "data.num_workers=0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: could not write") and "taken" in err[0], err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders; the test above covers root")
@pytest.mark.parametrize("command", [evaluate_main, export_main], ids=["evaluate", "export"])
def test_a_read_only_output_folder_exits_1_with_one_line(command, trained, tmp_path, capsys):
    """No permission to write in run.output_dir is exit 1 and one line naming the file."""
    path = place(trained, tmp_path / "run" / "checkpoints")
    (tmp_path / "run").chmod(0o555)
    try:
        assert command(["--checkpoint", str(path), "data.num_workers=0"]) == 1
    finally:
        (tmp_path / "run").chmod(0o755)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no permission" in err[0], err


TORCH_DISK_FULL = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
SAFETENSORS_DISK_FULL = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize(
    "target, error, file",
    [(torch.export, TORCH_DISK_FULL, "model.pt2"), (checkpoint_module, SAFETENSORS_DISK_FULL, "model.safetensors")],
    ids=["torch.export.save", "safetensors"],
)
def test_a_full_disk_during_export_exits_1_with_one_line(target, error, file, trained, tmp_path, monkeypatch, capsys):
    """A full disk, as torch or safetensors report it, is exit 1 and one line naming the file."""

    def disk_full(*args, **kwargs):
        raise error

    monkeypatch.setattr(target, "save" if target is torch.export else "save_file", disk_full)
    path = place(trained, tmp_path / "run" / "checkpoints")
    assert export_main(["--checkpoint", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and file in err[0] and ("disk" in err[0] or "No space" in err[0]), err


def test_evaluate_reports_top5_a_confusion_matrix_per_class_accuracy_and_mirror_image_tta(trained, tmp_path, capsys):
    """evaluate --tta: val/acc and val/loss are those of each image's and its mirror image's mean class
    probabilities; val/top5 counts the class among the 5 likeliest; eval/confusion.json's matrix counts
    every sample once with val/acc on its diagonal and each class's accuracy beside it, their mean is
    val/balanced_acc; eval/confusion.png is drawn."""
    out = tmp_path / "out"
    assert evaluate_main(["--checkpoint", str(trained), f"run.output_dir={out}", "data.num_workers=0", "--tta"]) == 0
    result = json.loads(capsys.readouterr().out)
    report = json.loads((out / "eval" / "confusion.json").read_text())
    matrix = torch.tensor(report["matrix"])
    assert matrix.sum() == result["val/samples"] == 101 and result["tta"] is True
    assert matrix.diag().sum().item() / 101 == pytest.approx(result["val/acc"])
    accuracies = [report["per_class"][name]["accuracy"] for name in report["classes"]]
    assert accuracies == [matrix[i, i].item() / matrix[i].sum().item() for i in range(10)]
    assert result["val/balanced_acc"] == pytest.approx(sum(accuracies) / 10)
    assert (out / "eval" / "confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["reports"] == [str(out / "eval" / "confusion.json"), str(out / "eval" / "confusion.png")]

    cfg, _, state = restore_trained(SPEC, ["--checkpoint", str(trained)], "evaluate")
    task = Task(cfg, torch.device("cpu"))
    _, val_set = task.datasets()
    model = task.build_model().eval()
    model.load_state_dict(state["model"])
    images = task.inputs(torch.stack([image for image, _ in val_set]))
    targets = torch.tensor([target for _, target in val_set])
    with torch.no_grad():
        probabilities = (model(images).softmax(-1) + model(images.flip(-1)).softmax(-1)) / 2
    assert result["val/acc"] == pytest.approx((probabilities.argmax(-1) == targets).double().mean().item())
    assert result["val/loss"] == pytest.approx(F.nll_loss(probabilities.log(), targets).item(), rel=1e-5)
    top5 = (probabilities.topk(5).indices == targets[:, None]).any(-1).double().mean().item()
    assert result["val/top5"] == pytest.approx(top5)
