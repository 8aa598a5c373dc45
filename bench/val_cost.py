"""Validation at many classes: what the per-epoch metrics cost, against the epoch's training.

    .venv/bin/python bench/val_cost.py                        # 20,000 val samples x 1,000 classes
    .venv/bin/python bench/val_cost.py --before e857693 --rounds 2   # e857693: before the change

It bakes the template (the working tree; with --before REF, also the template at that git ref,
the two measured side by side in alternating rounds) and measures each baked project twice:

  metrics   the multiclass task's metrics(rows, detail=False), what train.py computes on the
            gathered rows after each epoch's validation, on seeded random rows of --val-samples x
            --classes (logits with the label's one raised, so APs are neither 0 nor 1), timed
            --repeats times in one process, then once under cProfile for where the time goes
  train.py  a real run, one process, on the synthetic vectors (data.dataset=synthetic) sized so
            that the val split holds --val-samples: the per-epoch train_seconds and val_seconds
            of its metrics.jsonl (the medians over the epochs after the first)

Both run with OMP_NUM_THREADS=--threads (1 by default: on a small shared machine, two threads
that wait on a busy core make some indexing kernels a hundred times slower, which would be
measured as the code's cost). Writes val_cost.json and val_cost.md into --out and prints the table.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench

# Runs inside a baked project (its own modules), so that each version times its own code.
METRICS_PROBE = """
import cProfile, io, json, pstats, sys, time
import torch
from omegaconf import OmegaConf
from ddpkit.tasks import MulticlassTask
from ddpkit.splits import Splits
samples, classes, repeats = (int(a) for a in sys.argv[1:4])
generator = torch.Generator().manual_seed(0)
labels = torch.randint(0, classes, (samples,), generator=generator)
logits = torch.randn(samples, classes, generator=generator, dtype=torch.float64)
logits[torch.arange(samples), labels] += 2.0
rows = torch.cat([labels.double()[:, None], logits.softmax(dim=1)], dim=1)
splits = Splits(None, None, None, "multiclass", num_classes=classes)
task = MulticlassTask(OmegaConf.create({}), splits, None)
seconds = []
for _ in range(repeats):
    start = time.perf_counter()
    result = task.metrics(rows, detail=False)
    seconds.append(time.perf_counter() - start)
profile = cProfile.Profile()
profile.runcall(task.metrics, rows, detail=False)
stats = pstats.Stats(profile, stream=io.StringIO()).sort_stats("tottime")
top = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:6]
print(json.dumps({"seconds": seconds, "result": result,
                  "profile": [[f"{f.rsplit('/', 1)[-1]}:{line}({name})", calls, own, total]
                              for (f, line, name), (_, calls, own, total, _) in top]}))
"""


def bake_ref(ref: str, where: Path) -> Path:
    """The template as it was at git ref `ref`, baked with its default answers."""
    from cookiecutter.main import cookiecutter

    source = where / "template"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(bench.REPO), "archive", ref], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    return Path(cookiecutter(str(source), no_input=True, output_dir=str(where / "baked")))


def environment(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}


def time_metrics(project: Path, args: argparse.Namespace) -> dict:
    done = subprocess.run([sys.executable, "-c", METRICS_PROBE, str(args.val_samples),
                           str(args.classes), str(args.repeats)], cwd=project, text=True,
                          capture_output=True, env=environment(args.threads), check=False)
    if done.returncode:
        raise SystemExit(f"{done.stderr[-3000:]}\nerror: the metrics probe failed in {project}")
    return json.loads(done.stdout.splitlines()[-1])


def time_training(project: Path, args: argparse.Namespace, run_dir: Path) -> dict:
    # val is data.val_fraction (0.15) of the samples, rounded up: 133,333 give 20,000 (and
    # 86,666 to train).
    samples = round(args.val_samples / 0.15)
    command = [sys.executable, "train.py", f"run.dir={run_dir}", f"train.epochs={args.epochs}",
               "train.progress_bar=false", "data.dataset=synthetic",
               f"data.synthetic_samples={samples}", f"data.synthetic_classes={args.classes}",
               f"train.global_batch_size={args.batch}"]
    with open(run_dir.with_suffix(".log"), "w") as out:
        done = subprocess.run(command, cwd=project, stdout=out, stderr=subprocess.STDOUT,
                              env=environment(args.threads), check=False)
    if done.returncode:
        raise SystemExit(f"error: {' '.join(command)} failed; see {run_dir.with_suffix('.log')}")
    epochs = bench.json_lines(run_dir / "metrics.jsonl")[1:]  # the first warms up
    train = statistics.median(e["train_seconds"] for e in epochs)
    val = statistics.median(e["val_seconds"] for e in epochs)
    return {"train_seconds": train, "val_seconds": val, "val_share": val / (train + val),
            "val_accuracy": epochs[-1]["val_accuracy"],
            "val_average_precision_macro": epochs[-1]["val_average_precision_macro"]}


def table(rows: list[dict], args: argparse.Namespace) -> str:
    header = (f"{args.val_samples:,} val samples x {args.classes:,} classes, one process, "
              f"OMP_NUM_THREADS={args.threads}, global batch {args.batch}; medians over "
              f"{args.rounds} round(s)")
    columns = ("| code | metrics(detail=False) (s) | its macro AP | train.py: train s / epoch | "
               "val s / epoch | val share of the epoch |")
    lines = [header, "", columns, "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['code']} | {r['metrics_seconds']:.3f} | "
              f"{r['result']['average_precision_macro']!r} | {r['train_seconds']:.2f} | "
              f"{r['val_seconds']:.2f} | {r['val_share']:.1%} |" for r in rows]
    for r in rows:
        lines += ["", f"{r['code']}: where metrics() spends its time (cProfile, own seconds)"]
        lines += [f"    {own:8.3f}  {calls:6d} calls  {name}" for name, calls, own, _ in
                  r["profile"]]
    return "\n".join(lines)


def measure(projects: dict[str, Path], args: argparse.Namespace, scratch: Path) -> list[dict]:
    """Alternating rounds (before, after, before, ...): a slow spell hits both alike."""
    runs = {code: [] for code in projects}
    for round_index in range(args.rounds):
        for code, project in projects.items():
            print(f"round {round_index + 1}/{args.rounds}: {code} ...", flush=True)
            probe = time_metrics(project, args)
            trained = time_training(project, args, scratch / f"run-{code}-{round_index}")
            runs[code].append({**trained, "metrics_seconds": statistics.median(probe["seconds"]),
                               "profile": probe["profile"], "result": probe["result"]})
    rows = []
    for code, measured in runs.items():
        row = {key: statistics.median(r[key] for r in measured)
               for key in ("metrics_seconds", "train_seconds", "val_seconds", "val_share")}
        rows.append({"code": code, **row, "profile": measured[-1]["profile"],
                     "result": measured[-1]["result"], "rounds": measured})
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--val-samples", type=int, default=20_000)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=3, help="the first is not measured")
    parser.add_argument("--batch", type=int, default=1024, help="train.global_batch_size")
    parser.add_argument("--repeats", type=int, default=3, help="metrics() calls per round")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--before", default="", help="a git ref to measure beside the tree")
    parser.add_argument("--out", type=Path, default=bench.BENCH / "results")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ddp-val-cost-") as tmp:
        scratch = Path(tmp)
        projects = {}
        if args.before:
            projects[f"before ({args.before})"] = bake_ref(args.before, scratch / "before")
        projects["this tree"] = bench.bake(scratch / "after")
        rows = measure(projects, args, scratch)
    import torch

    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    markdown = table(rows, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "val_cost.json").write_text(json.dumps(
        {"machine": machine, "arguments": {k: str(v) for k, v in vars(args).items()},
         "rows": rows}, indent=1) + "\n")
    (args.out / "val_cost.md").write_text(markdown + "\n")
    print("\n" + markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
