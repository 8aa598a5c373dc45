"""Sharded checkpoints with real processes: every rank writes its part (DCP), a kill at any step
or during a save resumes exactly, asynchronous saves write what synchronous ones write, the
one-file export evaluates like the checkpoint, and loading never runs code."""

import json
import pickle
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_distributed import assert_same_numbers, evaluate_with
from test_faults import epoch_records, finish, kill_worker, launch, logged_steps, wait_for

from conftest import TINY, TRIALS, RunsCode, fixture, only_run_dir, run
from ddpkit import checkpoint_load
from ddpkit.checkpoint import reused_staging_buffers
from ddpkit.checkpoint_files import MODEL_FILE, STATE_FILE, list_checkpoints, verified
from ddpkit.checkpoint_load import read_tensors
from ddpkit.config import UserError

FSDP = "parallel.strategy=fsdp"
# 4 epochs of 19 steps, a checkpoint every 5, dropout on: an exact resume needs every part.
KILLED = [*TINY, FSDP, "train.epochs=4", "train.log_every=1", "train.ckpt_every=5"]
TOTAL_STEPS = 4 * 19


def saved_tensors(path: Path) -> dict:
    return {f"{part}.{key}": value for part in ("model", "optimizer")
            for key, value in read_tensors(path, part).items()}


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert different == [], different


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    result = run(["./run.sh", *KILLED, f"run.output_dir={out}"], NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stdout
    return only_run_dir(out)


def final_weights(run_dir: Path) -> dict:
    return torch.load(run_dir / MODEL_FILE, weights_only=True)["model"]


# SIGKILL to one worker at a random step; torchrun restarts the workers, which resume from the
# newest complete checkpoint. Even trials (0, 2, ...) write their checkpoints asynchronously,
# odd ones synchronously (a kill during a synchronous save: the test after this one).
@pytest.mark.slow
@pytest.mark.parametrize("trial", range(TRIALS))
def test_fsdp_killed_at_a_random_step_resumes_bitwise(tmp_path, uninterrupted, trial):
    extra = ["train.checkpoint_async=true"] if trial % 2 == 0 else []
    launcher = launch([*KILLED, *extra, f"run.output_dir={tmp_path}"])
    kill_after = random.Random(trial).randrange(3, TOTAL_STEPS - 3)
    wait_for(lambda: logged_steps(tmp_path) >= kill_after, launcher, f"step {kill_after}")
    kill_worker(launcher, trial % 2)
    output = finish(launcher)
    assert launcher.returncode == 0, output
    assert output.count("resumed from") == 1, output
    run_dir = only_run_dir(tmp_path)
    assert_bitwise_equal(final_weights(run_dir), final_weights(uninterrupted))
    assert_bitwise_equal(saved_tensors(list_checkpoints(run_dir / "checkpoints")[-1]),
                         saved_tensors(list_checkpoints(uninterrupted / "checkpoints")[-1]))
    assert epoch_records(run_dir) == epoch_records(uninterrupted)
    steps = [json.loads(line)["step"] for line in
             (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, TOTAL_STEPS + 1))
    # TensorBoard too: the steps the restarted job logged again replace the killed job's.
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == steps


# DDP at 3 processes: a sum over three ranks depends on the order of its terms, which DDP's
# gradient buckets decide; a resumed process must all-reduce in the layout the uninterrupted
# run had at that step (parallel.settle_gradient_buckets). Dropout, BatchNorm and augmentation
# on; the data streamed from 7 uneven shards by 2 loader workers per rank (ddpkit/streams.py).
DDP3 = [*TINY, "train.epochs=4", "train.log_every=1", "train.ckpt_every=7",
        "train.keep_checkpoints=0", "model.dropout=0.1", "model.batchnorm=true",
        f"data.dataset={fixture('stream_vectors')}", "data.num_workers=2"]


@pytest.fixture(scope="module")
def uninterrupted_at_3(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted-3")
    result = run(["./run.sh", *DDP3, f"run.output_dir={out}"], NPROC_PER_NODE="3")
    assert result.returncode == 0, result.stdout
    return only_run_dir(out)


@pytest.mark.slow
def test_ddp_resumed_from_any_checkpoint_at_3_processes_is_bitwise(tmp_path, uninterrupted_at_3):
    copy = tmp_path / "run"
    shutil.copytree(uninterrupted_at_3, copy)
    for later in list_checkpoints(copy / "checkpoints")[1:]:  # resume from step 7
        shutil.rmtree(later)
    (copy / MODEL_FILE).unlink()
    result = run(["./run.sh", *DDP3, f"run.dir={copy}"], NPROC_PER_NODE="3")
    assert result.returncode == 0, result.stdout
    assert "resumed from" in result.stdout and "step 7," in result.stdout
    assert_bitwise_equal(final_weights(copy), final_weights(uninterrupted_at_3))


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(TRIALS))
def test_ddp_killed_at_a_random_step_and_rank_resumes_bitwise_at_3_processes(
        tmp_path, uninterrupted_at_3, trial):
    launcher = launch([*DDP3, f"run.output_dir={tmp_path}"], nproc=3)
    pick = random.Random(1000 + trial)
    kill_after = pick.randrange(8, TOTAL_STEPS - 3)  # after the first checkpoint
    wait_for(lambda: logged_steps(tmp_path) >= kill_after, launcher, f"step {kill_after}")
    kill_worker(launcher, pick.randrange(3))
    output = finish(launcher)
    assert launcher.returncode == 0, output
    assert output.count("resumed from") == 1, output
    run_dir = only_run_dir(tmp_path)
    assert_bitwise_equal(final_weights(run_dir), final_weights(uninterrupted_at_3))
    assert epoch_records(run_dir) == epoch_records(uninterrupted_at_3)


@pytest.mark.slow
def test_a_kill_during_a_sharded_save_resumes_the_checkpoint_before(tmp_path):
    # A wide model: each rank's shard of a checkpoint is ~50 MB, so the write can be hit.
    args = [*TINY, FSDP, "model.hidden_dim=2048", "model.num_layers=3", "train.ckpt_every=5",
            "train.epochs=1", "train.keep_checkpoints=0", f"run.output_dir={tmp_path}"]
    launcher = launch(args)
    first = wait_for(lambda: next(iter(tmp_path.glob("*/checkpoints/step-00000005")), None),
                     launcher, "the first checkpoint")
    folder = first.parent
    wait_for(lambda: list(folder.glob(".step-00000010.tmp/*.distcp")), launcher,
             "the second checkpoint's shards")
    kill_worker(launcher, 1)
    killed_while_writing = not (folder / "step-00000010").exists()
    output = finish(launcher)
    assert killed_while_writing, "the write finished before the kill: make it bigger"
    assert launcher.returncode == 0, output
    assert output.count("resumed from") == 1, output
    assert "step-00000005: step 5" in output, output
    assert list(folder.glob(".*tmp*")) == []  # the partial folder was cleaned up
    assert [p.name for p in list_checkpoints(folder)] == [
        "step-00000005", "step-00000010", "step-00000015", "step-00000019"]


@pytest.mark.slow
def test_asynchronous_saves_write_what_synchronous_ones_write(tmp_path):
    args = [*TINY, "train.epochs=1", "train.ckpt_every=5", "train.keep_checkpoints=0"]
    for mode in ("false", "true"):
        result = run(["./run.sh", *args, f"train.checkpoint_async={mode}",
                      f"run.dir={tmp_path / mode}"], NPROC_PER_NODE="2")
        assert result.returncode == 0, result.stdout
    sync, background = (list_checkpoints(tmp_path / mode / "checkpoints")
                        for mode in ("false", "true"))
    assert [p.name for p in sync] == [p.name for p in background] and len(sync) == 4
    for a, b in zip(sync, background, strict=True):
        assert verified(a) and verified(b)  # both wrote a manifest that matches
        assert_bitwise_equal(saved_tensors(a), saved_tensors(b))
        small = [torch.load(path / STATE_FILE, weights_only=True) for path in (a, b)]
        assert [s["step"] for s in small] == [int(a.name[5:])] * 2
        assert small[0]["rng"][1]["torch"].equal(small[1]["rng"][1]["torch"])


@pytest.mark.slow
def test_the_one_file_export_evaluates_like_the_sharded_checkpoint(uninterrupted, tmp_path):
    exported = torch.load(uninterrupted / MODEL_FILE, weights_only=True)
    latest = list_checkpoints(uninterrupted / "checkpoints")[-1]
    assert exported["step"] == TOTAL_STEPS and latest.name == f"step-{TOTAL_STEPS:08d}"
    assert_bitwise_equal(exported["model"], read_tensors(latest, "model"))
    again = run([sys.executable, "export.py", str(uninterrupted), str(tmp_path / "again.pt")])
    assert again.returncode == 0, again.stdout
    assert_bitwise_equal(torch.load(tmp_path / "again.pt", weights_only=True)["model"],
                         exported["model"])
    # The same process count and batches, the same weights: the same numbers, to the last bit.
    sharded = evaluate_with(uninterrupted, tmp_path / "sharded", 2)  # the latest checkpoint
    one_file = evaluate_with(uninterrupted / MODEL_FILE, tmp_path / "one-file", 2)
    assert_same_numbers(sharded, one_file, tol=0)


def a_checkpoint(folder: Path, optimizer_extra=None) -> Path:
    """A small checkpoint folder written by DCP on this process alone."""
    state = {"model": {"w": torch.ones(3)},
             "optimizer": {"param_groups": [{"lr": 0.1, "extra": optimizer_extra}]}}
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    torch.save({"step": 1, "epoch": 0, "step_in_epoch": 1}, folder / STATE_FILE)
    return folder


def test_loading_a_sharded_checkpoint_never_runs_code(tmp_path):
    marker = tmp_path / "code-ran"
    good = a_checkpoint(tmp_path / "good")
    assert torch.equal(read_tensors(good)["w"], torch.ones(3))

    evil_values = a_checkpoint(tmp_path / "values", optimizer_extra=RunsCode(marker))
    with pytest.raises(UserError, match=f"refusing to load checkpoint {evil_values}"):
        checkpoint_load.read_sharded(evil_values, {"optimizer": {
            "param_groups": [{"lr": 0.0, "extra": None}]}}, distributed=False)

    evil_metadata = a_checkpoint(tmp_path / "metadata")
    metadata = evil_metadata / ".metadata"
    metadata.write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(UserError, match="Python objects beyond checkpoint metadata"):
        read_tensors(evil_metadata)
    assert not marker.exists()

    metadata.unlink()
    with pytest.raises(UserError, match="not a complete checkpoint folder"):
        read_tensors(evil_metadata)


def test_asynchronous_saves_stage_into_the_same_buffers_each_time():
    stager = reused_staging_buffers()
    if stager is None:
        pytest.skip("this torch has no DefaultStager: async_save stages with fresh copies")
    state = {"weight": torch.randn(64, 8), "opt": {"step": torch.tensor(3.0), "lr": 0.1}}
    first = stager.stage(state)
    state["weight"].add_(1.0)
    second = stager.stage(state)
    assert second["weight"].data_ptr() == first["weight"].data_ptr()  # no new allocation
    assert torch.equal(second["weight"], state["weight"]) and second["opt"]["lr"] == 0.1
    assert second["weight"].data_ptr() != state["weight"].data_ptr()  # a copy, not the original
    stager.close()


def test_a_parameter_that_never_had_a_gradient_resumes_bitwise(tmp_path):
    # The optimizer keeps no state for a head the model never uses, so its checkpoints hold
    # none; a fresh optimizer's state covers every parameter, and the resume must not ask the
    # checkpoint for the missing entries (it once failed, calling the checkpoint damaged).
    args = [sys.executable, "train.py", *TINY, f"model.name={fixture('unused_head')}"]
    whole = run([*args, f"run.dir={tmp_path / 'whole'}"])
    assert whole.returncode == 0, whole.stdout
    first = list_checkpoints(tmp_path / "whole" / "checkpoints")[0]
    assert not any(key.startswith("state.spare_head.") for key in read_tensors(first, "optimizer"))
    resumed = run([*args, f"train.resume={first}", f"run.dir={tmp_path / 'resumed'}"])
    assert resumed.returncode == 0, resumed.stdout
    assert "resumed from" in resumed.stdout, resumed.stdout
    assert f"step {int(first.name[5:])}," in resumed.stdout, resumed.stdout
    assert_bitwise_equal(final_weights(tmp_path / "resumed"), final_weights(tmp_path / "whole"))
