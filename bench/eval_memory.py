"""Evaluation at scale: what an evaluation writes and how much memory a process needs.

    .venv/bin/python bench/eval_memory.py                  # 40,000 test samples x 100 classes
    .venv/bin/python bench/eval_memory.py --samples 1000000 --classes 10

It bakes the default project, trains one step of the MLP on synthetic vectors (data.dataset=
synthetic; the test split is 20% of --samples), then evaluates that checkpoint under torchrun
with --nproc processes, once exactly (every sample's row gathered) and once binned
(eval.binned_thresholds, a fixed-size summary per process), and reports for each: the bytes
written into the evaluation folder, the peak resident memory of the largest process (wait4 over
the process tree), the wall time, and the macro AP of both, to show what binning costs in
accuracy. Writes results into --out (eval_memory.json / .md) and prints the table.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200_000, help="whole set; test: 20%%")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--bins", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=bench.BENCH / "results")
    args = parser.parse_args(argv)
    data = [f"data.synthetic_samples={args.samples}", f"data.synthetic_classes={args.classes}",
            "data.dataset=synthetic"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddp-eval-bench-") as tmp:
        scratch = Path(tmp)
        project = bench.bake(scratch / "baked")
        run_dir = scratch / "run"
        print("training one step ...", flush=True)
        bench.run_measured(bench.torchrun("train.py", f"run.dir={run_dir}", "train.max_steps=1",
                                          "train.progress_bar=false", *data, nproc=1),
                           project, scratch / "train.log", nproc=1)
        for mode, extra in (("exact", []), ("binned", [f"eval.binned_thresholds={args.bins}"])):
            out = scratch / f"eval-{mode}"
            print(f"evaluating, {mode} ...", flush=True)
            start = time.perf_counter()
            _, rss = bench.run_measured(
                bench.torchrun("evaluate.py", f"eval.checkpoint={run_dir}",
                               f"eval.output_dir={out}", *extra, nproc=args.nproc),
                project, scratch / f"eval-{mode}.log", nproc=args.nproc)
            metrics = json.loads((out / "metrics.json").read_text())
            rows.append({"mode": mode, "samples": metrics["num_samples"],
                         "classes": args.classes, "processes": args.nproc,
                         "written_mb": folder_bytes(out) / 1e6, "peak_rss_mib": rss,
                         "seconds": time.perf_counter() - start,
                         "average_precision_macro": metrics["average_precision_macro"],
                         "files": sorted(p.name for p in out.iterdir())})
    lines = [("| mode | test samples x classes | processes | written (MB) | peak RSS per "
              "process (MiB) | wall time (s) | macro AP |"), "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['mode']} | {r['samples']:,} x {r['classes']} | {r['processes']} | "
              f"{r['written_mb']:.2f} | {r['peak_rss_mib']:.0f} | {r['seconds']:.1f} | "
              f"{r['average_precision_macro']:.4f} |" for r in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eval_memory.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "eval_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
