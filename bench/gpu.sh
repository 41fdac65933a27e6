#!/usr/bin/env bash
# GPU benchmark of the generated project on one CUDA device: the default model (ResNet-18) in
# fp32 eager vs bf16 + channels_last + torch.compile, at the default 32x32 images and at 224x224.
#
#   bench/gpu.sh                 # bake the template's defaults (needs cookiecutter), then run
#   bench/gpu.sh PROJECT_DIR     # run an already-baked project (imported from PROJECT_DIR/src)
#
# Each case is a real `python -m PACKAGE.train` run; the figures are the medians of what the run
# logs itself (perf/samples_per_s, perf/step_time_s, peak memory) over its warm windows (the first
# three windows, which hold start-up and compilation, are left out). Prints one `name: value` line
# per figure, then a table; writes bench/results/gpu.json (or $GPU_JSON). GPU_SIZES="224px" runs
# one image size only.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

if [[ $# -ge 1 ]]; then
    PROJECT="$(cd "$1" && pwd)"
else
    "$PYTHON" -m cookiecutter --no-input -f -o "$WORK" "$HERE/.."
    PROJECT="$WORK/my-trainer"
fi
PACKAGE="$(basename "$(dirname "$(ls "$PROJECT"/src/*/train.py)")")"
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')"

COMMON=(run.device=cuda trainer.resume=never trainer.max_epochs=1000 trainer.log_every=10
        trainer.checkpoint_every=100000 data.num_workers=8 data.val_size=512)
declare -A SIZES=(
    [32px]="data.image_size=32 model.small_input=true data.batch_size=128 data.train_size=20000 trainer.max_steps=150"
    [224px]="data.image_size=224 model.small_input=false data.batch_size=256 data.train_size=5120 trainer.max_steps=80"
)
declare -A MODES=(
    [fp32_eager]="trainer.precision=fp32"
    [bf16_channels_last_compile]="trainer.precision=bf16 model.channels_last=true model.compile=true"
)
mkdir -p "$WORK/runs"
for size in ${GPU_SIZES:-32px 224px}; do
    for mode in fp32_eager bf16_channels_last_compile; do
        run="$WORK/runs/${size}_${mode}"
        # shellcheck disable=SC2086  # the case strings are lists of overrides
        (cd "$PROJECT" && PYTHONPATH="$PROJECT/src${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m "$PACKAGE.train" \
            "${COMMON[@]}" ${SIZES[$size]} ${MODES[$mode]} run.output_dir="$run" >"$run.log" 2>&1) \
            || { echo "case ${size}_${mode} failed:"; tail -20 "$run.log"; exit 1; }
    done
done

"$PYTHON" - "$WORK/runs" "${GPU_JSON:-$HERE/results/gpu.json}" <<'PY'
import json, statistics, sys
from pathlib import Path
import torch

runs, out = Path(sys.argv[1]), Path(sys.argv[2])
device = torch.cuda.get_device_name(0)
results = {"device": device, "torch": torch.__version__, "cases": {}}
print(f"device: {device}")
for run in sorted(p for p in runs.iterdir() if p.is_dir()):
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    warm = [r for r in records if "perf/samples_per_s" in r][3:]
    case = {
        "images_per_s": statistics.median(r["perf/samples_per_s"] for r in warm),
        "step_time_ms": 1000 * statistics.median(r["perf/step_time_s"] for r in warm),
        "data_wait": statistics.median(r["perf/data_wait"] for r in warm),
        "peak_allocated_gib": max(r["perf/max_mem_allocated_gib"] for r in warm),
        "peak_reserved_gib": max(r["perf/max_mem_reserved_gib"] for r in warm),
        "val_acc": [r for r in records if "val/acc" in r][-1]["val/acc"],
    }
    results["cases"][run.name] = case
    for key, value in case.items():
        print(f"gpu/{run.name}/{key}: {value:.4g}")
print()
print(f"| case | images/s | step ms | data wait | peak alloc GiB | peak reserved GiB |")
print(f"|---|---|---|---|---|---|")
for name, c in results["cases"].items():
    print(f"| {name} | {c['images_per_s']:.0f} | {c['step_time_ms']:.1f} | {c['data_wait']:.1%} "
          f"| {c['peak_allocated_gib']:.2f} | {c['peak_reserved_gib']:.2f} |")
for size in ("32px", "224px"):
    base, fast = results["cases"].get(f"{size}_fp32_eager"), results["cases"].get(f"{size}_bf16_channels_last_compile")
    if base and fast:
        print(f"gpu/{size}/speedup: {fast['images_per_s'] / base['images_per_s']:.2f}x")
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(results, indent=2) + "\n")
PY
