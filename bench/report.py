"""Write benchmark results into docs/performance.md (between markers) and docs/img/bench.png.

    python bench/report.py          # from bench/results/cpu.json and bench/results/gpu.json

bench/run.py --docs calls write_docs() after a run. The CPU table comes from cpu.json;
the GPU table from gpu.json, which bench/gpu.sh writes on a CUDA machine. The language model's
demo figures the two READMEs quote (DEMO_QUOTES) are rewritten from cpu.json too, and
tests/test_docs.py checks they agree with it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent / "docs"
PAGE = DOCS / "performance.md"
PLOT = DOCS / "img" / "bench.png"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
TEMPLATE = HERE.parent
# Where the READMEs quote the language model's demo: a pattern with one named group per figure
# (demo_figures' names); white space in a pattern matches any, line breaks included.
DEMO_QUOTES = {
    TEMPLATE / "README.md": r"ends (?P<over>\d+\.\d)% above that floor in (?P<wall>\d+) s",
    TEMPLATE / "{{cookiecutter.project_slug}}" / "README.md": (
        r"ended at\s+`val/loss`\s+(?P<loss>\d\.\d{4})\s+against\s+a\s+floor\s+of\s+"
        r"(?P<floor>\d\.\d{4}),\s+(?P<over>\d+\.\d)%\s+above\s+it,\s+in\s+(?P<wall>\d+)\s+s"
    ),
}
CONTENDERS = ("raw", "generated", "lightning")


def cpu_section(results: dict) -> str:
    from run import summary

    f = results["figures"]
    rows = [
        "| | raw PyTorch | generated | Lightning |",
        "|---|---|---|---|",
    ]
    for model, label in (("mlp", "tiny MLP, s/step"), ("resnet18", "ResNet-18 32x32, s/step")):
        rows.append(
            f"| {label} | "
            + " | ".join(f"{f[f'step_s/{model}/{c}']:.4f}" for c in CONTENDERS)
            + " |"
        )
    rows.append(
        "| ResNet-18 32x32, page faults/step | "
        + " | ".join(f"{f[f'faults_per_step/resnet18/{c}']:.0f}" for c in CONTENDERS)
        + " |"
    )
    rows.append(
        "| process start to first step, s | "
        + " | ".join(f"{f[f'startup_s/{c}']:.2f}" for c in CONTENDERS)
        + " |"
    )
    return "\n".join(
        [
            f"CPU: {results['machine']}, torch {results['torch']}, "
            f"median of {results['reps']} repetitions ({2 * results['reps'] + 1} for the tiny"
            f" MLP's step times and the start-up times, {results['reps'] + 2} for ResNet-18's"
            " step times).",
            "",
            "![Step time relative to raw PyTorch, and start-up time](img/bench.png)",
            "",
            *rows,
            "",
            "Raw PyTorch with the allocator setting the generated project makes on CPU "
            f"(`raw_cached`): {f['step_s/resnet18/raw_cached']:.4f} s/step on ResNet-18, "
            f"{f['faults_per_step/resnet18/raw_cached']:.0f} page faults/step.",
            *lm_lines(results),
            *scale_lines(results),
            *prepare_lines(results),
            *nanogpt_lines(results),
            "",
            summary(f),
        ]
    )


def lm_lines(results: dict) -> list[str]:
    """The language model's step times and tokens/s (results without them: none)."""
    f = results["figures"]
    if "step_s/lm/raw" not in f:
        return []
    paired = "ratio/lm/generated_over_raw_paired"
    reps = len(results["runs"]["step_s/lm/raw"])
    return [
        "",
        f"Language model (task=language-model, micro GPT, 32 x 128 tokens per step, "
        f"{reps} repetitions): generated {f['step_s/lm/generated']:.4f} s/step "
        f"({f['tokens_per_s/lm/generated']:.0f} tokens/s; its log says "
        f"{f['tokens_per_s/lm/generated_logged']:.0f}), raw PyTorch {f['step_s/lm/raw']:.4f} "
        f"s/step ({f['tokens_per_s/lm/raw']:.0f} tokens/s); generated/raw "
        f"{f['ratio/lm/generated_over_raw']:.3f}, per repetition {f[paired]:.3f} "
        f"(quartiles {f[paired + '_q1']:.3f} to {f[paired + '_q3']:.3f}).",
    ]


def scale_lines(results: dict) -> list[str]:
    """The scale figures (9): memory of full vs sharded saves, async stall, meta vs eager build."""
    f = results["figures"]
    if "scale/share_gb" not in f:
        return []
    return [
        "",
        f"Scale (task=language-model, {f['scale/params'] / 1e6:.1f}M parameters, 2 FSDP processes, "
        f"`bench/scale.py`): each rank's share of the state (weights and both Adam moments) "
        f"{f['scale/share_gb']:.2f} GB. Rank 0's peak extra resident memory during a save: "
        f"full (gathered) {f['scale/save_extra_gb/full']:.2f} GB, sharded "
        f"{f['scale/save_extra_gb/sharded']:.3f} GB "
        f"({f['scale/ratio/save_extra_over_share/sharded']:.3f} x its share), asynchronous "
        f"{f['scale/save_extra_gb/async']:.2f} GB (its host buffers, made by the first save and "
        "reused). Training blocked in save(): full "
        f"{f['scale/save_blocked_s/full']:.2f} s, sharded "
        f"{f['scale/save_blocked_s/sharded']:.2f} s, "
        f"asynchronous {f['scale/save_blocked_s/async']:.2f} s (the first one "
        f"{f['scale/save_blocked_s/async_first']:.2f} s, allocating its host buffers) "
        f"({f['scale/ratio/async_stall_over_sync']:.2f} x the synchronous stall); median step "
        f"{f['scale/step_s/sharded']:.2f} s ({f['scale/step_s/async']:.2f} s with asynchronous "
        "saves). "
        f"Each rank's peak memory while building the model: on the meta device "
        f"{f['scale/build_peak_extra_gb/meta']:.2f} GB, whole then sharded "
        f"{f['scale/build_peak_extra_gb/eager']:.2f} GB.",
    ]


def prepare_lines(results: dict) -> list[str]:
    """prepare's throughput (10): MB of text per second, plain loop vs 1 and 2 workers."""
    f = results["figures"]
    if "prepare/bytes/plain_mb_s" not in f:
        return []
    rows = [
        "",
        "| prepare, MB of text/s | plain loop | 1 worker | 2 workers |",
        "|---|---|---|---|",
    ]
    for tokenizer, label in (("bytes", "bytes"), ("bpe", "BPE tokenizer.json, 8,192 tokens")):
        speeds = [f[f"prepare/{tokenizer}/{c}_mb_s"] for c in ("plain", "workers1", "workers2")]
        rows.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in speeds) + " |")
    return [
        "",
        f"prepare (`bench/prepare.py`): {f['prepare/text_mb']:.1f} MB of the standard library's "
        f"sources, {f['prepare/documents']:.0f} files; the plain loop reads, encodes and writes "
        "each file in one process (one output file), prepare streams, splits and shards.",
        *rows,
    ]


def nanogpt_lines(results: dict) -> list[str]:
    """The nanoGPT comparison (11): final validation loss and median step time of each."""
    f = results["figures"]
    if "nanogpt/ours_val_loss" not in f:
        return []
    return [
        "",
        f"Against nanoGPT (`python bench/run.py --only-nanogpt --nanogpt DIR`, DIR a checkout "
        "of karpathy/nanoGPT): both at nanoGPT's CPU character-level recipe (4 layers, 4 heads, "
        "width 128, context 64, batch 12, lr 1e-3 cosine to 1e-4 after 100 warmup steps, weight "
        f"decay 0.1, beta2 0.99, no dropout), {f['nanogpt/steps']:.0f} steps on "
        f"{f['nanogpt/text_bytes'] / 1e6:.1f} MB of the standard library's ASCII sources, the "
        "last 10% validating (cut at the same byte; nanoGPT's character vocabulary, bytes here). "
        f"Validation loss {f['nanogpt/ours_val_loss']:.4f} here (every validation token), "
        f"{f['nanogpt/nanogpt_val_loss']:.4f} for nanoGPT's train.py (its estimate over 200 "
        f"random batches); median step {f['nanogpt/ours_step_s'] * 1000:.1f} ms here, "
        f"{f['nanogpt/nanogpt_step_s'] * 1000:.1f} ms for nanoGPT "
        f"({f['nanogpt/step_time_ratio']:.3f} x); {f.get('nanogpt/reps', 1):.0f} run(s) of each. "
        "nanoGPT's README reports about 1.88 for this recipe on Shakespeare, a less predictable "
        "text.",
    ]


def gpu_section(gpu: dict) -> str:
    """The GPU table of bench/gpu.sh's results (MFU columns where the run measured them)."""
    ceiling = gpu.get("matmul_bf16_tflops")
    rows = [
        f"GPU: {gpu['device']}, torch {gpu['torch']} (`bench/gpu.sh`)"
        + (
            f"; bf16 dense peak {gpu['bf16_peak_tflops'] or 'unknown'} TFLOP/s, measured bf16 "
            f"matmul ceiling {ceiling:.0f} TFLOP/s."
            if ceiling
            else "."
        ),
        "",
        "| case | samples/s | tokens/s | step ms | data wait | MFU (peak) | MFU (matmul ceiling) "
        "| peak allocated GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cell(case: dict, key: str, spec: str) -> str:
        return format(case[key], spec) if case.get(key) is not None else "-"

    for name, c in gpu["cases"].items():
        samples = c.get("samples_per_s", c.get("images_per_s"))  # earlier results: images/s only
        rows.append(
            f"| {name} | {samples:.0f} | {cell(c, 'tokens_per_s', '.0f')} "
            f"| {c['step_time_ms']:.1f} | {c['data_wait']:.1%} | {cell(c, 'mfu', '.1%')} "
            f"| {cell(c, 'mfu_of_matmul_ceiling', '.1%')} "
            f"| {cell(c, 'peak_allocated_gib', '.2f')} |"
        )
    if gpu.get("note"):
        rows += ["", gpu["note"]]
    return "\n".join(rows)


def plot(results: dict, path: Path = PLOT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    f = results["figures"]
    figure, (steps, startup) = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
    width = 0.27
    for i, contender in enumerate(CONTENDERS):
        ratios = [f[f"step_s/{m}/{contender}"] / f[f"step_s/{m}/raw"] for m in ("mlp", "resnet18")]
        steps.bar([x + (i - 1) * width for x in range(2)], ratios, width, label=contender)
    steps.axhline(1.0, color="black", linewidth=0.8)
    steps.set(title="Step time / raw PyTorch (lower is better)", xticks=range(2))
    steps.set_xticklabels(["tiny MLP", "ResNet-18"])
    steps.legend(fontsize="small")
    startup.bar(CONTENDERS, [f[f"startup_s/{c}"] for c in CONTENDERS], color=["C0", "C1", "C2"])
    startup.set(title="Process start to first optimizer step", ylabel="seconds")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def demo_figures(figures: dict) -> dict[str, str]:
    """The language model's demo as the READMEs print it: over the floor in %, wall seconds, the
    final val/loss and the floor."""
    ratio, loss = figures["lm_demo/val_loss_over_floor"], figures["lm_demo/val_loss"]
    return {
        "over": f"{(ratio - 1) * 100:.1f}",
        "wall": f"{figures['lm_demo/wall_s']:.0f}",
        "loss": f"{loss:.4f}",
        "floor": f"{loss / ratio:.4f}",
    }


def _quote(path: Path) -> tuple[str, re.Match]:
    """A README's text and where it quotes the demo figures."""
    text = path.read_text(encoding="utf-8")
    match = re.search(DEMO_QUOTES[path], text)
    if not match:
        raise SystemExit(f"{path} does not quote the language model's demo as DEMO_QUOTES expects")
    return text, match


def quoted(path: Path) -> dict[str, str]:
    """The demo figures a README quotes now."""
    return _quote(path)[1].groupdict()


def quote_demo(path: Path, figures: dict) -> None:
    """Rewrite the demo figures a README quotes (only the numbers; its wrapping stays)."""
    (text, match), values = _quote(path), demo_figures(figures)
    parts, last = [text[: match.start()]], match.start()
    for name in sorted(match.groupdict(), key=match.start):
        parts += [text[last : match.start(name)], values[name]]
        last = match.end(name)
    path.write_text("".join(parts) + text[last:], encoding="utf-8")


def write_docs(
    results: dict, gpu: dict | None = None, page_path: Path = PAGE, plot_path: Path = PLOT
) -> None:
    """Replace the text between the markers of docs/performance.md, redraw the plot, and quote the
    language model's demo in the READMEs when the results measured it."""
    gpu_file = HERE / "results" / "gpu.json"
    if gpu is None and gpu_file.exists():
        gpu = json.loads(gpu_file.read_text())
    body = cpu_section(results) + ("\n\n" + gpu_section(gpu) if gpu else "")
    page = page_path.read_text(encoding="utf-8")
    if START not in page:
        raise SystemExit(f"{page_path} has no {START} ... {END} markers")
    page = re.sub(
        f"{re.escape(START)}.*?{re.escape(END)}", f"{START}\n{body}\n{END}", page, flags=re.S
    )
    page_path.write_text(page, encoding="utf-8")
    plot(results, plot_path)
    if "lm_demo/val_loss_over_floor" in results["figures"]:
        for readme in DEMO_QUOTES:
            quote_demo(readme, results["figures"])


def with_parts(cpu: dict) -> dict:
    """cpu.json's results with the figures of the --only-PART runs (results/cpu_PART.json) that a
    full run measures too: scale where cpu.json lacks it, prepare and nanoGPT."""
    for part, figure in (("scale", "scale/share_gb"), ("prepare", None), ("nanogpt", None)):
        part_file = HERE / "results" / f"cpu_{part}.json"  # from run.py --only-PART
        if part_file.exists() and (figure is None or figure not in cpu["figures"]):
            found = json.loads(part_file.read_text())["figures"]
            prefix = "" if part != "nanogpt" or "nanogpt/steps" in found else "nanogpt/"
            cpu["figures"].update({prefix + name: value for name, value in found.items()})
    return cpu


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    write_docs(with_parts(json.loads((HERE / "results" / "cpu.json").read_text())))
