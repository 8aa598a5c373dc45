"""Benchmark: `./run.sh train.fast_dev_run=true` against the default run, `./run.sh`, and
against the launch floor: torchrun starting 2 processes that import torch and exit.

    .venv/bin/python bench/dev_run.py --rounds 5

Bakes the template with its default answers, then runs the two commands back to back in rounds
(a warm-up round, then --rounds measured ones), each timed whole, from the command's start to its
exit: run.sh's checks, torchrun, both workers' imports and set-up, the work, the exit. Reports
the median of the per-round ratios (fast dev run / default run) with their spread, and the
seconds the fast dev run spent inside train.py (its own "ok in N s"), which shows how much of it
is the launch. The floor is what no command of the project can go under; the fast dev run's
excess over it (per round, then the median and spread) is what the project itself costs. Writes
dev_run.json and dev_run.md into --out.
"""

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMANDS = {"default run": [], "fast dev run": ["train.fast_dev_run=true"]}


def timed(project: Path, args: list[str], output: Path) -> tuple[float, str]:
    env = {**os.environ, "PYTHON": sys.executable, "NPROC_PER_NODE": "2",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    started = time.perf_counter()
    done = subprocess.run(["./run.sh", *args, f"run.output_dir={output}",
                           "train.progress_bar=false"], cwd=project, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{done.stdout[-3000:]}\nerror: ./run.sh {' '.join(args)} failed")
    return seconds, done.stdout


def launch_floor(folder: Path) -> float:
    """Seconds for torchrun to start 2 processes that import torch and exit."""
    script = folder / "floor.py"
    script.write_text("import torch  # noqa: F401\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node=2", str(script)], cwd=folder, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return time.perf_counter() - started


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds after a warm-up")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    from cookiecutter.main import cookiecutter

    rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ddp-dev-run-") as tmp:
        project = Path(cookiecutter(str(REPO), no_input=True, output_dir=tmp))
        for index in range(args.rounds + 1):
            measured = {"launch floor": launch_floor(Path(tmp))}
            for name, extra in COMMANDS.items():
                seconds, text = timed(project, extra, Path(tmp) / "runs")
                measured[name] = seconds
                if extra:
                    inside = re.search(r"fast_dev_run ok in ([\d.]+) s", text)
                    measured["fast dev run, inside train.py"] = float(inside.group(1))
            runs = list((Path(tmp) / "runs").glob("[!.]*"))
            print(f"round {index}/{args.rounds}: " + ", ".join(
                f"{name} {value:.2f} s" for name, value in measured.items())
                  + f" (runs kept: {len(runs)})", flush=True)
            if index:
                rounds.append(measured)
    ratios = [r["fast dev run"] / r["default run"] for r in rounds]
    excess = [r["fast dev run"] - r["launch floor"] for r in rounds]
    medians = {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}
    import torch

    machine = {"cores": os.cpu_count(), "python": platform.python_version(),
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    summary = {"machine": machine, "rounds": rounds, "medians": medians,
               "ratio": {"median": statistics.median(ratios), "low": min(ratios),
                         "high": max(ratios), "rounds": ratios},
               "over_floor": {"median": statistics.median(excess), "low": min(excess),
                              "high": max(excess), "rounds": excess}}
    lines = [(f"`./run.sh` (2 processes, gloo, the default digits MLP, 30 epochs) and `./run.sh "
             f"train.fast_dev_run=true`, whole commands, {args.rounds} measured rounds after a "
             f"warm-up; {machine['cores']} cores, Python {machine['python']}, torch "
             f"{machine['torch']}, {machine['date']}."), "",
             "| command | seconds (median) |", "|---|---:|"]
    lines += [f"| {name} | {value:.2f} |" for name, value in medians.items()]
    ratio = summary["ratio"]
    lines += ["", (f"fast dev run / default run: median of per-round ratios "
              f"**{ratio['median']:.3f}** (spread {ratio['low']:.3f} to {ratio['high']:.3f})")]
    over = summary["over_floor"]
    lines += [(f"fast dev run - launch floor: median of per-round differences "
              f"**{over['median']:.2f} s** (spread {over['low']:.2f} to {over['high']:.2f} s)")]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dev_run.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "dev_run.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
