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
# Random draws of the training data that a resumed run must repeat exactly: crops, flips, TrivialAugment,
# mixup, cutmix and random erasing, all drawn per (seed, epoch, sample).
RECIPE = ["data.augment=trivial", "data.mixup=0.2", "data.cutmix=1.0", "data.random_erase=0.25"]
RANDOM_DATA = RECIPE
# The model of the engine's fault runs, which write a checkpoint every second step: timm's test ResNet
# (0.37M parameters, with BatchNorm buffers that must come back on every rank) in place of ResNet-18's
# 11.2M, whose checkpoints took half of a 2-process FSDP run's time (23 s against 11). The bf16 runs on
# the CPU train it too: on a CPU without AVX-512 torch computes bf16 convolutions' gradients in its slow
# reference kernels, 15.5 s a ResNet-18 step of TINY against 0.23 s in fp32 (0.6 s for this one). The
# task's other tests train the default model.
SMALL_MODEL = ["model.name=timm:test_resnet"]
# No random draws of the training data: both loaders (data.loader=device, workers) hand over the same batches.
SAME_DATA = ["data.augment=none"]
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
    (["data.augment=autoaugment"], "data.augment='autoaugment': choose one of none, flip_crop, trivial, randaugment"),
    (["data.augment=rand-q9"], "data.augment='rand-q9': timm cannot parse it"),
    (["data.mixup=-0.2"], "data.mixup=-0.2 is a Beta distribution's alpha"),
    (["data.random_erase=1.5"], "data.random_erase=1.5 is a probability"),
    (["data.balance=sampler"], "choose one of none, weights"),
    (["data.mix_partner=pairs"], "choose one of set, batch"),
]
# Settings under which N processes x batch b train like 1 process x batch N x b (GroupNorm: BatchNorm
# statistics depend on the per-process batch), with the recipe's random draws on: a sample is augmented
# and mixed alike whichever process takes it.
BATCH_INDEPENDENT = ["model.norm=group", *RECIPE]


def timm_folder(path, num_classes: int = 7):
    """What the hub's timm models look like: timm's test ConvNeXt saved by timm.models.save_for_hf."""
    import timm

    model = timm.create_model("test_convnext", num_classes=num_classes)
    config = {"architecture": "test_convnext", "num_classes": num_classes}
    timm.models.save_for_hf(model, str(path), model_config=config, safe_serialization=True)
    return model
