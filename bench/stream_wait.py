"""Benchmark: does the streamed loader make the training step wait?

    python bench/stream_wait.py                  # the defaults below; about 2 minutes on 2 cores
    python bench/stream_wait.py --step-ms 5 --epochs 3

It bakes the template with its default answers and runs bench/stream_wait_probe.py under
`torchrun --nproc_per_node=2` (gloo on the CPU) in it: each rank reads --epochs epochs of
DataModule.train_steps, the iterator the training loop reads, and times each next(), with a
stand-in of --step-ms milliseconds in place of the training step, then a barrier (the step's
all-reduce). The digits without augmentation, global batch 64 (19 steps an epoch). Cases:

  read         digits_shards read in the training process (data.num_workers=0), no step: the
               wait is what reading and collating one step's batch costs
  sleep        digits_shards, 2 loader workers per rank, the step a sleep: the cores are free
               for the workers while the step runs
  spin         the same with a busy loop for the step: it takes a core, as a real step does
  map-spin     the same data map-style in memory (data.dataset=digits, read in the training
               process), for comparison
  map-workers  the map-style data given to 2 loader workers per rank, the step a sleep: what a
               batch costs to come from a worker process, whatever the dataset

Per case, over both ranks: the median and the largest wait of the steps inside an epoch, and
separately of each epoch's first step (the loader's iterator starts at each epoch: its workers
begin reading then, with no batch read ahead) and the run's very first step (the workers start).
Writes stream_wait.json and stream_wait.md into --out, and prints the table.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import BENCH, bake, run_measured, torchrun

BASE = ["data.augment=false", "train.progress_bar=false"]
CASES = {
    "read": (["data.dataset=digits_shards", "data.num_workers=0"], "sleep", False),
    "sleep": (["data.dataset=digits_shards", "data.num_workers=2"], "sleep", True),
    "spin": (["data.dataset=digits_shards", "data.num_workers=2"], "spin", True),
    "map-spin": (["data.dataset=digits", "data.num_workers=0"], "spin", True),
    "map-workers": (["data.dataset=digits", "data.num_workers=2"], "sleep", True),
}


def probe(project: Path, scratch: Path, case: str, epochs: int, step_ms: float) -> dict:
    overrides, kind, stepped = CASES[case]
    out = scratch / f"{case}.json"
    command = torchrun(str(BENCH / "stream_wait_probe.py"), str(out), str(epochs),
                       str(step_ms if stepped else 0), kind, *BASE, *overrides, nproc=2)
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{project}{os.pathsep}{env_path}" if env_path else str(project)
    try:
        _, _, status = run_measured(command, project, scratch / f"{case}.log", nproc=2)
    finally:
        os.environ["PYTHONPATH"] = env_path
    if status != 0:
        raise SystemExit(f"error: the {case} probe failed (exit status {status})")
    return json.loads(out.read_text())


def summary(measured: dict, step_ms: float) -> dict:
    """Waits in milliseconds, and as fractions of the step where there is one."""
    waits = [w for rank in measured["waits"] for w in rank]
    inside = [s * 1000 for epoch, index, s in waits if index > 0]
    starts = [s * 1000 for epoch, index, s in waits if index == 0 and epoch > 0]
    first = [s * 1000 for epoch, index, s in waits if index == 0 and epoch == 0]
    return {"inside_median_ms": statistics.median(inside), "inside_max_ms": max(inside),
            "inside_over_1ms": sum(w > 1 for w in inside), "inside_steps": len(inside),
            "epoch_start_median_ms": statistics.median(starts),
            "epoch_start_max_ms": max(starts), "first_step_ms": max(first),
            "step_ms": step_ms}


def table(results: dict) -> str:
    lines = [("| case | step (ms) | wait inside an epoch: median (ms) | largest (ms) | steps "
             "over 1 ms | epoch's first step: median (ms) | largest (ms) | run's first step "
             "(ms) |"), "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for case, r in results.items():
        step = f"{r['step_ms']:g}" if CASES[case][2] else "none"
        lines.append(
            f"| {case} | {step} | {r['inside_median_ms']:.3f} | {r['inside_max_ms']:.2f} | "
            f"{r['inside_over_1ms']} of {r['inside_steps']} | {r['epoch_start_median_ms']:.2f} "
            f"| {r['epoch_start_max_ms']:.2f} | {r['first_step_ms']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--step-ms", type=float, default=40.0,
                        help="the stand-in step (the wide MLP of bench.py's stream workload "
                             "takes 22 to 37 ms a step on 2 cores)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    if any(c not in CASES for c in cases) or args.epochs < 2:
        parser.error(f"--cases takes {', '.join(CASES)}; --epochs at least 2")

    results = {}
    with tempfile.TemporaryDirectory(prefix="ddp-stream-wait-") as tmp:
        scratch = Path(tmp)
        project = bake(scratch / "baked")
        for case in cases:
            print(f"stream_wait: {case} ...", flush=True)
            results[case] = summary(probe(project, scratch, case, args.epochs, args.step_ms),
                                    args.step_ms)

    import torch

    header = (f"bench/stream_wait.py --epochs {args.epochs} --step-ms {args.step_ms:g}: 2 "
              f"processes (gloo), {os.cpu_count()} cores, Python {platform.python_version()}, "
              f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}.\n\n")
    markdown = header + table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stream_wait.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "stream_wait.md").write_text(markdown + "\n")
    print("\n" + markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
