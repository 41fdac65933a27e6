"""The language model against nanoGPT's own train.py, at nanoGPT's published CPU recipe.

    python bench/nanogpt.py [--nanogpt DIR] [--mb 4] [--steps 2000] [--reps 1] [--json FILE]

DIR is a checkout of https://github.com/karpathy/nanoGPT (never part of this repository; without
--nanogpt, a shallow clone into a temporary folder, which needs the network). The
recipe is the one nanoGPT's README gives for a character-level model on a CPU (4 layers, 4 heads,
width 128, context 64, batch 12, 2,000 steps, lr 1e-3 with 100 warmup steps and cosine decay to
1e-4, weight decay 0.1, beta2 0.99, no dropout, fp32, no compile; its README reports a validation
loss of about 1.88 on Shakespeare). Both train on the same text, one file of the Python standard
library's ASCII sources (about --mb MB; one byte is one character, so nats per character and
per byte agree), with the same split: `prepare` cuts the last 10% at a line boundary, and
nanoGPT's train.bin / val.bin (its character vocabulary, as its shakespeare_char/prepare.py
writes them) are cut at the very same byte. Figures per contender: the final validation loss
(ours: every validation token once; nanoGPT: its estimate_loss over --eval-iters random
batches) and the median seconds per optimizer step (ours: perf/step_time_s of the log lines;
nanoGPT: its per-iteration times, the evaluation iterations left out). With --reps N the two run
in turn N times and the medians are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
NANOGPT = "https://github.com/karpathy/nanoGPT"
RECIPE = {  # nanoGPT's README, "I only have a macbook": the CPU run of train_shakespeare_char
    "block_size": 64,
    "batch_size": 12,
    "n_layer": 4,
    "n_head": 4,
    "n_embd": 128,
    "learning_rate": 1e-3,
    "min_lr": 1e-4,
    "warmup_iters": 100,
    "weight_decay": 0.1,
    "beta2": 0.99,
    "dropout": 0.0,
}


def stdlib_text(megabytes: float) -> bytes:
    """The standard library's .py files that are pure ASCII, in sorted order, until about megabytes
    (tests and site-packages left out): the same bytes for the same Python version."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in ("site-packages", "dist-packages", "test", "idlelib") or "tests" in parts:
            continue
        data = path.read_bytes()
        if not data.isascii() or b"\r" in data:
            continue
        chunks.append(data if data.endswith(b"\n") else data + b"\n")
        size += len(chunks[-1])
        if size >= megabytes * 1e6:
            break
    return b"".join(chunks)


def nanogpt_data(text: bytes, train_bytes: int, folder: Path) -> int:
    """train.bin, val.bin and meta.pkl as nanoGPT's shakespeare_char/prepare.py writes them (sorted
    characters, uint16 ids), split at train_bytes; returns the vocabulary size."""
    chars = sorted(set(text.decode("ascii")))
    lookup = np.zeros(128, dtype=np.uint16)
    lookup[[ord(c) for c in chars]] = np.arange(len(chars), dtype=np.uint16)
    ids = lookup[np.frombuffer(text, dtype=np.uint8)]
    folder.mkdir(parents=True)
    ids[:train_bytes].tofile(folder / "train.bin")
    ids[train_bytes:].tofile(folder / "val.bin")
    meta = {
        "vocab_size": len(chars),
        "itos": dict(enumerate(chars)),
        "stoi": {c: i for i, c in enumerate(chars)},
    }
    (folder / "meta.pkl").write_bytes(pickle.dumps(meta))
    return len(chars)


def run_nanogpt(checkout: Path, work: Path, steps: int, eval_iters: int) -> dict:
    """nanoGPT's train.py at the recipe, in a copy of the checkout; its final val loss and median
    iteration time."""
    command = [
        sys.executable,
        "train.py",
        "config/train_shakespeare_char.py",
        "--dataset=bench",
        "--device=cpu",
        "--compile=False",
        f"--eval_iters={eval_iters}",
        "--log_interval=1",
        f"--max_iters={steps}",
        f"--lr_decay_iters={steps}",
        f"--eval_interval={steps}",
        f"--out_dir={work / 'out'}",
        *(f"--{key}={value}" for key, value in RECIPE.items()),
    ]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"nanoGPT's train.py failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    losses = re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", done.stdout)
    step, _, val = losses[-1]
    if int(step) != steps:
        raise SystemExit(f"nanoGPT's last evaluation is at step {step}, not {steps}")
    times = [
        float(ms) / 1000
        for it, ms in re.findall(r"iter (\d+): loss [\d.]+, time ([\d.]+)ms", done.stdout)
        if int(it) % steps and int(it) > 0
    ]  # iteration 0 and evaluations out
    return {"val_loss": float(val), "step_s": statistics.median(times), "wall_s": wall}


def run_ours(
    project: Path, package: str, text_file: Path, work: Path, steps: int, extra: tuple = ()
) -> dict:
    """prepare (one file: the last 10% is validation) and train at the recipe (with the extra
    overrides); the final val/loss and the median perf/step_time_s."""
    data, out = work / "data", work / "run"
    env = {**os.environ, "PYTHONPATH": str(project / "src")}
    prepare = [
        sys.executable,
        "-m",
        f"{package}.prepare",
        "--out",
        str(data),
        "--val-fraction",
        "0.1",
        str(text_file),
    ]
    subprocess.run(prepare, cwd=project, env=env, check=True, capture_output=True, timeout=600)
    overrides = [
        "run.device=cpu",
        "tracker.name=none",
        f"run.output_dir={out}",
        "data.name=text",
        f"data.root={data}",
        f"data.seq_len={RECIPE['block_size']}",
        f"data.batch_size={RECIPE['batch_size']}",
        f"model.n_layer={RECIPE['n_layer']}",
        f"model.n_head={RECIPE['n_head']}",
        f"model.d_model={RECIPE['n_embd']}",
        f"model.dropout={RECIPE['dropout']}",
        f"optim.lr={RECIPE['learning_rate']}",
        f"optim.min_lr_ratio={RECIPE['min_lr'] / RECIPE['learning_rate']}",
        f"optim.warmup_steps={RECIPE['warmup_iters']}",
        f"optim.weight_decay={RECIPE['weight_decay']}",
        f"optim.betas=[0.9,{RECIPE['beta2']}]",
        "trainer.grad_clip=1.0",
        f"trainer.max_steps={steps}",
        "trainer.max_epochs=1000",
        "trainer.val_every=null",
        "trainer.log_every=10",
        f"trainer.checkpoint_every={steps}",
        *extra,
    ]
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", f"{package}.train", *overrides],
        cwd=project,
        env=env,
        check=True,
        capture_output=True,
        timeout=3600,
    )
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val/loss" in r][-1]
    times = [r["perf/step_time_s"] for r in records if "perf/step_time_s" in r and r["step"] > 10]
    return {
        "val_loss": val["val/loss"],
        "val_step": val["step"],
        "step_s": statistics.median(times),
        "wall_s": wall,
    }


def compare(
    checkout: Path,
    project: Path,
    package: str,
    work: Path,
    megabytes: float,
    steps: int,
    reps: int,
    eval_iters: int,
) -> dict:
    """Both contenders, in turn, reps times; the medians of each figure and every run's figures."""
    text = stdlib_text(megabytes)
    text_file = work / "stdlib.txt"
    text_file.write_bytes(text)
    runs: dict[str, list[dict]] = {"ours": [], "nanogpt": []}
    for rep in range(reps):
        ours = work / f"ours{rep}"
        # nanoGPT's model is GPT-2's family: ours of the same family (bench/arch.py compares llama)
        gpt2 = ("model.arch=gpt2",)
        runs["ours"].append(run_ours(project, package, text_file, ours, steps, gpt2))
        train_bytes = json.loads((ours / "data" / "meta.json").read_text())["train"]["bytes"]
        copy = work / f"nanogpt{rep}"
        shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git"))
        vocab = nanogpt_data(text, train_bytes, copy / "data" / "bench")
        runs["nanogpt"].append(run_nanogpt(copy, copy, steps, eval_iters))
    figures = {
        "text_bytes": len(text),
        "train_bytes": train_bytes,
        "nanogpt_vocab": vocab,
        "steps": steps,
        "reps": reps,
    }
    for name, results in runs.items():
        for key in ("val_loss", "step_s", "wall_s"):
            figures[f"{name}_{key}"] = statistics.median(r[key] for r in results)
    figures["step_time_ratio"] = figures["ours_step_s"] / figures["nanogpt_step_s"]
    return {"figures": figures, "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--nanogpt", type=Path, help="a checkout of karpathy/nanoGPT (default: clone one)"
    )
    parser.add_argument("--mb", type=float, default=4.0, help="megabytes of standard-library text")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--eval-iters", type=int, default=200, help="nanoGPT's evaluation batches")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "cpu_nanogpt.json")
    sys.path.insert(0, str(HERE))
    from run import add_project_options, lm_project, report, shallow_clone

    add_project_options(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkout = args.nanogpt or shallow_clone(NANOGPT, Path(tmp) / "nanoGPT", "--nanogpt")
        if not (checkout / "train.py").is_file():
            parser.error(f"--nanogpt {checkout}: no train.py; clone {NANOGPT}")
        project, package = lm_project(args, Path(tmp))
        result = compare(
            checkout, project, package, Path(tmp), args.mb, args.steps, args.reps, args.eval_iters
        )
    import torch

    result.update(torch=torch.__version__, cpus=os.cpu_count(), command=" ".join(sys.argv))
    report(result, args.json)
    print(json.dumps({f"nanogpt/{key}": value for key, value in result["figures"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
