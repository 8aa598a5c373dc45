"""Checkpoints that are checked before they are read: each holds a manifest of its files' sizes
and checksums; a damaged one is skipped by resume=auto (one line) and refused when named (one
line, exit 2), a lost manifest or state.pt included; one of an older version, which wrote no
manifest, still loads, with one line; and a checkpoint being read by evaluate.py or export.py is
not pruned under it."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from test_checkpoints import a_checkpoint

from conftest import TINY, run
from ddpkit import checkpoint, checkpoint_files, checkpoint_load, weight_choice
from ddpkit.checkpoint_files import MANIFEST_FILE, list_checkpoints, verified
from ddpkit.config import UserError

# One process, 19 steps, a checkpoint at steps 7, 14 and 19, all kept.
ARGS = [*TINY, "train.epochs=1", "train.ckpt_every=7", "train.keep_checkpoints=0"]


def damage(shard: Path) -> None:
    """8 kB of random bytes written over a shard's own: its size stays the same."""
    with open(shard, "r+b") as handle:
        handle.seek(shard.stat().st_size // 3)
        handle.write(os.urandom(8192))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    result = run([sys.executable, "train.py", *ARGS, f"run.dir={run_dir}"])
    assert result.returncode == 0, result.stdout
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns(".lock"))
    return copy


@pytest.mark.slow
def test_resume_auto_skips_a_damaged_checkpoint_for_the_newest_intact_one(trained, tmp_path):
    run_dir = copy_of(trained, tmp_path)
    damage(run_dir / "checkpoints" / "step-00000019" / "__0_0.distcp")
    result = run(["./run.sh", *ARGS, "train.epochs=2", f"run.dir={run_dir}"],
                 NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stdout
    assert result.stdout.count("step-00000019 is damaged (__0_0.distcp: checksum differs); "
                               "resuming from step-00000014") == 1, result.stdout
    assert f"resumed from {run_dir}/checkpoints/step-00000014: step 14," in result.stdout
    newest = list_checkpoints(run_dir / "checkpoints")[-1]
    assert newest.name == "step-00000038" and verified(newest)


@pytest.mark.slow
def test_a_damaged_checkpoint_named_to_resume_is_one_line_and_exit_2(trained, tmp_path):
    damaged = tmp_path / "step-00000019"
    shutil.copytree(trained / "checkpoints" / damaged.name, damaged)
    damage(damaged / "__0_0.distcp")
    result = run(["./run.sh", *ARGS, f"train.resume={damaged}",
                  f"run.output_dir={tmp_path / 'runs'}"], NPROC_PER_NODE="2")
    assert result.returncode == 2, result.stdout
    errors = [line for line in result.stdout.splitlines() if "error" in line]
    assert errors == [f"error: cannot load checkpoint {damaged}: __0_0.distcp is damaged "
                      "(checksum differs): give an earlier checkpoint of the run, or its run "
                      "folder to use the newest intact one, or copy this one again from where "
                      "it came from"], result.stdout
    assert "Traceback" not in result.stdout
    assert list((tmp_path / "runs").iterdir()) == []  # no run folder left behind


@pytest.mark.slow
def test_a_checkpoint_that_lost_its_manifest_is_skipped_not_trained_on(trained, tmp_path):
    run_dir = copy_of(trained, tmp_path)
    newest = run_dir / "checkpoints" / "step-00000019"
    (newest / MANIFEST_FILE).unlink()
    damage(newest / "__0_0.distcp")
    with open(run_dir / "train_log.jsonl", "a") as log:  # and a line cut short by a kill
        log.write('{"step": 20, "lo')
    result = run([sys.executable, "train.py", *ARGS, "train.epochs=2", f"run.dir={run_dir}"])
    assert result.returncode == 0, result.stdout
    assert result.stdout.count("step-00000019 is damaged (manifest.json: missing); resuming "
                               "from step-00000014") == 1, result.stdout
    assert f"resumed from {run_dir}/checkpoints/step-00000014: step 14," in result.stdout
    assert f"{run_dir}/train_log.jsonl: left out 1 line(s) that are not whole records" in (
        result.stdout)
    steps = [json.loads(line)["step"] for line in (run_dir / "train_log.jsonl").open()]
    assert steps == sorted(steps) and steps[-1] == 38


@pytest.mark.slow
def test_a_checkpoint_without_its_state_file_gives_way_to_the_newest_intact_one(trained,
                                                                               tmp_path):
    run_dir = copy_of(trained, tmp_path)
    newest = run_dir / "checkpoints" / "step-00000019"
    (newest / "state.pt").unlink()
    named = run([sys.executable, "export.py", str(newest), str(tmp_path / "model.pt")])
    assert named.returncode == 2, named.stdout
    assert named.stdout.strip().splitlines() == [
        f"error: cannot load checkpoint {newest}: state.pt is missing: give an earlier "
        "checkpoint of the run, or its run folder to use the newest intact one, or copy this one "
        "again from where it came from"]
    result = run([sys.executable, "train.py", *ARGS, "train.epochs=2", f"run.dir={run_dir}"])
    assert result.returncode == 0, result.stdout
    assert result.stdout.count("step-00000019 is damaged (state.pt: missing); resuming from "
                               "step-00000014") == 1, result.stdout
    assert "deleted" not in result.stdout


def without_format_version(folder: Path) -> None:
    """A checkpoint as an older version wrote it: no manifest, no format_version."""
    (folder / MANIFEST_FILE).unlink()
    state = torch.load(folder / "state.pt", weights_only=True)
    del state["format_version"]
    torch.save(state, folder / "state.pt")


@pytest.mark.slow
def test_a_checkpoint_of_an_older_version_without_manifest_loads_with_one_line(trained, tmp_path):
    run_dir = copy_of(trained, tmp_path)
    for saved in list_checkpoints(run_dir / "checkpoints"):
        without_format_version(saved)
    result = run([sys.executable, "train.py", *ARGS, "train.epochs=2", f"run.dir={run_dir}"])
    assert result.returncode == 0, result.stdout
    assert result.stdout.count("could not be verified") == 1, result.stdout
    assert "step-00000019 has no manifest.json (saved by an older version)" in result.stdout
    assert "resumed from" in result.stdout


@pytest.mark.slow
def test_export_of_a_run_takes_its_newest_intact_checkpoint(trained, tmp_path):
    run_dir = copy_of(trained, tmp_path)
    (run_dir / "checkpoints" / "step-00000019" / "state.pt").write_bytes(b"cut")
    result = run([sys.executable, "export.py", str(run_dir), str(tmp_path / "model.pt")])
    assert result.returncode == 0, result.stdout
    assert ("step-00000019 is damaged (state.pt: 3 bytes, " in result.stdout
            and "reading step-00000014" in result.stdout), result.stdout
    assert torch.load(tmp_path / "model.pt", weights_only=True)["step"] == 14


@pytest.mark.slow
def test_evaluate_of_a_run_takes_its_newest_intact_checkpoint(trained, tmp_path):
    run_dir = copy_of(trained, tmp_path)
    damage(run_dir / "checkpoints" / "step-00000019" / "__0_0.distcp")
    result = run(["./run.sh", "evaluate.py", f"eval.checkpoint={run_dir}",
                  f"eval.output_dir={tmp_path / 'eval'}"], NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stdout
    assert result.stdout.count("step-00000019 is damaged (__0_0.distcp: checksum differs); "
                               "reading step-00000014") == 1, result.stdout
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["step"] == 14 and metrics["checkpoint"].endswith("step-00000014")


def test_verification_names_the_file_that_differs(tmp_path):
    folder = a_checkpoint(tmp_path / "step-00000001")
    checkpoint_files.write_manifest(folder)
    assert set(json.loads((folder / MANIFEST_FILE).read_text())["files"]) == {
        ".metadata", "__0_0.distcp", "state.pt"}
    assert verified(folder)
    shard = folder / "__0_0.distcp"
    good = shard.read_bytes()
    shard.write_bytes(bytes(255 - byte for byte in good))  # same size, other bytes
    with pytest.raises(UserError, match=r"__0_0.distcp is damaged \(checksum differs\)"):
        verified(folder)
    shard.write_bytes(good[:-1])
    with pytest.raises(UserError, match=rf"\({len(good) - 1} bytes, {len(good)} in its manif"):
        verified(folder)
    shard.unlink()
    with pytest.raises(UserError, match=r"__0_0.distcp is missing"):
        verified(folder)
    (folder / MANIFEST_FILE).write_text("{")
    with pytest.raises(UserError, match=r"manifest.json is damaged \(unreadable\)"):
        verified(folder)
    (folder / MANIFEST_FILE).unlink()
    assert not verified(folder)  # no manifest, of a format without one: loads, unverified
    state = torch.load(folder / "state.pt", weights_only=True)
    torch.save({**state, "format_version": checkpoint_files.FORMAT_VERSION}, folder / "state.pt")
    with pytest.raises(UserError, match=r"manifest.json is missing"):
        verified(folder)  # of a format that always has one: it was lost


def a_run(root: Path, *steps: int) -> Path:
    """A run folder with checkpoints of these steps, each with its manifest."""
    for step in steps:
        checkpoint_files.write_manifest(a_checkpoint(root / "checkpoints" / f"step-{step:08d}"))
    return root


class Bare(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))


def test_training_does_not_prune_the_checkpoint_evaluate_is_reading(tmp_path):
    # evaluate.py and export.py read a checkpoint twice (state.pt, then the shards); training
    # that saved and pruned between the two reads made the second fail with KeyError: 'model'.
    run_dir = a_run(tmp_path / "run", 1, 2)
    folder = run_dir / "checkpoints"
    source = checkpoint_files.find_checkpoint(str(run_dir))  # what evaluate.py and export.py choose
    assert source.name == "step-00000002"
    state = checkpoint_load.load_checkpoint(source)
    a_run(run_dir, 3)  # between the two reads, training saves a checkpoint and prunes
    checkpoint.prune_checkpoints(folder, keep=1)
    model = Bare()
    which = weight_choice.choose(source, state, "auto", "eval.weights=auto")  # as they read
    checkpoint_load.load_model_weights(model, source, weight_choice.read(source, state, which))
    assert torch.equal(model.w.detach(), torch.ones(3))
    assert [path.name for path in list_checkpoints(folder)] == ["step-00000002", "step-00000003"]
    checkpoint_files.release(source)  # the reader is done: the next save prunes it
    checkpoint.prune_checkpoints(folder, keep=1)
    assert [path.name for path in list_checkpoints(folder)] == ["step-00000003"]


def test_a_checkpoint_pruned_before_it_is_opened_gives_way_to_the_then_newest(
        tmp_path, monkeypatch):
    run_dir = a_run(tmp_path / "run", 1, 2)
    listed = checkpoint_files.list_checkpoints

    def then_training_saves_and_prunes(folder):
        found = listed(folder)
        if not (folder / "step-00000003").exists():
            a_run(run_dir, 3)
            shutil.rmtree(folder / "step-00000002")
        return found

    monkeypatch.setattr(checkpoint_files, "list_checkpoints", then_training_saves_and_prunes)
    source = checkpoint_files.find_checkpoint(str(run_dir))
    assert source == run_dir / "checkpoints" / "step-00000003"
    assert torch.equal(checkpoint_load.read_model(source)["w"], torch.ones(3))
    checkpoint_files.release(source)


@pytest.mark.slow
def test_a_training_process_prunes_around_a_checkpoint_another_process_reads(trained, tmp_path):
    run_dir = copy_of(trained, tmp_path)
    # This process reads step 19, as evaluate.py does.
    source = checkpoint_files.find_checkpoint(str(run_dir))
    result = run([sys.executable, "train.py", *ARGS, "train.epochs=2", "train.ckpt_every=2",
                  "train.keep_checkpoints=1", f"run.dir={run_dir}"])
    assert result.returncode == 0, result.stdout
    assert [path.name for path in list_checkpoints(run_dir / "checkpoints")] == [
        "step-00000019", "step-00000038"]
    assert verified(source) and checkpoint_load.read_model(source)
    checkpoint_files.release(source)


def test_a_run_without_an_intact_checkpoint_is_one_line(tmp_path):
    run_dir = a_run(tmp_path / "run", 1)
    (run_dir / "checkpoints" / "step-00000001" / "state.pt").write_bytes(b"")
    with pytest.raises(UserError, match=r"no intact checkpoint in .*: step-00000001 is damaged "
                                        r"\(state.pt: 0 bytes, \d+ in its manifest\)"):
        checkpoint_files.find_checkpoint(str(run_dir))
