"""The same command again continues a run, whatever launched it (docs/checkpoints.md: "Which run
the same command continues"): which run it picks; after SIGTERM and after Ctrl-C, at 1 process
(`python train.py`) and at 2 (`./run.sh`; SIGTERM there: test_cluster.py), the command the run's
last line prints continues it in its folder from the saved step, to the weights of an
uninterrupted run; the same command with a setting changed starts a new folder, and its line says
how to continue the old one; a stop inside the run's last validation loses nothing."""

import fcntl
import json
import logging
import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from test_faults import epoch_records, final_model, finish, wait_for

from conftest import PROJECT, TINY, command_env, fixture, only_run_dir, run
from ddpkit.checkpoint_files import list_checkpoints
from ddpkit.checkpoint_load import load_checkpoint
from ddpkit.config import load_config
from ddpkit.run_folder import continued_run, job_id

# TINY's run (3 epochs of 19 steps), a checkpoint every 10 steps, on vectors whose training reads
# hold at a step until a signal comes (fixtures.HeldSamples): the signal comes at step HOLD_AT,
# after the checkpoint of step 20, however fast the machine.
HELD = [*TINY, f"data.dataset={fixture('held_vectors')}", "train.ckpt_every=10"]
HOLD_AT = 25
LAUNCHERS = {1: (["python", "train.py"], {}), 2: (["./run.sh"], {"NPROC_PER_NODE": "2"})}


def launch(command: list[str], **env: str) -> subprocess.Popen:
    """A command in a session of its own, with SIGINT as a terminal delivers it (a suite started
    in the background inherits SIGINT ignored, which a shell cannot trap)."""
    return subprocess.Popen(command, cwd=PROJECT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=command_env(**env),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def stopped_in(output_dir: Path, command: list[str], number: int, wait: str, **env: str
               ) -> str:
    """Run `command` until the file `wait` names appears (the hold's or the validation's marker,
    env[wait]), send `number` to its process group, and return what it printed."""
    marker = output_dir.parent / f"{output_dir.name}-held"
    launcher = launch(command, **{wait: str(marker)}, **env)
    wait_for(marker.exists, launcher, f"the marker {wait}")
    os.killpg(launcher.pid, number)
    output = finish(launcher)
    stopped = {signal.SIGTERM: 75, signal.SIGINT: 130}[number]
    assert launcher.returncode == stopped, output
    assert "Traceback" not in output, output
    return output


def printed_line(pattern: str, output: str) -> re.Match:
    """The one line of `output` that matches `pattern` (its end: the command it prints)."""
    found = [match for line in output.splitlines() if (match := re.search(pattern, line))]
    assert len(found) == 1, output
    return found[0]


def run_printed(command: str) -> subprocess.CompletedProcess:
    """The command a line printed, run as a user pastes it: by the shell, in the project."""
    return run(["bash", "-c", command])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """reference(n): the folder of HELD's uninterrupted run at n processes (each run once)."""
    folders = {}

    def at(nproc: int) -> Path:
        if nproc not in folders:
            folder = tmp_path_factory.mktemp(f"reference-{nproc}")
            command, env = LAUNCHERS[nproc]
            result = run([*command, *HELD, f"run.dir={folder}"], **env)
            assert result.returncode == 0, result.stdout
            folders[nproc] = folder
        return folders[nproc]

    return at


def test_the_newest_unfinished_run_of_these_settings_is_the_one_continued(tmp_path, caplog,
                                                                          monkeypatch):
    args = [*TINY, f"run.output_dir={tmp_path}"]
    cfg = load_config(args)

    def run_folder(time: str, status: str | None, *changed: str) -> Path:
        folder = tmp_path / f"digits-mlp-20261207-{time}"
        folder.mkdir()
        (folder / ".lock").touch()
        if status:  # (None: only the markers of a launch that failed before its run started)
            (folder / "config.yaml").write_text(OmegaConf.to_yaml(load_config([*args, *changed])))
            (folder / "summary.json").write_text(json.dumps({"status": status}))
        return folder

    run_folder("100000", "preempted")
    ours = run_folder("100001", "interrupted", "train.progress_bar=true")  # (how it is shown)
    run_folder("100002", "done")  # finished: never continued
    other = run_folder("100003", "failed", "optim.lr=0.02")
    run_folder("100004", None)
    (tmp_path / "digits-mlp-2-20261207-100005").mkdir()  # another run.name's
    caplog.set_level(logging.INFO, logger="ddp")
    assert continued_run(cfg) == ours
    assert caplog.messages[-1] == (
        f"continuing {ours}, the newest run of digits-mlp with these settings, which did not "
        "finish (interrupted), from step 0 (it saved no checkpoint) (train.resume=never starts "
        "a new run instead)")

    with open(ours / ".lock") as held:  # a job is running in it
        fcntl.flock(held, fcntl.LOCK_EX)
        assert continued_run(cfg) is None
    assert caplog.messages[-1].startswith(f"{ours}, the newest run of digits-mlp with these "
                                          "settings that did not finish, is in use by another job")

    for folder in tmp_path.glob("digits-mlp-20261207-10000[01]"):
        (folder / "summary.json").write_text(json.dumps({"status": "done"}))
    assert continued_run(cfg) is None
    assert caplog.messages[-1].startswith(
        f"{other}, the newest run of digits-mlp that did not finish (failed), was started with "
        "other settings (optim.lr 0.02 -> 0.01): a new run folder. To continue that run instead, "
        "from step 0 (it saved no checkpoint), with these settings where a resume allows them, "
        "run the same command with run.dir=")

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # a bare torchrun's: every job's
    assert job_id() == ""


# SIGTERM to ./run.sh at 2 processes: test_cluster.py (test_sigterm_saves_the_step_reached...).
@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "number"), [(1, signal.SIGTERM), (1, signal.SIGINT),
                                               (2, signal.SIGINT)],
                         ids=["python-sigterm", "python-ctrl-c", "run.sh-ctrl-c"])
def test_the_command_a_stopped_run_prints_continues_it_bitwise(tmp_path, reference, nproc,
                                                               number):
    command, env = LAUNCHERS[nproc]
    args = [*HELD, f"run.output_dir={tmp_path}"]
    output = stopped_in(tmp_path, [*command, *args], number, "HOLD_MARKER",
                        HOLD_AT_STEP=str(HOLD_AT), **env)
    run_dir = only_run_dir(tmp_path)
    if number == signal.SIGTERM:  # the step it stopped at, saved
        line = printed_line(rf"^preempted: saved step (\d+) in {re.escape(str(run_dir))}; to "
                            r"continue from there, run the same command again: (.+)$", output)
        status = "preempted"
    else:  # nothing saved: the periodic checkpoint before the step it stopped at
        line = printed_line(rf"^interrupted \(SIGINT\) at step {HOLD_AT - 1}; the newest "
                            rf"checkpoint of {re.escape(str(run_dir))} is step (20): to continue "
                            r"from there, run the same command again: (.+)$", output)
        status = "interrupted"
    step, printed = int(line[1]), line[2]
    assert shlex.split(printed) == [*(f"{k}={v}" for k, v in env.items()), *command, *args]

    again = run_printed(printed)
    assert again.returncode == 0, again.stdout
    assert (f"continuing {run_dir}, the newest run of digits-mlp with these settings, which "
            f"did not finish ({status}), from its checkpoint of step {step} (train.resume=never "
            "starts a new run instead)") in again.stdout
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{step:08d}'}: step {step}," in (
        again.stdout)
    assert only_run_dir(tmp_path) == run_dir
    resumed, expected = final_model(run_dir), final_model(reference(nproc))
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)
    assert epoch_records(run_dir) == epoch_records(reference(nproc))


@pytest.mark.slow
def test_a_changed_setting_starts_a_new_folder_and_says_how_to_continue_the_old_one(tmp_path):
    args = ["python", "train.py", *HELD, f"run.output_dir={tmp_path}"]
    stopped_in(tmp_path, args, signal.SIGTERM, "HOLD_MARKER", HOLD_AT_STEP=str(HOLD_AT))
    old = only_run_dir(tmp_path)

    changed = run([*args, "optim.lr=0.02"])
    assert changed.returncode == 0, changed.stdout
    assert "resumed from" not in changed.stdout
    line = printed_line(
        rf"{re.escape(str(old))}, the newest run of digits-mlp that did not finish \(preempted\), "
        r"was started with other settings \(optim\.lr 0\.01 -> 0\.02\): a new run folder\. To "
        rf"continue that run instead, from its checkpoint of step {HOLD_AT}, with these settings "
        rf"where a resume allows them, run the same command with run\.dir={re.escape(str(old))} "
        r"added: (.+)$", changed.stdout)
    assert shlex.split(line[1]) == [*args, "optim.lr=0.02", f"run.dir={old}"]
    new = [folder for folder in tmp_path.iterdir() if folder != old]
    assert len(new) == 1 and (new[0] / "model.pt").is_file()

    continued = run_printed(line[1])
    assert continued.returncode == 0, continued.stdout
    assert f"resumed from {old / 'checkpoints' / f'step-{HOLD_AT:08d}'}: step {HOLD_AT}," in (
        continued.stdout)
    assert (f"changed since the checkpoint, in effect from step {HOLD_AT + 1}: optim.lr 0.01 -> "
            "0.02") in continued.stdout
    assert json.loads((old / "summary.json").read_text())["status"] == "done"
    assert sorted(tmp_path.iterdir()) == sorted([old, new[0]])


def summary_without_timings(run_dir: Path) -> dict:
    """summary.json but for its timings (throughput), the best checkpoint named within the run."""
    summary = json.loads((run_dir / "summary.json").read_text())
    del summary["throughput"]
    if summary["best_checkpoint"]:
        summary["best_checkpoint"] = str(Path(summary["best_checkpoint"]).relative_to(run_dir))
    return summary


def final_validation_state(run_dir: Path) -> dict:
    return load_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1])["validation"]


def stopped_in_last_validation(output_dir: Path, command: list[str], validations: int,
                               **env: str) -> tuple[Path, str]:
    """`command` (tests/preempt_in_validation.py) preempted inside its last validation, the
    validation number `validations`: its run folder and the command its line prints."""
    output = stopped_in(output_dir, command, signal.SIGTERM, "PREEMPT_MARKER",
                        PREEMPT_VALIDATION=str(validations), **env)
    run_dir = only_run_dir(output_dir)
    line = printed_line(rf"^preempted: saved step (\d+) in {re.escape(str(run_dir))}; to "
                        r"continue from there, run the same command again: (.+)$", output)
    return run_dir, line[2]


@pytest.mark.slow
def test_a_stop_in_the_last_validation_is_validated_again_by_the_same_command(tmp_path,
                                                                              reference):
    command = ["python", "tests/preempt_in_validation.py", *HELD, f"run.output_dir={tmp_path}"]
    run_dir, printed = stopped_in_last_validation(tmp_path, command, 3)
    uninterrupted = reference(1)
    assert epoch_records(run_dir) == epoch_records(uninterrupted)[:2]  # the third not done

    again = run_printed(printed)
    assert again.returncode == 0, again.stdout
    assert epoch_records(run_dir) == epoch_records(uninterrupted)  # but for *_seconds
    assert summary_without_timings(run_dir) == summary_without_timings(uninterrupted)
    assert final_validation_state(run_dir) == final_validation_state(uninterrupted)
