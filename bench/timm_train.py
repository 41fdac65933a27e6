"""The image task against timm's own train.py: the same timm model, images, recipe and steps.

    python bench/timm_train.py [--timm DIR] [--model resnet18] [--epochs 10] [--reps 1] [--json F]

DIR is a checkout of https://github.com/huggingface/pytorch-image-models (never part of this
repository; without --timm, a shallow clone into a temporary folder, which needs the network); its
train.py runs on the installed timm. The images are scikit-learn's digits (1,797 8x8 grey scans that
ship inside the package, so nothing is downloaded), scaled to 32x32 RGB PNG files in an ImageFolder:
every fifth image of each class is validation (360), the rest training (1,437). The recipe, the
same on both sides: AdamW at lr 2e-3 (weight decay 0.05 on matrices), batch 64, one warmup epoch
then cosine decay to 1e-5, timm's RandAugment rand-m9-mstd0.5-inc1, random erasing 0.25, mixup
0.2 and cutmix 1.0 (switching half the time), label smoothing 0.1, drop path 0.05, fp32 on the CPU
with 2 loader workers, validation after every epoch. What differs and stays: timm's random resized
crop draws scale 0.08-1 (ours 0.35-1), its random erasing fills with noise (ours with the mean),
its mixup pairs a batch with itself reversed (ours with a sample drawn from the whole set).

Ours runs twice: with data.mix_partner=set (the default: each mixed image's partner is a second
image drawn from the whole set and loaded for it) and =batch (the batch reversed, as timm mixes).
Figures per contender: the final top-1 validation accuracy (both: every validation image once), the
median seconds per optimizer step (ours: perf/step_time_s; timm: its logged batch times, the first
log line of each epoch left out) and the wall time. With --reps N the two run in turn N times and
the medians are kept.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TIMM = "https://github.com/huggingface/pytorch-image-models"
SIZE = 32
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
RECIPE = {
    "batch": 64,
    "lr": 2e-3,
    "min_lr": 1e-5,
    "weight_decay": 0.05,
    "augment": "rand-m9-mstd0.5-inc1",
    "erase": 0.25,
    "mixup": 0.2,
    "cutmix": 1.0,
    "smoothing": 0.1,
    "drop_path": 0.05,
    "workers": 2,
}


def digits_folder(root: Path) -> tuple[int, int]:
    """scikit-learn's digits as root/train/<digit>/*.png and root/val/<digit>/*.png, 32x32 RGB."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    seen = dict.fromkeys(range(10), 0)
    counts = {"train": 0, "val": 0}
    for pixels, label in zip(digits.images, digits.target, strict=True):
        split = "val" if seen[label] % 5 == 4 else "train"
        seen[label] += 1
        folder = root / split / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        grey = Image.fromarray((pixels * (255 / 16)).round().astype(np.uint8))
        grey.resize((SIZE, SIZE), Image.Resampling.BICUBIC).convert("RGB").save(
            folder / f"{counts[split]}.png"
        )
        counts[split] += 1
    return counts["train"], counts["val"]


def run_timm(checkout: Path, data: Path, out: Path, model: str, epochs: int) -> dict:
    """timm's train.py at the recipe; its last epoch's eval_top1 and median logged batch time."""
    r = RECIPE
    command = [
        *(sys.executable, str(checkout / "train.py"), "--data-dir", str(data)),
        *("--train-split", "train", "--val-split", "val", "--model", model, "--num-classes", "10"),
        *("--input-size", "3", str(SIZE), str(SIZE), "--crop-pct", "1.0"),
        *("--mean", *map(str, MEAN), "--std", *map(str, STD)),
        *("--batch-size", str(r["batch"]), "--validation-batch-size", str(r["batch"])),
        *("--epochs", str(epochs), "--opt", "adamw", "--lr", str(r["lr"])),
        *(
            "--weight-decay",
            str(r["weight_decay"]),
            "--sched",
            "cosine",
            "--min-lr",
            str(r["min_lr"]),
        ),
        *("--warmup-epochs", "1", "--warmup-lr", str(r["min_lr"]), "--cooldown-epochs", "0"),
        *("--aa", r["augment"], "--reprob", str(r["erase"]), "--mixup", str(r["mixup"])),
        *("--cutmix", str(r["cutmix"]), "--smoothing", str(r["smoothing"])),
        *("--drop-path", str(r["drop_path"]), "--workers", str(r["workers"])),
        *("--device", "cpu", "--no-prefetcher", "--log-interval", "5", "--seed", "0"),
        *("--output", str(out), "--experiment", "bench", "--checkpoint-hist", "1"),
    ]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=checkout, capture_output=True, text=True, timeout=7200)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"timm's train.py failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    with open(out / "bench" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    times = batch_times(done.stdout + done.stderr)
    return {
        "val_acc": float(rows[-1]["eval_top1"]) / 100,
        "step_s": statistics.median(times),
        "wall_s": wall,
    }


def batch_times(log: str) -> list[float]:
    """The batch times timm's train.py logs ("Train: 3 [  10/22 ( 45%)]  Loss: ...  Time: 0.151s,
    ...": the interval's last batch), without each epoch's first line (batch 0: the loader's
    start)."""
    found = re.finditer(r"Train: \d+ \[\s*(\d+)/\d+.*?Time: ([\d.]+)s", log)
    return [float(m.group(2)) for m in found if int(m.group(1)) > 0]


def run_ours(
    project: Path,
    package: str,
    data: Path,
    out: Path,
    model: str,
    epochs: int,
    train_size: int,
    partner: str,
) -> dict:
    """The baked image project at the recipe (data.mix_partner=partner); its final val/acc and
    median perf/step_time_s."""
    r = RECIPE
    steps_per_epoch = train_size // r["batch"]
    overrides = [
        *("run.device=cpu", "tracker.name=none", f"run.output_dir={out}", "data.name=imagefolder"),
        *(f"data.root={data}", f"data.image_size={SIZE}", f"data.batch_size={r['batch']}"),
        f"data.mean=[{','.join(map(str, MEAN))}]",
        f"data.std=[{','.join(map(str, STD))}]",
        *(
            "data.loader=workers",
            f"data.num_workers={r['workers']}",
            f"data.augment={r['augment']}",
        ),
        *(
            f"data.random_erase={r['erase']}",
            f"data.mixup={r['mixup']}",
            f"data.cutmix={r['cutmix']}",
        ),
        *(f"data.mix_partner={partner}", f"model.name=timm:{model}"),
        *(f"model.drop_path={r['drop_path']}", f"model.label_smoothing={r['smoothing']}"),
        *(f"optim.lr={r['lr']}", f"optim.weight_decay={r['weight_decay']}"),
        *(f"optim.min_lr_ratio={r['min_lr'] / r['lr']}", f"optim.warmup_steps={steps_per_epoch}"),
        *(f"trainer.max_epochs={epochs}", "trainer.log_every=5"),
        f"trainer.checkpoint_every={steps_per_epoch * epochs}",
    ]
    env = {**os.environ, "PYTHONPATH": str(project / "src")}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", f"{package}.train", *overrides],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"the project's train failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val/acc" in r][-1]
    times = [r["perf/step_time_s"] for r in records if "perf/step_time_s" in r]
    return {"val_acc": val["val/acc"], "step_s": statistics.median(times), "wall_s": wall}


def compare(
    checkout: Path, project: Path, package: str, work: Path, model: str, epochs: int, reps: int
) -> dict:
    data = work / "digits"
    train_size, val_size = digits_folder(data)
    runs: dict[str, list[dict]] = {"ours": [], "ours_batch": [], "timm": []}
    for rep in range(reps):
        for name, partner in (("ours", "set"), ("ours_batch", "batch")):
            out = work / f"{name}{rep}"
            runs[name].append(
                run_ours(project, package, data, out, model, epochs, train_size, partner)
            )
        runs["timm"].append(run_timm(checkout, data, work / f"timm{rep}", model, epochs))
    figures: dict = {
        "model": model,
        "epochs": epochs,
        "train_images": train_size,
        "val_images": val_size,
    }
    for name, results in runs.items():
        for key in ("val_acc", "step_s", "wall_s"):
            figures[f"{name}_{key}"] = statistics.median(r[key] for r in results)
    figures["step_time_ratio"] = figures["ours_step_s"] / figures["timm_step_s"]
    figures["step_time_ratio_batch"] = figures["ours_batch_step_s"] / figures["timm_step_s"]
    return {"figures": figures, "runs": runs, "recipe": RECIPE}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--timm", type=Path, help="a checkout of pytorch-image-models (default: clone one)"
    )
    parser.add_argument("--model", default="resnet18", help="a timm model name")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "cpu_timm.json")
    sys.path.insert(0, str(HERE))
    from run import bake, report, shallow_clone

    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkout = args.timm or shallow_clone(TIMM, Path(tmp) / "timm", "--timm")
        if not (checkout / "train.py").is_file():
            parser.error(f"--timm {checkout}: no train.py; clone {TIMM}")
        project, package = bake(Path(tmp) / "project")
        result = compare(checkout, project, package, Path(tmp), args.model, args.epochs, args.reps)
    import timm
    import torch

    result.update(
        torch=torch.__version__,
        timm=timm.__version__,
        cpus=os.cpu_count(),
        command=" ".join(sys.argv),
    )
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
