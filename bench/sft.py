"""Supervised fine-tuning on CPU: packed sequences against padded ones, on the same conversations.

    python bench/sft.py [--project DIR --package NAME] [--preset mini] [--seq-len 512] [--steps 20]

Conversations of uneven length (sums asked with system prompts of 0 to 8 sentences, 60 to 430
bytes rendered) are prepared with `prepare --chat` (bytes tokenizer), then trained for --steps
optimizer steps (after 3 warm-up steps) with AdamW, batch 8, two ways:

- packed: the project's training set (task/data.Packs): whole conversations first-fit into rows
  of --seq-len positions, positions restarting per conversation, a block-diagonal causal mask;
- padded: one conversation per row, the rest of the row padding (not trained), plain causal
  attention, as a loader without packing feeds them.

Figures: conversation tokens (not padding) per second and trained tokens per second, the share
of positions that are conversation (fill), and packed over padded for each; the median of
--reps runs taken in turn.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BATCH = 8


def conversations(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        sentences = rng.randint(0, 8)
        system = " ".join("Answer with the number only, nothing else." for _ in range(sentences))
        messages = [
            {"role": "user", "content": f"what is {a}+{b}?"},
            {"role": "assistant", "content": str(a + b)},
        ]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        records.append({"messages": messages})
    return records


def measure(package: str, data: Path, preset: str, seq_len: int, steps: int) -> dict:
    import numpy as np
    import torch

    data_module = importlib.import_module(f"{package}.task.data")
    model_module = importlib.import_module(f"{package}.task.model")
    config_module = importlib.import_module(f"{package}.task.config")
    meta = json.loads((data / "meta.json").read_text())
    tokens = data_module.Tokens(paths=[data / f for f in meta["train"]["files"]])
    masks = data_module.Tokens(paths=[data / f for f in meta["train"]["mask_files"]], dtype="uint8")
    ends = np.fromfile(data / meta["train"]["ends"], dtype=np.int64)
    packed = data_module.Packs(tokens, masks, ends, seq_len, seed=0)
    padded = data_module.Packs(tokens, masks, ends, seq_len, seed=0)
    padded.packs = [np.array([document]) for pack in packed.packs for document in pack]
    figures = {}
    for name, dataset, documents in (("packed", packed, True), ("padded", padded, False)):
        torch.manual_seed(0)
        cfg = config_module.ModelConfig(preset=preset, arch="llama")
        model = model_module.build_model(cfg, vocab_size=meta["vocab_size"], seq_len=seq_len)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        real = trained = 0
        elapsed = 0.0
        for step in range(3 + steps):
            indices = [(step * BATCH + i) % len(dataset) for i in range(BATCH)]
            batch = torch.stack([dataset[(0, index)] for index in indices])
            inputs, targets, numbers = batch[:, 0], batch[:, 1], batch[:, 2]
            start = time.perf_counter()
            logits = model(inputs, documents=numbers if documents else None)
            counted = (targets != data_module.IGNORE).sum()
            loss = model_module.lm_loss(logits, targets, reduction="sum") / counted.clamp(min=1)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= 3:
                elapsed += time.perf_counter() - start
                # conversation positions: a pack's documents are numbered 0.., its padding one more
                real += sum(
                    int((batch[i, 2] < len(dataset.packs[index])).sum())
                    for i, index in enumerate(indices)
                )
                trained += int(counted)
        figures[f"{name}_tokens_per_s"] = real / elapsed
        figures[f"{name}_trained_tokens_per_s"] = trained / elapsed
        figures[f"{name}_fill"] = real / (steps * BATCH * seq_len)
    for unit in ("tokens_per_s", "trained_tokens_per_s"):
        ratio = figures[f"packed_{unit}"] / figures[f"padded_{unit}"]
        figures[f"packed_over_padded_{unit}"] = ratio
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mini")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "cpu_sft.json")
    sys.path.insert(0, str(HERE))
    from run import add_project_options, command_line, lm_project

    add_project_options(parser)
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        project, package = lm_project(args, Path(tmp))
        sys.path.insert(0, str(project / "src"))
        source = Path(tmp) / "chat.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in conversations(2000, 0)))
        prepare = importlib.import_module(f"{package}.prepare").main
        if prepare(["--chat", "--out", str(Path(tmp) / "data"), str(source)]) != 0:
            return 1
        for _ in range(args.reps):
            runs.append(measure(package, Path(tmp) / "data", args.preset, args.seq_len, args.steps))
    figures = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    for key, value in figures.items():
        print(f"sft/{key}: {value}", flush=True)
    import torch

    result = {"figures": figures, "preset": args.preset, "seq_len": args.seq_len, "batch": BATCH}
    result |= {"steps": args.steps, "reps": args.reps, "torch": torch.__version__}
    result |= {"cpus": os.cpu_count()}
    result |= {"threads": torch.get_num_threads(), "command": command_line("sft.py", args)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
