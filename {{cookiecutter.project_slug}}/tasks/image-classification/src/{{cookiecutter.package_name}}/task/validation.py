"""Validation: exact metrics over the whole validation set, for any number of processes.

Every sample is counted once (the validation loader splits the set into disjoint strided slices),
losses are weighted by samples, accuracy is correct / samples, and the model runs under eval()
and no_grad(). Used by training after every epoch and by the evaluate command.
"""

from __future__ import annotations

import json
import math

import torch
from torch import nn
from torch.nn import functional as F

from ..engine.loaders import in_lockstep
from ..engine.parallel import distributed
from ..engine.step import autocast
from .data import DeviceImages

TOP_K = 5


def evaluate_model(
    model: nn.Module, loader, inputs: DeviceImages, precision: str = "fp32", *, tta: bool = False, confusion: int = 0
) -> dict:
    """Validation loss and accuracy over every sample, summed over all processes.

    val/loss is the sample-weighted mean loss, val/acc = correct / samples counted (not / batches),
    val/top5 the share whose class is among the 5 highest logits (all of them with 5 classes or fewer),
    and val/samples the number of samples counted. Runs under eval() and no_grad(). `inputs` moves
    each batch's images to the device and normalises them, as in training. tta: the prediction is the
    mean of the class probabilities of each image and its mirror image. confusion=C: also "confusion",
    the C x C counts of (true class, predicted class) as a list of rows.
    """
    model.eval()
    device = inputs.device
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, correct, top-5 correct, samples
    counts = torch.zeros(confusion * confusion, dtype=torch.int64, device=device)
    images = None
    with torch.no_grad(), autocast(device, precision):
        for batch in in_lockstep(loader, device):
            if batch is None:
                model(images)  # keeps step with processes that have one more batch; not counted
                if tta:
                    model(images.flip(-1))
                continue
            images, targets = batch
            images = inputs(images)
            targets = targets.to(device, non_blocking=True)
            logits = model(images).float()
            if tta:  # the log of the mean probability: what the loss and the ranking see
                mirrored = model(images.flip(-1)).float()
                logits = torch.logsumexp(torch.stack([logits.log_softmax(-1), mirrored.log_softmax(-1)]), 0)
                logits -= math.log(2)
            sums[0] += F.cross_entropy(logits, targets, reduction="sum")
            predicted = logits.argmax(dim=1)
            sums[1] += (predicted == targets).sum()
            top = logits.topk(min(TOP_K, logits.shape[-1]), dim=1).indices
            sums[2] += (top == targets[:, None]).any(dim=1).sum()
            sums[3] += targets.numel()
            if confusion:
                counts += torch.bincount(targets * confusion + predicted, minlength=confusion * confusion)
    distributed.all_reduce_sum(sums)
    loss_sum, correct, top_correct, samples = sums.tolist()  # one host sync for the whole pass
    metrics = {
        "val/loss": loss_sum / samples,
        "val/acc": correct / samples,
        "val/top5": top_correct / samples,
        "val/samples": int(samples),
    }
    if confusion:
        distributed.all_reduce_sum(counts)
        metrics["confusion"] = counts.view(confusion, confusion).tolist()
    return metrics


def confusion_report(matrix: list[list[int]], classes: list[str]) -> tuple[dict, dict]:
    """Per-class accuracy (recall) and their mean (balanced accuracy), and the report confusion.json holds:
    the classes, the matrix (rows: true class, columns: predicted) and each class's accuracy and samples."""
    per_class = {}
    for index, (name, row) in enumerate(zip(classes, matrix, strict=True)):
        total = sum(row)
        per_class[name] = {"accuracy": row[index] / total if total else None, "samples": total}
    seen = [c["accuracy"] for c in per_class.values() if c["accuracy"] is not None]
    balanced = {"val/balanced_acc": sum(seen) / len(seen)} if seen else {}
    return balanced, {"classes": classes, "matrix": matrix, "per_class": per_class}


def confusion_json(report: dict) -> str:
    """confusion.json's text: one line per matrix row and per class."""
    rows = ",\n    ".join(json.dumps(row) for row in report["matrix"])
    classes = ",\n    ".join(f"{json.dumps(name)}: {json.dumps(value)}" for name, value in report["per_class"].items())
    lines = [f'  "classes": {json.dumps(report["classes"])},', f'  "matrix": [\n    {rows}\n  ],']
    lines.append('  "per_class": ' + "{\n    " + classes + "\n  }")
    return "{\n" + "\n".join(lines) + "\n}\n"


def confusion_png(report: dict, path) -> None:
    """The confusion matrix as a picture, rows normalised (each true class's predictions as shares)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    classes, matrix = report["classes"], torch.tensor(report["matrix"], dtype=torch.float64)
    shares = matrix / matrix.sum(dim=1, keepdim=True).clamp(min=1)
    side = min(2 + 0.4 * len(classes), 40)
    figure, axes = plt.subplots(figsize=(side, side))
    image = axes.imshow(shares.numpy(), cmap="Blues", vmin=0, vmax=1)
    figure.colorbar(image, ax=axes, fraction=0.046)
    ticks = range(len(classes))
    axes.set_xticks(ticks, classes, rotation=90)
    axes.set_yticks(ticks, classes)
    axes.set_xlabel("predicted class")
    axes.set_ylabel("true class")
    if len(classes) <= 30:
        for row in ticks:
            for col in ticks:
                colour = "white" if shares[row, col] > 0.5 else "black"
                axes.text(col, row, int(matrix[row, col]), ha="center", va="center", color=colour, fontsize=7)
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=100)
    plt.close(figure)
