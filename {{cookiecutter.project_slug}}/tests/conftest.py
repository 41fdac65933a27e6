"""Shared settings: a seconds-long CPU configuration and the gpu marker."""

import pytest
import torch

from {{ cookiecutter.package_name }}.checkpoint import latest_checkpoint

# 16x16 synthetic images, 6 steps per epoch, 101 validation samples (an uneven last batch).
TINY = [
    "run.device=cpu",
    "data.image_size=16",
    "data.train_size=192",
    "data.val_size=101",
    "data.batch_size=32",
    "data.num_workers=0",
    "trainer.max_epochs=1",
    "trainer.log_every=2",
    "optim.warmup_steps=2",
    "tracker.name=none",
]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


@pytest.fixture
def tiny(run_dir) -> list[str]:
    """Overrides for a tiny CPU run writing into a fresh directory."""
    return [*TINY, f"run.output_dir={run_dir}"]


@pytest.fixture
def final_weights():
    """Read the model weights of the newest checkpoint of a run directory."""

    def read(run_dir) -> dict[str, torch.Tensor]:
        _, state = latest_checkpoint(run_dir / "checkpoints")
        return state["model"]

    return read
