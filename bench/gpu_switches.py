"""The GPU figures of issue 46's switches (needs a CUDA machine): the language-model recipe's GPT
at a GPU's size, one process per GPU, run once with each switch and once without:

  off                       the recipe with the CUDA defaults (bf16 autocast, fused AdamW, TF32)
  activation_checkpointing  speed.activation_checkpointing=1
  compile_blocks            speed.compile=blocks
  compile                   speed.compile=true (the whole model: its compile time, for scale)
  ema                       train.ema_decay=0.999
  guard                     guard.enabled=true
  float8                    speed.float8=true (when torchao is installed and the GPU has float8)
  micro_batch_auto          train.micro_batch_size=auto with a global batch of --auto-batch

Per run: the seconds per step after the first logging window (as the CPU benchmark's `lm`), the
largest `peak_memory_gib` of the training log (rank 0's max_memory_allocated per window), the
seconds compiling, and for micro_batch_auto the micro-batch it chose. Each is given against
`off`. Writes bench/results/gpu-switches.md and gpu-switches.json.

    python bench/gpu_switches.py                       # GPT 12x768, context 512, batch 32
    python bench/gpu_switches.py --layers 24 --width 1024 --steps 40
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench

SWITCHES = {"off": [], "activation_checkpointing": ["speed.activation_checkpointing=1"],
            "compile_blocks": ["speed.compile=blocks"], "compile": ["speed.compile=true"],
            "ema": ["train.ema_decay=0.999"], "guard": ["guard.enabled=true"],
            "float8": ["speed.float8=true"]}


def has_float8() -> bool:
    try:
        import torchao  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(0) >= (8, 9)


def workload(args) -> dict:
    """bench.py's lm workload at this size: the recipe's overrides, the model and batch set."""
    lm = bench.lm_workload(steps=args.steps, batch=args.batch)
    resized = {"model.hidden_dim": args.width, "model.num_layers": args.layers,
               "data.block_size": args.context}
    overrides = [o for o in lm["overrides"] if o.split("=")[0] not in resized]
    overrides += [f"{key}={value}" for key, value in resized.items()]
    return {**lm, "overrides": overrides, "nproc": torch.cuda.device_count()}


def measure(project: Path, work: dict, scratch: Path, name: str, extra: list[str]) -> dict:
    result = bench.run_template(project, work, scratch, "gpu", name=name, overrides=tuple(extra))
    run_dir = scratch / f"{name}-gpu"
    records = bench.json_lines(run_dir / "train_log.jsonl")
    result["peak_memory_gib"] = max(r.get("peak_memory_gib", float("nan")) for r in records)
    chosen = re.search(r"train\.micro_batch_size=auto: (\d+) sample",
                       (scratch / f"{name}-gpu.log").read_text())
    result["micro_batch"] = int(chosen[1]) if chosen else None
    return result


def table(results: dict, gpu: str, gpus: int, args) -> list[str]:
    off = results["off"]
    lines = [f"{gpu} x {gpus}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; GPT "
             f"{args.layers}x{args.width}, context {args.context}, global batch {args.batch}, "
             f"{args.steps} steps.", "",
             "| switch | ms / step | vs off | peak memory (GiB) | vs off | compiling (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        auto = name == "micro_batch_auto"  # another global batch: its step is not comparable
        note = (f" (global batch {args.auto_batch}: auto chose {r['micro_batch']} a pass)"
                if auto else "")
        ratio = "-" if auto else f"{r['seconds_per_step'] / off['seconds_per_step']:.3f}"
        lines.append(f"| {name}{note} | {r['seconds_per_step'] * 1000:.1f} | {ratio} | "
                     f"{r['peak_memory_gib']:.2f} | "
                     f"{r['peak_memory_gib'] / off['peak_memory_gib']:.3f} | "
                     f"{r.get('compile_seconds', 0.0):.1f} |")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32, help="global batch size")
    parser.add_argument("--auto-batch", type=int, default=512,
                        help="global batch of the micro_batch_auto run")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=bench.BENCH / "results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench/gpu_switches.py needs a CUDA GPU; on CPU use bash bench/run.sh "
              "--workloads switches", file=sys.stderr)
        return 2
    work = workload(args)
    runs = dict(SWITCHES, micro_batch_auto=["train.micro_batch_size=auto",
                                            f"train.global_batch_size={args.auto_batch}"])
    if not has_float8():
        runs.pop("float8")
    results = {}
    with tempfile.TemporaryDirectory(prefix="ddp-gpu-switches-") as tmp:
        scratch = Path(tmp)
        project = bench.bake(scratch / "baked")
        subprocess.run([sys.executable, *work["prepare"]], cwd=project, check=True)
        for name, extra in runs.items():
            batch = args.auto_batch if name == "micro_batch_auto" else args.batch
            results[name] = measure(project, {**work, "global_batch": batch}, scratch, name,
                                    extra)
    lines = table(results, torch.cuda.get_device_name(0), work["nproc"], args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu-switches.md").write_text("\n".join(lines) + "\n")
    (args.out / "gpu-switches.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
