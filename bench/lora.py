"""Adapters against full fine-tuning, and this project's LoRA against peft's, on CPU at
SmolLM2-135M's shape (30 layers, width 576, 9 heads with 3 key/value heads, SwiGLU width 1536,
49,152 tokens, tied).

    python bench/lora.py [--project DIR --package NAME] [--steps 3] [--reps 2] [--only lora peft]
        [--json FILE]
    python bench/lora.py --drift   # how far a merge stored in bf16 moves the logits (merge_drift)

Contenders, each in a process of its own, on the same random weights and tokens (a batch of 2
sequences of 128 tokens, float32, SDPA):
- full: this project's llama, every weight trained;
- lora: the same with LoRA r=16, alpha 32, on every linear layer of the blocks (task/model/lora.py),
  only the adapters trained;
- qlora: lora over the blocks' linear weights stored in NF4 (model.quantize=nf4, torchao's NF4);
- peft: transformers' LlamaForCausalLM with peft's LoRA of the same rank, alpha and targets.
A step is forward, float32 cross-entropy, backward, AdamW over the trainable parameters, zero_grad.
Reported per contender: trainable parameters, the bytes of parameters + gradients + AdamW's two
moments (counted), the peak resident set of the steps over the one before them and the process's
resident set once they are done, weights included (measured), and the median step time over
--steps after --warmup. The contenders alternate --reps times; medians are
kept. lora's and peft's first losses must agree to 1e-4 (the same model: a fresh adapter changes
nothing), or the comparison is void (exit 1); qlora's differs by what NF4 rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
SHAPE = {
    "n_layer": 30,
    "d_model": 576,
    "n_head": 9,
    "n_kv_head": 3,
    "intermediate_size": 1536,
    "vocab_size": 49_152,
    "rope_theta": 100_000.0,
}
BATCH, SEQ_LEN = 2, 128
RANK, ALPHA = 16, 32.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _ours(package: str, weights: Path, adapters: bool, quantize: bool = False):
    import importlib

    from safetensors.torch import load_file

    model_module = importlib.import_module(f"{package}.task.model")
    lora = importlib.import_module(f"{package}.task.model.lora")
    shape = model_module.ModelShape(arch="llama", seq_len=SEQ_LEN, **SHAPE)
    model = model_module.architecture(shape)
    state = load_file(str(weights))
    model.load_state_dict({name.removeprefix("model."): tensor for name, tensor in state.items()})
    if adapters:
        with_adapters(lora, model, seed=0)
        if quantize:
            lora.quantize_base(model, "llama")
    return model, lambda tokens: model(tokens)


def with_adapters(lora, model, seed: int):
    """LoRA r=RANK on every linear layer of the blocks, initialised as the project does (A drawn, B
    zero) from a generator of seed; returns the generator."""
    import torch

    config = SimpleNamespace(
        r=RANK, alpha=ALPHA, dropout=0.0, targets=None, rslora=False, dora=False
    )
    lora.add_adapters(model, "llama", config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith((".lora_A", ".lora_B")):
                lora.init_module(name, module, generator, SHAPE["n_layer"])
    return generator


def _peft(weights: Path):
    import peft
    from hf_llama import llama_for_causal_lm

    model = llama_for_causal_lm(SHAPE, SEQ_LEN, weights)
    lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS)
    model = peft.get_peft_model(model, lora)
    return model, lambda tokens: model(input_ids=tokens, use_cache=False).logits


def write_weights(package: str, path: Path) -> None:
    """This project's llama of SHAPE, seeded, by Hugging Face's names, into path."""
    import importlib

    import torch
    from safetensors.torch import save_file

    model_module = importlib.import_module(f"{package}.task.model")
    torch.manual_seed(0)
    shape = model_module.ModelShape(arch="llama", seq_len=SEQ_LEN, **SHAPE)
    model = model_module.architecture(shape)
    save_file({f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}, str(path))


def merge_drift(package: str) -> dict:
    """How far storing a merged model in bf16 moves the logits: this project's llama of SHAPE
    (random, seeded) with LoRA r=16 adapters as after training (B drawn, not zero), merged in
    float32 (lora.merged_state), then rounded to bf16; against that, the base alone in bf16."""
    import importlib

    import torch

    model_module = importlib.import_module(f"{package}.task.model")
    lora = importlib.import_module(f"{package}.task.model.lora")
    shape = model_module.ModelShape(arch="llama", seq_len=SEQ_LEN, **SHAPE)
    torch.manual_seed(0)
    model = model_module.architecture(shape).eval()
    generator = with_adapters(lora, model, seed=1)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(".lora_B"):  # as after training
                module.weight.normal_(0.0, 0.002, generator=generator)
        tokens = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ_LEN), generator=generator)
        adapted = model(tokens)
        plain = model_module.architecture(shape).eval()

        def logits(state: dict) -> torch.Tensor:
            plain.load_state_dict(state)
            return plain(tokens)

        merged = lora.merged_state(model)
        base = {k: v for k, v in model.state_dict().items() if not lora.is_adapter(k)}
        in_bf16 = logits({k: v.bfloat16().float() for k, v in merged.items()})
        merged_fp32 = logits(merged)
        base_fp32, base_bf16 = (
            logits(base),
            logits({k: v.bfloat16().float() for k, v in base.items()}),
        )
    return {
        "merge_fp32_max_abs": (merged_fp32 - adapted).abs().max().item(),
        "merge_bf16_mean_abs": (in_bf16 - adapted).abs().mean().item(),
        "merge_bf16_max_abs": (in_bf16 - adapted).abs().max().item(),
        "base_bf16_mean_abs": (base_bf16 - base_fp32).abs().mean().item(),
        "base_bf16_max_abs": (base_bf16 - base_fp32).abs().max().item(),
        "merge_bf16_top1_changed": (in_bf16.argmax(-1) != adapted.argmax(-1)).float().mean().item(),
        "logits_std": adapted.std().item(),
    }


def _bytes(param) -> int:
    """What a parameter takes: an NF4 one its 4-bit codes and its scales."""
    if hasattr(param, "quantized_data"):
        parts = (param.quantized_data, param.quantized_scalers, param.quantization_factor)
        return sum(part.numel() * part.element_size() for part in parts)
    return param.numel() * param.element_size()


def contender(which: str, package: str, weights: Path, warmup: int, steps: int) -> dict:
    """One contender's run, in this process: step times, first loss, counted and measured memory."""
    import torch
    from hf_llama import _rss_kb, timed_steps

    torch.manual_seed(0)
    if which == "peft":
        model, forward = _peft(weights)
    else:
        model, forward = _ours(package, weights, which != "full", which == "qlora")
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0)
    times, losses, peak_extra_mb = timed_steps(
        forward, optimizer, SHAPE, BATCH, SEQ_LEN, warmup, steps
    )
    params = {id(p): p for p in model.parameters()}  # a tied head counted once
    total = sum(p.numel() for p in params.values())
    trained = sum(p.numel() for p in trainable)
    stored = sum(_bytes(p) for p in params.values())
    return {
        "step_s": statistics.median(times[warmup:]),
        "first_loss": losses[0],
        "trainable": trained,
        "params": total,
        "state_mb": (stored + 4 * 3 * trained) / 2**20,  # weights, float32 gradients, two moments
        "peak_extra_mb": peak_extra_mb,
        "rss_training_mb": _rss_kb("VmRSS") / 1024,  # the whole process, weights included
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "cpu_lora.json")
    contenders = ("weights", "full", "lora", "qlora", "peft")
    parser.add_argument("--contender", choices=contenders, help=argparse.SUPPRESS)
    parser.add_argument(
        "--only", nargs="+", choices=contenders[1:], help="some contenders (default: all four)"
    )
    parser.add_argument(
        "--drift", action="store_true", help="only how far bf16 storage moves a merge's logits"
    )
    parser.add_argument("--weights", type=Path, help=argparse.SUPPRESS)
    sys.path.insert(0, str(HERE))
    from hf_llama import report
    from run import add_project_options, command_line, lm_project

    add_project_options(parser)
    args = parser.parse_args()
    if args.drift:
        project, package = lm_project(args, Path(tempfile.mkdtemp()))
        sys.path.insert(0, str(project / "src"))
        figures = merge_drift(package)
        for key, value in figures.items():
            print(f"{key}: {value:.4g}")
        out = args.json.with_name("cpu_lora_merge_drift.json")
        out.write_text(
            json.dumps({"figures": figures, "command": command_line("lora.py", args)}, indent=2)
            + "\n"
        )
        return 0
    if args.contender == "weights":
        write_weights(args.package, args.weights)
        return 0
    if args.contender:
        found = contender(args.contender, args.package, args.weights, args.warmup, args.steps)
        print(json.dumps(found))
        return 0
    runs: dict[str, list[dict]] = {name: [] for name in args.only or contenders[1:]}
    with tempfile.TemporaryDirectory() as tmp:
        project, package = lm_project(args, Path(tmp))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(project / "src"), str(HERE)])}
        weights = Path(tmp) / "weights.safetensors"
        common = ["--package", package, "--weights", str(weights), "--warmup", str(args.warmup)]
        common += ["--steps", str(args.steps)]
        for which in ("weights",) + tuple(runs) * args.reps:
            command = [sys.executable, __file__, "--contender", which, *common]
            done = subprocess.run(
                command, env=env, check=True, capture_output=True, text=True, timeout=3600
            )
            if which != "weights":
                runs[which].append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"{which}: {json.dumps(runs[which][-1])}", flush=True)
    figures = {}
    for which, results in runs.items():
        for key in ("step_s", "peak_extra_mb", "rss_training_mb", "state_mb", "trainable"):
            figures[f"{which}_{key}"] = statistics.median(r[key] for r in results)
    ratios = {
        "lora_over_peft_step_time": ("lora_step_s", "peft_step_s"),
        "lora_over_full_step_time": ("lora_step_s", "full_step_s"),
        "qlora_over_lora_step_time": ("qlora_step_s", "lora_step_s"),
        "lora_over_full_peak_memory": ("lora_peak_extra_mb", "full_peak_extra_mb"),
    }
    for name, (top, bottom) in ratios.items():
        if top in figures and bottom in figures:
            figures[name] = figures[top] / figures[bottom]
    if "lora" in runs and "peft" in runs:  # each repetition's own ratio: runs seconds apart
        pairs = zip(runs["lora"], runs["peft"], strict=True)
        paired = [ours["step_s"] / theirs["step_s"] for ours, theirs in pairs]
        figures["lora_over_peft_step_time_paired"] = statistics.median(paired)
    first = [runs[name][0]["first_loss"] for name in ("lora", "peft") if name in runs]
    figures["first_loss_gap"] = abs(first[0] - first[-1]) / first[-1]
    return report(figures, runs, command_line("lora.py", args), args.json, first)


if __name__ == "__main__":
    sys.exit(main())
