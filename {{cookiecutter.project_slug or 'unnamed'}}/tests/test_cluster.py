"""Cluster life with real processes: preemption signals save the step reached and the same command
resumes, under run.sh and as a Kubernetes TrainJob's pods or SkyPilot's nodes start it; one job
per run folder; a stalled rank is named; a full disk is one line; launch mistakes are one line."""

import json
import os
import random
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_faults import (
    descendants,
    epoch_records,
    final_model,
    finish,
    kill_tree,
    wait_for,
    wait_until,
)
from test_launch import free_port

from conftest import PROJECT, TINY, TRIALS, command_env, only_run_dir, run
from ddpkit.checkpoint_files import list_checkpoints
from ddpkit.checkpoint_load import load_checkpoint, read_model
from ddpkit.config import load_config
from ddpkit.data import DataModule
from ddpkit.dist_utils import DistEnv
from ddpkit.launch_file import TEXT, LaunchFile
from ddpkit.targets import CLUSTER_RUNS, PREEMPTED, kubernetes, skypilot

# 6 epochs, checkpoints only at the end: whatever a preemption saves, it saved on its own.
# A large val split read one sample at a time: about 0.1 s of validation an epoch.
EPOCHS = 6
LONG = [*TINY, f"train.epochs={EPOCHS}", "train.log_every=1", "train.ckpt_every=0",
        "data.val_fraction=0.5", "eval.batch_size=1"]
EPOCH_STEPS = DataModule(load_config(LONG), DistEnv(0, 0, 2, True),
                         torch.device("cpu")).steps_per_epoch


def launch(args: list[str], **env: str) -> subprocess.Popen:
    """./run.sh in a session of its own (its process group: run.sh alone; torchrun and the
    workers get one of their own from run.sh), with SIGINT as a terminal delivers it: a suite
    started in the background inherits SIGINT ignored, which a shell cannot trap."""
    return subprocess.Popen(["./run.sh", *args], cwd=PROJECT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=command_env(NPROC_PER_NODE="2", **env),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def logged(output_dir: Path) -> list[dict]:
    logs = list(output_dir.glob("*/train_log.jsonl")) or list(output_dir.glob("train_log.jsonl"))
    if not logs:
        return []
    return [json.loads(line) for line in logs[0].read_text().splitlines() if line.endswith("}")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("reference")
    result = run(["./run.sh", *LONG, f"run.dir={out}"], NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stdout
    return {"model": final_model(out), "epochs": epoch_records(out)}


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(TRIALS))
def test_sigterm_saves_the_step_reached_and_the_same_command_resumes(tmp_path, reference, trial):
    """SIGTERM to ./run.sh at 2 processes (test_same_command.py has 1 process, and Ctrl-C), then
    the command its last line prints, without a job id: the run continues in its folder."""
    args = [*LONG, f"run.output_dir={tmp_path}"]
    total = EPOCHS * EPOCH_STEPS
    if trial == 0:  # inside the third epoch's validation
        marker = tmp_path.parent / f"{tmp_path.name}-validating"
        args = ["tests/preempt_in_validation.py", *args]
        launcher = launch(args, PREEMPT_VALIDATION="3", PREEMPT_MARKER=str(marker))
        wait_for(marker.exists, launcher, "the third validation")
    else:
        launcher = launch(args)
        stop_after = random.Random(trial).randrange(5, total - 5)
        wait_for(lambda: len(logged(tmp_path)) >= stop_after, launcher, f"step {stop_after}")
    os.killpg(launcher.pid, signal.SIGTERM)  # run.sh's process group, as a scheduler does
    output = finish(launcher)
    assert launcher.returncode == PREEMPTED, output
    assert output.count("preempted: saved step") == 1, output
    run_dir = only_run_dir(tmp_path)
    saved = load_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1])
    assert saved["step"] == logged(tmp_path)[-1]["step"]  # 0 steps lost: it saved the step reached
    if trial == 0:  # the third epoch's steps done, its validation not
        assert saved["step"] == 3 * EPOCH_STEPS and len(epoch_records(run_dir)) == 2
    assert "Traceback" not in output and "restart" not in output.lower(), output
    printed = output.split(f"preempted: saved step {saved['step']} in {run_dir}; to continue from "
                           "there, run the same command again: ")[1].splitlines()[0]
    assert shlex.split(printed) == ["NPROC_PER_NODE=2", "./run.sh", *args]

    again = run(["bash", "-c", printed])  # as a user pastes it
    assert again.returncode == 0, again.stdout
    assert f"resumed from {run_dir}" in again.stdout  # the same folder
    resumed = final_model(run_dir)
    assert all(torch.equal(resumed[k], reference["model"][k]) for k in resumed)
    assert epoch_records(run_dir) == reference["epochs"]
    assert [r["step"] for r in logged(tmp_path)] == list(range(1, total + 1))


def node_environment(system: str, rank: int, port: int) -> dict:
    """What each system sets on the second of two nodes (here: two processes on loopback)."""
    if system == "kubeflow":  # the torch plugin's variables, and RDZV_ID from the manifest
        manifest = LaunchFile(PROJECT, "launch/trainjob.yaml")
        return {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(rank),
                "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port),
                "RDZV_ID": manifest.read(("metadata", "name"), TEXT)}
    return {"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NUM_GPUS_PER_NODE": "1",
            "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1",
            "SKYPILOT_TASK_ID": "sky-managed-2026-12-07-1", "MASTER_PORT": str(port)}


def start_nodes(system: str, command: list[str], tmp_path: Path, attempt: int, **env) -> list:
    """The launcher's command on two "nodes", each a process with its system's variables; their
    output in files (two pipes read one after the other could fill)."""
    port = free_port()
    nodes = []
    for rank in (0, 1):
        with open(tmp_path / f"{system}-{attempt}-{rank}.out", "w") as output:
            nodes.append(subprocess.Popen(
                command, cwd=PROJECT, stdout=output, stderr=subprocess.STDOUT, text=True,
                start_new_session=True,
                env=command_env(**node_environment(system, rank, port), **env)))
    return nodes


def ended(nodes: list, system: str, tmp_path: Path, attempt: int) -> tuple[list, str]:
    for node in nodes:
        finish(node)
    codes = [node.returncode for node in nodes]
    text = "".join((tmp_path / f"{system}-{attempt}-{rank}.out").read_text() for rank in (0, 1))
    return codes, text


def ours(output: str) -> str:
    """A node's output without torchrun's exit-barrier error: the head node's torchrun may close
    the rendezvous store while another node reads the barrier's last key (pytorch issue 69520);
    the workers had ended and the exit status is unchanged."""
    return "\n".join(line for line in output.splitlines()
                     if "elastic/agent/server/api.py" not in line)


@pytest.mark.slow
@pytest.mark.parametrize("system", ["kubeflow", "skypilot"])
def test_a_cluster_launchers_nodes_save_on_sigterm_and_resume(tmp_path, reference, system):
    """launch/trainjob.yaml's command as two pods (PET_*), launch/sky.yaml's run block as two
    nodes (SKYPILOT_*): SIGTERM to each (as Kubernetes sends it to a pod's first process) saves
    the step reached and exits 75; started again, the job resumes in the same run folder (found
    by the TrainJob's name, the SkyPilot task id) with no step lost."""
    target = kubernetes(PROJECT) if system == "kubeflow" else skypilot(PROJECT)
    runs = tmp_path / "volume"
    command = [word.replace(f"={CLUSTER_RUNS}", f"={runs}") for word in target.command]
    assert f"run.output_dir={runs}" in command  # the launcher's own command, its volume moved
    # Stopped inside the second validation, however fast this machine is.
    marker = tmp_path / "validating"
    script = command.index(system) + 1  # run.sh's first argument: the script, before overrides
    nodes = start_nodes(system, [*command[:script], "tests/preempt_in_validation.py",
                                 *command[script:], *LONG], tmp_path, 0,
                        PREEMPT_VALIDATION="2", PREEMPT_MARKER=str(marker))
    wait_for(marker.exists, nodes[0], "the second validation")
    for node in nodes:
        node.send_signal(signal.SIGTERM)
    codes, output = ended(nodes, system, tmp_path, 0)
    # Every node exits 75: each system sees a preempted pod or node, not a finished one.
    assert codes == [PREEMPTED, PREEMPTED], output
    assert output.count("preempted: saved step") == 1 and "Traceback" not in ours(output), output
    run_dir = only_run_dir(runs)
    saved = load_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1])
    assert saved["step"] == logged(runs)[-1]["step"] == 2 * EPOCH_STEPS  # 0 steps lost

    codes, output = ended(start_nodes(system, [*command, *LONG], tmp_path, 1), system, tmp_path, 1)
    assert codes == [0, 0], output
    assert f"resumed from {run_dir}" in output
    resumed = final_model(run_dir)
    assert all(torch.equal(resumed[k], reference["model"][k]) for k in resumed)
    assert [r["step"] for r in logged(runs)] == list(range(1, EPOCHS * EPOCH_STEPS + 1))


@pytest.mark.slow
def test_a_second_job_on_the_same_run_folder_is_refused(tmp_path):
    args = [*TINY, "train.epochs=3", "train.ckpt_every=10"]
    solo = run(["./run.sh", *args, f"run.dir={tmp_path / 'solo'}"], NPROC_PER_NODE="2")
    assert solo.returncode == 0, solo.stdout
    first = launch([*args, f"run.dir={tmp_path / 'shared'}"])
    wait_for(lambda: len(logged(tmp_path / "shared")) >= 2, first, "the first job's steps")
    # The first job's workers are paused (not ended) while the second job starts: it is still
    # running, whatever the speed of this machine, and holds the lock.
    workers = [pid for pid in descendants(first.pid) if b"train.py" in
               Path(f"/proc/{pid}/cmdline").read_bytes()]
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    try:
        second = run(["./run.sh", *args, f"run.dir={tmp_path / 'shared'}"], NPROC_PER_NODE="2")
    finally:
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
    holder = json.loads((tmp_path / "shared" / ".lock").read_text())
    output = finish(first)
    assert first.returncode == 0, output
    assert second.returncode == 2, second.stdout
    assert second.stdout.strip().splitlines()[-1].endswith(
        f"error: run folder {tmp_path / 'shared'} is in use by another job (host "
        f"{holder['host']}, pid {holder['pid']}): wait for it to end, or use another run.dir")
    assert second.stdout.count("error") == 1, second.stdout

    def records(path: Path) -> list[dict]:  # timings aside
        return [{k: v for k, v in json.loads(line).items()
                 if k not in ("time", "samples_per_s", "samples_per_s_per_rank",
                              "tflops_per_rank", "mfu") and not k.endswith("_seconds")}
                for line in path.read_text().splitlines()]

    for name in ("train_log.jsonl", "metrics.jsonl"):  # the first job ran as if alone
        assert records(tmp_path / "shared" / name) == records(tmp_path / "solo" / name), name


@pytest.mark.slow
def test_the_lock_of_a_killed_job_is_taken_over(tmp_path):
    args = [*TINY, "train.ckpt_every=5", f"run.dir={tmp_path}"]
    killed = launch(args, MAX_RESTARTS="0")
    wait_for(lambda: list_checkpoints(tmp_path / "checkpoints"), killed, "a checkpoint")
    holder = json.loads((tmp_path / ".lock").read_text())
    everyone = descendants(killed.pid)
    kill_tree(killed)  # SIGKILL: nothing runs to release the lock but the kernel
    killed.wait()
    for pid in everyone:  # gone once reaped: by torchrun, or by init for the orphans
        wait_until(lambda pid=pid: not Path(f"/proc/{pid}").exists(), f"process {pid} to go")
    again = run(["./run.sh", *args], NPROC_PER_NODE="2")
    assert again.returncode == 0, again.stdout
    assert (f"took over run folder {tmp_path} from host {holder['host']}, pid "
            f"{holder['pid']}, which is no longer running") in again.stdout
    assert "resumed from" in again.stdout


@pytest.mark.slow
def test_a_stalled_rank_is_named_with_its_line_and_the_job_ends(tmp_path):
    # The 30 s collective timeout ends the job; finish() fails the test if it has not ended
    # after 150 s (it would hang until rank 1's hour-long sleep ends).
    launcher = launch(["tests/stall_at_step.py", *TINY, "ddp.timeout_minutes=0.5",
                       f"run.output_dir={tmp_path}"], STALL_STEP="20", STALL_RANK="1")
    output = finish(launcher, timeout=150)
    assert launcher.returncode == 1, output
    stalls = [line for line in output.splitlines() if "the job stalled" in line]
    assert len(stalls) == 1, output
    line = next(n for n, text in enumerate(
        (PROJECT / "tests" / "stall_at_step.py").read_text().splitlines(), 1) if "sleep(" in text)
    assert "rank 1 (" in stalls[0] and f"tests/stall_at_step.py:{line} in " in stalls[0], stalls
    assert "restart" not in output.lower() and "Traceback" not in output, output
    leftover = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                if str(tmp_path).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert leftover == []


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MB tmpfs (root only): room for a checkpoint or two of the model below."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_keeps_the_earlier_checkpoints(small_disk):
    # 16-512-512-4: about 270,000 parameters, 3.3 MB a checkpoint with AdamW's state.
    result = run(["./run.sh", *TINY, "model.hidden_dim=512", "train.ckpt_every=5",
                  "train.keep_checkpoints=0", f"run.dir={small_disk / 'run'}"],
                 NPROC_PER_NODE="2")
    assert result.returncode == 2, result.stdout
    errors = [line for line in result.stdout.splitlines() if line.startswith("error")]
    assert len(errors) == 1, result.stdout
    assert "No space left on device" in errors[0] and "MB needed" in errors[0], errors
    assert "resumed from" not in result.stdout  # not retried
    saved = list_checkpoints(small_disk / "run" / "checkpoints")
    assert saved and all(read_model(path) for path in saved)
    assert list((small_disk / "run" / "checkpoints").glob(".*")) == []  # no partial folder


@pytest.mark.slow
def test_a_disk_full_at_the_start_is_one_line_and_leaves_no_lock(small_disk):
    subprocess.run(["dd", "if=/dev/zero", f"of={small_disk / 'filler'}", "bs=64k"],
                   capture_output=True, check=False)  # until the disk is full
    result = run(["./run.sh", *TINY, f"run.dir={small_disk / 'run'}"], NPROC_PER_NODE="2")
    assert result.returncode == 2, result.stdout
    lines = result.stdout.strip().splitlines()
    # (torch 2.9's gloo prints a line per rank on stdout as it connects; 2.13's does not)
    assert [line for line in lines if not line.startswith("[Gloo] Rank ")] == [
        f"error: cannot write {small_disk / 'run' / '.lock'}: No space left on device (0.0 MB "
        f"free in {small_disk / 'run'}); free space there or set run.output_dir / run.dir to a "
        "larger disk, then rerun to resume"]
    assert [path.name for path in small_disk.iterdir()] == ["filler"]


@pytest.mark.slow
def test_a_disk_that_fills_at_the_manifest_says_the_space_there_was(small_disk):
    result = run(["./run.sh", "tests/fill_disk_at_manifest.py", *TINY, "train.ckpt_every=5",
                  "train.keep_checkpoints=0", f"run.dir={small_disk / 'run'}"],
                 NPROC_PER_NODE="2", FILL_AT_STEP="10", FILL_DIR=str(small_disk))
    assert result.returncode == 2, result.stdout
    errors = [line for line in result.stdout.splitlines() if "error" in line]
    folder = small_disk / "run" / "checkpoints"
    assert len(errors) == 1 and errors[0].startswith(
        f"error: cannot write {folder / 'step-00000010'}: No space left on device (0.0 MB free "
        f"in {folder}, about "), result.stdout
    assert [path.name for path in list_checkpoints(folder)] == ["step-00000005"]
    assert read_model(folder / "step-00000005") and list(folder.glob(".*")) == []


@pytest.mark.parametrize(
    ("env", "message"),
    [({"RANK": "1"}, "RANK is set but RANK, LOCAL_RANK and WORLD_SIZE are not all whole numbers"),
     ({"RANK": "0", "WORLD_SIZE": "2"},
      "RANK and WORLD_SIZE are set but MASTER_ADDR and MASTER_PORT not")],
    ids=["rank-alone", "no-master-addr"],
)
def test_a_half_set_distributed_environment_is_one_line(env, message):
    result = subprocess.run([sys.executable, "train.py", *TINY], cwd=PROJECT, text=True,
                            env={**command_env(), **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, timeout=60, check=False)
    assert result.returncode == 2
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.stdout


@pytest.mark.slow
def test_sigint_ends_the_job_with_status_130(tmp_path):
    launcher = launch([*TINY, "train.epochs=50", f"run.output_dir={tmp_path}"])
    wait_for(lambda: len(logged(tmp_path)) >= 3, launcher, "some steps")
    os.killpg(launcher.pid, signal.SIGINT)
    output = finish(launcher)
    assert launcher.returncode == 130, output
