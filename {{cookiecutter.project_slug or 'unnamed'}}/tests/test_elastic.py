"""Elastic membership (NNODES=MIN:MAX): two "nodes" on this machine, each its own run.sh and
torchrun, joined by torchrun's c10d rendezvous. One node is killed outright mid-epoch: the other
goes on alone from the last checkpoint; the killed node is started again: the job grows back to
two and finishes. Every training batch read is written down (tests/fixtures.py:RecordedSamples),
so the test sees which samples each epoch saw, and which steps ran twice."""

import json
import signal
from collections import Counter

import pytest
from test_launch import Launch, free_port

from conftest import TINY, fixture, only_run_dir, run
from ddpkit.config import load_config
from ddpkit.schedules import factor_of

pytestmark = pytest.mark.slow

BATCH, EPOCHS, STEPS_PER_EPOCH, TRAIN, LR = 12, 3, 19, 228, 0.01  # TINY's
KILL_AT, CHECKPOINT_BEFORE = 25, 20  # TINY checkpoints every 20 steps


def test_an_elastic_job_shrinks_when_a_node_is_lost_and_grows_when_it_comes_back(tmp_path):
    record = tmp_path / "record"
    record.mkdir()
    args = [*TINY, f"data.dataset={fixture('recorded_vectors')}", "data.num_workers=0",
            f"run.output_dir={tmp_path / 'runs'}"]
    # A node is taken for lost after 1 s x 5 without a heartbeat; once one node is there, the
    # rendezvous waits 2 s for more (torch's defaults: 15 s and 30 s).
    timeouts = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5"
    env = dict(NNODES="1:2", NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), RDZV_ID=f"elastic-{tmp_path.name}",
               ELASTIC_RECORD=str(record), ELASTIC_BATCH=str(BATCH), ELASTIC_HOLD_AFTER="5")
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    # Node a hosts the rendezvous store (is_host), which must outlive b; b connects to it.
    node_a = Launch(tmp_path / "a", args, RDZV_CONF=f"{timeouts},is_host=1", **env)
    env["RDZV_CONF"] = f"{timeouts},is_host=0"
    node_b = Launch(tmp_path / "b", args, ELASTIC_KILL_AT=str(KILL_AT), **env)
    assert node_b.proc.wait(timeout=240) == -signal.SIGKILL  # b killed itself (and its run.sh)
    node_a.read_until(f"world 2 -> 1 at step {CHECKPOINT_BEFORE}")
    node_b = Launch(tmp_path / "b", args, **env)  # b comes back; its run.sh clears what b left
    lines_a, lines_b = node_a.finish(), node_b.finish()
    output = "\n".join(lines_a + lines_b)
    assert node_a.proc.returncode == 0 and node_b.proc.returncode == 0, output

    changes = [line.split("world ")[1].split(":")[0] for line in lines_a + lines_b
               if " world " in line and " at step " in line]
    # a may have started alone (b joining later): then a first 1 -> 2 at an early step.
    assert changes[-2] == f"2 -> 1 at step {CHECKPOINT_BEFORE}", output
    grew_at = int(changes[-1].removeprefix("1 -> 2 at step "))
    assert grew_at > KILL_AT, output
    assert f"stopped by torchrun: saved step {grew_at}" in output  # the grow lost no step
    assert "preempted" not in output

    run_dir = only_run_dir(tmp_path / "runs")  # one run folder throughout
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "done"
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == EPOCHS
    # The log and the learning-rate schedule go on at the right step through both changes.
    logged = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    steps = [record["step"] for record in logged]
    assert steps == sorted(set(steps)) and steps[-1] == EPOCHS * STEPS_PER_EPOCH
    assert {CHECKPOINT_BEFORE, grew_at} <= set(steps)  # windows end at the saves
    schedule = factor_of(load_config(TINY), EPOCHS * STEPS_PER_EPOCH)
    # the rate each logged step trained with
    assert [record["lr"] for record in logged] == [LR * schedule(step - 1) for step in steps]

    reads = [json.loads(line) for path in record.iterdir()
             for line in path.read_text().splitlines()]
    for read in reads:  # each rank's slice of its step, as DistributedSampler deals it
        first = (read["step"] - 1) % STEPS_PER_EPOCH * BATCH
        assert read["places"] == list(range(first + read["rank"], first + BATCH, read["world"]))
    seen = Counter((read["epoch"], place) for read in reads for place in read["places"])
    twice = {read["step"] for read in reads if seen[read["epoch"], read["places"][0]] > 1}
    # Every sample of every epoch once, but for the steps run since the last checkpoint before
    # the node was lost: they ran again after it (README: "When a machine is lost").
    assert set(seen) == {(epoch, place) for epoch in range(EPOCHS) for place in range(TRAIN)}
    assert set(seen.values()) == {1, 2}
    assert set(range(CHECKPOINT_BEFORE + 1, KILL_AT)) <= twice <= set(
        range(CHECKPOINT_BEFORE + 1, KILL_AT + 1))
    steps_at = Counter(read["world"] for read in reads)
    assert steps_at[1] and steps_at[2]


JOB = dict(NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", RDZV_ID="bad-input")


@pytest.mark.parametrize(("env", "expected"), [
    (dict(NNODES="2:1"), "NNODES=2:1 is not valid: the range's minimum 2 is above its maximum 1"),
    (dict(NNODES="1:x"), "NNODES=1:x is not valid: it must be a whole number of machines, at "
                         "least 1, or a range MIN:MAX such as 1:4"),
    (dict(NNODES="1:2", RDZV_CONF="last_call_timeout"), "RDZV_CONF=last_call_timeout is not "
     "valid: give key=value pairs joined by commas, e.g. RDZV_CONF=last_call_timeout=5"),
    (dict(NNODES="1:2", RDZV_CONF="last_call_timeout=abc"), "RDZV_CONF: last_call_timeout=abc "
     "is not valid: last_call_timeout must be a whole number, at least 1"),
    (dict(NNODES="1:2", RDZV_CONF="is_host=maybe"), "RDZV_CONF: is_host=maybe is not valid: "
     "is_host must be true or false"),
    # 12 divides by 6 processes but not by the 5 the job can shrink to
    (dict(NNODES="5:6", MASTER_PORT="1"), "train.global_batch_size=12 does not divide by the 5 "
     "processes (NNODES=5:6: the job can shrink to 5 node(s)): use a multiple of 5, e.g. "
     "train.global_batch_size=10"),
])
def test_a_bad_elastic_launch_is_one_line(env, expected):
    result = run(["./run.sh", *TINY], **JOB, **env)
    assert result.returncode == 2
    assert result.stdout.strip().splitlines() == [f"error: {expected}"]
