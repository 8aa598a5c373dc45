"""Check that N processes train like one process: rerun it after swapping in your own model.

    python check_equivalence.py                          # 2 processes vs 1, default config
    python check_equivalence.py --nproc 4 --steps 10 model.name=mine
    python check_equivalence.py --nproc 2 --accum 2      # and gradient accumulation on top
    python check_equivalence.py --strategy fsdp          # N processes with FSDP vs 1
    python check_equivalence.py --config configs/my_experiment.yaml   # your experiment's config

It trains the same config twice for a few optimizer steps, with the same *global* batch: once
as one process (`python train.py`) and once under torchrun with --nproc processes (and
train.grad_accum_steps=--accum), then compares the loss of every step (relative difference at
most --rtol) and every final parameter: max|a - b| at most --param-rtol x max|a| + --param-atol,
a being the parameter after 1 process and b after N. A table names the worst parameters (--show
of them, and every failing one), on a pass and on a failure.

Elements with no gradient signal are excused: those whose float64 gradient over the compared
steps' data is zero but for rounding, at the initial and at the final weights alike (an
attention key bias: softmax ignores what is added to every score alike). Their rounding noise
differs between the runs, and Adam turns it into real steps; the table marks such a parameter
"no gradient signal (excused)". Its other elements, and every other parameter, must agree.

Randomness that depends on how the batch is split is switched off for both runs: dropout
(model.dropout=0) and training augmentation (data.augment=false, which your datasets should
honour too). Both runs compare their last weights (no early stop, model.pt from the last step,
whatever train.export says). The steps stay inside the first epoch's full global batches (the
last batch of an epoch is padded differently at different process counts); by default
max(15, optim.warmup_steps + 5) of them, past the warmup, and a note says so when every
compared step is still inside it.

Exit status: 0 PASS, 1 FAIL (with the first step that differs and what usually causes it),
2 could not run (bad input, a run that failed: its one-line error is printed).
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

from ddpkit import equivalence
from ddpkit.checkpoint_files import MODEL_FILE
from ddpkit.config import UserError, load_config

PROJECT_DIR = Path(__file__).resolve().parent
SWITCHED_OFF = ["model.dropout=0", "data.augment=false"]  # randomness that depends on the split
# Both runs end at the same step with their last weights: no early stop, no best checkpoint.
LAST_WEIGHTS = ["train.early_stop_patience=0", "train.keep_best=false", "train.export=last"]
CAUSES = """What breaks equivalence, and the fix:
  - BatchNorm: each rank normalises with its own share of the batch -> model.sync_batchnorm=true
  - randomness that differs per rank (dropout, random augmentation) -> off for this check
    (model.dropout=0 and data.augment=false are set; make your own randomness honour them), or
    draw it from a generator seeded by sample index rather than by rank
  - a loss that is not a mean over the batch (e.g. a sum) -> divide by the batch size
  - code that reads the rank or the world size (torch.distributed) in the model or the loss"""


class CannotRun(Exception):
    """The check could not be made: the message says why (exit status 2)."""


def steps_to_compare(overrides: list[str], requested: int | None) -> int:
    """Steps inside the first epoch whose global batch is the same at every process count."""
    from ddpkit import recipes
    from ddpkit.data import DataModule
    from ddpkit.dist_utils import DistEnv

    recipes.load()  # your model.py, data_sources.py and tasks.py add to the registries
    cfg = load_config(overrides)
    data = DataModule(cfg, DistEnv(0, 0, 1, False), torch.device("cpu"))
    full = data.full_steps_per_epoch
    batch, dataset = cfg.train.global_batch_size, cfg.data.dataset
    if full < 2:
        raise CannotRun(f"the training split of data.dataset={dataset} holds {full} full global "
                        f"batch(es) of {batch}: lower train.global_batch_size so an epoch has at "
                        "least 2 steps to compare")
    if requested is not None and requested > full:
        raise CannotRun(f"--steps {requested} is more than the {full} full steps in one epoch of "
                        f"data.dataset={dataset} at train.global_batch_size={batch}: use "
                        f"--steps {full} or fewer")
    if requested:
        return requested
    steps = equivalence.default_steps(cfg.optim.warmup_steps, full)
    note = equivalence.warmup_note(steps, cfg.optim.warmup_steps)
    if note:
        print(note)
    return steps


def finished(run_dir: Path, steps: int) -> bool:
    """Whether run_dir holds a finished run of `steps` steps (its final model)."""
    model = run_dir / MODEL_FILE
    return model.is_file() and torch.load(model, weights_only=True)["step"] == steps


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
    # A temp folder of the run's own, removed after it: torchrun leaves a torchelastic_* one.
    with tempfile.TemporaryDirectory(prefix="eq-") as temp:
        env["TMPDIR"] = temp
        result = subprocess.run([sys.executable, *args], cwd=PROJECT_DIR, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
        if errors:  # the run's own one-line report of a mistake in the input
            raise CannotRun(f"the {name} run stopped: {errors[0].removeprefix('error: ')}")
        print(result.stdout[-4000:])
        raise CannotRun(f"the {name} run failed (exit status {result.returncode}); its output "
                        "is above")
    return run_dir


def step_losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "train_log.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def final_parameters(run_dir: Path) -> dict:
    return torch.load(run_dir / MODEL_FILE, map_location="cpu", weights_only=True)["model"]


def train_both(args, common: list[str], steps: int) -> tuple:
    """Train 1 process, then N; returns both runs' step losses and final parameters."""
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or Path(scratch)
        # Named by its config, so checks of several candidates can share it.
        key = hashlib.sha256("\n".join(common).encode()).hexdigest()[:10]
        one = workdir / f"one-process-{key}"
        if finished(one, steps):
            print(f"reusing the 1-process run in {one}")
        else:
            train(workdir, one.name, 1, common)
        many = train(workdir, f"{args.nproc}-processes-{args.strategy}-accum-{args.accum}",
                     args.nproc, [*common, f"train.grad_accum_steps={args.accum}",
                                  f"parallel.strategy={args.strategy}"])
        return step_losses(one), step_losses(many), final_parameters(one), final_parameters(many)


def gradient_signal(common: list[str], steps: int, params_one: dict) -> dict | None:
    """equivalence.no_signal's masks, or None (nothing excused) where the model or the task
    cannot run in float64."""
    print("weighing the gradient signal of the parameters over tolerance ...", flush=True)
    try:
        return equivalence.no_signal(load_config(common), steps, params_one)
    except (RuntimeError, TypeError) as error:  # a float32-only model or loss
        print(f"note: no float64 gradient ({type(error).__name__}: {str(error)[:200]}), so no "
              "parameter is excused for lack of gradient signal")
        return None


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The options, and the config: --config FILE first, then the key=value overrides."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes of the second run")
    parser.add_argument("--accum", type=int, default=1, help="grad_accum_steps of the 2nd run")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp",
                        help="parallel.strategy of the 2nd run (the 1st is one plain process)")
    parser.add_argument("--steps", type=int, help="optimizer steps to compare (default: "
                        f"max({equivalence.MIN_STEPS}, optim.warmup_steps + "
                        f"{equivalence.PAST_WARMUP}), within the first epoch)")
    parser.add_argument("--rtol", type=float, default=1e-5, help="relative loss tolerance")
    parser.add_argument("--param-rtol", type=float, default=1e-4,
                        help="a final parameter's allowed max|a-b|, relative to its max|a|")
    parser.add_argument("--param-atol", type=float, default=1e-5,
                        help="added to that: the floor of a parameter's tolerance")
    parser.add_argument("--show", type=int, default=8,
                        help="parameters in the table of the worst (failing ones: all)")
    parser.add_argument("--workdir", type=Path, help="keep the runs here (default: temporary); "
                        "a finished 1-process run of the same config there is reused")
    parser.add_argument("--config", metavar="FILE", help="the config file both runs start from, "
                        "as train.py takes it (default: configs/default.yaml); key=value "
                        "overrides after the options apply on top")
    args, overrides = parser.parse_known_args(argv)
    if args.config:
        overrides = ["--config", args.config, *overrides]
    return args, overrides


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    try:
        load_config(overrides, world_size=args.nproc * args.accum)
        steps = steps_to_compare([*overrides, *SWITCHED_OFF], args.steps)
        common = [*overrides, *SWITCHED_OFF, *LAST_WEIGHTS, f"train.max_steps={steps}",
                  "train.log_every=1", "train.ckpt_every=0", "train.progress_bar=false"]
        losses_one, losses_many, params_one, params_many = train_both(args, common, steps)
        checks = equivalence.compare_parameters(params_one, params_many, args.param_rtol,
                                                args.param_atol)
        if any(check.ratio > 1 for check in checks):  # rounding noise, or a real divergence?
            excused = gradient_signal(common, steps, params_one)
            checks = equivalence.compare_parameters(params_one, params_many, args.param_rtol,
                                                    args.param_atol, excused)
    except (UserError, CannotRun) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    print(f"\n{'step':>5} {'loss, 1 process':>18} {f'loss, {args.nproc} processes':>20} "
          f"{'rel. diff':>10}")
    first_bad = None
    for step, (a, b) in enumerate(zip(losses_one, losses_many, strict=True), start=1):
        rel = abs(a - b) / max(abs(a), 1e-12)
        print(f"{step:>5} {a:>18.9f} {b:>20.9f} {rel:>10.2e}")
        if rel > args.rtol and first_bad is None:
            first_bad = step
    print(f"\nfinal parameters, a after 1 process, b after {args.nproc}; tolerance "
          f"{args.param_rtol:g} x max|a| + {args.param_atol:g}; the worst first:")
    print(equivalence.table(checks, args.show))
    failed = [check.name for check in checks if not check.passed]
    if first_bad is None and not failed:
        print(f"PASS: {args.nproc} process(es) x {args.accum} accumulation step(s) train like "
              f"1 process (losses within {args.rtol:g} relative for {len(losses_one)} steps)")
        return 0
    where = [f"the loss differs from step {first_bad}"] if first_bad else []
    if failed:
        where.append(f"parameters drift apart ({', '.join(failed[:5])}"
                     f"{', ...' if len(failed) > 5 else ''})")
    print(f"FAIL: {'; '.join(where)}.\n{CAUSES}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
