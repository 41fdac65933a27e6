#!/usr/bin/env bash
# GPU benchmark on one CUDA device (about 6 minutes on an H200): ResNet-18 at 32x32 with the device
# loader vs 8 workers, fp32 eager vs bf16 + channels_last + torch.compile, and the language model at
# GPT-2 small's size in bf16 + compile; images/s or tokens/s, step time, data wait, peak memory and
# MFU. Writes bench/results/gpu.json; see gpu.py for the cases and how each figure is measured.
#
#   bench/gpu.sh                  # bake both tasks (needs cookiecutter and tokenizers), run every case
#   bench/gpu.sh --image-project DIR --lm-project DIR   # already-baked projects
#   bench/gpu.sh --cpu-check      # each case for a few steps on the CPU: checks the script only
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python3}" "$HERE/gpu.py" "$@"
