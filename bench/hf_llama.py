"""The language model's llama against transformers' own LlamaForCausalLM: seconds per training
step and peak memory on CPU, at the same shape, batch, weights and tokens (float32, SDPA).

    python bench/hf_llama.py [--project DIR --package NAME] [--steps 20] [--reps 3] [--json FILE]

The shape is SmolLM2's at a CPU size: 4 layers, width 256, 8 heads with 2 key/value heads,
SwiGLU width 704, a vocabulary of 8,192, tied embeddings, rope_theta 100,000; a batch of 4
sequences of 256 tokens. One set of random weights (this project's llama, seeded) is written
once and loaded by both, by Hugging Face's names. A training step is the same for both: forward
(transformers with use_cache=False: nothing to cache in training), float32 cross-entropy of
every position, backward, AdamW, zero_grad. Each contender runs in a process of its own: --warmup
steps, then --steps timed ones (the median is its step time); its peak memory is the peak
resident set of the steps over the resident set before the first (gradients, optimizer state,
activations: the kernel's high-water mark, reset just before). The contenders alternate --reps
times; each figure is the median. Both first losses must agree (same weights, same tokens) to
1e-4, relative, or the comparison is void (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPE = {
    "n_layer": 4,
    "d_model": 256,
    "n_head": 8,
    "n_kv_head": 2,
    "intermediate_size": 704,
    "vocab_size": 8192,
    "rope_theta": 100_000.0,
}
BATCH, SEQ_LEN = 4, 256


def _rss_kb(field: str) -> int:
    """VmRSS or VmHWM of this process, in kB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _ours(package: str, weights: Path):
    import importlib

    from safetensors.torch import load_file

    model_module = importlib.import_module(f"{package}.task.model")
    shape = model_module.ModelShape(arch="llama", seq_len=SEQ_LEN, **SHAPE)
    model = model_module.architecture(shape)
    state = load_file(str(weights))
    model.load_state_dict({name.removeprefix("model."): tensor for name, tensor in state.items()})
    return model, lambda tokens: model(tokens)


def llama_for_causal_lm(shape: dict, seq_len: int, weights: Path):
    """transformers' LlamaForCausalLM of a shape (SHAPE's keys; tied, SDPA) with weights by Hugging
    Face's names from a safetensors file."""
    import transformers
    from safetensors.torch import load_file

    config = transformers.LlamaConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["d_model"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["n_layer"],
        num_attention_heads=shape["n_head"],
        num_key_value_heads=shape["n_kv_head"],
        max_position_embeddings=seq_len,
        rms_norm_eps=1e-5,
        rope_theta=shape["rope_theta"],
        tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(load_file(str(weights)), strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:
        raise SystemExit(f"weights do not fit LlamaForCausalLM: {missing[:3]} {unexpected[:3]}")
    model.tie_weights()
    return model


def _theirs(weights: Path):
    model = llama_for_causal_lm(SHAPE, SEQ_LEN, weights)
    return model, lambda tokens: model(input_ids=tokens, use_cache=False).logits


def write_weights(package: str, path: Path) -> None:
    """This project's llama of SHAPE, seeded, by Hugging Face's names, into path."""
    import importlib

    import torch
    from safetensors.torch import save_file

    model_module = importlib.import_module(f"{package}.task.model")
    torch.manual_seed(0)
    model = model_module.architecture(
        model_module.ModelShape(arch="llama", seq_len=SEQ_LEN, **SHAPE)
    )
    save_file({f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}, str(path))


def timed_steps(forward, optimizer, shape: dict, batch: int, seq_len: int, warmup: int, steps: int):
    """warmup + steps training steps (forward, float32 cross-entropy, backward, step, zero_grad) on
    seeded random tokens: each step's seconds, each loss, and the peak resident memory the steps add
    (MB: the kernel's high-water mark, reset just before, over the resident set then)."""
    import torch
    from torch.nn import functional as F

    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape["vocab_size"], (batch, seq_len + 1), generator=generator)
    before = _rss_kb("VmRSS")
    with contextlib.suppress(OSError):  # the high-water mark back to the current set (Linux)
        Path("/proc/self/clear_refs").write_text("5")
    times, losses = [], []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    return times, losses, (_rss_kb("VmHWM") - before) / 1024


def contender(which: str, package: str, weights: Path, warmup: int, steps: int) -> dict:
    """One contender's run, in this process: its step times, first loss and peak extra memory."""
    import torch

    torch.manual_seed(0)
    model, forward = _ours(package, weights) if which == "ours" else _theirs(weights)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    times, losses, peak_extra_mb = timed_steps(
        forward, optimizer, SHAPE, BATCH, SEQ_LEN, warmup, steps
    )
    return {
        "step_s": statistics.median(times[warmup:]),
        "first_loss": losses[0],
        "peak_extra_mb": peak_extra_mb,
        "params": sum(p.numel() for p in model.parameters()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "cpu_hf_llama.json")
    parser.add_argument(
        "--contender", choices=("weights", "ours", "theirs"), help=argparse.SUPPRESS
    )
    parser.add_argument("--weights", type=Path, help=argparse.SUPPRESS)
    sys.path.insert(0, str(HERE))
    from run import add_project_options, lm_project

    add_project_options(parser)
    args = parser.parse_args()
    if args.contender == "weights":
        write_weights(args.package, args.weights)
        return 0
    if args.contender:
        found = contender(args.contender, args.package, args.weights, args.warmup, args.steps)
        print(json.dumps(found))
        return 0
    runs: dict[str, list[dict]] = {"ours": [], "theirs": []}
    with tempfile.TemporaryDirectory() as tmp:
        project, package = lm_project(args, Path(tmp))
        env = {**os.environ, "PYTHONPATH": str(project / "src")}
        weights = Path(tmp) / "weights.safetensors"
        common = ["--package", package, "--weights", str(weights)]
        common += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
        for which in ("weights",) + ("ours", "theirs") * args.reps:
            command = [sys.executable, __file__, "--contender", which, *common]
            done = subprocess.run(
                command, env=env, check=True, capture_output=True, text=True, timeout=3600
            )
            if which != "weights":
                runs[which].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"{which}: {json.dumps(runs[which][-1])}", flush=True)
    figures = {}
    for which, results in runs.items():
        for key in ("step_s", "peak_extra_mb"):
            figures[f"{which}_{key}"] = statistics.median(r[key] for r in results)
    figures["params"] = runs["ours"][0]["params"]
    figures["step_time_ratio"] = figures["ours_step_s"] / figures["theirs_step_s"]
    figures["peak_memory_ratio"] = figures["ours_peak_extra_mb"] / figures["theirs_peak_extra_mb"]
    first = runs["ours"][0]["first_loss"], runs["theirs"][0]["first_loss"]
    figures["first_loss_gap"] = abs(first[0] - first[1]) / first[1]

    print(json.dumps({f"hf_llama/{key}": value for key, value in figures.items()}))
    return report(figures, runs, " ".join(sys.argv), args.json, first)


def report(figures: dict, runs: dict, command: str, path: Path, first: tuple) -> int:
    """Print the figures as name: value lines, write them with the runs to path; exit status 1 when
    the contenders' first losses (first) differ by more than 1e-4: then they were not one model."""
    import torch

    result = {"figures": figures, "runs": runs, "torch": torch.__version__, "cpus": os.cpu_count()}
    result["command"] = command
    for key, value in figures.items():
        print(f"{key}: {value:.4g}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    if figures["first_loss_gap"] > 1e-4:
        print(f"the first losses differ ({first}): not the same model", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
