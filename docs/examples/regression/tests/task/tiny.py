"""The task's seconds-long CPU configuration for the tests, and what its runs log.

192 training samples of 8 features, 6 steps per epoch, 101 validation samples (an uneven last
batch).
"""

TINY = [
    "run.device=cpu",
    "data.train_size=192",
    "data.val_size=101",
    "data.batch_size=32",
    "data.num_workers=0",
    "trainer.max_epochs=1",
    "trainer.log_every=2",
    "optim.warmup_steps=2",
    "tracker.name=none",
]
# Random draws of the training data that a resumed run must repeat exactly: none here.
RANDOM_DATA: list[str] = []
# The model of the engine's fault runs, which write a checkpoint every second step: TINY's.
SMALL_MODEL: list[str] = []
# No random draws of the training data: both loaders hand over the same batches.
SAME_DATA: list[str] = []
# Keys of a validation line, and the one that counts what was validated with the set's size.
VAL_KEYS = ("val/loss", "val/mae", "val/samples")
VAL_COUNT = ("val/samples", 101)
# A change of the model on resume that must be refused, and how the error names it.
MODEL_CHANGE = ("model.hidden=32", "model.hidden 64 -> 32")
# Mistakes in the task's own keys, and what the error says.
BAD_CONFIGS = [
    (["model.activation=sigmoid"], "choose one of gelu, relu, tanh"),
    (["data.noise=-1"], "data.noise=-1.0 must be a finite number, 0 or more"),
    (["model.hidden=0"], "model.hidden=0 must be at least 1"),
]
# Settings under which N processes x batch b train like 1 process x batch N x b (nothing in an MLP
# depends on the per-process batch).
BATCH_INDEPENDENT: list[str] = []
