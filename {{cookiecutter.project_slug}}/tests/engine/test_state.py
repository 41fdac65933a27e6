"""The training core's pieces on their own: one optimizer step with any loss, the checkpoint format, and
steps that never wait for the device between log lines (for the task's own loss and data)."""

import copy

import pytest
import torch
from torch import nn

from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import latest_checkpoint, load_checkpoint
from {{ cookiecutter.package_name }}.engine.config import OptimConfig, TrainerConfig
from {{ cookiecutter.package_name }}.engine.optim import Diverged, build_optimizer
from {{ cookiecutter.package_name }}.engine.state import FORMAT_VERSION, TrainState
from {{ cookiecutter.package_name }}.engine.step import train_step
from {{ cookiecutter.package_name }}.train import main

from tiny import SMALL_MODEL


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


def test_adamw_takes_optim_betas():
    """optim.betas reaches AdamW: one step equals torch's AdamW with those betas, not with its defaults."""
    torch.manual_seed(0)
    model, inputs = nn.Linear(4, 1), torch.randn(8, 4)
    reference = copy.deepcopy(model)
    optimizer = build_optimizer(model, OptimConfig(lr=0.1, weight_decay=0.0, betas=[0.5, 0.6]))
    expected = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.0, betas=(0.5, 0.6))
    for _ in range(2):  # the second step depends on beta1 and beta2 through the moments
        for net, opt in ((model, optimizer), (reference, expected)):
            opt.zero_grad()
            net(inputs).square().mean().backward()
            opt.step()
    assert all(group["betas"] == (0.5, 0.6) for group in optimizer.param_groups)
    torch.testing.assert_close(model.state_dict(), reference.state_dict())
    assert OptimConfig().betas == [0.9, 0.999]  # torch's default, unless the task says otherwise


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


@pytest.mark.slow
@pytest.mark.core  # checkpoint formats: the same for every task
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


HOST_READS = {
    torch.ops.aten._local_scalar_dense.default,  # item(), bool(), float(), int(), `if tensor:`
    torch.ops.aten.nonzero.default,  # boolean-mask indexing, one-argument torch.where
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_steps_read_no_tensor_back_to_python_between_log_lines(tiny, precision):
    """From the second optimizer step to the fifth no tensor value is read into Python.

    On a GPU each such read would make the host wait for the device. Workers load the data, so
    every tensor operation recorded here belongs to the step. Copies to the CPU (.cpu(), tolist())
    are invisible on a CPU; the gpu test below catches those.
    """
    import traceback

    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in HOST_READS:
                frames = [f for f in traceback.extract_stack() if "img" in f.filename]
                self.seen.append(f"{func} at {frames[-1].filename}:{frames[-1].lineno}" if frames else str(func))
            return func(*args, **(kwargs or {}))

    reads, steps = HostReads(), []

    def watch(optimizer, args, kwargs):
        steps.append(len(steps) + 1)
        if len(steps) == 1:
            reads.__enter__()
        elif len(steps) == 5:
            reads.__exit__(None, None, None)

    handle = register_optimizer_step_post_hook(watch)
    try:
        quiet = ["trainer.max_steps=6", "trainer.log_every=1000", "trainer.checkpoint_every=1000"]
        model = SMALL_MODEL if precision == "bf16" else []  # bf16 on a CPU: see tiny.py
        assert main([*tiny, *model, *quiet, "data.num_workers=2", f"trainer.precision={precision}"]) == 0
    finally:
        handle.remove()
    assert steps == [1, 2, 3, 4, 5, 6]
    assert reads.seen == []


@pytest.mark.gpu
@pytest.mark.parametrize("loader", ["device", "workers"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_training_steps_never_wait_for_the_gpu(tiny, precision, loader):
    """Between log lines a training step makes no host-device sync, with either data.loader: from the
    second optimizer step to the last, torch's sync debug mode turns any sync into an error."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = []

    def watch(optimizer, args, kwargs):
        steps.append(len(steps) + 1)
        torch.cuda.set_sync_debug_mode("error" if len(steps) < 6 else "default")

    handle = register_optimizer_step_post_hook(watch)
    try:
        overrides = [o for o in tiny if o != "run.device=cpu"] + ["run.device=cuda", f"trainer.precision={precision}"]
        quiet = ["trainer.max_steps=6", "trainer.log_every=1000", "trainer.checkpoint_every=1000"]
        assert main([*overrides, *quiet, f"data.loader={loader}"]) == 0
    finally:
        handle.remove()
        torch.cuda.set_sync_debug_mode("default")
    assert steps == [1, 2, 3, 4, 5, 6]
