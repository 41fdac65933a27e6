"""The task's seconds-long CPU configuration for the tests, and what its runs log.

16x16 synthetic images, 6 steps per epoch, 101 validation samples (an uneven last batch).
"""

TINY = [
    "run.device=cpu",
    "data.image_size=16",
    "data.train_size=192",
    "data.val_size=101",
    "data.batch_size=32",
    "data.num_workers=0",
    "trainer.max_epochs=1",
    "trainer.log_every=2",
    "optim.warmup_steps=2",
    "tracker.name=none",
]
# Random draws of the training data that a resumed run must repeat exactly.
RANDOM_DATA = ["data.augment=true"]
# No random draws of the training data: both loaders (data.loader=device, workers) hand over the same batches.
SAME_DATA = ["data.augment=false"]
# Keys of a validation line, and the one that counts what was validated with the set's size.
VAL_KEYS = ("val/loss", "val/acc", "val/samples")
VAL_COUNT = ("val/samples", 101)
# A change of the model on resume that must be refused, and how the error names it.
MODEL_CHANGE = ("model.norm=group", "model.norm 'batch' -> 'group'")
# Mistakes in the task's own keys, and what the error says.
BAD_CONFIGS = [
    (["data.name=mnist"], "choose one of synthetic, cifar10, imagefolder"),
    (["model.freeze_backbone=true"], "model.freeze_backbone=true needs model.pretrained"),
    (["model.norm=group", "model.name=vit_b_16"], "model.norm=group works with ResNets only"),
    (["data.name=imagefolder", "data.root=/nonexistent"], "has no train/ folder"),
    (["model.drop_path=0.1"], "model.drop_path=0.1 applies to timm models (model.name=timm:NAME)"),
    (["model.label_smoothing=1.0"], "model.label_smoothing=1.0 must be at least 0 and below 1"),
]
# Settings under which N processes x batch b train like 1 process x batch N x b (GroupNorm: BatchNorm
# statistics depend on the per-process batch).
BATCH_INDEPENDENT = ["model.norm=group"]
