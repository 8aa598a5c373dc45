"""Hyperparameter sweeps: every trial a normal run, launched with run.sh.

    python sweep.py optim.lr=1e-3,3e-3 model.hidden_dim=128,256        # a grid: 4 trials
    python sweep.py --random 8 optim.lr=loguniform(1e-4,1e-2) model.dropout=0,0.1,0.2
    python sweep.py --nproc 2 --name lr-scan optim.lr=1e-3,3e-3 train.epochs=50
    python sweep.py --slurm optim.lr=1e-3,3e-3                          # a SLURM job array
    python sweep.py --optuna 20 optim.lr=loguniform(1e-4,1e-2) model.hidden_dim=128,256

An override with a comma (or a range, for --random) is swept; one without is set in every
trial, unless its key is swept too (commas inside brackets or quotes split nothing:
optim.milestones=[100,200],[300] sweeps two lists). Optuna's samplers draw the plan once, kept
in sweep.json: GridSampler the whole grid in an order shuffled by --seed (so that the first
trials already spread over it), RandomSampler the --random draws. With --optuna N, TPE picks each
trial when a slot is free instead, hears every epoch's headline validation value and prunes a
trial below the median of the earlier ones at that epoch (it gets SIGTERM, saves a checkpoint
and leaves); the study is <sweep>/optuna.db.

Before the sweep folder is made, the options and every trial's command line go through the
checks its run.sh would make before launch (the config, the global batch over --nproc
processes on one node, your files compiling; a range stands for its two ends, --random's draws
for themselves): a mistake is one line naming the trial (or every trial), exit 2, none started.

Each trial runs `./run.sh <its overrides> run.dir=<sweep>/trial-NNN` with --nproc processes
(default: $NPROC_PER_NODE, else 1): an ordinary run folder, resumable, evaluable, tracked. Here
the trials are packed onto the GPUs (k GPUs of its own for a trial of k processes, one trial at
a time without GPUs); with --slurm they are a job array (<sweep>/array.sbatch) whose elements
each run slurm.sbatch on one node.

The sweep folder (default runs/sweeps/<name>) holds sweep.json, the trials' run folders,
logs/trial-NNN.log and, when every trial has ended, summary.csv and summary.md (trials ranked by
the task's headline validation metric) and summary.png (that metric against each swept setting).
The same command again (same --name) reruns only the trials that did not finish (from their
checkpoints), or continues the study up to N trials. A failing trial is reported with its
one-line error; the others go on. The exit status is 0 when every trial finished, 1 otherwise.
"""

import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit import report
from ddpkit.config import PROJECT_DIR, UserError, load_config, schema_type
from ddpkit.preflight import OWN_FILES, Refused, check_compiles, named_files, preflight

PLAN_FILE = "sweep.json"
PREEMPTED_EXIT = 75  # as dist_utils.PREEMPTED_EXIT (not imported: it would import torch)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LAUNCH_MARK = "### sweep.py started:"  # heads each launch in a trial's log
RANGE = re.compile(r"^(uniform|loguniform|int)\((.+),(.+)\)$")
BRACKETS = {"[": "]", "(": ")", "{": "}"}
# sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (as the bake's answer).
SLURM_TIME = re.compile(r"[0-9]+(:[0-9]+){0,2}|[0-9]+-[0-9]+(:[0-9]+){0,2}")
MAX_SEED = 2**32 - 1  # Optuna's samplers take seeds from 0 to this


def _optuna():
    """optuna, imported on first use: only a sweep pays for its import (a second or so)."""
    try:
        import optuna
    except ModuleNotFoundError:
        raise UserError("sweeps need the optuna package, one of the project's dependencies: "
                        "pip install -e . in the project's environment") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


# --- the plan --------------------------------------------------------------------------------

def _parse_range(item: str, key: str, ranged: re.Match, random_search: bool) -> tuple:
    """(kind, low, high) of a `key=kind(low,high)` override, checked."""
    if not random_search:
        raise UserError(f"{item}: a range needs --random N (a grid takes lists: {key}=a,b,c)")
    kind, low, high = ranged.groups()
    declared = schema_type(key)
    if declared not in (int, float, Any):  # a draw is a number: a string or a flag takes none
        raise UserError(f"{item}: {key} is not a number: give it a list of values, "
                        f"e.g. {key}=a,b")
    if declared is int and kind != "int":
        raise UserError(f"{item}: {key} takes whole numbers: use int({low},{high})")
    try:
        low_value, high_value = float(low), float(high)
    except ValueError:
        raise UserError(f"{item}: the range's ends must be numbers") from None
    if not low_value < high_value or (kind == "loguniform" and low_value <= 0):
        raise UserError(f"{item}: needs 0 < low < high for loguniform, low < high otherwise")
    if kind == "int" and math.ceil(low_value) > math.floor(high_value):
        raise UserError(f"{item}: {key} has no whole number between {low} and {high}: "
                        "widen the range")
    return kind, low_value, high_value


def split_values(item: str, value: str) -> list[str]:
    """The values of `key=a,b,c`, split at the commas outside brackets and quotes, each kept as
    written: optim.milestones=[100,200],[300] has two values, optim.milestones=[100,200] one."""
    values, start, closing, quote = [], 0, [], ""
    for at, char in enumerate(value):
        if quote or char in "'\"":
            quote = "" if char == quote else quote or char
        elif char in BRACKETS:
            closing.append(BRACKETS[char])
        elif char in BRACKETS.values() and (not closing or closing.pop() != char):
            raise UserError(f"{item}: its values do not parse: a {char} closes nothing: "
                            "check the brackets")
        elif char == "," and not closing:
            values.append(value[start:at])
            start = at + 1
    if quote or closing:
        raise UserError(f"{item}: its values do not parse: a {quote or closing[-1]} is missing")
    return [*values, value[start:]]


def parse_space(overrides: list[str], random_search: bool) -> tuple[dict, list[str]]:
    """{key: [values] or (kind, low, high)} for the swept keys, and the fixed overrides."""
    space, fixed = {}, []
    for item in overrides:
        key, has_value, value = item.partition("=")
        if not has_value or not key:
            raise UserError(f"{item!r} is not a key=value override, e.g. optim.lr=1e-3,3e-3")
        if schema_type(key) is None:
            raise UserError(f"{key} is not a config key (python config.py lists them all)")
        if key in ("run.dir", "run.output_dir"):
            raise UserError(f"{key} is set by the sweep for each trial: drop it (use --out)")
        ranged = RANGE.match(value.replace(" ", ""))
        values = [] if ranged else split_values(item, value)
        if not ranged and len(values) == 1:
            fixed.append(item)
            continue
        # A trial's own settings follow the fixed ones: a list wins over a fixed value of its
        # key (a command's base overrides may hold one), but of two lists neither would.
        if key in space:
            raise UserError(f"{key} is swept twice: give one list of its values")
        if len(set(values)) != len(values) or "" in values:
            raise UserError(f"{item}: list each value once, separated by commas")
        space[key] = _parse_range(item, key, ranged, random_search) if ranged else values
    if not space:
        raise UserError("nothing to sweep: give at least one key a list of values, e.g. "
                        "optim.lr=1e-3,3e-3")
    return space, fixed


def _suggest(trial, key: str, spec) -> str:
    """The setting an Optuna trial draws for one key, as the override's text."""
    if isinstance(spec, list):
        return trial.suggest_categorical(key, spec)
    kind, low, high = spec
    if kind == "int":
        return str(trial.suggest_int(key, math.ceil(low), math.floor(high)))
    return f"{trial.suggest_float(key, low, high, log=kind == 'loguniform'):.4g}"


def _count(spec) -> float:
    """How many settings a swept key has (a float range: unbounded)."""
    if isinstance(spec, list):
        return len(spec)
    kind, low, high = spec
    return math.floor(high) - math.ceil(low) + 1 if kind == "int" else math.inf


def plan_trials(space: dict, random_trials: int = 0, seed: int = 0) -> list[dict]:
    """Each trial's swept settings, in order, drawn by an in-memory Optuna study: the whole grid
    (GridSampler, its order shuffled by `seed`), or `random_trials` draws (RandomSampler),
    distinct while the space has that many."""
    samplers = _optuna().samplers
    size = math.prod(_count(spec) for spec in space.values())
    sampler = (samplers.RandomSampler(seed=seed) if random_trials
               else samplers.GridSampler(space, seed=seed))
    study = _optuna().create_study(sampler=sampler)
    trials, seen = [], set()
    while len(trials) < (random_trials or size):
        trial = study.ask()
        drawn = {key: _suggest(trial, key, spec) for key, spec in space.items()}
        if tuple(drawn.values()) in seen and len(seen) < size:
            continue
        seen.add(tuple(drawn.values()))
        trials.append(drawn)
    return trials


def trial_id(index: int) -> str:
    return f"trial-{index:03d}"


def trial_argv(config_file: str, fixed: list[str], settings: dict) -> list[str]:
    """A trial's command line but its run folder: its config file, the fixed overrides, then
    its own settings."""
    args = [f"--config={config_file}"] if config_file else []
    return [*args, *fixed, *(f"{key}={value}" for key, value in settings.items())]


@dataclass
class Sweep:
    folder: Path
    trials: list[dict]  # the swept settings of each trial
    fixed: list[str]  # overrides of every trial
    nproc: int
    config_file: str = ""
    pruned: list[int] = field(default_factory=list)  # Optuna: trials stopped early on purpose
    drawn_from: dict = field(default_factory=dict)  # grid / random: the space, --random, --seed

    def overrides(self, index: int) -> list[str]:
        return [*trial_argv(self.config_file, self.fixed, self.trials[index]),
                f"run.dir={self.run_dir(index)}"]

    def run_dir(self, index: int) -> Path:
        return self.folder / trial_id(index)

    def log_file(self, index: int) -> Path:
        return self.folder / "logs" / f"{trial_id(index)}.log"

    def finished(self, index: int) -> bool:
        summary = self.run_dir(index) / report.SUMMARY_FILE
        try:
            return json.loads(summary.read_text()).get("status") == "done"
        except (OSError, json.JSONDecodeError):
            return False

    def settings(self) -> tuple:
        """What a rerun must match to continue this sweep."""
        return self.fixed, self.nproc, self.config_file, self.drawn_from

    def save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        plan = {"trials": self.trials, "fixed": self.fixed, "nproc": self.nproc,
                "config_file": self.config_file, "pruned": self.pruned,
                "drawn_from": self.drawn_from}
        path = self.folder / PLAN_FILE
        tmp = path.with_name(f".{path.name}.tmp")  # a stop while writing keeps the old plan
        tmp.write_text(json.dumps(plan, indent=1) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, folder: Path) -> "Sweep":
        try:
            plan = json.loads((folder / PLAN_FILE).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise UserError(f"{folder} is not a sweep folder ({error})") from None
        return cls(folder, plan["trials"], plan["fixed"], plan["nproc"], plan["config_file"],
                   plan.get("pruned", []), plan.get("drawn_from", {}))


def open_sweep(args, space: dict, fixed: list[str], drawn_from: dict,
               planned: list[dict] | None = None) -> Sweep:
    """The sweep folder: created with its plan (`planned`, or trials drawn by plan_trials when
    `drawn_from` is given, none yet for Optuna), or found again, when the command's settings
    must match."""
    wanted = Sweep(args.out / args.name, [], fixed, args.nproc, args.config or "",
                   drawn_from=drawn_from)
    if (wanted.folder / PLAN_FILE).is_file():
        found = Sweep.load(wanted.folder)
        if found.settings() != wanted.settings():
            raise UserError(f"{wanted.folder} holds a sweep with other settings: rerun its own "
                            "command to continue it, or choose another --name")
        return found
    if drawn_from:
        wanted.trials = planned if planned is not None else plan_trials(
            space, args.random, args.seed)
    wanted.save()
    return wanted


# --- what every trial's run.sh would refuse, found before the first launch --------------------

def checked_settings(space: dict) -> list[dict]:
    """The swept settings to check: every combination of each key's values, a range standing
    for its two ends (written as a draw is), which the checks' bounds hold for if they hold at
    both. A grid's are its trials."""
    values = {key: spec if isinstance(spec, list) else list(dict.fromkeys(_ends(spec)))
              for key, spec in space.items()}
    return [dict(zip(values, combination, strict=True))
            for combination in itertools.product(*values.values())]


def _ends(spec: tuple) -> list[str]:
    kind, low, high = spec
    if kind == "int":
        return [str(math.ceil(low)), str(math.floor(high))]
    return [f"{low:.4g}", f"{high:.4g}"]


def trial_problem(args, argv: list[str]) -> str | None:
    """What a trial's preflight would refuse (None: nothing): on this machine run.sh's own
    checks; for a SLURM array, whose trials run elsewhere, those that do not ask the machine
    (the config, the batch split over --nproc processes on one node, the named files)."""
    try:
        if not args.slurm:
            preflight(["--nproc-per-node", str(args.nproc), "--nnodes", "1", *argv])
            return None
        cfg = load_config(argv, world_size=args.nproc)
        check_compiles(named_files([*argv, str(cfg.data.dataset), str(cfg.model.name),
                                    str(cfg.task.name)]))
    except (UserError, Refused) as error:
        return str(error)
    return None


def check_trials(args, fixed: list[str], trials: list[dict]) -> None:
    """Each trial's command line through trial_problem: one line, naming the first trial that
    would be refused, or none when every trial would be, alike (the fix is then a fixed
    override, the config file or --nproc)."""
    problems = [(settings, problem) for settings in trials
                if (problem := trial_problem(args, trial_argv(args.config, fixed, settings)))]
    if not problems:
        return
    settings, problem = problems[0]
    if len(problems) == len(trials) and len({problem for _, problem in problems}) == 1:
        raise UserError(f"every trial: {problem}")
    raise UserError(f"trial {' '.join(f'{k}={v}' for k, v in settings.items())}: {problem}")


def check_sweep(args, space: dict, fixed: list[str]) -> list[str]:
    """Everything a trial's launch would refuse, checked once before the sweep folder exists:
    the GPUs for --nproc, your files compiling, every trial's config (checked_settings). Returns
    the GPUs the trials are packed onto (none for --slurm)."""
    devices = [] if args.slurm else chosen_devices(args)
    check_devices(args.nproc, devices)
    listed = [f"{key}={value}" for key, spec in space.items() if isinstance(spec, list)
              for value in spec]
    try:
        check_compiles([*OWN_FILES, "train.py", *named_files([*fixed, *listed])])
    except Refused as error:
        raise UserError(str(error)) from None
    check_trials(args, fixed, checked_settings(space))
    return devices


# --- running trials on one machine -------------------------------------------------------------

def visible_devices() -> list[str]:
    """The GPUs this process may use (ids as CUDA_VISIBLE_DEVICES names them)."""
    from ddpkit.preflight import visible_gpus

    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    return [str(i) for i in range(visible_gpus())]


def check_devices(nproc: int, devices: list[str]) -> None:
    if devices and nproc > len(devices):
        raise UserError(f"a trial of {nproc} processes needs {nproc} GPUs and {len(devices)} "
                        f"are visible: use --nproc {len(devices)} or fewer")


def run_packed(trials, nproc: int, devices: list[str], start, wait_step=None,
               max_parallel: int = 0, watch=None, ended=None) -> dict[int, int]:
    """Run trials, as many at once as the devices allow (one at a time with none).

    `trials` is a list of trial indices, or a function that gives the next one when a slot is
    free (None: none for now; Optuna asks its study then). start(index, devices) starts a trial
    and returns something with poll() (a Popen); watch(index, process) is called while it runs,
    ended(index, status) once it has ended; wait_step() between polls (default: a short sleep).
    Returns each trial's exit status."""
    check_devices(nproc, devices)
    if isinstance(trials, list):
        trials = functools.partial(next, iter(list(trials)), None)
    free, running, statuses = list(devices), {}, {}  # each GPU to one trial at a time
    need = nproc if devices else 0
    limit = max_parallel or (len(devices) // nproc if devices else 1)
    while True:
        while len(running) < limit and len(free) >= need and (index := trials()) is not None:
            block, free = free[:need], free[need:]
            running[index] = (start(index, block), block)
        if not running:
            return statuses
        (wait_step or (lambda: time.sleep(0.2)))()
        for index, (process, block) in list(running.items()):
            if watch:
                watch(index, process)
            if (status := process.poll()) is not None:
                statuses[index] = status
                free += block
                del running[index]
                if ended:
                    ended(index, status)


def error_line(log_file: Path) -> str:
    """The line that says why a trial failed: its `error: ...`, else its last words."""
    try:
        lines = [line.strip() for line in log_file.read_text(errors="replace").splitlines()]
    except OSError:
        return "(no log)"
    for line in reversed(lines):
        if line.startswith("error:") or " error: " in line:
            return line
    return next((line for line in reversed(lines) if line), "(empty log)")


def start_trial(sweep: Sweep, index: int, devices: list[str], threads: int) -> subprocess.Popen:
    # Each trial a job of its own, on this machine alone (an exported NNODES, or a project
    # baked for several nodes, would have its run.sh wait for other nodes).
    env = dict(os.environ, NPROC_PER_NODE=str(sweep.nproc), OMP_NUM_THREADS=str(threads),
               NNODES="1")
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    for name in ("RDZV_ID", "SLURM_JOB_ID", "DDP_JOB_ID", "REPLICA_GROUP", "REPLICA_GROUPS",
                 "TORCHFT_LIGHTHOUSE"):
        env.pop(name, None)
    log_file = sweep.log_file(index)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a") as handle:
        handle.write(f"{LAUNCH_MARK} {time.strftime('%Y-%m-%d %H:%M:%S')} ./run.sh "
                     f"{' '.join(sweep.overrides(index))}\n")
        handle.flush()
        return subprocess.Popen(["./run.sh", *sweep.overrides(index)], cwd=PROJECT_DIR,
                                stdout=handle, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


class Stopped(Exception):
    """The sweep got a signal; its running trials are stopped."""

    def __init__(self, number: int):
        super().__init__(signal.Signals(number).name)
        self.number = number


def _terminate(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)


@contextlib.contextmanager
def trials_stop_with_the_sweep(processes: list[subprocess.Popen]) -> Iterator[None]:
    """Ctrl-C, SIGTERM from a scheduler or SIGHUP (the terminal closed): every running trial's
    process group (run.sh and its job) gets SIGTERM, which run.sh treats as a preemption (a
    checkpoint at the step all ranks reach), and the sweep waits for them before it raises
    Stopped; a rerun continues. Trials run in sessions of their own, so nothing else tells them.
    A mistake that stops the sweep (UserError) stops its running trials the same way."""
    received: list[int] = []

    def stop(number, frame):
        _terminate(processes)
        if not received:  # a second signal only forwards: the sweep is waiting already
            received.append(number)
            raise Stopped(number)

    previous = {number: signal.signal(number, stop) for number in STOP_SIGNALS}
    try:
        yield
    except (Stopped, UserError) as error:
        if isinstance(error, UserError):
            _terminate(processes)
        for process in processes:
            process.wait()
        raise
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def report_end(sweep: Sweep, index: int, status: int) -> None:
    """One line on a trial that ended: finished with its best headline value, or failed with
    the line that says why."""
    if status == 0 and sweep.finished(index):
        history = report.read_run(sweep.run_dir(index))
        print(f"{trial_id(index)} finished: val_{history.headline} "
              f"{report._cell(history.best())}", flush=True)
        return
    log_file = sweep.log_file(index)
    print(f"{trial_id(index)} failed (exit {status}): {error_line(log_file)}  [log: {log_file}]",
          flush=True)


def run_trials(sweep: Sweep, devices: list[str], trials, max_parallel: int = 0,
               start: Callable | None = None, wait_step=None, watch=None,
               ended=None) -> dict[int, int]:
    """Run trials on this machine, whoever picks them (a plan, or Optuna): packed onto the GPUs
    (run_packed), each start and end printed as it comes (`ended` replaces report_end), and
    stopped with the sweep. `start` replaces the launch of run.sh (tests)."""
    threads = max(1, (os.cpu_count() or 1) // max(1, len(devices) or sweep.nproc))
    processes: list[subprocess.Popen] = []

    def launch(index: int, block: list[str]) -> subprocess.Popen:
        settings = " ".join(f"{k}={v}" for k, v in sweep.trials[index].items())
        where = f" on GPU {','.join(block)}" if block else ""
        print(f"{trial_id(index)} started: {settings}{where}", flush=True)
        processes.append(start(index, block) if start else
                         start_trial(sweep, index, block, threads))
        return processes[-1]

    with trials_stop_with_the_sweep(processes):
        return run_packed(trials, sweep.nproc, devices, launch, wait_step, max_parallel, watch,
                          ended or functools.partial(report_end, sweep))


def run_local(sweep: Sweep, devices: list[str], max_parallel: int) -> dict[int, int]:
    """The trials of the plan that did not finish, run here."""
    todo = [i for i in range(len(sweep.trials)) if not sweep.finished(i)]
    done = len(sweep.trials) - len(todo)
    print(f"sweep {sweep.folder}: {len(sweep.trials)} trial(s), {done} finished before, "
          f"{len(todo)} to run, {sweep.nproc} process(es) each, "
          f"{'GPUs ' + ','.join(devices) if devices else 'no GPU: one at a time'}", flush=True)
    return run_trials(sweep, devices, todo, max_parallel)


# --- SLURM --------------------------------------------------------------------------------------

# Not submitit: its pickled launch and its own requeue would stand beside slurm.sbatch's (exit
# 75, scontrol requeue) and cluster.sh's environment; each element runs slurm.sbatch instead.
ARRAY_HEAD = """#!/usr/bin/env bash
# Job array of sweep {name}, written by `python sweep.py --slurm` (which resubmits the trials that
# did not finish): slurm.sbatch's #SBATCH lines, then the sweep's; element N runs trial N through
# slurm.sbatch on one node (cluster.sh sets the node up; a preempted element requeues itself).
"""
SBATCH_OPTION = re.compile(r"#SBATCH\s+(--[\w-]+)")


def array_script(sweep: Sweep, indices: list[int], args) -> str:
    """A job array of the trials `indices`: each element one trial on a node of its own."""
    ours = {"--job-name": sweep.folder.name,
            "--array": ",".join(map(str, indices)) + (
                f"%{args.max_parallel}" if args.max_parallel else ""),
            "--nodes": "1", "--gpus-per-node": str(sweep.nproc),
            "--output": f"{sweep.folder}/logs/trial-%a.slurm.out"}
    ours.update({"--time": args.time} if args.time else {})
    ours.update({"--cpus-per-task": str(args.cpus_per_task)} if args.cpus_per_task else {})
    lines = (PROJECT_DIR / "slurm.sbatch").read_text().splitlines()
    kept = [line for line in lines if (option := SBATCH_OPTION.match(line))
            and option[1] not in ours]
    return "\n".join([
        ARRAY_HEAD.format(name=sweep.folder.name).rstrip("\n"), *kept,
        *(f"#SBATCH {option}={value}" for option, value in ours.items()),
        "set -euo pipefail", f"cd {shlex.quote(str(PROJECT_DIR))}",
        'case "$SLURM_ARRAY_TASK_ID" in',
        *(f"  {i}) trial=({shlex.join(sweep.overrides(i))}) ;;" for i in indices),
        '  *) echo "error: no trial $SLURM_ARRAY_TASK_ID in this array" >&2; exit 2 ;;',
        "esac", f"export NPROC_PER_NODE={sweep.nproc}",
        'exec bash ./slurm.sbatch "${trial[@]}"', ""])


def submit_array(sweep: Sweep, args) -> int:
    todo = [i for i in range(len(sweep.trials)) if not sweep.finished(i)]
    if not todo:
        print(f"sweep {sweep.folder}: every trial finished")
        return write_summary(sweep)
    script = sweep.folder / "array.sbatch"
    script.write_text(array_script(sweep, todo, args))
    (sweep.folder / "logs").mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        print(f"wrote {script} (not submitted: --dry-run)")
        return 0
    result = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True,
                            text=True, check=False)
    if result.returncode != 0:
        raise UserError(f"sbatch refused {script}: {result.stderr.strip() or result.stdout}")
    print(f"submitted job array {result.stdout.strip()} ({len(todo)} trial(s)); when it has "
          f"ended, `python sweep.py --summary {sweep.folder}` writes the summary")
    return 0


# --- Optuna ------------------------------------------------------------------------------------

def task_direction(config_file: str, fixed: list[str]) -> str:
    """maximize or minimize: what the task's headline metric wants (the data is built to know
    the task, as training does)."""
    from ddpkit import recipes
    from ddpkit.data import build_splits
    from ddpkit.tasks import build_task

    recipes.load()  # the dataset and task may be yours
    cfg = load_config(trial_argv(config_file, fixed, {}))
    task = build_task(cfg, build_splits(cfg))
    return "maximize" if task.higher_is_better else "minimize"


def _new_epochs(run_dir: Path, seen: int) -> list[dict]:
    """Records of metrics.jsonl after the first `seen` (a line being written is left out)."""
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except OSError:
        return []
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    return [json.loads(line) for line in lines[seen:]]


class OptunaSearch:
    """--optuna: a study that picks each trial when a slot is free (next_trial), hears its
    epochs' headline validation values and prunes it (watch), and is told how it ended (ended).
    The study lives in `storage`: a rerun continues it until `n_trials` have finished or been
    pruned; a trial the last run left unfinished is marked failed and its settings are tried
    again first, as a new trial from step 0."""

    def __init__(self, sweep: Sweep, space: dict, n_trials: int, storage: str, direction: str,
                 seed: int = 0, prune_after: int = 2):
        optuna = _optuna()
        self.sweep, self.space, self.n_trials = sweep, space, n_trials
        self.states = optuna.trial.TrialState
        self.study = optuna.create_study(
            study_name=sweep.folder.name, storage=storage, load_if_exists=True,
            direction=direction, sampler=optuna.samplers.TPESampler(seed=seed),
            pruner=optuna.pruners.MedianPruner(n_startup_trials=prune_after, n_warmup_steps=0))
        for left in self.study.get_trials(deepcopy=False, states=(self.states.RUNNING,)):
            self.study.tell(left.number, state=self.states.FAIL)
            self.study.enqueue_trial(left.params)
        self.counted = len(self.study.get_trials(
            deepcopy=False, states=(self.states.COMPLETE, self.states.PRUNED)))
        self.jobs: dict[int, dict] = {}  # the running trials: {"trial", "seen", "pruning"}
        self.key = None  # the headline metric's key in metrics.jsonl, from a summary.json

    def next_trial(self) -> int | None:
        if self.counted + len(self.jobs) >= self.n_trials:
            return None
        trial = self.study.ask()
        trials = self.sweep.trials
        trials.extend({} for _ in range(trial.number + 1 - len(trials)))
        trials[trial.number] = {k: _suggest(trial, k, spec) for k, spec in self.space.items()}
        self.sweep.save()
        self.jobs[trial.number] = {"trial": trial, "seen": 0, "pruning": False}
        return trial.number

    def watch(self, number: int, process) -> None:
        """Report a running trial's new epochs; SIGTERM it when the pruner says so (it saves a
        checkpoint and leaves, as when preempted)."""
        job, run_dir = self.jobs[number], self.sweep.run_dir(number)
        if self.key is None and (run_dir / report.SUMMARY_FILE).is_file():
            with contextlib.suppress(OSError, json.JSONDecodeError, KeyError):
                summary = json.loads((run_dir / report.SUMMARY_FILE).read_text())
                self.key = "val_" + summary["headline"]
        for record in _new_epochs(run_dir, job["seen"]):
            job["seen"] += 1
            value = record.get(self.key) if self.key else None
            if value is None or job["pruning"]:
                continue
            job["trial"].report(value, step=record["epoch"])
            if job["trial"].should_prune():
                job["pruning"] = True
                print(f"{trial_id(number)} pruned at epoch {record['epoch']} ({self.key} "
                      f"{value:.4g})", flush=True)
                process.send_signal(signal.SIGTERM)

    def ended(self, number: int, status: int) -> None:
        """Tell the study how a trial went; one that could not start stops the search (the
        fix is the user's, and every later trial would fail the same way)."""
        job = self.jobs.pop(number)
        if job["pruning"]:
            self.study.tell(job["trial"], state=self.states.PRUNED)
            self.sweep.pruned.append(number)
            self.sweep.save()
            self.counted += 1
            return
        report_end(self.sweep, number, status)
        if status == 0 and self.sweep.finished(number):
            self.study.tell(job["trial"], report.read_run(self.sweep.run_dir(number)).best())
            self.counted += 1
            return
        self.study.tell(job["trial"], state=self.states.FAIL)
        if not self.sweep.run_dir(number).is_dir():
            raise UserError(f"{trial_id(number)} could not start, so no other will: "
                            f"{error_line(self.sweep.log_file(number))}")

    def print_best(self) -> None:
        if self.study.get_trials(deepcopy=False, states=(self.states.COMPLETE,)):
            best = self.study.best_trial
            print(f"best: {trial_id(best.number)} {self.key or 'value'} {best.value:.4g} "
                  + " ".join(f"{k}={v}" for k, v in best.params.items()), flush=True)


def check_storage(storage: str) -> None:
    """That the study's --storage opens, before the sweep folder exists."""
    try:
        _optuna().storages.RDBStorage(storage)
    except Exception as error:  # sqlalchemy's own errors, or an ImportError for a missing driver
        raise UserError(f"--storage {storage} does not open: "
                        f"{str(error).splitlines()[0].rstrip('.')}: give a database URL, e.g. "
                        "sqlite:///runs/sweeps/study.db") from None


def run_optuna(sweep: Sweep, space: dict, n_trials: int, devices: list[str], storage: str,
               direction: str, seed: int = 0, start=None, wait_step=None,
               prune_after: int = 2) -> None:
    """Ask Optuna for trials and run them as the grid's run (run_trials); see OptunaSearch."""
    search = OptunaSearch(sweep, space, n_trials, storage, direction, seed, prune_after)
    run_trials(sweep, devices, search.next_trial, start=start, wait_step=wait_step,
               watch=search.watch, ended=search.ended)
    search.print_best()


# --- the summary ------------------------------------------------------------------------------

def write_summary(sweep: Sweep) -> int:
    """summary.csv / .md (ranked) and summary.png; returns 0 if every trial finished."""
    rows, runs = [], []
    for index, settings in enumerate(sweep.trials):
        run_dir = sweep.run_dir(index)
        history = report.read_run(run_dir) if run_dir.is_dir() else None
        if history is not None:
            runs.append((settings, history))
        status = "finished" if sweep.finished(index) else "failed"
        if index in sweep.pruned:
            status = "pruned"
        row = {"trial": trial_id(index), **settings, "status": status,
               "metric": f"val_{history.headline}" if history else None,
               "best": history.best() if history else None,
               "last": (history.val_values() or [None])[-1] if history else None}
        if row["status"] == "failed":
            row["error"] = error_line(sweep.log_file(index))
        rows.append(row)
    higher = all(history.higher_is_better for _, history in runs) if runs else True
    rows = report.rank(rows, higher_is_better=higher)
    tables = report.write_table(rows, sweep.folder / "summary")
    png = plot_sweep(sweep, runs, sweep.folder / "summary.png")
    print(report.markdown_table(rows), end="")
    print(f"wrote {', '.join(str(path) for path in [*tables, png])}")
    return 0 if all(row["status"] in ("finished", "pruned") for row in rows) else 1


def _number(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def plot_sweep(sweep: Sweep, runs: list, out: Path) -> Path:
    """The best headline validation value of each trial against each swept setting."""
    plt = report._pyplot()
    keys = list(sweep.trials[0]) if sweep.trials else []
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(4.5 * max(1, len(keys)), 3.8),
                             squeeze=False)
    metric = f"val {runs[0][1].headline}" if runs else "val metric"
    for ax, key in zip(axes[0], keys, strict=False):
        points = [(settings[key], history.best()) for settings, history in runs
                  if history.best() is not None]
        numbers = [_number(value) for value, _ in points]
        if points and all(n is not None for n in numbers):
            ax.scatter(numbers, [best for _, best in points])
            positive = [n for n in numbers if n > 0]
            if len(positive) == len(numbers) and max(numbers) / min(numbers) >= 10:
                ax.set_xscale("log")
        elif points:
            labels = sorted({value for value, _ in points})
            ax.scatter([labels.index(value) for value, _ in points],
                       [best for _, best in points])
            ax.set_xticks(range(len(labels)), labels, rotation=30)
        ax.set(xlabel=key, ylabel=f"best {metric}")
        ax.grid(alpha=0.3)
    fig.suptitle(f"sweep {sweep.folder.name}: {len(runs)} of {len(sweep.trials)} trials")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# --- command line -------------------------------------------------------------------------------

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
        raise UserError("--slurm runs each trial through slurm.sbatch, which this project was "
                        "baked without (scheduler=none): bake it with scheduler=slurm, or drop "
                        "--slurm to run the trials on this machine")


def chosen_devices(args) -> list[str]:
    """--gpus, else the GPUs this process sees."""
    if args.gpus is None:
        return visible_devices()
    devices = [device.strip() for device in args.gpus.split(",") if device.strip()]
    if len(set(devices)) != len(devices):  # two trials would share a GPU
        raise UserError(f"--gpus {args.gpus} names a GPU twice: name each once")
    return devices


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
    return write_summary(sweep)


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
    sweep = open_sweep(args, space, fixed, drawn_from, planned)
    if args.slurm:
        return submit_array(sweep, args)
    run_local(sweep, devices, args.max_parallel)
    return write_summary(sweep)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.summary:
            return write_summary(Sweep.load(args.summary))
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
