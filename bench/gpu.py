"""GPU benchmark of the generated projects on one CUDA device, with model FLOPs utilisation (MFU).

    bench/gpu.sh                        # bake both tasks (needs cookiecutter), run every case
    bench/gpu.sh --image-project DIR --lm-project DIR   # baked projects, imported from DIR/src
    bench/gpu.sh --cases resnet18_32px_device_bf16_compile   # some cases only
    bench/gpu.sh --cpu-check            # every case for a few steps on the CPU: checks this script

Cases (each a real `python -m PACKAGE.train` run with the overrides in CASES):
- ResNet-18 at 32x32 (CIFAR-10's size, 100,000 synthetic images), batch 1024: the device loader vs
  8 workers with bf16 + channels_last + torch.compile, and fp32 eager vs that on the device loader;
- the language model at GPT-2 small's size (12 layers, width 768, 50,257-token vocabulary: 124M
  parameters), 1024-token sequences, batch 32, bf16 + compile, on random tokens written in the
  prepared-data format (throughput does not depend on what the tokens say);
- the llama family at SmolLM2-135M's shape (30 layers, width 576, 9 heads over 3 key/value heads,
  SwiGLU 1536, tied; with the random tokens' 50,257-token vocabulary 135.2M parameters), 2048-token
  sequences, batch 16 (the same tokens per step), bf16 + compile;
- LoRA at Llama-3.2-1B's shape (16 layers, width 2048, 32 heads over 8 key/value heads, SwiGLU
  8192, tied, llama3 rotary scaling; 1.24B parameters with the 50,257-token vocabulary): r=16 on
  every linear layer of the blocks over a frozen random base written as a Hugging Face folder
  (model.init_from), 2048-token sequences, batch 8, bf16 + compile.

Figures per case are medians over the run's own log windows (perf/samples_per_s, step time, data
wait: host time in the loader for the workers, GPU time making batches, by CUDA events, for the
device loader), leaving out the windows that hold start-up and compilation or sit next to a
validation, and the peak memory. FLOPs per
sample are counted, not quoted: torch.utils.flop_counter over one forward and backward of the
project's own model (its ResNet-18 at 32x32, whose small-input stem keeps the max-pool: 0.28
GFLOP forward, 0.84 GFLOP forward and backward per image, a quarter of the CIFAR variant without
the max-pool, 1.11 and 3.34; GPT-2 small: 6N plus attention per token). MFU is the achieved
rate over the device's bf16 dense peak (a table of data-sheet figures; GPU_PEAK_TFLOPS overrides
it), and over the bf16 matmul ceiling measured here (8192^3 matrix products), which no model
exceeds.

Prints one `name: value` line per figure and a table against the targets; writes
bench/results/gpu.json (or --json FILE). Stays under 8 minutes on an H100/H200-class device.
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

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE.parent

# bf16 dense tensor-core peaks (without sparsity) from the vendors' data sheets, TFLOP/s; the first
# name found in torch.cuda.get_device_name() wins, so the more specific names come first.
BF16_PEAK_TFLOPS = [
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("H200", 989.0),  # also GH200
    ("H100", 989.0),  # SXM
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("RTX 4090", 165.0),
]

IMAGE_32PX = [
    "data.name=synthetic",
    "data.image_size=32",
    "model.small_input=true",
    "data.train_size=100000",  # 97 steps an epoch: validations (after every epoch) stay rare
    "data.val_size=1024",  # one batch: validation compiles one graph
    "data.batch_size=1024",
]
WORKERS = ["data.loader=workers", "data.num_workers=8"]
DEVICE = ["data.loader=device"]
FP32_EAGER = ["trainer.precision=fp32"]
BF16_COMPILE = ["trainer.precision=bf16", "model.channels_last=true", "model.compile=true"]
GPT2_SMALL = [
    "model.preset=gpt2",
    "data.seq_len=1024",
    "data.batch_size=32",
    "data.loader=device",
    "trainer.precision=bf16",
    "model.compile=true",
]
SMOLLM2_135M = [
    "model.preset=smollm2-135m",
    "data.seq_len=2048",
    "data.batch_size=16",
    "data.loader=device",
    "trainer.precision=bf16",
    "model.compile=true",
]
LLAMA_FOLDER = "{llama_folder}"  # replaced by the random base write_llama_folder writes
LORA_1B = [
    f"model.init_from={LLAMA_FOLDER}",
    "model.lora.r=16",
    "model.lora.alpha=32",
    "data.seq_len=2048",
    "data.batch_size=8",
    "data.loader=device",
    "trainer.precision=bf16",
    "model.compile=true",
]
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
}
CPU_CHECK_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
# Random tokens of the GPT-2 vocabulary: 610 steps of training, one batch of validation windows.
LM_TOKENS = {"train": 20_000_000, "val": 32 * 1024 + 1}
VOCAB = 50257
TASKS = {"image": "image-classification", "lm": "language-model"}  # the cookiecutter answers
SIZES = ("data.train_size", "data.val_size", "data.batch_size", "data.num_workers", "data.loader")

# name: (task, overrides, optimizer steps). The loaders compared at the fast setting, the precisions
# with the data on the device. Steps give each case about 20 s of steady state at the target
# speeds; the first third of a run's log windows (compilation, warm-up) is left out.
CASES = {
    "resnet18_32px_workers_bf16_compile": ("image", [*IMAGE_32PX, *WORKERS, *BF16_COMPILE], 300),
    "resnet18_32px_device_fp32_eager": ("image", [*IMAGE_32PX, *DEVICE, *FP32_EAGER], 600),
    "resnet18_32px_device_bf16_compile": ("image", [*IMAGE_32PX, *DEVICE, *BF16_COMPILE], 1500),
    "gpt2_small_1024_bf16_compile": ("lm", GPT2_SMALL, 600),
    "smollm2_135m_2048_bf16_compile": ("lm", SMOLLM2_135M, 600),
    "llama3.2_1b_lora_r16_2048_bf16_compile": ("lm", LORA_1B, 300),
}
COMMON = [
    "trainer.resume=never",
    "trainer.max_epochs=1000",
    "trainer.log_every=20",
    "trainer.val_every=1000000",  # validation only after each epoch (rare: see the sizes)
    "trainer.checkpoint_every=1000000",
    "optim.warmup_steps=10",
]
# --cpu-check: the same cases, small enough for a CPU (the figures then check the script only).
# Images in batches of 8: on a CPU without AVX-512 torch computes bf16 convolutions' gradients in
# its slow reference kernels (the three image cases took 95 s in batches of 16 on such a CPU, 67 s
# in batches of 8). The same CPU computes bf16 matrix products slowly too: the language model's
# cases take 2 windows of 64 tokens a step, whose 50,257-word output layer dominates.
CPU_CHECK = {
    "image": [
        "data.train_size=256",
        "data.val_size=64",
        "data.batch_size=8",
        "data.num_workers=2",
    ],
    "lm": ["model.preset=nano", "model.arch=gpt2", "data.seq_len=64", "data.batch_size=2"],
}
CPU_CHECK_LM_TOKENS = {"train": 20_000, "val": 520}

# Targets on an H200: (case, figure, text, check). 100,000 images/s is about 35% MFU for the CIFAR
# ResNet-18 (3.34 GFLOP per image) and about 8.5% for this project's (0.84 GFLOP): images/s and data
# wait are the targets for it, its MFU is reported.
TARGETS = [
    ("resnet18_32px_device_bf16_compile", "images_per_s", ">= 100,000", lambda v: v >= 100_000),
    ("resnet18_32px_device_bf16_compile", "data_wait", "< 0.02", lambda v: v < 0.02),
    ("gpt2_small_1024_bf16_compile", "tokens_per_s", ">= 520,000", lambda v: v >= 520_000),
    ("gpt2_small_1024_bf16_compile", "mfu", ">= 0.45 of peak", lambda v: v >= 0.45),
]

# Counts one forward and backward of the project's model on one sample (run in the project's
# environment): python -c FLOPS_SCRIPT PACKAGE TASK OVERRIDES...
FLOPS_SCRIPT = """
import importlib, json, sys
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
package, task_kind, *overrides = sys.argv[1:]
config = importlib.import_module(f"{package}.engine.config")
SPEC = importlib.import_module(f"{package}.task.config").SPEC
Task = importlib.import_module(f"{package}.task.task").Task
cfg = config.load_config(SPEC, ["configs/default.yaml"], [*overrides, "run.device=cpu"])
task = Task(cfg, torch.device("cpu"))
task.datasets()  # the data decides the number of classes or the vocabulary
model = task.build_model(torch.device("cpu"))
params = sum(p.numel() for p in model.parameters())
if task_kind == "image":
    size = cfg.data.image_size
    sample = torch.zeros(1, 3, size, size)
else:
    sample = torch.zeros(1, cfg.data.seq_len, dtype=torch.long)
# On the CPU, fused attention is one operation the counter has no formula for (it would count 0);
# the math backend's matrix products are counted: full T x T attention, as the counter's GPU
# formulas count the fused kernels.
with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
    out = model(sample)
    forward = counter.get_total_flops()
    out.float().sum().backward()
print(json.dumps({"forward": forward, "train": counter.get_total_flops(), "params": params}))
"""


def peak_tflops(device_name: str) -> float | None:
    """The device's bf16 dense peak: GPU_PEAK_TFLOPS, else the data-sheet table, else None."""
    if os.environ.get("GPU_PEAK_TFLOPS"):
        return float(os.environ["GPU_PEAK_TFLOPS"])
    return next((peak for name, peak in BF16_PEAK_TFLOPS if name in device_name), None)


def matmul_ceiling_tflops(device: torch.device, n: int = 8192, reps: int = 40) -> float:
    """The best bf16 FLOP rate of n x n x n matrix products on `device` (best of 3 timed loops)."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(a)
    for _ in range(3):
        torch.mm(a, b, out=out)
    best = 0.0
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - started))
    return best / 1e12


def write_tokens(root: Path, sizes: dict[str, int]) -> Path:
    """A prepared-data directory (prepare.py's format) of uniformly random GPT-2-vocabulary tokens,
    with a word-level tokenizer.json of that vocabulary (needs the tokenizers package)."""
    from tokenizers import Tokenizer, models

    root.mkdir(parents=True, exist_ok=True)
    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"<|endoftext|>": VOCAB - 1}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(root / "tokenizer.json"))
    rng = np.random.default_rng(0)
    meta = {
        "format": 1,
        "tokenizer": "tokenizer.json",
        "vocab_size": VOCAB,
        "eot": VOCAB - 1,
        "dtype": "uint16",
    }
    for split, tokens in sizes.items():
        rng.integers(0, VOCAB, size=tokens, dtype=np.uint16).tofile(root / f"{split}.bin")
        meta[split] = {
            "tokens": tokens,
            "bytes": tokens,
            "documents": 1,
        }  # bytes: only val/bpb reads it
    meta |= {"skipped_files": 0, "val_fraction": sizes["val"] / sum(sizes.values())}
    (root / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return root


def write_llama_folder(folder: Path, keys: dict, vocab: int) -> Path:
    """A Hugging Face Llama folder (config.json, model.safetensors in bf16) of random weights, N(0,
    0.02), of the shape keys gives, Llama 3.2's rotary settings and a tied head."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    rope["original_max_position_embeddings"] = 8192
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": rope,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        **keys,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    d, inner, heads = keys["hidden_size"], keys["intermediate_size"], keys["num_attention_heads"]
    head, kv = keys["head_dim"], keys["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    for i in range(keys["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "self_attn.q_proj.weight": (heads * head, d),
            layer + "self_attn.k_proj.weight": (kv * head, d),
            layer + "self_attn.v_proj.weight": (kv * head, d),
            layer + "self_attn.o_proj.weight": (d, heads * head),
            layer + "mlp.gate_proj.weight": (inner, d),
            layer + "mlp.up_proj.weight": (inner, d),
            layer + "mlp.down_proj.weight": (d, inner),
            layer + "input_layernorm.weight": (d,),
            layer + "post_attention_layernorm.weight": (d,),
        }
    generator = torch.Generator().manual_seed(0)
    weights = {
        name: torch.ones(shape)
        if len(shape) == 1
        else torch.randn(shape, generator=generator) * 0.02
        for name, shape in shapes.items()
    }
    save_file(
        {name: w.to(torch.bfloat16) for name, w in weights.items()},
        str(folder / "model.safetensors"),
    )
    return folder


def bake(work: Path, task: str) -> Path:
    from cookiecutter.main import cookiecutter

    out = work / task
    out.mkdir(parents=True, exist_ok=True)
    return Path(
        cookiecutter(
            str(TEMPLATE), no_input=True, output_dir=str(out), extra_context={"task": task}
        )
    )


def setting(overrides: list[str], key: str, default: str = "0") -> str:
    """The value the last override of key sets (later overrides win)."""
    return next(
        (o.split("=", 1)[1] for o in reversed(overrides) if o.startswith(f"{key}=")), default
    )


def package_of(project: Path) -> str:
    return next(p.parent.name for p in (project / "src").glob("*/train.py"))


def project_env(project: Path) -> dict:
    path = os.pathsep.join(filter(None, [str(project / "src"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def checked(command: list, project: Path, log: Path | None = None, timeout: float = 900) -> str:
    """Run a command in a project; stop the benchmark with the end of its output if it fails."""
    done = subprocess.run(
        [str(c) for c in command],
        cwd=project,
        env=project_env(project),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if log:
        log.write_text(done.stdout + done.stderr)
    if done.returncode:
        raise SystemExit(
            f"{' '.join(map(str, command))} failed ({done.returncode}):\n"
            f"{(done.stdout + done.stderr)[-3000:]}"
        )
    return done.stdout


def case_overrides(
    task: str,
    overrides: list[str],
    steps: int,
    cpu_check: bool,
    lm_data: Path,
    llama_folder: Path | None = None,
) -> list[str]:
    chosen = [*COMMON, *overrides, f"trainer.max_steps={steps}"]
    chosen = [o.replace(LLAMA_FOLDER, str(llama_folder)) for o in chosen]
    if task == "lm":
        chosen += ["data.name=text", f"data.root={lm_data}"]
    if not cpu_check:
        return [*chosen, "run.device=cuda"]
    check = CPU_CHECK[task]
    if any(o.startswith("model.init_from=") for o in chosen):  # the folder's shape: a small one
        check = [o for o in check if not o.startswith("model.")]
    small = [*check, "run.device=cpu", "trainer.log_every=2", "trainer.max_steps=8"]
    replaced = {o.split("=")[0] for o in small} | {
        "model.compile"
    }  # compiling takes minutes on a CPU
    return [o for o in chosen if o.split("=")[0] not in replaced] + small


def training_windows(records: list[dict], log_every: int) -> list[dict]:
    """The log windows of training alone, in order: those next to a validation are left out (the
    host stops timing while it validates, but training work still queued on the device finishes
    then), and so is the first third (start-up, compilation)."""
    validated = {r["step"] for r in records if "val/loss" in r}
    windows = [r for r in records if "perf/samples_per_s" in r]
    windows = windows[len(windows) // 3 :]
    return [
        r for r in windows if not any(r["step"] - log_every <= v <= r["step"] for v in validated)
    ]


def case_figures(
    records: list[dict],
    flops: dict,
    task: str,
    seq_len: int,
    log_every: int,
    peak: float | None,
    ceiling: float,
) -> dict:
    """A case's figures from its metrics.jsonl records and its FLOPs per sample."""
    warm = training_windows(records, log_every)
    if not warm:
        raise SystemExit("the run logged no window of training alone: give the case more steps")
    samples_per_s = statistics.median(r["perf/samples_per_s"] for r in warm)
    achieved = samples_per_s * flops["train"] / 1e12
    figures = {
        "samples_per_s": samples_per_s,
        "step_time_ms": 1000 * statistics.median(r["perf/step_time_s"] for r in warm),
        "data_wait": statistics.median(r["perf/data_wait"] for r in warm),
        "gflop_per_sample": flops["train"] / 1e9,
        "gflop_per_sample_forward": flops["forward"] / 1e9,
        "params_m": flops["params"] / 1e6,
        "tflops": achieved,
        "mfu_of_matmul_ceiling": achieved / ceiling,
    }
    if peak:
        figures["mfu"] = achieved / peak
    if "perf/max_mem_allocated_gib" in warm[-1]:
        figures["peak_allocated_gib"] = max(r["perf/max_mem_allocated_gib"] for r in warm)
        figures["peak_reserved_gib"] = max(r["perf/max_mem_reserved_gib"] for r in warm)
    if task == "image":
        figures["images_per_s"] = samples_per_s
        figures["val_acc"] = [r for r in records if "val/acc" in r][-1]["val/acc"]
    else:
        figures["tokens_per_s"] = samples_per_s * seq_len
        figures["gflop_per_token"] = figures["gflop_per_sample"] / seq_len
        figures["val_loss"] = [r for r in records if "val/loss" in r][-1]["val/loss"]
    return figures


def table(results: dict) -> str:
    lines = [
        "| case | samples/s | tokens/s | step ms | data wait | TFLOP/s | MFU (peak) "
        "| MFU (matmul ceiling) | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in results["cases"].items():
        mfu = f"{c['mfu']:.1%}" if "mfu" in c else "-"
        tokens = f"{c['tokens_per_s']:.0f}" if "tokens_per_s" in c else "-"
        memory = f"{c['peak_allocated_gib']:.1f}" if "peak_allocated_gib" in c else "-"
        lines.append(
            f"| {name} | {c['samples_per_s']:.0f} | {tokens} | {c['step_time_ms']:.1f} "
            f"| {c['data_wait']:.1%} "
            f"| {c['tflops']:.1f} | {mfu} | {c['mfu_of_matmul_ceiling']:.1%} | {memory} |"
        )
    lines += ["", "| target | value | holds |", "|---|---|---|"]
    for case, figure, text, check in TARGETS:
        value = results["cases"].get(case, {}).get(figure)
        if value is not None:
            lines.append(
                f"| {case} {figure} {text} | {value:.4g} | {'yes' if check(value) else 'NO'} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-project", type=Path, help="a baked image-classification project")
    parser.add_argument("--lm-project", type=Path, help="a baked language-model project")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument(
        "--json", type=Path, help="default: bench/results/gpu.json (--cpu-check: none)"
    )
    parser.add_argument(
        "--cpu-check", action="store_true", help="a few CPU steps per case: checks, not timings"
    )
    args = parser.parse_args()
    if not args.cpu_check and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (--cpu-check runs the cases briefly on the CPU)")
    device = torch.device("cpu" if args.cpu_check else "cuda")
    device_name = "CPU check" if args.cpu_check else torch.cuda.get_device_name(device)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        given = {"image": args.image_project, "lm": args.lm_project}
        projects = {
            task: (given[task] or bake(work, TASKS[task])).resolve()
            for task in {CASES[n][0] for n in args.cases}
        }
        lm_data = (
            write_tokens(work / "tokens", CPU_CHECK_LM_TOKENS if args.cpu_check else LM_TOKENS)
            if "lm" in projects
            else None
        )
        llama_folder = None
        if any(LLAMA_FOLDER in " ".join(CASES[n][1]) for n in args.cases):
            shape = CPU_CHECK_LLAMA if args.cpu_check else LLAMA_1B
            llama_folder = write_llama_folder(work / "llama", shape, VOCAB)
        ceiling = matmul_ceiling_tflops(device, *((256, 3) if args.cpu_check else ()))
        peak = None if args.cpu_check else peak_tflops(device_name)
        results = {
            "device": device_name,
            "torch": torch.__version__,
            "cpu_check": args.cpu_check,
            "bf16_peak_tflops": peak,
            "matmul_bf16_tflops": ceiling,
            "cases": {},
        }
        print(
            f"device: {device_name}\nmatmul_bf16_tflops: {ceiling:.4g}\nbf16_peak_tflops: {peak}",
            flush=True,
        )
        flops = {}  # per task, and per base for adapters: the model of the case, one sample
        for name in args.cases:
            task, overrides, steps = CASES[name]
            project, package = projects[task], package_of(projects[task])
            chosen = case_overrides(task, overrides, steps, args.cpu_check, lm_data, llama_folder)
            model = (task, any(o.startswith("model.init_from=") for o in chosen))
            if model not in flops:
                shape = [
                    o
                    for o in chosen
                    if o.startswith(("data.", "model.")) and not o.startswith(SIZES)
                ]
                shape += ["data.train_size=64", "data.val_size=64"] if task == "image" else []
                command = [sys.executable, "-c", FLOPS_SCRIPT, package, task, *shape]
                flops[model] = json.loads(checked(command, project).splitlines()[-1])
            out = work / "runs" / name
            command = [sys.executable, "-m", f"{package}.train", *chosen, f"run.output_dir={out}"]
            checked(command, project, log=work / f"{name}.log")
            records = [
                json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            ]
            seq_len = int(setting(chosen, "data.seq_len"))
            log_every = int(setting(chosen, "trainer.log_every"))
            case = case_figures(records, flops[model], task, seq_len, log_every, peak, ceiling)
            results["cases"][name] = {**case, "overrides": chosen}
            for figure, value in case.items():
                print(f"gpu/{name}/{figure}: {value:.4g}", flush=True)
    results["wall_s"] = time.perf_counter() - started
    print(f"wall_s: {results['wall_s']:.0f}\n\n{table(results)}")
    out = args.json or (None if args.cpu_check else HERE / "results" / "gpu.json")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
