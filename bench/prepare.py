"""Throughput of the language model's `prepare`: MB of text per second.

    python bench/prepare.py [--mb 30] [--reps 3] [--json FILE]

Bakes task=language-model and tokenizes the same corpus (the Python standard library's .py
files, one document each, about --mb MB) with:

    plain     a single-process loop that reads each file, encodes it, appends the end-of-document
              token and writes the ids (the loop a user would write first; one output file)
    workers1  prepare, one process (streaming, shards, the hash split)
    workers2  prepare --workers 2

each with the bytes tokenizer and with a byte-level BPE tokenizer.json (8,192 tokens, trained here
on the corpus with the `tokenizers` package). Each figure is the median of --reps runs, the
contenders alternating inside every repetition; only the tokenizing and writing is timed (each
run is a fresh process, its imports left out). In one process, prepare hands the `tokenizers`
package a batch that it spreads over its own threads (all cores); with --workers N, each worker
runs one thread. The bytes tokenizer always runs in one process (a copy), so its workers2 row
measures the same code as workers1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONTENDERS = ("plain", "workers1", "workers2")

PLAIN = """
import sys, time
from pathlib import Path
import numpy as np
from {package}.task.tokenizer import load_tokenizer
tokenizer = load_tokenizer(sys.argv[1])
files = [Path(p) for p in sys.argv[3:]]
start = time.perf_counter()
with open(sys.argv[2], "wb") as out:
    for path in files:
        text = path.read_bytes().decode("utf-8")
        ids = tokenizer.encode(text) + [tokenizer.eot]
        out.write(np.asarray(ids, dtype=np.uint16).tobytes())
print(time.perf_counter() - start)
"""

PREPARE = """
import sys, time
from pathlib import Path
from {package}.task.prepare import Options, prepare
options = Options(tokenizer=sys.argv[1], workers=int(sys.argv[3]))
start = time.perf_counter()
prepare(sys.argv[4:], Path(sys.argv[2]), options)
print(time.perf_counter() - start)
"""


def corpus(megabytes: float) -> list[Path]:
    """The standard library's UTF-8 .py files, sorted, until about megabytes (site-packages out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        try:
            path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append(path)
        size += path.stat().st_size
        if size >= megabytes * 1e6:
            break
    return files


def train_bpe(files: list[Path], path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(f) for f in files[: len(files) // 4]], trainer)
    tokenizer.save(str(path))


def timed(command: list[str], cwd: Path, env: dict) -> float:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{' '.join(command[:4])} failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def measure(project: Path, package: str, work: Path, megabytes: float, reps: int) -> dict:
    files = corpus(megabytes)
    size = sum(f.stat().st_size for f in files)
    train_bpe(files, work / "tokenizer.json")
    env = {**os.environ, "PYTHONPATH": str(project / "src")}
    plain, prepare = PLAIN.format(package=package), PREPARE.format(package=package)
    runs: dict[str, list[float]] = {}
    for rep in range(reps):
        for tokenizer in ("bytes", "bpe"):
            spec = "bytes" if tokenizer == "bytes" else str(work / "tokenizer.json")
            order = CONTENDERS if rep % 2 == 0 else CONTENDERS[::-1]
            for contender in order:
                out = work / f"out-{tokenizer}-{contender}-{rep}"
                if contender == "plain":
                    command = [sys.executable, "-c", plain, spec, str(out), *map(str, files)]
                else:
                    workers = contender.removeprefix("workers")
                    command = [
                        sys.executable,
                        "-c",
                        prepare,
                        spec,
                        str(out),
                        workers,
                        *map(str, files),
                    ]
                seconds = timed(command, project, env)
                runs.setdefault(f"{tokenizer}/{contender}", []).append(size / 1e6 / seconds)
                subprocess.run(["rm", "-rf", str(out)], check=True)
    figures = {"prepare/text_mb": size / 1e6, "prepare/documents": len(files)}
    for name, values in runs.items():
        figures[f"prepare/{name}_mb_s"] = statistics.median(values)
    for tokenizer in ("bytes", "bpe"):
        plain_speed = figures[f"prepare/{tokenizer}/plain_mb_s"]
        for workers in ("workers1", "workers2"):
            figures[f"prepare/{tokenizer}/{workers}_over_plain"] = (
                figures[f"prepare/{tokenizer}/{workers}_mb_s"] / plain_speed
            )
    return {"figures": figures, "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mb", type=float, default=30.0, help="megabytes of standard-library sources"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "cpu_prepare.json")
    sys.path.insert(0, str(HERE))
    from run import add_project_options, lm_project

    add_project_options(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        project, package = lm_project(args, Path(tmp))
        result = measure(project, package, Path(tmp), args.mb, args.reps)
    result.update(cpus=os.cpu_count(), command=" ".join(sys.argv))
    for key, value in result["figures"].items():
        print(f"{key}: {value:.4g}")
    print(json.dumps(result["figures"]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
