"""Validation: exact metrics over the whole validation set, for any number of processes.

Every sample is counted once (the validation loader splits the set into disjoint strided slices),
losses are weighted by samples, accuracy is correct / samples, and the model runs under eval()
and no_grad(). Used by training after every epoch and by the evaluate command.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..engine.loaders import in_lockstep
from ..engine.parallel import distributed
from ..engine.step import autocast
from .data import DeviceImages


def evaluate_model(model: nn.Module, loader, inputs: DeviceImages, precision: str = "fp32") -> dict:
    """Validation loss and accuracy over every sample, summed over all processes.

    val/loss is the sample-weighted mean loss, val/acc = correct / samples counted (not / batches),
    and val/samples the number of samples counted. Runs under eval() and no_grad(). `inputs` moves
    each batch's images to the device and normalises them, as in training.
    """
    model.eval()
    device = inputs.device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    images = None
    with torch.no_grad(), autocast(device, precision):
        for batch in in_lockstep(loader, device):
            if batch is None:
                model(images)  # keeps step with processes that have one more batch; not counted
                continue
            images, targets = batch
            images = inputs(images)
            targets = targets.to(device, non_blocking=True)
            logits = model(images)
            sums[0] += F.cross_entropy(logits.float(), targets, reduction="sum")
            sums[1] += (logits.argmax(dim=1) == targets).sum()
            sums[2] += targets.numel()
    distributed.all_reduce_sum(sums)
    loss_sum, correct, samples = sums.tolist()  # one host sync for the whole pass
    return {"val/loss": loss_sum / samples, "val/acc": correct / samples, "val/samples": int(samples)}
