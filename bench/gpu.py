"""The GPU half of the benchmark (run by bench/gpu.sh on a CUDA machine): images per second of
the compute-bound CNN workload, one process per GPU, in three configurations:

  handwritten fp32     bench/handwritten.py: float32, no speed settings (the seed's style)
  template defaults    baked train.py: bf16 autocast, channels_last, fused AdamW, TF32
  template + compile   the same with speed.compile=true

Measured on the epoch clock: the median over the epochs after the first of an epoch's seconds,
training and validation together (for the template, metrics.jsonl's epoch_seconds, read after the
GPU has finished; for the hand-written loop, its epoch's seconds, which end with a validation that
reads its results back). The speed-up is the hand-written loop's epoch time over each one's.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=50_000, help="synthetic 3x32x32 images")
    parser.add_argument("--batch", type=int, default=512, help="global batch size")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", type=Path, default=bench.BENCH / "results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench/gpu.sh needs a CUDA GPU; on CPU use bash bench/run.sh",
              file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()  # one process per GPU (one: a plain process, no DDP)
    gpu = torch.cuda.get_device_name(0)
    data = [f"data.synthetic_samples={args.samples}", f"train.global_batch_size={args.batch}",
            f"train.epochs={args.epochs}", "model.name=cnn", "data.dataset=images",
            "train.progress_bar=false", "train.log_every=20"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="ddp-gpu-bench-") as tmp:
        scratch = Path(tmp)
        project = bench.bake(scratch / "baked")
        log = scratch / "handwritten.log"
        bench.run_measured(bench.torchrun(
            str(bench.BENCH / "handwritten.py"), "--workload", "cnn", "--epochs",
            str(args.epochs), "--samples", str(args.samples), "--batch-size", str(args.batch),
            nproc=gpus), bench.BENCH, log, nproc=gpus)
        epochs = [r for r in bench.json_lines(log) if "epoch" in r]
        results["handwritten fp32"] = statistics.median(e["seconds"] for e in epochs[1:])
        for name, extra in (("template defaults", []),
                            ("template + compile", ["speed.compile=true"])):
            run_dir = scratch / name.replace(" ", "-")
            bench.run_measured(bench.torchrun("train.py", f"run.dir={run_dir}", *data, *extra,
                                              nproc=gpus),
                               project, scratch / f"{run_dir.name}.log", nproc=gpus)
            epochs = bench.json_lines(run_dir / "metrics.jsonl")
            results[name] = statistics.median(e["epoch_seconds"] for e in epochs[1:])
    base = results["handwritten fp32"]
    lines = [(f"{gpu} x {gpus}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; "
             f"{args.samples} images, global batch {args.batch}, {args.epochs} epochs."), "",
             ("| configuration | epoch seconds (median of epochs 2+) | speed-up vs handwritten "
             "fp32 |"), "|---|---:|---:|"]
    lines += [f"| {name} | {value:.3f} | {base / value:.2f} |" for name, value in results.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.md").write_text("\n".join(lines) + "\n")
    (args.out / "gpu.json").write_text(json.dumps({"gpu": gpu, "gpus": gpus,
                                                   "epoch_seconds": results}, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
