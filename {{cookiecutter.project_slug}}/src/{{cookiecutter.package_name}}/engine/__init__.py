"""The training engine: everything a task does not decide. Nothing here imports the task (../task/):
the commands (../train.py, ../evaluate.py, ...) hand it in as arguments, its declaration (a TaskSpec)
and its class (a seam.Task), both types declared once in seam.py. Below the top of the loop each
part takes the config sections it reads, not the whole config.

    seam                the task interface: TaskSpec and the Task base class
    config, errors, cli typed configuration, the error kinds, and their exit statuses in every command
    startup             the garbage collector off while a command imports torch (python -m PACKAGE.COMMAND)
    loop, step, state   the outer training loop, one optimizer step, the checkpointable state
    loaders, optim, ema, metrics, trackers, profiler, provenance, rundir, preemption, launcher
    torch_private       the few private PyTorch names used, each with a test
    parallel/           process groups, DDP/FSDP2/HSDP wrapping, meta-device init, activation checkpointing,
                        the state dicts checkpoints hold
    ckpt/               atomic files, full and sharded checkpoints, restoring a trained model
    sweep/              Optuna searches, each trial a training run (python -m PACKAGE.sweep)
"""

PACKAGE = __name__.split(".")[0]  # the project's import name, as commands and messages spell it
