"""lm-evaluation-harness on CPU: this project's harness model (evaluate --tasks) against the
harness's own HFLM on the `export --format hf` folder of the same weights, in items per second of a
multiple-choice task.

    python bench/harness.py [--project DIR --package NAME] [--items 100] [--batch 8] [--reps 3]
        [--json FILE]

The model: GPT-2 small's shape (12 layers, width 768, 12 heads) with a 4,096-token byte-level BPE
trained on the standard library's sources, random weights (the time does not depend on them). The
task: --items multiple-choice items in the shape of HellaSwag's (a context of 64 tokens, four
endings of 24: the one that follows in the text and three from elsewhere), a task YAML in an
include folder, nothing downloaded. Each contender, in a process of its own, scores the same
harness requests (4 x --items log-likelihoods) with the same --batch, once to warm up and then
timed; they alternate --reps times and the medians are kept. Their per-request log-likelihoods
must agree to 1e-4 or the comparison is void (exit 1). Goal: ours at least as fast (ratio ours
over HFLM in items per second at least 1).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPE = ["model.arch=gpt2", "model.n_layer=12", "model.n_head=12", "model.d_model=768"]
CONTEXT, ENDING, VOCAB = 64, 24, 4096
YAML = """task: bench_mc
dataset_path: json
dataset_kwargs:
  data_files:
    validation: ITEMS
output_type: multiple_choice
validation_split: validation
doc_to_text: "{{context}}"
doc_to_choice: "{{endings}}"
doc_to_target: "{{label}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def corpus(path: Path, limit: int = 3_000_000) -> None:
    """About 3 MB of the standard library's Python sources, one file after another."""
    parts, size = [], 0
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = source.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size > limit:
            break
    path.write_text("".join(parts), encoding="utf-8")


def setup(work: Path, package: str, items: int) -> None:
    """The tokenizer, the prepared text, the model's hf export (work/hf), the task (work/tasks)."""
    import importlib

    import tokenizers
    import torch

    corpus(work / "corpus.txt")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train([str(work / "corpus.txt")], trainer)
    tokenizer.save(str(work / "tokenizer.json"))
    prepare = importlib.import_module(f"{package}.prepare").main
    tokens = ["--out", str(work / "data"), "--tokenizer", str(work / "tokenizer.json")]
    assert prepare([*tokens, str(work / "corpus.txt")]) == 0
    task, _ = build(package, work)
    model = task.build_model().eval()
    hf = importlib.import_module(f"{package}.task.model.hf")
    hf.write_folder(model, work / "hf", task.data.tokenizer, task.data.tokenizer.eot)
    torch.save(model.state_dict(), work / "weights.pt")
    ids = tokenizer.encode((work / "corpus.txt").read_text(encoding="utf-8")).ids
    rng, records = random.Random(0), []
    span = CONTEXT + ENDING
    for _ in range(items):
        start = rng.randrange(len(ids) - span)
        others = [rng.randrange(len(ids) - ENDING) for _ in range(3)]
        endings = [ids[start + CONTEXT : start + span], *(ids[o : o + ENDING] for o in others)]
        label = rng.randrange(4)
        endings.insert(label, endings.pop(0))
        records.append(
            {
                "context": tokenizer.decode(ids[start : start + CONTEXT]),
                "endings": [tokenizer.decode(e) for e in endings],
                "label": label,
            }
        )
    (work / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (work / "tasks").mkdir()
    (work / "tasks" / "bench_mc.yaml").write_text(YAML.replace("ITEMS", str(work / "items.jsonl")))


def build(package: str, work: Path):
    """The project's Task over the prepared text, the model's shape at a 1,024-token context."""
    import importlib

    import torch

    config = importlib.import_module(f"{package}.engine.config")
    spec = importlib.import_module(f"{package}.task.config").SPEC
    overrides = ["run.device=cpu", "data.name=text", f"data.root={work / 'data'}", *SHAPE]
    cfg = config.load_config(spec, [], [*overrides, "data.seq_len=1024"])
    task = importlib.import_module(f"{package}.task.task").Task(cfg, torch.device("cpu"))
    task.datasets()
    return task, cfg


def contender(which: str, package: str, work: Path, batch: int) -> dict:
    """One timed pass over the task's requests after a warm-up; the per-request log-likelihoods."""
    import importlib

    import torch

    harness_tasks = importlib.import_module(f"{package}.task.harness_tasks")
    request = harness_tasks.Request(["bench_mc"], include=str(work / "tasks"))
    (task,), _ = harness_tasks.load_tasks(request)
    task.build_all_requests(rank=0, world_size=1)
    instances = task.instances
    if which == "ours":
        project_task, _ = build(package, work)
        model = project_task.build_model().eval()
        model.load_state_dict(torch.load(work / "weights.pt", weights_only=True))
        benchmarks = importlib.import_module(f"{package}.task.benchmarks")
        lm = benchmarks.HarnessModel(
            model, project_task.data.tokenizer, torch.device("cpu"), "fp32", batch
        )
    else:
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=str(work / "hf"), device="cpu", batch_size=batch)
    lm.loglikelihood(instances[: 4 * batch])  # warm-up
    start = time.perf_counter()
    results = lm.loglikelihood(instances)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "items_per_s": len(instances) / 4 / seconds,
        "loglikelihoods": [r[0] for r in results],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "cpu_harness.json")
    parser.add_argument("--contender", choices=("ours", "hflm"), help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    sys.path.insert(0, str(HERE))
    from run import add_project_options, command_line, lm_project, report

    add_project_options(parser)
    args = parser.parse_args()
    if args.contender:  # one measurement, in this fresh process
        sys.path.insert(0, str(args.project / "src"))
        result = contender(args.contender, args.package, args.work, args.batch)
        print(json.dumps(result))
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench-harness-"))
    project, package = lm_project(args, work)
    sys.path.insert(0, str(project / "src"))
    setup(work, package, args.items)
    runs = {"ours": [], "hflm": []}
    for rep in range(args.reps):
        for which in ("ours", "hflm") if rep % 2 == 0 else ("hflm", "ours"):
            command = [sys.executable, __file__, "--contender", which, "--work", str(work)]
            command += ["--project", str(project), "--package", package, "--batch", str(args.batch)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            runs[which].append(json.loads(done.stdout.strip().splitlines()[-1]))
    ours, theirs = runs["ours"][0]["loglikelihoods"], runs["hflm"][0]["loglikelihoods"]
    gap = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
    rates = {k: statistics.median(r["items_per_s"] for r in v) for k, v in runs.items()}
    figures = {
        "harness/items": args.items,
        "harness/batch": args.batch,
        "harness/items_per_s/ours": rates["ours"],
        "harness/items_per_s/hflm": rates["hflm"],
        "harness/ratio/ours_over_hflm": rates["ours"] / rates["hflm"],
        "harness/loglikelihood_max_abs_gap": gap,
    }
    report(
        {
            "command": command_line("harness.py", args),
            "figures": figures,
            "runs": {k: [r["seconds"] for r in v] for k, v in runs.items()},
        },
        args.json,
    )
    if gap > 1e-4:
        print(f"void: the contenders' log-likelihoods differ by up to {gap:.2e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
