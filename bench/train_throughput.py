"""Benchmark the generated training loop: bake the defaults, then time real training runs.

    python bench/train_throughput.py                 # CPU: the demo run + throughput cases
    python bench/train_throughput.py --cases gpu     # GPU: fp32 / bf16 / fp16 / channels_last

For each case it reports the wall time of the whole command, the median perf/samples_per_s that
the run itself logged (warm steps only), and the final val/acc. Results go to stdout as a table
and, with --json FILE, to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]
CPU_STEPS = ["trainer.max_steps=60", "trainer.log_every=10"]
GPU_STEPS = ["trainer.max_steps=300", "trainer.log_every=50", "data.train_size=50000"]
CASES = {
    "cpu": {
        "demo (defaults, no arguments)": [],
        "cpu fp32 batch 128, 60 steps": CPU_STEPS,
        "cpu bf16 batch 128, 60 steps": [*CPU_STEPS, "trainer.precision=bf16"],
    },
    "gpu": {
        "gpu fp32": GPU_STEPS,
        "gpu bf16": [*GPU_STEPS, "trainer.precision=bf16"],
        "gpu fp16": [*GPU_STEPS, "trainer.precision=fp16"],
        "gpu bf16 channels_last": [
            *GPU_STEPS,
            "trainer.precision=bf16",
            "model.channels_last=true",
        ],
    },
}


def run_case(project: Path, name: str, overrides: list[str], out: Path) -> dict:
    run_dir = out / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
    env = {**os.environ, "PYTHONPATH": str(project / "src")}
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "my_trainer.train", f"run.output_dir={run_dir}", *overrides],
        cwd=project,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["perf/samples_per_s"] for r in records if "perf/samples_per_s" in r][
        1:
    ]  # first window warms up
    final = [r for r in records if "val/acc" in r][-1]
    return {
        "case": name,
        "wall_s": round(wall, 1),
        "samples_per_s": round(statistics.median(speeds), 1) if speeds else None,
        "val_acc": round(final["val/acc"], 4),
        "val_samples": final["val/samples"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", choices=sorted(CASES), default="cpu")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=tmp))
        results = [
            run_case(project, name, overrides, Path(tmp))
            for name, overrides in CASES[args.cases].items()
        ]
    print(f"{'case':<34} {'wall s':>8} {'samples/s':>10} {'val/acc':>8} {'val n':>6}")
    for r in results:
        speed = str(r["samples_per_s"])
        print(
            f"{r['case']:<34} {r['wall_s']:>8} {speed:>10} {r['val_acc']:>8} {r['val_samples']:>6}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
