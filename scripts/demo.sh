#!/usr/bin/env bash
# The main job, end to end: set up, bake a project with the default answers, train it with
# 2 processes (torchrun, gloo on CPU), evaluate it, and show where the results are.
# The baked project lands in demo/ (recreated on every call).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
export PATH="$root/.venv/bin:$PATH"

rm -rf "$root/demo"
cookiecutter "$root" --no-input --output-dir "$root/demo" >/dev/null
project="$root/demo/my_ddp_experiment"
cd "$project"

echo "== training with 2 processes: ./run.sh (in $project)"
NPROC_PER_NODE=2 ./run.sh run.dir=runs/demo
echo "== evaluating the final checkpoint with 2 processes"
NPROC_PER_NODE=2 ./run.sh evaluate.py eval.checkpoint=runs/demo

python - "$project/runs/demo" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
metrics = json.loads((run / "eval-test" / "metrics.json").read_text())
print()
print(f"test accuracy  {metrics['accuracy']:.4f}  ({metrics['num_samples']} samples, "
      f"{metrics['world_size']} processes)")
print(f"test metrics   {run / 'eval-test' / 'metrics.json'}")
print(f"per-epoch log  {run / 'metrics.jsonl'}")
print(f"curves         {run / 'curves.png'}")
print(f"checkpoints    {run / 'checkpoints'}")
print(f"TensorBoard    tensorboard --logdir {run / 'tb'}")
PY
