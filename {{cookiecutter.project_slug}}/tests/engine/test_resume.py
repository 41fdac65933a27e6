"""The rules of a run directory: a resumed run trains what its config says, a fresh start loses
no earlier file, and one run at a time writes into a directory."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from {{ cookiecutter.package_name }}.engine.ckpt.checkpoint import latest_checkpoint, list_checkpoints, weights_metadata
from {{ cookiecutter.package_name }}.engine.config import load_config
from {{ cookiecutter.package_name }}.engine.optim import warmup_cosine
from {{ cookiecutter.package_name }}.engine.rundir import LOCK_NAME, RunLock
from {{ cookiecutter.package_name }}.task.config import SPEC
from {{ cookiecutter.package_name }}.train import main

from conftest import killed_when, read_metrics
from tiny import MODEL_CHANGE, RANDOM_DATA

# 6 optimizer steps per epoch; a checkpoint every 2 steps, all of them kept.
SAVING = ["trainer.checkpoint_every=2", "trainer.keep_last=10", "trainer.log_every=1"]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


SAVES = {
    "full": ["trainer.checkpoint_format=full"],
    "sharded": ["trainer.checkpoint_format=sharded"],
    "async": ["trainer.async_checkpoint=true"],  # sharded, written in the background
}

# The full format's row is the fast tier's resume test, with each task's random data draws. The
# sharded formats' rows are slow and `core`: the formats are the engine's, the same for every task.
SLOW_FORMAT = [pytest.mark.slow, pytest.mark.core]


@pytest.mark.parametrize("save", [s if s == "full" else pytest.param(s, marks=SLOW_FORMAT) for s in SAVES])
def test_resume_after_a_crash_matches_an_uninterrupted_run(save, tiny, tmp_path, final_weights):
    """Killed after step 5 and resumed from the step-4 checkpoint (the task's random data draws on, a
    validation every 3 steps), training ends with identical weights and the same logged lines: with
    either checkpoint format, and with saves written in the background; loading with 2 workers
    (full) or from the device (sharded, async)."""
    loader = "data.loader=workers" if save == "full" else "data.loader=device"
    run = [*tiny, *RANDOM_DATA, loader, "data.num_workers=2", "trainer.max_epochs=2", "trainer.val_every=3"]
    common = [*run, "trainer.checkpoint_every=4", *SAVES[save]]
    assert main([*run, "trainer.checkpoint_every=4", f"run.output_dir={tmp_path / 'straight'}"]) == 0

    crashed = tmp_path / "crashed"
    killed_when(lambda metrics, step: step >= 6, [*common, f"run.output_dir={crashed}"])
    assert list_checkpoints(crashed / "checkpoints")[-1].name == "step_00000004" + (".pt" if save == "full" else "")
    assert main([*common, f"run.output_dir={crashed}"]) == 0

    straight, resumed = final_weights(tmp_path / "straight"), final_weights(crashed)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    keys = ("step", "epoch", "train/loss", "val/loss", SPEC.monitor)
    lines = [[tuple(r.get(k) for k in keys) for r in read_metrics(run)] for run in (tmp_path / "straight", crashed)]
    assert lines[0] == lines[1]
    assert [r["step"] for r in read_metrics(crashed) if "train/loss" in r] == [2, 4, 6, 8, 10, 12]  # 2, 4 once
    assert [r["step"] for r in read_metrics(crashed) if "val/loss" in r] == [3, 6, 9, 12]


@pytest.mark.slow
def test_resuming_with_a_changed_learning_rate_exits_2_naming_key_values_and_remedies(tiny, run_dir, capsys):
    """A resume with another optim.lr or model shape stops before training: one line names each key with
    its old and new value and says how to proceed; nothing in the run directory changes."""
    default = load_config(SPEC, [], tiny)
    assert main([*tiny, *SAVING, "trainer.max_steps=2"]) == 0
    before = {p.name: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    capsys.readouterr()

    assert main([*tiny, *SAVING, "trainer.max_steps=4", "optim.lr=0.0001"]) == 2
    err = one_line_error(capsys)
    assert f"optim.lr {default.optim.lr} -> 0.0001" in err and "trainer.override_optim=true" in err
    assert f"resume with optim.lr={default.optim.lr}, or start a new run.output_dir" in err  # the way back

    override, named = MODEL_CHANGE
    assert main([*tiny, *SAVING, "trainer.max_steps=4", override, "optim.weight_decay=0.3"]) == 2
    err = one_line_error(capsys)
    assert named in err and f"optim.weight_decay {default.optim.weight_decay} -> 0.3" in err
    assert "override_optim" not in err  # it cannot make a different model resumable
    assert {p.name: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


@pytest.mark.slow
@pytest.mark.core  # checkpoints and resume rules: the same for every task
def test_allowed_changes_are_applied_and_logged(tiny, run_dir, caplog):
    """Stop conditions, cadence and workers may change on resume; the log names what changed and the
    run continues from its checkpoint."""
    assert main([*tiny, *SAVING, "trainer.max_steps=2"]) == 0
    with caplog.at_level("INFO"):
        changed = ["trainer.max_epochs=2", "trainer.max_steps=8", "trainer.log_every=2", "data.num_workers=1"]
        assert main([*tiny, *SAVING, *changed]) == 0
    assert "resuming with changed data.num_workers, trainer.log_every, trainer.max_epochs, trainer.max_steps" in (
        caplog.text
    )
    steps = [r["step"] for r in read_metrics(run_dir) if "train/loss" in r]
    assert steps == [1, 2, 4, 6, 8]  # continued at step 3, logging every 2 steps from then on


@pytest.mark.slow
@pytest.mark.core  # checkpoints and resume rules: the same for every task
def test_override_optim_applies_the_new_learning_rate_and_weight_decay(tiny, run_dir, capsys):
    """The remedy of a diverged run works: with trainer.override_optim=true, a run resumed from step 2 with
    a lower optim.lr, another weight decay and other betas trains with them from its next step on."""
    assert main([*tiny, *SAVING, "trainer.max_steps=2"]) == 0
    new = ["optim.lr=0.0001", "optim.weight_decay=0.2", "optim.betas=[0.8,0.9]", "trainer.override_optim=true"]
    new.append("trainer.max_steps=6")
    assert main([*tiny, *SAVING, *new]) == 0

    logged = {r["step"]: r["train/lr"] for r in read_metrics(run_dir) if "train/lr" in r}
    total = 6  # optimizer steps of the run as configured now
    for step in (3, 4, 5, 6):  # step s uses the rate the schedule gives after s - 1 steps
        assert logged[step] == pytest.approx(1e-4 * warmup_cosine(step - 1, warmup=2, total=total, min_ratio=0.01))
    groups = latest_checkpoint(run_dir / "checkpoints")[1]["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.2, 0.0]  # biases and norms still without decay
    assert [tuple(g["betas"]) for g in groups] == [(0.8, 0.9), (0.8, 0.9)]
    assert all(g["initial_lr"] == 1e-4 for g in groups)


@pytest.mark.slow
@pytest.mark.core  # checkpoints and resume rules: the same for every task
def test_batch_size_may_change_when_the_global_batch_does_not(tiny, run_dir, capsys):
    """B per step may be resumed as 2 accumulated micro-batches of B/2, not as B/2 per step."""
    batch = load_config(SPEC, [], tiny).data.batch_size
    assert main([*tiny, *SAVING, "trainer.max_steps=2"]) == 0
    capsys.readouterr()
    assert main([*tiny, *SAVING, "trainer.max_steps=4", f"data.batch_size={batch // 2}"]) == 2
    err = one_line_error(capsys)
    assert f"data.batch_size {batch} -> {batch // 2}" in err and f"global batch {batch} -> {batch // 2}" in err
    halves = [f"data.batch_size={batch // 2}", "trainer.grad_accum_steps=2"]
    assert main([*tiny, *SAVING, "trainer.max_steps=4", *halves]) == 0
    assert latest_checkpoint(run_dir / "checkpoints")[1]["progress"]["step"] == 4


@pytest.mark.slow
@pytest.mark.core  # checkpoints and resume rules: the same for every task
def test_resuming_with_another_precision_exits_2(tiny, run_dir, capsys):
    """An fp32 checkpoint resumed with trainer.precision=bf16 (on a GPU also fp16, whose scaler state an
    fp32 checkpoint lacks) stops with one line naming trainer.precision."""
    assert main([*tiny, *SAVING, "trainer.max_steps=2"]) == 0
    capsys.readouterr()
    assert main([*tiny, *SAVING, "trainer.max_steps=4", "trainer.precision=bf16"]) == 2
    assert "trainer.precision 'fp32' -> 'bf16'" in one_line_error(capsys)


@pytest.mark.gpu
def test_resuming_an_fp32_checkpoint_with_fp16_exits_2_on_a_gpu(tiny, run_dir, capsys):
    """On a GPU, fp16 is allowed; resuming an fp32 checkpoint with it (its gradient scaler state is empty,
    which GradScaler.load_state_dict refuses with a RuntimeError) stops with one line instead."""
    gpu = [arg.replace("run.device=cpu", "run.device=cuda") for arg in tiny]
    assert main([*gpu, *SAVING, "trainer.max_steps=2"]) == 0
    capsys.readouterr()
    assert main([*gpu, *SAVING, "trainer.max_steps=4", "trainer.precision=fp16"]) == 2
    assert "trainer.precision 'fp32' -> 'fp16'" in one_line_error(capsys)


@pytest.mark.slow
@pytest.mark.core  # checkpoints and resume rules: the same for every task
def test_a_fresh_start_in_a_used_directory_keeps_every_earlier_file(tiny, run_dir):
    """trainer.resume=never in a directory that holds two earlier runs: their metrics, best model, config and
    checkpoints are renamed *.superseded under names of their own; the new metrics.jsonl holds one series."""
    first = [*tiny, *SAVING, "trainer.max_steps=4"]
    assert main(first) == 0
    files = ("metrics.jsonl", "best.safetensors", "config.yaml", "checkpoints/step_00000004.pt")
    run1 = {name: (run_dir / name).read_bytes() for name in files}
    assert main([*first, "trainer.resume=never", "run.seed=1"]) == 0
    run2 = {name: (run_dir / name).read_bytes() for name in files}
    assert main([*first, "trainer.resume=never", "run.seed=2"]) == 0

    for name in files:
        assert (run_dir / f"{name}.superseded").read_bytes() == run1[name], name
        assert (run_dir / f"{name}.2.superseded").read_bytes() == run2[name], name
    steps = [r["step"] for r in read_metrics(run_dir) if "train/loss" in r]
    assert steps == [1, 2, 3, 4]  # one series, not three appended
    assert "seed: 2" in (run_dir / "config.yaml").read_text()


@pytest.mark.slow
@pytest.mark.core  # checkpoints and resume rules: the same for every task
def test_a_fresh_start_after_a_run_without_checkpoints_sets_its_metrics_aside(tiny, run_dir):
    """A run that died before its first checkpoint left metrics.jsonl: the next start (resume=auto finds
    nothing) sets it aside instead of appending a second series."""
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "epoch": 0, "train/loss": 9.0}\n')
    (run_dir / "wandb_run_id").write_text("0123abcd")
    assert main([*tiny, "trainer.max_steps=2"]) == 0
    assert (run_dir / "metrics.jsonl.superseded").read_text() == '{"step": 1, "epoch": 0, "train/loss": 9.0}\n'
    assert all(r.get("train/loss") != 9.0 for r in read_metrics(run_dir))
    assert (run_dir / "wandb_run_id.superseded").read_text() == "0123abcd"  # the next wandb run gets a new id


@pytest.mark.slow
@pytest.mark.core  # checkpoints and resume rules: the same for every task
def test_resuming_from_an_earlier_checkpoint_sets_aside_a_later_best_model(tiny, run_dir):
    """best.safetensors of step 6 is not replaced by the best of a run resumed from step 2: it is renamed,
    and the new best.safetensors says in its header which step made it."""
    assert main([*tiny, *SAVING]) == 0  # one epoch: validated (and best) at step 6
    best_of_step_6 = (run_dir / "best.safetensors").read_bytes()
    assert weights_metadata(run_dir / "best.safetensors")["step"] == "6"
    step_2 = list_checkpoints(run_dir / "checkpoints")[0]
    assert main([*tiny, *SAVING, "trainer.max_steps=3", f"trainer.resume={step_2}"]) == 0
    assert (run_dir / "best.safetensors.superseded").read_bytes() == best_of_step_6
    assert weights_metadata(run_dir / "best.safetensors")["step"] == "3"


HOLD_LOCK = """
import sys, time
from {{ cookiecutter.package_name }}.engine.rundir import RunLock
RunLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.core  # checkpoints and resume rules: the same for every task
def test_a_second_run_in_the_same_directory_exits_2_naming_the_first(tiny, run_dir, capsys):
    """While another process holds the directory, a run exits 2 naming its pid and host, and writes nothing;
    once that process is killed (its lock file left behind), the next run takes the lock over."""
    run_dir.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(run_dir)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main([*tiny, "trainer.max_steps=2"]) == 2
        err = one_line_error(capsys)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in err and "in use by another run" in err
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate(timeout=60)
    assert (run_dir / LOCK_NAME).exists()  # stale: its process is gone
    assert main([*tiny, "trainer.max_steps=2"]) == 0
    assert not (run_dir / LOCK_NAME).exists()  # released at the end of the run


def test_the_lock_file_names_its_holder(tmp_path):
    """The lock file says which host and pid hold it, and a second holder in the same process is refused."""
    with RunLock(tmp_path):
        record = json.loads((tmp_path / LOCK_NAME).read_text())
        assert (record["host"], record["pid"]) == (socket.gethostname(), os.getpid())
        with pytest.raises(Exception, match=f"pid {os.getpid()}"):
            RunLock(tmp_path).acquire()
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.slow
@pytest.mark.core  # checkpoints and resume rules: the same for every task
def test_best_model_header_records_its_step_and_metrics(tiny, run_dir):
    """best.safetensors carries the step and validation metrics that made it best."""
    assert main([*tiny]) == 0
    meta = weights_metadata(run_dir / "best.safetensors")
    val = [r for r in read_metrics(run_dir) if SPEC.monitor in r][-1]
    assert meta["step"] == str(val["step"]) and float(meta[SPEC.monitor]) == val[SPEC.monitor]
