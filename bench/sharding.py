"""Benchmark: DDP against FSDP on a model of about 100M parameters, and how long a checkpoint
holds the ranks, synchronous against asynchronous.

    python bench/sharding.py                    # the defaults below; about 10 minutes on 2 cores
    python bench/sharding.py --rounds 1 --procs 2    # quicker

It bakes the template with its default answers and trains the default data (digits) with the
MLP widened to --hidden units over --layers hidden layers (4096 x 7: 101M parameters, 1.2 GB of
weights and AdamW state in float32):

  memory and step time   for each round, for each process count in --procs, bench/
                         sharding_probe.py (train.py's set-up and training step) with
                         parallel.strategy=ddp, then fsdp, for --steps optimizer steps. Per run:
                         the peak resident memory of the largest rank at the end of the steps
                         (set-up included, before any checkpoint), and the median time of a step
                         after the first two. FSDP's figures are also given as ratios to DDP's of
                         the same round and process count (median of the rounds, with their
                         spread).
  checkpoint hold        bench/sharding_probe.py hold (--hold-procs processes, FSDP): per round, a
                         training step, then a synchronous save and an asynchronous one of the
                         same state. Held: the time until save() returns on the slowest rank;
                         for the asynchronous save, also the time until the write is on disk.

Writes sharding.json and sharding.md into --out, and prints the table.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from bench import BENCH, bake, run_measured


def torchrun(script: str, *args: str, nproc: int) -> list[str]:
    """Under torchrun even for 1 process, so that the model is really wrapped (DDP) or sharded
    (FSDP, a single shard)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", script, *args]


def model_args(args) -> list[str]:
    return [f"model.hidden_dim={args.hidden}", f"model.num_layers={args.layers}",
            "model.dropout=0", "train.progress_bar=false"]


def probe(project: Path, scratch: Path, args, mode: str, count: int, strategy: str,
          nproc: int, tag: str) -> dict:
    """bench/sharding_probe.py under torchrun in the baked project; returns what it measured."""
    name = f"{mode}-{strategy}-{nproc}-{tag}"
    command = torchrun(str(BENCH / "sharding_probe.py"), mode, str(scratch / f"{name}.json"),
                       str(count), *model_args(args), f"parallel.strategy={strategy}",
                       f"run.dir={scratch / name}", nproc=nproc)
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{project}{os.pathsep}{env_path}" if env_path else str(project)
    try:
        run_measured(command, project, scratch / f"{name}.log", nproc)
    finally:
        os.environ["PYTHONPATH"] = env_path
    return json.loads((scratch / f"{name}.json").read_text())


def train_run(project: Path, scratch: Path, args, strategy: str, nproc: int, tag: str) -> dict:
    result = probe(project, scratch, args, "train", args.steps, strategy, nproc, tag)
    return {"peak_rss_mib": max(result["peak_rss_mib"]),
            "seconds_per_step": result["seconds_per_step"]}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--procs", default="1,2,4")
    parser.add_argument("--steps", type=int, default=7, help="optimizer steps per training run")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--hold-procs", type=int, default=2)
    parser.add_argument("--hold-rounds", type=int, default=5)
    parser.add_argument("--parts", default="train,hold", help="train, hold, or both")
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    procs = [int(n) for n in args.procs.split(",")] if "train" in parts else []
    parameters = (64 * args.hidden + args.hidden + (args.layers - 1) * (args.hidden ** 2
                  + args.hidden) + args.hidden * 10 + 10)

    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        project = bake(scratch / "bake")
        runs: dict = {}
        for round_index in range(args.rounds):
            for nproc in procs:
                for strategy in ("ddp", "fsdp"):
                    result = train_run(project, scratch, args, strategy, nproc, str(round_index))
                    runs.setdefault(f"{strategy}-{nproc}", []).append(result)
                    print(f"round {round_index + 1}: {strategy} x {nproc}: {result}", flush=True)
        hold = None
        if "hold" in parts:
            hold = probe(project, scratch, args, "hold", args.hold_rounds, "fsdp",
                         args.hold_procs, "0")
            print(f"checkpoint hold: {hold}", flush=True)

    rows = []
    for nproc in procs:
        ddp, fsdp = runs[f"ddp-{nproc}"], runs[f"fsdp-{nproc}"]
        memory = [f["peak_rss_mib"] / d["peak_rss_mib"] for d, f in zip(ddp, fsdp, strict=True)]
        step = [f["seconds_per_step"] / d["seconds_per_step"]
                for d, f in zip(ddp, fsdp, strict=True)]
        rows.append({
            "processes": nproc,
            "ddp_peak_rss_mib": statistics.median(d["peak_rss_mib"] for d in ddp),
            "fsdp_peak_rss_mib": statistics.median(f["peak_rss_mib"] for f in fsdp),
            "memory_ratio": memory,
            "ddp_seconds_per_step": statistics.median(d["seconds_per_step"] for d in ddp),
            "fsdp_seconds_per_step": statistics.median(f["seconds_per_step"] for f in fsdp),
            "step_time_ratio": step,
        })
    held = [s / a for s, a in zip(hold["sync_held"], hold["async_held"],
                                  strict=True)] if hold else []
    results = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                          f"Python {platform.python_version()}",
               "parameters": parameters, "args": {k: str(v) for k, v in vars(args).items()},
               "runs": runs, "rows": rows, "hold": hold, "hold_ratio": held}
    title = (f"# DDP vs FSDP, {parameters / 1e6:.0f}M parameters (MLP {args.hidden} x "
             f"{args.layers}), {results['machine']}")
    header = ("| processes | DDP peak RSS (MiB) | FSDP peak RSS (MiB) | FSDP / DDP memory "
              "| DDP s/step | FSDP s/step | FSDP / DDP step time |")
    rounds = f"{args.rounds} round(s); FSDP / DDP ratios: median of the rounds (lowest-highest)."
    lines = [title, "", rounds, "", header, "|" + " --- |" * 7] if rows else [title]
    for row in rows:
        lines.append(f"| {row['processes']} | {row['ddp_peak_rss_mib']:.0f} | "
                     f"{row['fsdp_peak_rss_mib']:.0f} | {spread(row['memory_ratio'])} | "
                     f"{row['ddp_seconds_per_step']:.2f} | {row['fsdp_seconds_per_step']:.2f} | "
                     f"{spread(row['step_time_ratio'])} |")
    hold_title = (f"Checkpoint of the whole state (FSDP, {args.hold_procs} processes, "
                  f"{len(held)} rounds): seconds the ranks are held per save, slowest rank.")
    lines += [] if not hold else ["", hold_title, "",
                                  "| save | held (median, lowest-highest) | on disk after |",
              "|" + " --- |" * 3,
              f"| synchronous | {spread(hold['sync_held'])} | the same |",
              f"| asynchronous | {spread(hold['async_held'])} | {spread(hold['async_total'])} |",
              "", f"Synchronous / asynchronous hold, per round: {spread(held)}"]
    args.out.mkdir(parents=True, exist_ok=True)
    name = "sharding" if len(parts) == 2 else f"sharding-{parts[0]}"
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1))
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
