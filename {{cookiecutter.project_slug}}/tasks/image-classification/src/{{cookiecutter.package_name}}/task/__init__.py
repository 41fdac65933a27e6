"""Yours: what this project trains, images and their classifier. task.py is what the engine calls
(engine/seam.py declares it), config.py what it reads; the rest are the task's own building blocks.

    task                the Task: data sets, model, loss, validation, evaluate's reports, export
    config              the data and model sections, the task's SPEC, what a timm folder sets
    data                synthetic / cifar10 / imagefolder, transforms, normalisation on the device
    augment             the recipe: TrivialAugment / RandAugment, mixup, cutmix, random erasing
    model               a torchvision or timm model by name or folder, freezing, layer decay, the loss
    validation          exact validation metrics over the whole set, the confusion matrix
"""
