"""--optuna: OptunaSearch is a study (in --storage, by default <sweep>/optuna.db) that chooses each
trial when a slot is free, hears every epoch's headline validation value from the trial's
metrics.jsonl and prunes a trial below the median (SIGTERM: it saves a checkpoint and leaves),
and is told how each trial ended; run_optuna runs its trials through the same packing as a
plan's (local.run_trials). task_direction says whether the task's headline metric is maximized
or minimized; check_storage opens --storage before the sweep folder exists."""

import contextlib
import json
import signal
from pathlib import Path

from ddpkit import report
from ddpkit.config import UserError, load_config
from ddpkit.extras.sweep.folder import Sweep, trial_argv, trial_id
from ddpkit.extras.sweep.local import error_line, report_end, run_trials
from ddpkit.extras.sweep.space import import_optuna, suggest


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
        optuna = import_optuna()
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
        trials[trial.number] = {k: suggest(trial, k, spec) for k, spec in self.space.items()}
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
            # Reported at its epoch; a run by steps (token windows) has none: at its step.
            at = ("epoch", record["epoch"]) if "epoch" in record else ("step", record["step"])
            job["trial"].report(value, step=at[1])
            if job["trial"].should_prune():
                job["pruning"] = True
                print(f"{trial_id(number)} pruned at {at[0]} {at[1]} ({self.key} "
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
        import_optuna().storages.RDBStorage(storage)
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
