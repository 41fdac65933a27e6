"""The training core's pieces on their own: one optimizer step with any loss, and the checkpoint format."""

import copy

import pytest
import torch
from torch import nn

from {{ cookiecutter.package_name }}.checkpoint import latest_checkpoint, load_checkpoint
from {{ cookiecutter.package_name }}.config import OptimConfig, TrainerConfig
from {{ cookiecutter.package_name }}.optim import Diverged, build_optimizer
from {{ cookiecutter.package_name }}.state import FORMAT_VERSION, TrainState
from {{ cookiecutter.package_name }}.step import train_step
from {{ cookiecutter.package_name }}.train import main


def regression_state() -> TrainState:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = build_optimizer(model, OptimConfig(lr=0.1, weight_decay=0.0))
    return TrainState(
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        loader_generator=torch.Generator(),
        device=torch.device("cpu"),
    )


def mean_squared_error(model: nn.Module, batch) -> tuple[torch.Tensor, int]:
    inputs, targets = batch
    return ((model(inputs) - targets) ** 2).mean(), len(targets)


def test_train_step_accumulates_any_loss_into_one_update():
    """train_step with a loss function of the caller's: 2 micro-batches of 4 give the update of one batch of 8."""
    state = regression_state()
    reference = copy.deepcopy(state.model)
    inputs, targets = torch.randn(8, 4), torch.randn(8, 1)

    result = train_step(
        state,
        iter([(inputs[:4], targets[:4]), (inputs[4:], targets[4:])]),
        mean_squared_error,
        TrainerConfig(grad_accum_steps=2, grad_clip=0.0),
        global_micro=4,
    )

    mean_squared_error(reference, (inputs, targets))[0].backward()
    norm = torch.cat([p.grad.reshape(-1) for p in reference.parameters()]).norm()
    torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.0).step()
    for trained, expected in zip(state.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(trained, expected)
    torch.testing.assert_close(result.grad_norm, norm)
    assert (result.samples, result.lr) == (8, 0.1)
    assert (state.progress.step, state.progress.samples_done, state.running.count) == (1, 8, 8)


def test_a_non_finite_loss_skips_the_update_and_is_named_at_the_next_check():
    """A NaN loss leaves every weight as it was (no host sync in the step); the next check names the step."""
    state = regression_state()
    before = copy.deepcopy(state.model.state_dict())

    def nan_loss(model, batch):
        loss, n = mean_squared_error(model, batch)
        return loss * float("nan"), n

    train_step(state, iter([(torch.randn(4, 4), torch.randn(4, 1))]), nan_loss, TrainerConfig(), global_micro=4)
    assert all(torch.equal(before[k], v) for k, v in state.model.state_dict().items())
    with pytest.raises(Diverged, match="not finite at step 1"):
        state.check_updates()


def test_checkpoints_carry_their_format_and_a_newer_one_is_refused(tiny, run_dir, capsys):
    """Checkpoints say which layout they have; one from a newer project is refused in one line (exit 2), and
    one from before the key existed still resumes."""
    assert main([*tiny, "trainer.max_steps=2", "trainer.checkpoint_every=1"]) == 0
    path, state = latest_checkpoint(run_dir / "checkpoints")
    assert state["format"] == FORMAT_VERSION

    torch.save({**state, "format": FORMAT_VERSION + 1}, path)
    capsys.readouterr()
    assert main([*tiny, "trainer.max_steps=3", "trainer.checkpoint_every=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"checkpoint format {FORMAT_VERSION + 1} is newer" in err and err.count("\n") == 0

    torch.save({k: v for k, v in state.items() if k != "format"}, path)
    assert main([*tiny, "trainer.max_steps=3", "trainer.checkpoint_every=1"]) == 0
    assert load_checkpoint(latest_checkpoint(run_dir / "checkpoints")[0])["progress"]["step"] == 3
