"""The training engine: everything a task does not decide. A task (../task/) reaches it through
one declared interface, seam.py; nothing here imports anything else from the task.

    config, errors      typed configuration and the error kinds with their exit statuses
    loop, step, state   the outer training loop, one optimizer step, the checkpointable state
    loaders, optim, ema, metrics, trackers, profiler, provenance, rundir, preemption, launcher
    parallel/           process groups, DDP/FSDP2/HSDP wrapping, meta-device init, activation checkpointing
    ckpt/               atomic files, full and sharded checkpoints, restoring a trained model
"""

PACKAGE = __name__.split(".")[0]  # the project's import name, as commands and messages spell it
