"""Per-step fault tolerance with torchft (run_replicas.sh): two replica groups of two processes
on this machine, with DDP in each group, and with FSDP (each group shards the model over its two
processes, the groups replicate it: HSDP's layout). One process of group 1 is killed outright
mid-run: group 0 goes on at the next step without it; group 1's torchrun starts it again, it
heals from group 0 and both finish with the same weights, which evaluate to the same numbers at
1, 2 and 3 processes."""

import json
import os
import re
import signal
import subprocess
import time

import pytest
from test_distributed import evaluate_at
from test_launch import free_port, processes_in_group

from conftest import PROJECT, TINY, command_env, needs_extra, only_run_dir, run
from ddpkit.extras.replicas.groups import step_log

pytestmark = pytest.mark.slow
needs_extra("torchft")

GROUPS, LOSE_AT = 2, 30
EPOCHS, STEPS_PER_EPOCH = 5, 19  # TINY's steps at 12 samples a step


def start_replicas(args: list[str], **env: str) -> subprocess.Popen:
    """./run_replicas.sh in a session of its own, its output read by `finish`."""
    return subprocess.Popen(["./run_replicas.sh", *args], cwd=PROJECT, text=True,
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=command_env(**env))


def finish(launch: subprocess.Popen, timeout: float) -> str:
    """The launch's output once it has ended; no process of it may be left."""
    try:
        output, _ = launch.communicate(timeout=timeout)
    finally:
        left = processes_in_group(launch.pid)
        if left:
            os.killpg(launch.pid, signal.SIGKILL)
    assert not left, left
    return output


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_live_groups_go_on_without_a_lost_one_and_heal_it_when_it_comes_back(tmp_path,
                                                                                 strategy):
    args = ["tests/lose_replica_group.py", *TINY, f"train.epochs={EPOCHS}",
            f"parallel.strategy={strategy}", f"run.output_dir={tmp_path / 'runs'}"]
    launch = start_replicas(args, REPLICA_GROUPS=str(GROUPS), NPROC_PER_NODE="2",
                            TMPDIR=str(tmp_path), LIGHTHOUSE_PORT=str(free_port()),
                            RDZV_ID=f"replicas-{tmp_path.name}", LOSE_GROUP="1",
                            LOSE_AT=str(LOSE_AT), SLOW_STEP_S="0.1",
                            LOSE_MARKER=str(tmp_path / "lost"))
    output = finish(launch, timeout=300)
    assert launch.returncode == 0, output
    assert (tmp_path / "lost").read_text() == str(LOSE_AT)  # the failure happened

    run_dir = only_run_dir(tmp_path / "runs")  # one run folder for both groups
    total = EPOCHS * STEPS_PER_EPOCH
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "done"
    survivor, healed = step_log(run_dir, 0), step_log(run_dir, 1)
    steps = [record for record in survivor if "end" not in record]
    # Group 0 ran every step once, in order, each applied; some with group 1 missing.
    assert [record["step"] for record in steps] == list(range(1, total + 1))
    alone = [record["step"] for record in steps if record["groups"] == 1]
    assert alone and alone[0] in (LOSE_AT, LOSE_AT + 1), alone  # at once, or the step after
    assert alone == list(range(alone[0], alone[-1] + 1))  # then it came back for good
    assert alone[-1] < total
    # Group 1's second start healed at the step the live group had reached, and went on from there.
    rejoined = [record["step"] for record in healed if "end" not in record][LOSE_AT - 1:]
    assert rejoined == list(range(alone[-1] + 1, total + 1)), rejoined
    assert f"healed from a live group at step {alone[-1]}" in output
    windows = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert min(window["replica_groups_min"] for window in windows) == 1  # said in the log too
    assert windows[-1]["replica_groups_max"] == GROUPS
    digests = {log[-1]["weights_sha256"] for log in (survivor, healed)}
    assert len(digests) == 1  # the same weights, bit for bit, in both groups

    # The survivor's pauses, for the record (README: "When a machine is lost"): the step in
    # which the group was lost, the steps without it, the step at which it came back.
    around = {record["step"]: record["seconds"] for record in steps
              if alone[0] - 1 <= record["step"] <= alone[-1] + 2}
    print("survivor's step seconds around the loss and the rejoin:", around)
    longest = max(record["seconds"] for record in steps)
    print(f"longest survivor step: {longest:.3f} s")

    if strategy == "ddp":  # (model.pt is the same file whichever strategy trained it)
        evaluate_at(tmp_path, run_dir)  # exact at 1, 2 and 3 processes, as every run's model


def test_preempted_replica_groups_each_save_and_the_same_command_resumes(tmp_path):
    # SIGTERM to run_replicas.sh while both groups hold before step 40: each group stops at the
    # step its ranks agree on, the leading one writes the checkpoint, each run.sh exits 75; the
    # same command with the same RDZV_ID (the line says) resumes from the newest checkpoint, in
    # both groups.
    args = ["tests/lose_replica_group.py", *TINY, f"run.output_dir={tmp_path / 'runs'}"]
    env = dict(REPLICA_GROUPS=str(GROUPS), NPROC_PER_NODE="1", TMPDIR=str(tmp_path),
               LIGHTHOUSE_PORT=str(free_port()), RDZV_ID=f"replicas-{tmp_path.name}")
    launch = start_replicas(args, HOLD_AT="40", **env)
    run_dir = tmp_path / "runs" / f"digits-mlp-{env['RDZV_ID']}"

    def holding(group: int) -> bool:  # its step log has step 39: it holds before step 40
        path = run_dir / "replica_groups" / f"group-{group}.jsonl"
        return path.is_file() and '"step": 39,' in path.read_text()

    deadline = time.monotonic() + 120
    while not all(holding(group) for group in range(GROUPS)):
        if time.monotonic() > deadline or launch.poll() is not None:
            raise AssertionError(f"the groups never held at step 40:\n{finish(launch, 10)}")
        time.sleep(0.05)
    launch.send_signal(signal.SIGTERM)
    output = finish(launch, timeout=120)
    assert launch.returncode == 75, output
    saved = [int(step) for step in re.findall(r"preempted: saved step (\d+) ", output)]
    assert len(saved) == GROUPS and min(saved) >= 40, output
    # The groups' folder is found by the job id alone: each group's line names it.
    assert output.count(f"run the same command again with RDZV_ID={env['RDZV_ID']}\n") == (
        GROUPS), output
    newest = sorted(path.name for path in (run_dir / "checkpoints").iterdir())[-1]
    assert newest == f"step-{max(saved):08d}"

    resumed = run(["./run_replicas.sh", *args], timeout=240, **env)
    assert resumed.returncode == 0, resumed.stdout
    assert resumed.stdout.count(f"resumed from {run_dir}/checkpoints/{newest}:") == GROUPS
    logs = [step_log(run_dir, group) for group in range(GROUPS)]
    steps = sorted({record["step"] for log in logs for record in log if "end" not in record})
    assert steps == list(range(1, 3 * STEPS_PER_EPOCH + 1))  # every step, by one group or both
    assert logs[0][-1]["weights_sha256"] == logs[1][-1]["weights_sha256"]


@pytest.mark.parametrize(("setting", "message"), [
    ("train.checkpoint_async=true", "error: train.checkpoint_async=true does not go with replica "
     "groups (the group that writes a checkpoint may change before the write ends): set "
     "train.checkpoint_async=false"),
    ("tracking.mlflow=true", "error: tracking.mlflow=true does not go with replica groups yet: "
     "set tracking.mlflow=false (train_log.jsonl and TensorBoard have the run; a tracker can read "
     "them afterwards)"),
])
def test_a_setting_replica_groups_cannot_honour_is_one_line(tmp_path, setting, message):
    result = run(["./run_replicas.sh", *TINY, setting, f"run.output_dir={tmp_path / 'runs'}"],
                 timeout=120, REPLICA_GROUPS="1", NPROC_PER_NODE="1", TMPDIR=str(tmp_path),
                 LIGHTHOUSE_PORT=str(free_port()))
    assert result.returncode == 2, result.stdout
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert errors == [message], result.stdout
    assert not any((tmp_path / "runs").glob("*/checkpoints"))


def test_a_replica_group_without_a_lighthouse_is_one_line(tmp_path):
    result = run(["./run.sh", *TINY, f"run.output_dir={tmp_path / 'runs'}"],
                 REPLICA_GROUP="0", REPLICA_GROUPS="2", NPROC_PER_NODE="1")
    assert result.returncode == 2
    assert result.stdout.strip() == ("error: REPLICA_GROUP is set but TORCHFT_LIGHTHOUSE is not: "
                                     "give the lighthouse's address, http://<host>:<port> "
                                     "(run_replicas.sh starts one)")
    assert not (tmp_path / "runs").exists()
