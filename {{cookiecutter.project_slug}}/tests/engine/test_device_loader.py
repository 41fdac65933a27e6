"""data.loader=device: the data sets on the training device, batches gathered there. The same
samples in the same order as the workers pipeline (for any rank and mid-epoch), exact validation,
and what data.loader=auto chooses. Training with it (bit-exact resume, any number of processes)
is covered wherever the tests train: data.loader=auto chooses it for their small data sets."""

from types import SimpleNamespace

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from {{ cookiecutter.package_name }}.engine import loaders
from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import latest_checkpoint
from {{ cookiecutter.package_name }}.engine.config import load_config
from {{ cookiecutter.package_name }}.engine.loaders import DeviceTrainLoader, build_loaders
from {{ cookiecutter.package_name }}.task.config import SPEC
from {{ cookiecutter.package_name }}.task.task import Task
from {{ cookiecutter.package_name }}.train import main

from tiny import SAME_DATA, TINY

CPU = torch.device("cpu")


def built(kind: str, rank: int = 0, world_size: int = 1, extra: tuple = ()):
    """The training and validation loaders of data.loader=kind, and the line the log gets."""
    cfg = load_config(SPEC, [], [*TINY, *SAME_DATA, *extra, f"data.loader={kind}"])
    task = Task(cfg, CPU)
    train_set, val_set = task.datasets()
    env = SimpleNamespace(rank=rank, world_size=world_size, device=CPU)
    return build_loaders(cfg.data, cfg.run.seed, task, train_set, val_set, env)


def assert_same(a, b) -> None:
    """Batches equal value for value: tensors (any layout) or tuples of them."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    else:
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)


@pytest.mark.parametrize(("rank", "world_size"), [(0, 1), (0, 2), (1, 2)])
def test_the_device_loader_hands_over_what_the_workers_load(rank, world_size):
    """Every training batch of two epochs and every validation batch, for each rank of 1 and 2
    processes: the same samples, in the same order, with the same values and dtypes."""
    device_train, device_val, _ = built("device", rank, world_size)
    workers_train, workers_val, _ = built("workers", rank, world_size)
    assert isinstance(device_train, DeviceTrainLoader)
    assert len(device_train) == len(workers_train) > 1 and len(device_val) == len(workers_val) > 1
    for epoch in (0, 1):
        device_train.sampler.set_position(epoch, 0)
        workers_train.sampler.set_position(epoch, 0)
        pairs = list(zip(device_train, workers_train, strict=True))
        assert len(pairs) == len(workers_train)
        for ours, theirs in pairs:
            assert_same(ours, theirs)
    for ours, theirs in zip(device_val, workers_val, strict=True):
        assert_same(ours, theirs)


def test_the_device_loader_resumes_mid_epoch_with_the_batches_left():
    """set_position(epoch, samples done) continues the epoch with exactly the batches not yet taken."""
    train, _, _ = built("device")
    batch = train.batch_size
    train.sampler.set_position(1, 0)
    whole = list(train)
    train.sampler.set_position(1, 2 * batch)
    rest = list(train)
    assert len(rest) == len(whole) - 2
    for ours, theirs in zip(rest, whole[2:], strict=True):
        assert_same(ours, theirs)


def test_auto_chooses_the_device_when_the_data_fits_its_budget_and_says_why(monkeypatch):
    """data.loader=auto keeps the data on the device when it takes at most DEVICE_BUDGET of the device's
    memory, and says so with the sizes; past the budget it chooses workers, and says why."""
    train, _, reason = built("auto")
    assert isinstance(train, DeviceTrainLoader)
    assert reason.startswith("data.loader=auto chose device: the data sets take") and "25% of the RAM" in reason
    monkeypatch.setattr(loaders, "DEVICE_BUDGET", 1e-12)
    train, _, reason = built("auto")
    assert not isinstance(train, DeviceTrainLoader)
    assert reason.startswith("data.loader=auto chose workers: the data sets take") and "more than" in reason


def test_a_device_batch_larger_than_each_process_share_is_refused():
    """As with workers: a batch larger than a process's share of the training set exits 2 naming it."""
    with pytest.raises(loaders.ConfigError, match="is larger than the .* training samples each"):
        built("device", extra=("data.batch_size=100000",))


@pytest.mark.slow
def test_compiled_training_compiles_at_its_first_step_and_never_again(tiny, run_dir, monkeypatch):
    """model.compile=true with the device loader reaches its steady state at once: every training
    batch has one shape, so the graphs compiled for the first step serve all 18 steps of 3 epochs
    and the validations between them; validation compiles at its first pass only (the eval-mode
    graph, and the shorter last batch). The checkpoints hold plain keys (no _orig_mod. prefix).

    The graphs run through torch's aot_eager backend, counted: it traces forward and backward as
    the default backend does, without generating kernels (what takes minutes on a CPU), and
    recompiles are decided before any backend, by the guards torch.compile checks."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")
    compiled = {"train": 0, "validation": 0}

    def counting(graph, example_inputs):
        compiled["train" if torch.is_grad_enabled() else "validation"] += 1
        return aot_eager(graph, example_inputs)

    compile_model = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: compile_model(model, backend=counting))
    after_step = []  # what had been compiled when each optimizer step ended
    handle = register_optimizer_step_post_hook(lambda *args: after_step.append(dict(compiled)))
    try:
        assert main([*tiny, "model.compile=true", "data.loader=device", "trainer.max_epochs=3"]) == 0
    finally:
        handle.remove()
        torch._dynamo.reset()
    assert len(after_step) == 18
    assert after_step[0]["train"] >= 1 and after_step[0]["validation"] == 0
    assert {counts["train"] for counts in after_step} == {compiled["train"]}  # none after the first step
    first_validation = after_step[6]["validation"]  # the validation after epoch 1 (6 steps) compiled
    assert first_validation >= 1 and compiled["validation"] == first_validation  # the next two did not
    _, state = latest_checkpoint(run_dir / "checkpoints")
    assert state["model"] and not any(key.startswith("_orig_mod.") for key in state["model"])
