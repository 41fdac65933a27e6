"""Activation checkpointing (recompute.py): which modules are blocks, and that recomputing them in
backward changes no name, no gradient and no BatchNorm statistic, for the task's model and any other."""

import copy

import pytest
import torch
from torch import nn

from {{ cookiecutter.package_name }}.engine.config import load_config
from {{ cookiecutter.package_name }}.engine.loaders import build_train_loader
from {{ cookiecutter.package_name }}.engine.parallel.recompute import blocks, enable
from {{ cookiecutter.package_name }}.task.config import SPEC
from {{ cookiecutter.package_name }}.task.task import Task

from tiny import TINY


class Residual(nn.Module):
    """A ResNet-like block: convolution, BatchNorm, dropout, and a downsample nn.Sequential inside."""

    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.norm = nn.BatchNorm2d(width)
        self.drop = nn.Dropout(0.5)
        self.downsample = nn.Sequential(nn.Conv2d(width, width, 1), nn.BatchNorm2d(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.drop(self.norm(self.conv(x))) + self.downsample(x))


class Toy(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 1)
        self.stages = nn.ModuleList([nn.Sequential(Residual(width), nn.ReLU(), Residual(width)), Residual(width)])
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.head(x.mean((2, 3)))


def step(model: nn.Module, loss_of) -> tuple[torch.Tensor, dict, dict]:
    """One forward and backward in training mode: the loss, the gradients and the buffers after it."""
    model.train()
    torch.manual_seed(1)  # the same dropout draws for every model
    loss = loss_of(model)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return loss.detach(), grads, {name: b.clone() for name, b in model.named_buffers()}


def assert_same_step(plain: nn.Module, recomputed: nn.Module, loss_of) -> None:
    """Bitwise equal on the CPU: the recomputation runs the forward's kernels on the same inputs and
    RNG state, and backward then uses the same saved values."""
    loss, grads, buffers = step(plain, loss_of)
    loss_again, grads_again, buffers_again = step(recomputed, loss_of)
    assert torch.equal(loss, loss_again)
    assert grads.keys() == grads_again.keys() and all(torch.equal(grads[k], grads_again[k]) for k in grads)
    assert buffers.keys() == buffers_again.keys()
    assert [k for k in buffers if not torch.equal(buffers[k], buffers_again[k])] == []


def test_blocks_are_the_children_of_stages_not_their_insides():
    """Blocks: each child with parameters of an nn.Sequential or nn.ModuleList (not a ReLU), in module
    order, and nothing inside a block taken already (a downsample Sequential) unless the block is itself
    a stage (stages.0); enable() recomputes the innermost blocks only."""
    assert [name for name, _ in blocks(Toy())] == ["stages.0", "stages.1", "stages.0.0", "stages.0.2"]
    assert enable(Toy()) == 3
    root = nn.Sequential(Residual(4), nn.ReLU(), Residual(4))
    assert [name for name, _ in blocks(root)] == ["0", "2"]
    assert [name for name, _ in blocks(nn.Sequential(Toy()))] == ["0"]


def test_recomputation_changes_no_gradient_and_counts_batchnorm_statistics_once():
    """With dropout and BatchNorm in its blocks, a recomputing copy of a model gives bitwise the same
    loss, gradients and buffers: dropout redraws the same mask, and BatchNorm's running statistics and
    batch count move once per step, not again when the block is recomputed."""
    torch.manual_seed(0)
    plain, images = Toy(), torch.randn(6, 3, 8, 8)
    recomputed = copy.deepcopy(plain)
    assert enable(recomputed) == 3
    assert_same_step(plain, recomputed, lambda model: model(images).square().mean())
    assert recomputed.stages[1].norm.num_batches_tracked == 1


def test_each_block_runs_once_more_in_backward_and_enabling_twice_changes_nothing():
    """Recomputation really happens: each block's forward runs twice per step (forward and backward),
    also after enable() is called a second time, and in a copy of the model, which recomputes itself."""
    model = Toy()
    assert (enable(model), enable(model)) == (3, 3)
    twin, calls = copy.deepcopy(model), []
    for net in (model, twin):
        net.stages[1].conv.register_forward_hook(lambda module, *_: calls.append(module))
        step(net, lambda m: m(torch.randn(2, 3, 8, 8)).sum())
        assert all(p.grad is not None for p in net.parameters())
    assert calls == [model.stages[1].conv] * 2 + [twin.stages[1].conv] * 2


def task_model_and_loss(overrides: list[str] = ()):
    """The task's tiny model as training builds it, and the loss of its first training batch."""
    cfg = load_config(SPEC, [], [*TINY, *overrides])
    task = Task(cfg, torch.device("cpu"))
    train_set, _ = task.datasets()
    batch = next(iter(build_train_loader(cfg.data, train_set, seed=cfg.run.seed)))
    torch.manual_seed(0)
    return task.build_model(torch.device("cpu")), lambda model: task.loss(model, batch)[0]


@pytest.mark.slow
def test_the_tasks_model_trains_the_same_with_recomputation():
    """The task's model, recomputing each of its blocks in backward, gives the same loss, gradients and
    buffers after a forward and backward (BatchNorm statistics, if any, updated once)."""
    plain, loss_of = task_model_and_loss()
    recomputed = copy.deepcopy(plain)
    assert enable(recomputed) == len(blocks(plain)) > 1
    assert_same_step(plain, recomputed, loss_of)


def test_recomputation_keeps_every_name():
    """Parameter names and state_dict keys stay as they were: checkpoints and optimizer state are keyed by them."""
    model, _ = task_model_and_loss()
    names, keys = [n for n, _ in model.named_parameters()], list(model.state_dict())
    enable(model)
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys
