"""The sweep folder and its plan, sweep.json: Sweep holds each trial's swept settings, the fixed
overrides, the processes per trial, the config file, the trials Optuna pruned and what the plan
was drawn from, and names each trial's run folder, log file and run.sh command line; open_sweep
creates the folder with its plan, or finds it again for a rerun, which must ask for the same
sweep."""

import json
from dataclasses import dataclass, field
from pathlib import Path

from ddpkit import report, writes
from ddpkit.config import UserError
from ddpkit.extras.sweep.space import plan_trials

PLAN_FILE = "sweep.json"


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
        # Whole or not at all: a stop while writing keeps the old plan.
        writes.write_text(self.folder / PLAN_FILE, json.dumps(plan, indent=1) + "\n")

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
