"""The example task of docs/examples/regression works in a baked project: copied over its task/
folder, it trains, resumes, evaluates and exports with the project's own commands, on one process
and on two."""

import json
import os
import shutil
import sys
from pathlib import Path

from conftest import ROOT, Baked, bake, run

EXAMPLE = ROOT / "docs" / "examples" / "regression" / "task"
# Seconds-long CPU runs: 8 optimizer steps an epoch on one process (256 samples, batches of 32),
# and 65 validation samples, which two processes split 33/32, into 2 and 1 batches: the uneven
# case that validation must still count exactly. Overrides only: the bake's configs/*.yaml are
# the image task's and name keys this task does not have.
TINY = [
    "run.device=cpu",
    "tracker.name=none",
    "data.train_size=256",
    "data.val_size=65",
    "data.batch_size=32",
    "trainer.log_every=2",
    "optim.warmup_steps=2",
]


def _bake_with_example(cookies) -> Baked:
    """The default bake with its task/ package replaced by the example's files."""
    baked = bake(cookies)
    task = baked.path / "src" / baked.package / "task"
    shutil.rmtree(task)
    shutil.copytree(EXAMPLE, task, ignore=shutil.ignore_patterns("__pycache__"))
    return baked


def _run(baked: Baked, command: str, *args: str, nproc: int = 1) -> str:
    """Run `python -m PKG.<command> args` in the bake (under torchrun for nproc > 1); its stdout."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {**os.environ, "PYTHONPATH": str(baked.path / "src"), "OMP_NUM_THREADS": "1"}
    completed = run([*launcher, "-m", f"{baked.package}.{command}", *args], baked.path, env, 180)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, f"{command} {' '.join(args)} failed:\n{output[-4000:]}"
    return completed.stdout


def _records(output_dir: Path) -> list[dict]:
    lines = (output_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _validations(output_dir: Path) -> dict[int, dict]:
    return {record["step"]: record for record in _records(output_dir) if "val/loss" in record}


def test_example_task_trains_resumes_evaluates_and_exports(cookies, tmp_path):
    """A task copied from the example trains, continues from its checkpoint when run again with
    more epochs, and evaluate and export turn that run into metrics and a model that runs on
    batches of any size."""
    import torch

    baked = _bake_with_example(cookies)
    out = tmp_path / "run"
    _run(baked, "train", *TINY, "trainer.max_epochs=1", f"run.output_dir={out}")
    assert set(_validations(out)) == {8}

    _run(baked, "train", *TINY, "trainer.max_epochs=2", f"run.output_dir={out}")
    starts = json.loads((out / "run_info.json").read_text(encoding="utf-8"))["runs"]
    assert [start["resumed_from_step"] for start in starts] == [None, 8]
    validations = _validations(out)
    assert set(validations) == {8, 16}  # the first epoch's kept, the second's added
    assert any(record["step"] > 8 and "train/loss" in record for record in _records(out))
    assert validations[16]["val/loss"] < validations[8]["val/loss"]  # it went on learning
    assert validations[16]["val/samples"] == 65

    _run(baked, "evaluate", *TINY, f"run.output_dir={out}")
    evaluated = json.loads((out / "eval.json").read_text(encoding="utf-8"))
    assert evaluated["step"] == 16
    assert evaluated["val/samples"] == 65
    for key in ("val/loss", "val/mae"):
        assert abs(evaluated[key] - validations[16][key]) <= 1e-6 * validations[16][key], key

    _run(baked, "export", *TINY, f"run.output_dir={out}")
    assert (out / "export" / "model.safetensors").stat().st_size > 0
    program = torch.export.load(str(out / "export" / "model.pt2")).module()
    x = torch.randn(5, 8)  # the example input has 2 samples: the batch dimension is dynamic
    y = program(x)
    assert y.shape == (5, 1) and torch.isfinite(y).all()
    torch.testing.assert_close(program(x[:3]), y[:3])


def test_example_task_validates_exactly_on_two_processes(cookies, tmp_path):
    """Two gloo processes under FSDP train the example task (built sharded on the meta device), and
    the validation they log, over a set they split unevenly, equals one process's evaluation of the
    same checkpoint."""
    baked = _bake_with_example(cookies)
    out = tmp_path / "run"
    two = [*TINY, "trainer.max_epochs=1", "distributed.strategy=fsdp", f"run.output_dir={out}"]
    _run(baked, "train", *two, nproc=2)
    logged = _validations(out)[4]  # 256 samples / (2 processes x 32) = 4 steps
    assert logged["val/samples"] == 65

    _run(baked, "evaluate", *TINY, f"run.output_dir={out}")
    evaluated = json.loads((out / "eval.json").read_text(encoding="utf-8"))
    assert evaluated["step"] == 4 and evaluated["val/samples"] == 65
    for key in ("val/loss", "val/mae"):
        assert abs(evaluated[key] - logged[key]) <= 1e-6 * logged[key], key


def test_the_tasks_page_shows_the_example_files_as_they_are():
    """docs/tasks.md lists the example task's modules and tiny.py exactly as the files this test
    module bakes and trains, so the page cannot drift from the seam."""
    page = (ROOT / "docs" / "tasks.md").read_text(encoding="utf-8")
    example = ROOT / "docs" / "examples" / "regression"
    for shown, path in [
        ("`task/config.py`:", example / "task" / "config.py"),
        ("`task/task.py`:", example / "task" / "task.py"),
        ("`tests/task/tiny.py` is:", example / "tests" / "task" / "tiny.py"),
    ]:
        start = page.index(f"{shown}\n\n```python\n") + len(f"{shown}\n\n```python\n")
        listing = page[start : page.index("\n```\n", start)]
        assert listing == path.read_text(encoding="utf-8").rstrip("\n"), path.name
