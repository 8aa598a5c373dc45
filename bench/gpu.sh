#!/usr/bin/env bash
# GPU benchmark (needs a CUDA machine): the compute-bound CNN workload, seed-style float32
# (bench/handwritten.py) against the baked train.py with its CUDA defaults (bf16 autocast,
# channels_last, fused AdamW, TF32), without and with torch.compile; one process per GPU.
#   bash bench/gpu.sh                 # uses .venv if present, else python3 from PATH
#   PYTHON=/path/to/python bash bench/gpu.sh --samples 50000 --batch 1024 --epochs 4
# Needs torch (CUDA build) and cookiecutter in that Python. Prints images/s and writes
# bench/results/gpu.md and gpu.json. Issue 46's switches on a GPU (memory, time per step,
# compile time): python bench/gpu_switches.py (its docstring says what it runs).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
exec "$python" "$root/bench/gpu.py" "$@"
