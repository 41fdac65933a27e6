"""The task's seconds-long CPU configuration for the tests, and what its runs log.

The nano transformer on a small synthetic source: windows of 16 tokens, 6 steps per epoch, and
999 validation targets (an uneven last window). Validation follows each epoch, as for a fixed
data set, so the shared tests see the same rhythm for every task.
"""

TINY = [
    "run.device=cpu",
    "data.seq_len=16",
    "data.batch_size=8",
    "data.train_tokens=800",
    "data.val_tokens=1000",
    "data.num_workers=0",
    "model.preset=nano",
    "trainer.max_epochs=1",
    "trainer.max_steps=null",
    "trainer.val_every=null",
    "trainer.log_every=2",
    "optim.warmup_steps=2",
    "tracker.name=none",
]
# Random draws of the training data that a resumed run must repeat exactly (the windows' offsets).
RANDOM_DATA: list[str] = []
# The model of the engine's fault runs, which write a checkpoint every second step, and of its bf16 runs on
# the CPU: TINY's nano model.
SMALL_MODEL: list[str] = []
# No random draws of the training data: both loaders (data.loader=device, workers) hand over the same batches.
SAME_DATA: list[str] = []
# Keys of a validation line, and the one that counts what was validated with the split's size.
VAL_KEYS = ("val/loss", "val/ppl", "val/bpb", "val/tokens")
VAL_COUNT = ("val/tokens", 999)
# A change of the model on resume that must be refused, and how the error names it.
MODEL_CHANGE = ("model.preset=micro", "model.preset 'nano' -> 'micro'")
# Mistakes in the task's own keys, and what the error says.
BAD_CONFIGS = [
    (["data.name=bytes"], "choose one of synthetic, text"),
    (["model.preset=huge"], "choose one of nano, micro, mini, small, gpt2"),
    (["data.seq_len=0"], "data.seq_len=0 must be at least 1"),
    (["data.vocab_size=100"], "data.vocab_size=100 must be between 2 and 62"),
    (["data.order=6"], "too many to tabulate"),
    (["model.dropout=1.0"], "model.dropout=1.0 must be at least 0 and below 1"),
    (["model.lora.r=4"], "model.lora.r=4 trains adapters over the frozen weights of model.init_from, which is not set"),
    (["model.lora.dora=true"], "model.lora.dora is set, but model.lora.r=0"),
    (["model.quantize=nf4"], "model.quantize=nf4 stores the frozen base in 4 bits for adapters to train over"),
    (["trainer.eval_tasks=[hellaswag]"], "trainer.eval_tasks: benchmarks score text, and data.name=synthetic has none"),
]
# Settings under which N processes x batch b train like 1 process x batch N x b (nothing in the
# transformer depends on the per-process batch).
BATCH_INDEPENDENT = []
