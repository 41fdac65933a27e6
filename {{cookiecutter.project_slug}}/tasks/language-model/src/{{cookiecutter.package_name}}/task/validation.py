"""Validation: exact metrics over the whole validation split, for any number of processes.

Every target token is counted once (data.ValWindows cuts the split so; the validation loader gives
each process a disjoint strided share of the windows), the loss is summed per token and divided by
the tokens counted, and the model runs under eval() and no_grad(). Packed conversations (prepare
--chat) count their trained targets only: val/loss is the supervised loss. Used by training every
trainer.val_every steps and at the end, and by the evaluate command.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..engine.loaders import in_lockstep
from ..engine.parallel import distributed
from ..engine.step import autocast
from .data import IGNORE
from .model import lm_loss


def evaluate_model(model: nn.Module, loader, device: torch.device, precision: str, bytes_per_token: float) -> dict:
    """val/loss (mean cross-entropy per token, nats), val/ppl, val/bpb and val/tokens, summed over all processes."""
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, tokens
    inputs = documents = None
    with torch.no_grad(), autocast(device, precision):
        for batch in in_lockstep(loader, device):
            if batch is None:
                model(inputs, documents=documents)  # keeps step with processes that have one more batch; not counted
                continue
            if torch.is_tensor(batch):  # packed conversations: inputs, targets, documents
                packs = batch.to(device, non_blocking=True)
                inputs, targets, documents = packs[:, 0], packs[:, 1], packs[:, 2]
                sums[0] += lm_loss(model(inputs, documents=documents), targets, reduction="sum")
                sums[1] += (targets != IGNORE).sum()
                continue
            windows, skip = batch
            windows = windows.to(device, non_blocking=True)
            inputs, targets = windows[:, :-1], windows[:, 1:].clone()
            positions = torch.arange(targets.shape[1], device=device)
            targets[positions < skip.to(device)[:, None]] = IGNORE  # counted by the window before
            sums[0] += lm_loss(model(inputs), targets, reduction="sum")
            sums[1] += (targets != IGNORE).sum()
    distributed.all_reduce_sum(sums)
    loss_sum, tokens = sums.tolist()  # one host sync for the whole pass
    loss = loss_sum / tokens
    return {
        "val/loss": loss,
        "val/ppl": math.exp(min(loss, 700.0)),  # exp overflows a float above 709
        "val/bpb": loss / math.log(2) / bytes_per_token,
        "val/tokens": int(tokens),
    }
