"""Yours: what this project trains, images and their classifier. task.py is what the engine calls
(engine/seam.py declares it), config.py what it reads; the rest are the task's own building blocks.

    task                the Task: data sets, model, loss, validation, export; what the engine calls
    config              the data and model sections and the task's SPEC
    data                synthetic / cifar10 / imagefolder, transforms, normalisation on the device
    model               a torchvision model by name, freezing, the loss
    validation          exact validation metrics over the whole set, any number of processes
"""
