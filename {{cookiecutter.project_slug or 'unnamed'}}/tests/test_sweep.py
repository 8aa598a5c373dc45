"""Sweeps: the plan, the packing of trials onto GPUs (a scheduler test with pretend devices), the
checks of every trial before the first launch, and a real 4-trial grid of 2-process runs with one
trial that fails in training, rerun, summarised and reported."""

import argparse
import csv
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_evaluate_faults import left_in
from test_faults import descendants, finish, logged_steps, wait_for

from conftest import PROJECT, TINY, command_env, fixture, run
from ddpkit.config import UserError
from ddpkit.extras.sweep.folder import Sweep, open_sweep, trial_id
from ddpkit.extras.sweep.local import LAUNCH_MARK, chosen_devices, run_packed
from ddpkit.extras.sweep.main import build_parser, check_args
from ddpkit.extras.sweep.optuna_search import check_storage, run_optuna
from ddpkit.extras.sweep.space import parse_space, plan_trials
from ddpkit.extras.sweep.summary import write_sweep_summary


class PretendTrial:
    """Runs for three polls, then exits 0; records who ran alongside it and on which GPUs."""

    def __init__(self, index, devices, running, log):
        self.index, self.devices, self.polls, self.running = index, devices, 0, running
        running[index] = devices
        log.append({i: list(d) for i, d in running.items()})

    def poll(self):
        self.polls += 1
        if self.polls < 3:
            return None
        self.running.pop(self.index, None)
        return 0


def pack(trials: int, nproc: int, devices: list[str]):
    running, log = {}, []
    statuses = run_packed(list(range(trials)), nproc, devices,
                                lambda index, block: PretendTrial(index, block, running, log),
                                wait_step=lambda: None)
    return statuses, log


def test_eight_gpus_run_four_two_process_trials_at_once_on_disjoint_gpus():
    statuses, log = pack(10, 2, [str(i) for i in range(8)])
    assert statuses == dict.fromkeys(range(10), 0)
    assert max(len(snapshot) for snapshot in log) == 4
    for snapshot in log:
        used = [gpu for block in snapshot.values() for gpu in block]
        assert len(used) == len(set(used)) and all(len(b) == 2 for b in snapshot.values())
    assert {gpu for snapshot in log for block in snapshot.values() for gpu in block} == {
        str(i) for i in range(8)}


def test_without_gpus_one_trial_runs_at_a_time_and_too_big_a_trial_is_refused():
    statuses, log = pack(3, 2, [])
    assert statuses == {0: 0, 1: 0, 2: 0} and max(len(snapshot) for snapshot in log) == 1
    statuses, log = pack(4, 3, ["0", "1", "2", "3"])  # one 3-GPU trial at a time; 1 GPU idle
    assert max(len(snapshot) for snapshot in log) == 1
    with pytest.raises(UserError, match="needs 4 GPUs and 2 are visible"):
        pack(1, 4, ["0", "1"])


def test_the_plan_grid_random_and_bad_input():
    space, fixed = parse_space(["optim.lr=1e-3,3e-3", "model.hidden_dim=16,32",
                                      "train.epochs=2"], random_search=False)
    assert fixed == ["train.epochs=2"]
    grid = plan_trials(space, seed=3)
    assert len(grid) == 4 and len({tuple(t.values()) for t in grid}) == 4
    assert grid == plan_trials(space, seed=3)  # GridSampler's order: the seed's shuffle
    space, _ = parse_space(["optim.lr=loguniform(1e-4,1e-2)", "model.dropout=0,0.1"],
                                 random_search=True)
    draws = plan_trials(space, random_trials=6, seed=1)
    assert draws == plan_trials(space, random_trials=6, seed=1)  # the seed fixes them
    assert all(1e-4 <= float(t["optim.lr"]) <= 1e-2 for t in draws)
    space, _ = parse_space(["train.epochs=int(1,3)"], random_search=True)
    draws = [t["train.epochs"] for t in plan_trials(space, random_trials=5)]
    assert sorted(draws[:3]) == ["1", "2", "3"] and len(draws) == 5  # distinct while they can be
    for overrides, random_search, message in [
        (["optim.lrr=1,2"], False, "not a config key"),
        (["optim.lr=loguniform(1e-4,1e-2)"], False, "needs --random"),
        (["optim.lr=1e-3"], False, "nothing to sweep"),
        (["optim.lr=1e-3,1e-3"], False, "each value once"),
        (["run.dir=a,b"], False, "set by the sweep"),
        (["train.epochs=int(2.5,2.9)"], True, "train.epochs has no whole number"),
        (["optim.lr=1e-3,2e-3", "optim.lr=3e-3,4e-3"], False,
         "optim.lr is swept twice: give one list of its values"),
        (["optim.milestones=[100,200],[300"], False, r"do not parse: a \] is missing"),
        (["optim.milestones=[100],200]"], False, r"do not parse: a \] closes nothing"),
        (["train.epochs=uniform(1,3)"], True, r"train.epochs takes whole numbers: use int\(1,3\)"),
        (["optim.name=uniform(1,3)"], True, "optim.name is not a number: give it a list"),
    ]:
        with pytest.raises(UserError, match=message):
            parse_space(overrides, random_search)
    # Commas inside brackets or quotes separate no values; a list wins over a fixed value.
    space, fixed = parse_space(["optim.milestones=[100,200],[300]", "run.name='a,b'",
                                      "optim.lr=1e-3,2e-3", "optim.lr=3e-3"], random_search=False)
    assert space == {"optim.milestones": ["[100,200]", "[300]"], "optim.lr": ["1e-3", "2e-3"]}
    assert fixed == ["run.name='a,b'", "optim.lr=3e-3"]


@pytest.mark.slow
def test_a_grid_of_two_process_trials_survives_a_bad_one_reruns_it_alone_and_ranks(tmp_path):
    import matplotlib.image

    # The built-in cnn takes images only: on vectors that one trial passes the checks before
    # launch (the data's shape is known once it is built) and fails as training builds the
    # model. The lists win over TINY's model and data. NNODES=2 is the sweep's environment (or a
    # bake's default), not its trials': each runs on this machine alone.
    vectors, images = fixture("vectors"), fixture("images")
    command = [sys.executable, "sweep.py", "--name", "grid", "--out", str(tmp_path), "--nproc",
               "2", "--gpus", "", *TINY, f"model.name={fixture('mlp')},cnn",
               f"data.dataset={vectors},{images}", "model.channels=8", "train.epochs=1",
               "train.plot_curves=true"]
    first = run(command, timeout=600, NNODES="2")
    assert first.returncode == 1, first.stdout
    folder = tmp_path / "grid"
    # The grid's order is Optuna's GridSampler's, shuffled by --seed: the plan names the bad one.
    plan = json.loads((folder / "sweep.json").read_text())["trials"]
    assert sorted(tuple(t.values()) for t in plan) == [
        ("cnn", images), ("cnn", vectors), (fixture("mlp"), images), (fixture("mlp"), vectors)]
    bad = trial_id(plan.index({"model.name": "cnn", "data.dataset": vectors}))
    good = sorted({trial_id(index) for index in range(4)} - {bad})
    failed = [line for line in first.stdout.splitlines() if " failed (exit" in line]
    assert len(failed) == 1 and failed[0].startswith(
        f"{bad} failed (exit 2): error: model.name=cnn needs images"), failed
    for trial in good:
        assert json.loads((folder / trial / "summary.json").read_text())["status"] == "done"
        assert f"{trial} finished: val_accuracy " in first.stdout, first.stdout
    assert not (folder / bad).exists()  # a launch that failed leaves no run folder

    again = run(command, timeout=600, NNODES="2")
    assert again.returncode == 1 and "3 finished before, 1 to run" in again.stdout, again.stdout
    launches = {path.stem: path.read_text().count(LAUNCH_MARK)
                for path in (folder / "logs").iterdir()}
    assert launches == {**dict.fromkeys(good, 1), bad: 2}

    with open(folder / "summary.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["status"] for row in rows] == ["finished"] * 3 + ["failed"]
    assert rows[3]["trial"] == bad
    best = [float(row["best"]) for row in rows[:3]]
    assert best == sorted(best, reverse=True) and rows[0]["metric"] == "val_accuracy"
    assert "model.name=cnn needs images" in rows[3]["error"]
    assert (folder / "summary.md").read_text().count("| trial-") == 4
    assert matplotlib.image.imread(folder / "summary.png").shape[0] > 100
    trials_are_ordinary_runs(folder, good, rows, tmp_path / "report")


def trials_are_ordinary_runs(folder, good: list[str], rows: list[dict], out) -> None:
    """Each trial of a sweep is an ordinary run: its curves, and report.py over two of them."""
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(folder / good[0] / "curves.png").shape
    assert width > 2 * height  # three panels side by side
    report = run([sys.executable, "report.py", str(folder / good[0]), str(folder / good[1]),
                  "--out", str(out)])
    assert report.returncode == 0, report.stdout
    assert matplotlib.image.imread(out / "report.png").shape[0] > 100
    ranked = [line.split(",")[0] for line in
              (out / "report.csv").read_text().splitlines()[1:]]
    by_trial = {row["trial"]: float(row["best"]) for row in rows[:3]}
    assert ranked == sorted(good[:2], key=lambda t: -by_trial[t])
    missing = run([sys.executable, "report.py", str(out / "nowhere")])
    assert missing.returncode == 2 and missing.stdout.count("error:") == 1
    # Everything in the sweep folder, as `report.py runs/*` names mlflow.db and the like.
    everything = run([sys.executable, "report.py", *map(str, sorted(folder.iterdir())),
                      "--out", str(out)])
    assert everything.returncode == 0, everything.stdout
    assert everything.stdout.count("skipped (not run folders of train.py): logs, summary.csv, "
                                   "summary.md, summary.png, sweep.json") == 1, everything.stdout
    assert everything.stdout.count("| trial-") == 3


def test_bad_numbers_of_trials_and_empty_ranges_are_one_line(tmp_path):
    for args, message in [
        (["--optuna", "-1", "optim.lr=1e-3,3e-3"], "--optuna -1 is not valid"),
        (["--random", "2", "train.epochs=int(2.5,2.9)"], "train.epochs has no whole number"),
    ]:
        result = run([sys.executable, "sweep.py", "--out", str(tmp_path), *args])
        lines = result.stdout.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stdout
        assert lines[0].startswith("error: ") and message in lines[0], lines
    assert list(tmp_path.iterdir()) == []  # no sweep folder


def refusal(tmp_path, *args: str, **env: str) -> str:
    """The one line of a sweep.py that refuses before its first trial: exit 2, no traceback,
    no sweep folder (nor --out)."""
    out = tmp_path / "sweeps"
    result = run([sys.executable, "sweep.py", "--out", str(out), "--gpus", "", *args],
                 timeout=120, **env)
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stdout
    assert not out.exists(), sorted(out.rglob("*"))
    return lines[0]


def test_a_sweep_with_a_trial_that_would_be_refused_starts_none(tmp_path):
    # 64 (the default global batch) does not divide by 3 processes, in any trial: the line
    # says so once, about every trial.
    assert refusal(tmp_path, "--nproc", "3", "optim.lr=1e-3,2e-3") == (
        "error: every trial: train.global_batch_size=64 does not divide by the 3 processes: use "
        "a multiple of 3, e.g. train.global_batch_size=63")
    # One trial of four: its settings are named (the other three would have run).
    assert refusal(tmp_path, "--nproc", "2", *TINY, "train.max_steps=1",
                   "train.global_batch_size=12,16", "train.grad_accum_steps=1,3") == (
        "error: trial train.global_batch_size=16 train.grad_accum_steps=3: "
        "train.global_batch_size=16 does not divide by the 2 processes x 3 accumulation steps: "
        "use a multiple of 6, e.g. train.global_batch_size=12")
    # Optuna draws its trials later: a range is checked at its ends, here 1 (dropout is < 1).
    assert refusal(tmp_path, "--optuna", "2", *TINY, "train.max_steps=1",
                   "model.dropout=uniform(0,1)", "optim.lr=1e-3,2e-3") == (
        "error: trial model.dropout=1 optim.lr=1e-3: model.dropout=1.0 is not valid: it must be "
        "at least 0 and below 1")
    # --random's draws are checked too: 13, inside int(12,14), does not divide by 2.
    assert refusal(tmp_path, "--random", "4", "--nproc", "2", *TINY, "train.max_steps=1",
                   "train.global_batch_size=int(12,14)") == (
        "error: trial train.global_batch_size=13: train.global_batch_size=13 does not divide by "
        "the 2 processes: use a multiple of 2, e.g. train.global_batch_size=12")
    # A file of the user's that does not compile: once, whichever trial names it.
    broken = tmp_path / "broken_model.py"
    broken.write_text("def net(cfg, input_shape, num_outputs:\n")
    line = refusal(tmp_path, f"model.name={broken}:net", "optim.lr=1e-3,2e-3")
    assert line.startswith(f"error: {broken} line 1: ") and line.endswith(
        ": fix it and run again"), line


def test_a_slurm_array_that_sbatch_cannot_submit_leaves_nothing(tmp_path):
    # sbatch as it fails where no SLURM controller answers.
    (tmp_path / "bin").mkdir()
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.write_text("#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Unable to "
                      "contact slurm controller (connect failure)' >&2\nexit 1\n")
    sbatch.chmod(0o755)
    out = tmp_path / "sweeps"
    result = run([sys.executable, "sweep.py", "--slurm", "--out", str(out), *TINY,
                  "optim.lr=1e-3,2e-3"], timeout=120,
                 PATH=f"{tmp_path / 'bin'}:{command_env()['PATH']}")
    assert result.returncode == 2
    assert result.stdout.strip().splitlines() == [
        "error: sbatch did not submit the job array (sbatch: error: Batch job submission failed: "
        "Unable to contact slurm controller (connect failure)): run the same command again once "
        "sbatch works"]
    assert not out.exists()


def test_bad_sweep_options_are_one_line_before_anything_is_written(monkeypatch):
    def check(*argv: str) -> None:
        check_args(build_parser().parse_args([*argv, "optim.lr=1e-3,2e-3"]))

    for argv, message in [
        (["--seed", "-1"], "--seed -1 is not valid: it must be between 0 and 4294967295"),
        (["--max-parallel", "-1"], "--max-parallel -1 is not valid"),
        (["--time", "12:00:00"], "--time is for a SLURM job array: add --slurm, or drop it"),
        (["--dry-run", "--cpus-per-task", "4"],
         "--dry-run and --cpus-per-task are for a SLURM job array: add --slurm, or drop them"),
        (["--slurm", "--time", "noon"], "--time noon is not valid: give minutes, HH:MM:SS"),
        (["--slurm", "--gpus", "0"], "--gpus picks GPUs of this machine"),
        (["--storage", "sqlite:///x.db"], "--storage is for an Optuna study: add --optuna N"),
    ]:
        with pytest.raises(UserError) as refused:
            check(*argv)
        assert str(refused.value).startswith(message), (argv, str(refused.value))
    monkeypatch.setenv("NPROC_PER_NODE", "two")
    with pytest.raises(UserError, match="NPROC_PER_NODE=two is not valid"):
        check()
    with pytest.raises(UserError, match="--gpus 0,1,0 names a GPU twice"):
        chosen_devices(argparse.Namespace(gpus="0,1,0"))
    with pytest.raises(UserError, match="--storage nowhere does not open: "):
        check_storage("nowhere")


def test_the_plan_is_drawn_once_and_a_rerun_must_ask_for_the_same_sweep(tmp_path):
    def args(seed):
        return argparse.Namespace(out=tmp_path, name="kept", nproc=1, config="", random=3,
                                  seed=seed)

    space, fixed = parse_space(["optim.lr=uniform(0.1,0.2)"], random_search=True)
    drawn_from = {"space": {key: list(spec) for key, spec in space.items()}, "random": 3}
    first = open_sweep(args(0), space, fixed, {**drawn_from, "seed": 0})
    assert len({t["optim.lr"] for t in first.trials}) == 3
    first.trials[0]["optim.lr"] = "0.15"  # what is in sweep.json is run, not a new draw
    first.save()
    again = open_sweep(args(0), space, fixed, {**drawn_from, "seed": 0})
    assert again.trials == first.trials
    with pytest.raises(UserError, match="holds a sweep with other settings"):
        open_sweep(args(1), space, fixed, {**drawn_from, "seed": 1})


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGHUP, signal.SIGTERM])
def test_a_signal_to_the_sweep_stops_its_running_trial_and_waits_for_it(tmp_path, stop):
    temp = tmp_path / "temp"
    temp.mkdir()
    sweeper = subprocess.Popen(
        [sys.executable, "sweep.py", "--name", "stopped", "--out", str(tmp_path), "--nproc", "1",
         "--gpus", "", "optim.lr=0.01,0.02", *TINY, "train.epochs=100"],
        cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env=command_env(TMPDIR=str(temp)))
    trial = tmp_path / "stopped" / "trial-000"
    wait_for(lambda: logged_steps(trial.parent) >= 1, sweeper, "the first trial's first step")
    below = descendants(sweeper.pid)
    sweeper.send_signal(stop)  # to sweep.py alone, as a closed terminal or a scheduler does
    output = finish(sweeper)
    assert sweeper.returncode == 75, output
    assert "sweep stopped: rerun the same command to continue it" in output, output
    assert [pid for pid in below if Path(f"/proc/{pid}").exists()] == []  # no orphan
    assert left_in(temp) == []
    assert json.loads((trial / "summary.json").read_text())["status"] == "preempted"
    assert not (tmp_path / "stopped" / "trial-001").exists()


class PretendRun:
    """A trial that writes one epoch of metrics.jsonl per poll (val_accuracy `value`) and ends
    after `epochs`; SIGTERM makes it leave at the next poll with the preempted status, 75."""

    def __init__(self, run_dir, value, epochs=3):
        self.run_dir, self.value, self.epochs, self.written, self.signals = (
            run_dir, value, epochs, 0, [])
        run_dir.mkdir(parents=True)
        self._summary("running")

    def _summary(self, status):
        (self.run_dir / "summary.json").write_text(json.dumps(
            {"status": status, "headline": "accuracy", "higher_is_better": True}))

    def send_signal(self, signum):
        self.signals.append((signum, self.written))

    def poll(self):
        if self.signals:
            self._summary("preempted")
            return 75
        if self.written == self.epochs:
            self._summary("done")
            return 0
        self.written += 1
        with open(self.run_dir / "metrics.jsonl", "a") as handle:
            handle.write(json.dumps({"epoch": self.written, "step": 10 * self.written,
                                     "val_accuracy": self.value}) + "\n")
        return None


def test_optuna_prunes_a_trial_on_its_validation_metric_and_ranks_the_rest(tmp_path):
    import optuna
    space, fixed = parse_space(["optim.lr=loguniform(1e-4,1e-1)", "model.dropout=0,0.1"],
                                     random_search=True)
    plan = Sweep(tmp_path / "study", [], fixed, nproc=1)
    runs = {}

    def start(index, block):  # trials 0, 1 and 3 reach 0.9; trial 2 only 0.1
        runs[index] = PretendRun(plan.run_dir(index), 0.1 if index == 2 else 0.9)
        return runs[index]

    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    run_optuna(plan, space, 4, [], storage, "maximize", start=start,
                     wait_step=lambda: None)
    study = optuna.load_study(study_name="study", storage=storage)
    states = [trial.state.name for trial in study.trials]
    assert states == ["COMPLETE", "COMPLETE", "PRUNED", "COMPLETE"]
    assert runs[2].signals == [(15, 1)]  # SIGTERM after its first epoch, below the median
    assert plan.pruned == [2] and study.best_value == 0.9
    assert [json.loads(line)["epoch"] for line in
            (plan.run_dir(2) / "metrics.jsonl").read_text().splitlines()] == [1]
    assert all(1e-4 <= float(params["optim.lr"]) <= 1e-1 for params in plan.trials)
    assert write_sweep_summary(plan) == 0
    with open(plan.folder / "summary.csv") as handle:
        statuses = [row["status"] for row in csv.DictReader(handle)]
    assert statuses == ["finished"] * 3 + ["pruned"]
