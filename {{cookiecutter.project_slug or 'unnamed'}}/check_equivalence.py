"""Check that N processes train like one process: rerun it after swapping in your own model.

    python check_equivalence.py                          # 2 processes vs 1, default config
    python check_equivalence.py --nproc 4 --steps 20 model.name=mine
    python check_equivalence.py --nproc 2 --accum 2      # and gradient accumulation on top

It trains the same config twice for a few optimizer steps, with the same *global* batch: once
as one process (`python train.py`) and once under torchrun with --nproc processes (and
train.grad_accum_steps=--accum), then compares the loss of every step (relative difference at
most --rtol) and the final parameters. Dropout is switched off for both runs: its random masks
cannot be the same when the batch is split differently. Exit status 0 when they match, 1 when
not, with the first step that differs and what usually causes it.
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from config import UserError, load_config

PROJECT_DIR = Path(__file__).resolve().parent
CAUSES = """What breaks equivalence, and the fix:
  - BatchNorm: each rank normalises with its own share of the batch -> model.sync_batchnorm=true
  - randomness that differs per rank (dropout, random augmentation) -> off for this check, or
    draw it from a generator seeded by sample index rather than by rank
  - parameters unused in forward -> ddp.find_unused_parameters=true (or remove them)
  - a loss that is not a mean over the batch (e.g. a sum) -> divide by the global batch size
  - a global batch that is not split evenly (the last, padded step of an epoch) -> use --steps
    below the steps of one epoch"""


def finished(run_dir: Path, steps: int) -> bool:
    """Whether run_dir holds a finished run of `steps` steps (its final checkpoint)."""
    return (run_dir / "checkpoints" / f"step-{steps:08d}.pt").is_file()


def train(workdir: Path, name: str, nproc: int, overrides: list[str]) -> Path:
    run_dir = workdir / name
    if run_dir.exists():  # a run folder would be resumed, not trained afresh
        shutil.rmtree(run_dir)
    args = ["train.py", *overrides, f"run.dir={run_dir}"]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    print(f"training {name}: {nproc} process(es) ...", flush=True)
    result = subprocess.run([sys.executable, *args], cwd=PROJECT_DIR, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        print(result.stdout[-4000:])
        raise SystemExit(f"error: the {name} run failed (exit status {result.returncode})")
    return run_dir


def step_losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "train_log.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def final_parameters(run_dir: Path) -> dict:
    last = sorted((run_dir / "checkpoints").glob("step-*.pt"))[-1]
    return torch.load(last, map_location="cpu", weights_only=True)["model"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes of the second run")
    parser.add_argument("--accum", type=int, default=1, help="grad_accum_steps of the 2nd run")
    parser.add_argument("--steps", type=int, default=15, help="optimizer steps to compare")
    parser.add_argument("--rtol", type=float, default=1e-5, help="relative loss tolerance")
    parser.add_argument("--param-atol", type=float, default=1e-4,
                        help="largest allowed absolute difference of a final parameter")
    parser.add_argument("--workdir", type=Path, help="keep the runs here (default: temporary); "
                        "a finished 1-process run of the same config there is reused")
    args, overrides = parser.parse_known_args(argv)

    common = [*overrides, "model.dropout=0", f"train.max_steps={args.steps}",
              "train.log_every=1", "train.ckpt_every=0", "train.progress_bar=false"]
    try:
        load_config(common, world_size=args.nproc * args.accum)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or Path(scratch)
        # Named by its config, so checks of several candidates can share it.
        key = hashlib.sha256("\n".join(common).encode()).hexdigest()[:10]
        one = workdir / f"one-process-{key}"
        if finished(one, args.steps):
            print(f"reusing the 1-process run in {one}")
        else:
            train(workdir, one.name, 1, common)
        many = train(workdir, f"{args.nproc}-processes-accum-{args.accum}", args.nproc,
                     [*common, f"train.grad_accum_steps={args.accum}"])
        losses_one, losses_many = step_losses(one), step_losses(many)
        params_one, params_many = final_parameters(one), final_parameters(many)

    print(f"\n{'step':>5} {'loss, 1 process':>18} {f'loss, {args.nproc} processes':>20} "
          f"{'rel. diff':>10}")
    first_bad = None
    for step, (a, b) in enumerate(zip(losses_one, losses_many, strict=True), start=1):
        rel = abs(a - b) / max(abs(a), 1e-12)
        print(f"{step:>5} {a:>18.9f} {b:>20.9f} {rel:>10.2e}")
        if rel > args.rtol and first_bad is None:
            first_bad = step
    param_diff = max((params_one[k].double() - params_many[k].double()).abs().max().item()
                     for k in params_one if params_one[k].is_floating_point())
    print(f"largest final parameter difference: {param_diff:.3e} (allowed {args.param_atol:g})")
    if first_bad is None and param_diff <= args.param_atol:
        print(f"PASS: {args.nproc} process(es) x {args.accum} accumulation step(s) train like "
              f"1 process (losses within {args.rtol:g} relative for {len(losses_one)} steps)")
        return 0
    where = f"the loss differs from step {first_bad}" if first_bad else "parameters drift apart"
    print(f"FAIL: {where}.\n{CAUSES}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
