"""The command line of sweep.py: its options (build_parser), checked in one line before anything
is written (check_args, check_slurm_args); then a grid or --random plan, checked trial by trial,
run on this machine or submitted as a SLURM job array (sweep_main), or an Optuna study
(optuna_main), and the summary. main turns a mistake into `error: ...` and exit 2, and a stop
into exit 130 (Ctrl-C) or 75 (SIGTERM or SIGHUP: stopped on purpose, as a preempted run)."""

import argparse
import contextlib
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

from ddpkit.config import PROJECT_DIR, UserError
from ddpkit.extras.sweep.checks import check_sweep, check_trials
from ddpkit.extras.sweep.folder import PLAN_FILE, Sweep, open_sweep
from ddpkit.extras.sweep.local import Stopped, run_local
from ddpkit.extras.sweep.optuna_search import check_storage, run_optuna, task_direction
from ddpkit.extras.sweep.slurm import submit_array
from ddpkit.extras.sweep.space import parse_space, plan_trials
from ddpkit.extras.sweep.summary import write_sweep_summary
from ddpkit.project import PREEMPTED_EXIT

# sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (as the bake's answer).
SLURM_TIME = re.compile(r"[0-9]+(:[0-9]+){0,2}|[0-9]+-[0-9]+(:[0-9]+){0,2}")
MAX_SEED = 2**32 - 1  # Optuna's samplers take seeds from 0 to this


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Run a grid or random search of training runs (see the module docstring).")
    parser.add_argument("overrides", nargs="*", help="key=v1,v2 (swept) or key=v (fixed)")
    parser.add_argument("--name", default="", help="sweep name (default sweep-<time>); the "
                        "same name continues a sweep")
    parser.add_argument("--out", type=Path, default=Path("runs/sweeps"),
                        help="folder of sweep folders (default runs/sweeps)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes (GPUs) per trial (default: $NPROC_PER_NODE, else 1)")
    parser.add_argument("--config", default="", help="config file for every trial")
    parser.add_argument("--random", type=int, default=0, metavar="N",
                        help="N random draws instead of the whole grid")
    parser.add_argument("--seed", type=int, default=0, help="seed of the samplers: the grid's "
                        "order, --random's draws, --optuna's TPE")
    parser.add_argument("--gpus", default=None, help="GPU ids to pack trials on (default: "
                        "all visible); empty: run on CPU, one trial at a time")
    parser.add_argument("--max-parallel", type=int, default=0,
                        help="at most this many trials at once (default: as the GPUs allow)")
    parser.add_argument("--optuna", type=int, default=0, metavar="N",
                        help="N trials chosen by Optuna (TPE), pruned on the validation metric")
    parser.add_argument("--storage", default="", help="--optuna: the study's storage "
                        "(default sqlite:///<sweep>/optuna.db)")
    parser.add_argument("--direction", default="auto", choices=("auto", "maximize", "minimize"),
                        help="--optuna: auto follows the task's headline metric")
    parser.add_argument("--slurm", action="store_true", help="submit a SLURM job array, each "
                        "element slurm.sbatch on one node")
    parser.add_argument("--dry-run", action="store_true", help="--slurm: write, do not submit")
    parser.add_argument("--time", default="", help="--slurm: time limit per trial (default: "
                        "slurm.sbatch's)")
    parser.add_argument("--cpus-per-task", type=int, default=0, help="--slurm: CPUs per trial "
                        "(default: slurm.sbatch's)")
    parser.add_argument("--summary", type=Path, metavar="SWEEP",
                        help="only write the summary of the sweep folder SWEEP")
    return parser


def check_args(args) -> None:
    """One line on what is wrong with the command line, before anything is written."""
    if args.nproc is None:
        found = os.environ.get("NPROC_PER_NODE", "1")
        if not found.isdigit() or int(found) < 1:
            raise UserError(f"NPROC_PER_NODE={found} is not valid: give the processes per "
                            "trial, at least 1, with --nproc N")
        args.nproc = int(found)
    for option in ("random", "optuna"):
        if getattr(args, option) < 0:
            raise UserError(f"--{option} {getattr(args, option)} is not valid: a number of "
                            "trials, >= 1")
    if args.nproc < 1:
        raise UserError(f"--nproc {args.nproc} is not valid: at least 1 process per trial")
    if not 0 <= args.seed <= MAX_SEED:
        raise UserError(f"--seed {args.seed} is not valid: it must be between 0 and {MAX_SEED}")
    if args.max_parallel < 0:
        raise UserError(f"--max-parallel {args.max_parallel} is not valid: at least 1 trial "
                        "at once, or 0 for as many as the GPUs allow")
    if args.optuna and (args.slurm or args.random):
        raise UserError("--optuna chooses the trials itself: drop --slurm / --random")
    if not args.optuna:
        given = [option for option, value in (("--storage", args.storage),
                                              ("--direction", args.direction != "auto")) if value]
        _only_with(given, "an Optuna study: add --optuna N")
    check_slurm_args(args)


def _only_with(given: list[str], what: str) -> None:
    """Options given where they would do nothing: one line naming them."""
    if given:
        one = len(given) == 1
        raise UserError(f"{' and '.join(given)} {'is' if one else 'are'} for {what}, or drop "
                        f"{'it' if one else 'them'}")


def check_slurm_args(args) -> None:
    """The options of a SLURM array, given without --slurm (they would do nothing) or wrong."""
    if not args.slurm:
        _only_with([option for option, value in (
            ("--time", args.time), ("--dry-run", args.dry_run),
            ("--cpus-per-task", args.cpus_per_task)) if value], "a SLURM job array: add --slurm")
    if args.slurm and args.gpus is not None:
        raise UserError("--gpus picks GPUs of this machine, and --slurm runs the trials on "
                        "the cluster's (--nproc each): drop --gpus")
    if args.time and not SLURM_TIME.fullmatch(args.time):
        raise UserError(f"--time {args.time} is not valid: give minutes, HH:MM:SS or "
                        "D-HH:MM:SS (also MM:SS, D-HH, D-HH:MM), e.g. 12:00:00")
    if args.cpus_per_task < 0:
        raise UserError(f"--cpus-per-task {args.cpus_per_task} is not valid: at least 1, or 0 "
                        "for slurm.sbatch's")
    if args.slurm and not (PROJECT_DIR / "slurm.sbatch").is_file():
        raise UserError("--slurm runs each trial through slurm.sbatch, which is not in this "
                        "project: restore it from the template (cruft update, or copy it from a "
                        "new bake), or drop --slurm to run the trials on this machine")


def optuna_main(args) -> int:
    space, fixed = parse_space(args.overrides, random_search=True)
    devices = check_sweep(args, space, fixed)
    if args.storage:
        check_storage(args.storage)
    direction = (task_direction(args.config, fixed) if args.direction == "auto"
                 else args.direction)
    sweep = open_sweep(args, space, fixed, drawn_from={})
    storage = args.storage or f"sqlite:///{sweep.folder / 'optuna.db'}"
    print(f"sweep {sweep.folder}: Optuna, {args.optuna} trial(s), {direction} the validation "
          f"metric, study in {storage}", flush=True)
    run_optuna(sweep, space, args.optuna, devices, storage, direction, args.seed)
    return write_sweep_summary(sweep)


def sweep_main(args) -> int:
    if args.optuna:
        return optuna_main(args)
    space, fixed = parse_space(args.overrides, bool(args.random))
    devices = check_sweep(args, space, fixed)
    planned = None  # a sweep run before has its plan (checked when it was drawn)
    if not (args.out / args.name / PLAN_FILE).is_file():
        planned = plan_trials(space, args.random, args.seed)
    if planned and args.random:
        check_trials(args, fixed, planned)  # the draws themselves: a whole-number range's inside
    drawn_from = {"space": {key: list(spec) for key, spec in space.items()},
                  "random": args.random, "seed": args.seed}
    out_existed = args.out.exists()
    sweep = open_sweep(args, space, fixed, drawn_from, planned)
    if args.slurm:
        try:
            return submit_array(sweep, args)
        except UserError:
            if planned is not None:  # the folder is this command's: nothing of it is left
                shutil.rmtree(sweep.folder, ignore_errors=True)
                if not out_existed:
                    with contextlib.suppress(OSError):
                        args.out.rmdir()
            raise
    run_local(sweep, devices, args.max_parallel)
    return write_sweep_summary(sweep)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.summary:
            return write_sweep_summary(Sweep.load(args.summary))
        check_args(args)
        args.out = args.out if args.out.is_absolute() else PROJECT_DIR / args.out
        args.name = args.name or time.strftime("sweep-%Y%m%d-%H%M%S")
        return sweep_main(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Stopped) as stop:
        print("sweep stopped: rerun the same command to continue it", file=sys.stderr)
        # SIGTERM / SIGHUP: stopped on purpose, as a preempted run is (run.sh's 75).
        interrupted = isinstance(stop, KeyboardInterrupt) or stop.number == signal.SIGINT
        return 130 if interrupted else PREEMPTED_EXIT
