"""Generation speed of the language model on CPU: tokens per second for --new new tokens, with the
key/value cache (generate's default) and without it (--no-cache: the whole window again for
every token).

    python bench/generate.py [--project DIR --package NAME] [--presets mini small] [--new 512]

For each preset and family (model.arch gpt2 and llama), a model of that preset, seeded, with a
context of --new + 16 tokens, extends a 16-token prompt by --new tokens greedily through the
project's own sampler (task/generate.sample), once cached and once uncached, in turn --reps
times (medians). Both must give the same tokens, or the figures are void (exit 1).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT = 16


def measure(package: str, preset: str, arch: str, new: int, reps: int) -> dict:
    import torch

    model_module = importlib.import_module(f"{package}.task.model")
    config_module = importlib.import_module(f"{package}.task.config")
    sample = importlib.import_module(f"{package}.task.generate").sample
    torch.manual_seed(0)
    seq_len = new + PROMPT
    cfg = config_module.ModelConfig(preset=preset, arch=arch)
    model = model_module.build_model(cfg, vocab_size=257, seq_len=seq_len).eval()
    prompt = torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    seconds: dict[bool, list[float]] = {True: [], False: []}
    tokens = {}
    for _ in range(reps):
        for cache in (True, False):
            start = time.perf_counter()
            tokens[cache] = sample(model, prompt, new, seq_len, temperature=0, cache=cache)
            seconds[cache].append(time.perf_counter() - start)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "cached_tokens_per_s": new / statistics.median(seconds[True]),
        "uncached_tokens_per_s": new / statistics.median(seconds[False]),
        "same_tokens": tokens[True] == tokens[False],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["mini", "small"])
    parser.add_argument("--archs", nargs="+", default=["llama", "gpt2"])
    parser.add_argument("--new", type=int, default=512)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "cpu_generate.json")
    sys.path.insert(0, str(HERE))
    from run import add_project_options, lm_project

    add_project_options(parser)
    args = parser.parse_args()
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        project, package = lm_project(args, Path(tmp))
        sys.path.insert(0, str(project / "src"))
        for preset in args.presets:
            for arch in args.archs:
                found = measure(package, preset, arch, args.new, args.reps)
                for key, value in found.items():
                    figures[f"{preset}_{arch}_{key}"] = value
                    print(f"{preset}_{arch}_{key}: {value}", flush=True)
    import torch

    result = {"figures": figures, "new_tokens": args.new, "torch": torch.__version__}
    result |= {
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "command": " ".join(sys.argv),
    }
    print(json.dumps({f"generate/{key}": value for key, value in figures.items()}))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    if not all(value for key, value in figures.items() if key.endswith("same_tokens")):
        print("cached and uncached generation gave different tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
