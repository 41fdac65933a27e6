"""Evaluate a checkpoint on the validation set.

    python -m PACKAGE.evaluate run.output_dir=runs/demo           # newest checkpoint of that run
    python -m PACKAGE.evaluate --checkpoint runs/demo/checkpoints/step_00000120.pt
    torchrun --nproc_per_node=4 -m PACKAGE.evaluate run.output_dir=runs/demo

The model is rebuilt from the checkpoint (engine/ckpt/restore.py): its stored config gives only the
model's and the task's shape (the keys the task's TaskSpec.from_checkpoint names, and the precision).
--config files and key=value overrides win.
Everything else, places above all, comes from the command line or the defaults: a checkpoint
copied from elsewhere never decides where data is read from or anything is written.

Prints the metrics as JSON (`step` is null for weights saved without training progress) and
writes them to <output_dir>/eval.json, where output_dir is run.output_dir as given on the command
line (an override or a --config file) or, for --checkpoint PATH alone, the folder beside it: the
run directory for a run's checkpoints/step_N.pt (so a run's eval.json sits next to its
metrics.jsonl, as with run.output_dir), else the checkpoint's own folder. The task may add
reports (Task.evaluate), written to <output_dir>/eval/ and listed under "reports", and switches and
options of its own (TaskSpec.evaluate_flags, TaskSpec.evaluate_options; --help lists them).
Benchmark scores (eval/TASK/METRIC) also go to the tracker tracker.name names, in the run
<output_dir>'s tracker run, at the checkpoint's step (engine/trackers.py: log_scores).

Errors are one `error: ...` line on stderr: exit 2 for bad input (configuration, data,
checkpoint), 1 when an output cannot be written or CUDA runs out of memory (engine/cli.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from .engine import PACKAGE, cli
from .engine.ckpt.files import atomic_write, writing
from .engine.ckpt.restore import beside, load_model_weights, restore_trained, take_options, trained_step
from .engine.config import Config
from .engine.errors import OutOfMemory
from .engine.loaders import build_val_loader, shut_down_workers
from .engine.parallel import distributed
from .engine.trackers import log_scores
from .task.config import SPEC


def evaluate_checkpoint(cfg: Config, path: Path, state: dict, options: dict | None = None) -> tuple[dict, dict, bool]:
    """The validation metrics of a checkpoint (on every process), the task's reports (Task.evaluate: file
    name -> writer) and whether this is the main process. options: the task's own, given (Task.evaluate)."""
    from .task.task import Task  # here, not above: it brings the task's libraries, which --help does without

    env = distributed.setup(cfg.run, cfg.distributed)
    try:
        task = Task(cfg, env.device)
        _, val_set = task.datasets()
        task.check_model_files(beside(path))  # the data as the run saw it (its input encoding, say)
        val_loader = build_val_loader(cfg.data, val_set, rank=env.rank, world_size=env.world_size)
        try:
            model = task.build_model(env.device)
            load_model_weights(model, state, path, task.frozen_weights())
            return (*task.evaluate(model, val_loader, options or {}), env.is_main)
        finally:
            shut_down_workers(val_loader)
    finally:
        distributed.teardown()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return cli.run(lambda: _evaluate(argv))


def _evaluate(argv: list[str]) -> int:
    given, argv = take_options(argv, tuple(SPEC.evaluate_options), joined=True)  # --task-data a=x --task-data b=y
    options = {name: value for name, value in given.items() if value is not None}
    options |= dict.fromkeys(arg for arg in argv if arg in SPEC.evaluate_flags)
    argv = [arg for arg in argv if arg not in SPEC.evaluate_flags]
    cfg, path, state = restore_trained(SPEC, argv, f"{PACKAGE}.evaluate")
    try:
        metrics, reports, is_main = evaluate_checkpoint(cfg, path, state, options)
    except torch.OutOfMemoryError:
        raise OutOfMemory(f"CUDA out of memory; lower data.batch_size (now {cfg.data.batch_size})") from None
    if is_main:
        written = []
        for name, write in reports.items():  # before eval.json, which lists them
            report = Path(cfg.run.output_dir) / "eval" / name
            with writing(report):
                atomic_write(report, write)
            written.append(str(report))
        result = {"checkpoint": str(path), "step": trained_step(state), **metrics}
        text = json.dumps({**result, "reports": written} if written else result, indent=2)
        print(text)
        eval_json = Path(cfg.run.output_dir) / "eval.json"
        with writing(eval_json):
            atomic_write(eval_json, lambda tmp: tmp.write_text(text + "\n"))
        scores = {key: value for key, value in metrics.items() if key.startswith("eval/")}
        log_scores(Path(cfg.run.output_dir), cfg.tracker, scores, result["step"] or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
