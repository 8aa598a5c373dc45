"""What every trial's run.sh would refuse, found before the sweep folder exists and before the
first launch (check_sweep): the GPUs for --nproc, the user's files compiling, and each trial's
command line through the preflight (trial_problem; for a SLURM array the checks that do not ask
this machine), a range standing for its two ends and --random's draws for themselves. A mistake
is one line naming the first trial refused, or every trial when all are refused alike."""

import itertools
import math

from ddpkit.config import UserError, load_config
from ddpkit.extras.sweep.folder import trial_argv
from ddpkit.extras.sweep.local import check_devices, chosen_devices
from ddpkit.preflight import OWN_FILES, Refused, check_compiles, named_files, preflight


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
