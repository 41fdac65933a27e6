"""Which architecture of the language model learns more in the same time: gpt2 against llama at
nanoGPT's published CPU recipe (bench/nanogpt.py: 4 layers, 4 heads, width 128, context 64,
batch 12, lr 1e-3 with warmup and cosine decay, on about 4 MB of the Python standard library's
sources, one byte a token).

    python bench/arch.py [--steps 2000] [--reps 1] [--json FILE]

gpt2 trains --steps steps. llama (the micro preset's 2 key/value heads for 4 heads, its SwiGLU
width of 352) first trains the same number of steps, which gives its seconds per step; then it
trains again for the steps that take gpt2's wall time (its schedule stretched or shrunk to them),
and the final validation losses are compared: the one at the same steps and the one at the same
time. With --reps N each run repeats N times and the medians are kept. The architecture that
reaches the lower loss in the same time is the default for new models (DEFAULT_ARCH in
task/model/build.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=4.0, help="megabytes of standard-library text")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "cpu_arch.json")
    sys.path.insert(0, str(HERE))
    from nanogpt import run_ours, stdlib_text
    from run import add_project_options, lm_project, report

    add_project_options(parser)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"gpt2": [], "llama_same_steps": [], "llama_same_time": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        project, package = lm_project(args, work)
        text_file = work / "stdlib.txt"
        text_file.write_bytes(stdlib_text(args.mb))

        def train(name: str, rep: int, steps: int, arch: str) -> dict:
            folder, extra = work / f"{name}{rep}", (f"model.arch={arch}",)
            result = run_ours(project, package, text_file, folder, steps, extra)
            runs[name].append({**result, "steps": steps})
            print(f"{name} rep {rep}: {json.dumps(runs[name][-1])}", flush=True)
            return result

        for rep in range(args.reps):
            gpt2 = train("gpt2", rep, args.steps, "gpt2")
            llama = train("llama_same_steps", rep, args.steps, "llama")
            same_time = round(args.steps * gpt2["wall_s"] / llama["wall_s"])
            train("llama_same_time", rep, same_time, "llama")
    figures: dict = {"steps": args.steps, "reps": args.reps}
    for name, results in runs.items():
        for key in ("val_loss", "step_s", "wall_s", "steps"):
            figures[f"{name}_{key}"] = statistics.median(r[key] for r in results)
    figures["same_time_loss_gap"] = figures["gpt2_val_loss"] - figures["llama_same_time_val_loss"]
    figures["winner"] = "llama" if figures["same_time_loss_gap"] > 0 else "gpt2"
    import torch

    result = {"figures": figures, "runs": runs, "torch": torch.__version__, "cpus": os.cpu_count()}
    result["command"] = " ".join(sys.argv)
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
