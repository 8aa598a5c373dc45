"""Benchmark: the baked project's train.py against a hand-written DDP loop (and Lightning).

    bash bench/run.sh                       # set up, then everything below with the defaults
    python bench/bench.py --pairs 7 --workloads tiny,cnn

It bakes the template with its default answers, then for each workload runs the contenders
one after another in rounds (A B C, A B C, ...: a warm-up round, then --pairs measured ones),
each as `torchrun --standalone --nproc_per_node=2` on this machine:

  template     the baked train.py with its defaults (validation with exact metrics each epoch,
               checkpoints, logs, TensorBoard)
  handwritten  bench/handwritten.py: the loop a user writes from the seed blog post
  lightning    bench/lightning_loop.py, when pytorch_lightning is installed

Workloads: `tiny` (the default digits MLP, where per-step overhead dominates) and `cnn` (a small
CNN on synthetic 3x32x32 images, where compute dominates). Per run it takes the median seconds
per epoch (the first epoch excluded, validation included), the time from launch to the end of
the first optimizer step, the peak resident memory of the largest process, and the final
training loss; per contender the median of its runs; and ratios against handwritten. Writes
results.json and results.md into --out, and prints the table.
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

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
WORKLOADS = {
    "tiny": {"overrides": [], "epochs": 40,
             "what": "digits MLP (1797 8x8 images, 64-256-256-10), global batch 64"},
    "cnn": {"overrides": ["model.name=cnn", "data.dataset=images"], "epochs": 5,
            "what": "3-layer CNN on 2000 synthetic 3x32x32 images, global batch 64"},
}
NPROC = 2


def bake(where: Path) -> Path:
    from cookiecutter.main import cookiecutter

    return Path(cookiecutter(str(REPO), no_input=True, output_dir=str(where)))


def torchrun(script: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={NPROC}", script, *args]


def run_measured(command: list[str], cwd: Path, log: Path) -> tuple[float, float]:
    """Run a command to its end; returns its launch time (unix) and the peak resident memory
    (MiB) of the largest process in its tree (wait4 reports the whole reaped tree)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // NPROC)),
           "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        launched = time.time()
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=out,
                                   stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SystemExit(f"{tail}\nerror: {' '.join(command)} failed (exit status "
                         f"{process.returncode}); the end of its output is above")
    return launched, usage.ru_maxrss / 1024


def json_lines(path: Path) -> list[dict]:
    records = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
    return records


def summarise(epoch_seconds: list[float], first_step: float, launched: float, rss: float,
              loss: float) -> dict:
    return {"seconds_per_epoch": statistics.median(epoch_seconds[1:]),
            "time_to_first_step": first_step - launched, "peak_rss_mib": rss,
            "final_loss": loss, "epoch_seconds": epoch_seconds}


def run_template(project: Path, workload: dict, scratch: Path, tag: str) -> dict:
    run_dir = scratch / f"template-{tag}"
    command = torchrun("train.py", f"run.dir={run_dir}", f"train.epochs={workload['epochs']}",
                       "train.progress_bar=false", *workload["overrides"])
    launched, rss = run_measured(command, project, scratch / f"template-{tag}.log")
    epochs = json_lines(run_dir / "metrics.jsonl")
    first = json_lines(run_dir / "train_log.jsonl")[0]
    assert first["step"] == 1, first
    return summarise([e["epoch_seconds"] for e in epochs], first["time"], launched, rss,
                     epochs[-1]["train_loss"])


def run_script(name: str, script: Path, workload_name: str, workload: dict, scratch: Path,
               tag: str) -> dict:
    log = scratch / f"{name}-{tag}.log"
    command = torchrun(str(script), "--workload", workload_name, "--epochs",
                       str(workload["epochs"]))
    launched, rss = run_measured(command, BENCH, log)
    records = json_lines(log)
    epochs = [r for r in records if "epoch" in r]
    first = next(r["first_step"] for r in records if "first_step" in r)
    return summarise([e["seconds"] for e in epochs], first, launched, rss, epochs[-1]["loss"])


def have_lightning() -> bool:
    try:
        import pytorch_lightning  # noqa: F401
    except ImportError:
        return False
    return True


def table(results: dict, contenders: list[str]) -> str:
    lines = [("| workload | contender | s / epoch (median) | vs hand-written | launch to first "
             "step (s) | vs hand-written | peak RSS per process (MiB) | final train loss |"),
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for workload, by_contender in results.items():
        base = by_contender["handwritten"]
        for name in contenders:
            if name not in by_contender:
                lines.append(f"| {workload} | {name} | not installed | | | | | |")
                continue
            r = by_contender[name]
            lines.append(
                f"| {workload} | {name} | {r['seconds_per_epoch']:.4f} | "
                f"{r['seconds_per_epoch'] / base['seconds_per_epoch']:.3f} | "
                f"{r['time_to_first_step']:.2f} | "
                f"{r['time_to_first_step'] / base['time_to_first_step']:.3f} | "
                f"{r['peak_rss_mib']:.0f} | {r['final_loss']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=7, help="measured rounds after a warm-up")
    parser.add_argument("--workloads", default="tiny,cnn", help="comma-separated: tiny,cnn")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    args = parser.parse_args(argv)
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown or args.pairs < 1:
        parser.error(f"--workloads takes {', '.join(WORKLOADS)}; --pairs at least 1")

    contenders = ["template", "handwritten", "lightning"]
    lightning = have_lightning()
    results, runs = {}, {}
    with tempfile.TemporaryDirectory(prefix="ddp-bench-") as tmp:
        scratch = Path(tmp)
        project = bake(scratch / "baked")
        for name in names:
            workload = WORKLOADS[name]
            todo = {
                "template": lambda tag, w=workload: run_template(project, w, scratch, tag),
                "handwritten": lambda tag, n=name, w=workload: run_script(
                    "handwritten", BENCH / "handwritten.py", n, w, scratch, tag),
            }
            if lightning:
                todo["lightning"] = lambda tag, n=name, w=workload: run_script(
                    "lightning", BENCH / "lightning_loop.py", n, w, scratch, tag)
            runs[name] = {contender: [] for contender in todo}
            for round_index in range(args.pairs + 1):  # round 0 warms up caches, not measured
                for contender, run in todo.items():
                    tag = f"{name}-{round_index}"
                    print(f"{name:>5} round {round_index}/{args.pairs} {contender} ...",
                          flush=True)
                    result = run(tag)
                    if round_index:
                        runs[name][contender].append(result)
            results[name] = {
                contender: {key: statistics.median(r[key] for r in measured)
                            for key in ("seconds_per_epoch", "time_to_first_step",
                                        "peak_rss_mib", "final_loss")}
                for contender, measured in runs[name].items()
            }

    import torch

    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "python": platform.python_version(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d"), "processes": NPROC}
    markdown = table(results, contenders)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"machine": machine, "pairs": args.pairs,
         "workloads": {n: WORKLOADS[n]["what"] for n in names},
         "results": results, "runs": runs}, indent=1) + "\n")
    header = (f"{NPROC} processes (torchrun, gloo, CPU), {args.pairs} measured rounds after a "
              f"warm-up; {machine['cores']} cores, Python {machine['python']}, torch "
              f"{machine['torch']}, {machine['date']}.\n\n")
    (args.out / "results.md").write_text(header + markdown + "\n")
    print("\n" + header + markdown)
    print(f"\nwrote {args.out / 'results.md'} and {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
