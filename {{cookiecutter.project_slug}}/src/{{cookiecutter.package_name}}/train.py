"""Train (and resume) the task's model. One process is world size 1 of the same code.

    python -m PACKAGE.train                                        # one CPU or GPU, synthetic data
    python -m PACKAGE.train --config configs/default.yaml trainer.max_epochs=10 data.batch_size=64
    torchrun --nproc_per_node=4 -m PACKAGE.train --config configs/default.yaml
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml -m PACKAGE.train --config configs/default.yaml
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 \\
        -m PACKAGE.train --config configs/default.yaml          # on each node

Resume: run the same command again; trainer.resume=auto continues from the newest valid
checkpoint in run.output_dir, bit-exact. SIGTERM or SIGUSR1 stops after the current optimizer
step with a checkpoint and exit status 75 (see engine/preemption.py). `python -m PACKAGE.train --help`
lists every key.

Exit status (engine/errors.py): 0 done, 1 failed (diverged, out of memory, a peer hung or died, an output
could not be written), 2 bad configuration, data or checkpoint, 75 stopped by a signal after
writing a checkpoint (run the same command again).
"""

from __future__ import annotations

import sys
from pathlib import Path

from .engine import PACKAGE, cli, provenance
from .engine.config import Config, load_config, parse_args
from .engine.launcher import check_accelerate_fsdp
from .engine.loop import out_of_memory_advice as advice_for
from .engine.loop import train as train_task
from .task.config import SPEC


def train(cfg: Config) -> dict:
    """Train this project's task as configured (a config of load_config(SPEC, ...)); the final metrics."""
    from .task.task import Task  # here, not above: it brings the task's libraries, which --help does without

    return train_task(cfg, SPEC, Task)


def out_of_memory_advice(batch_size: int, accum: int) -> str:
    """What to change after the GPU ran out of memory, for this task."""
    return advice_for(batch_size, accum, SPEC.memory_hint)


def main(argv: list[str] | None = None) -> int:
    """The command line: parse, train, and print the final metrics (errors: engine/cli.py)."""
    argv = sys.argv[1:] if argv is None else argv
    provenance.command_line[:] = [Path(sys.executable).name, "-m", f"{PACKAGE}.train", *argv]
    return cli.run(lambda: _train(argv))


def _train(argv: list[str]) -> int:
    files, overrides = parse_args(SPEC, argv, f"{PACKAGE}.train")
    # accelerate launch's FSDP options, as keys between the --config files and the command line's.
    honoured = [f"{key}={str(value).lower()}" for key, value in check_accelerate_fsdp().items()]
    cfg = load_config(SPEC, files, [*honoured, *overrides])
    result = train(cfg)
    if cli.is_main_process():
        shown = dict.fromkeys([result["monitor"], "val/loss"])  # the monitored metric first, each once
        print(
            f"final {' '.join(f'{key}={result[key]:.4f}' for key in shown)} "
            f"(best {result['monitor']}={result['best']:.4f}) after {result['step']} steps; "
            f"outputs in {cfg.run.output_dir}/ (metrics.jsonl, config.yaml, checkpoints/, best.safetensors)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
