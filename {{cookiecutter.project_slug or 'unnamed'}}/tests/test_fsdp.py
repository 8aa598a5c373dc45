"""parallel.strategy=fsdp with real processes (FSDP2 over gloo): it trains like one process,
validates and evaluates by the same exact rules as DDP, and its checkpoints resume at another
process count with the model and optimizer state intact."""

import json
import shutil
import sys

import pytest
from test_distributed import assert_same_numbers, check_equivalence, evaluate_with

from conftest import TINY, only_run_dir, run
from ddpkit.checkpoint_files import list_checkpoints, verified

pytestmark = pytest.mark.slow
FSDP = "parallel.strategy=fsdp"


@pytest.fixture(scope="module")
def equivalence_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("equivalence-fsdp")


# 3 processes (uneven shards of some parameters), accumulation and clipping: the hardest case.
@pytest.mark.parametrize(("nproc", "accum", "clip"), [(3, 2, 0.5)])
def test_fsdp_trains_like_one_process(equivalence_dir, nproc, accum, clip):
    result = check_equivalence(equivalence_dir, "--strategy", "fsdp", "--nproc", str(nproc),
                               "--accum", str(accum), f"optim.grad_clip={clip}")
    assert result.returncode == 0, result.stdout
    assert f"PASS: {nproc} process(es) x {accum} accumulation step(s)" in result.stdout


def test_fsdp_validates_exactly(tmp_path):
    # 3 processes, one sample a batch: the val split's shards (17, 18, 18 samples) differ in
    # their number of batches, and every FSDP forward is a collective. (evaluate.py loads any
    # checkpoint into the bare model: the DDP tests cover it.)
    result = run(["./run.sh", *TINY, FSDP, "eval.batch_size=1", f"run.output_dir={tmp_path}"],
                 NPROC_PER_NODE="3")
    assert result.returncode == 0, result.stdout
    run_dir = only_run_dir(tmp_path)
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    one = evaluate_with(run_dir, tmp_path / "val1", 1, "eval.split=val")["metrics"]
    validated = {key[len("val_"):]: value for key, value in last.items()
                 if key.startswith("val_") and key != "val_seconds"}
    assert_same_numbers(validated, {key: one[key] for key in validated})


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fsdp") / "two"
    result = run(["./run.sh", *TINY, FSDP, "train.epochs=2", f"run.dir={run_dir}"],
                 NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stdout
    return run_dir


@pytest.mark.parametrize("nproc", [3, 1])
def test_fsdp_checkpoint_resumes_at_another_process_count(two_process_run, tmp_path, nproc):
    run_dir = tmp_path / "run"
    shutil.copytree(two_process_run, run_dir, ignore=shutil.ignore_patterns(".lock"))
    launch = ["./run.sh"] if nproc > 1 else [sys.executable]
    probe = run([*launch, "tests/reshard_probe.py", *TINY, FSDP, "train.epochs=2",
                 f"run.dir={run_dir}"], NPROC_PER_NODE=str(nproc))
    assert probe.returncode == 0, probe.stdout
    assert probe.stdout.count("same state: ") == 1, probe.stdout
    saved = len(list_checkpoints(run_dir / "checkpoints"))
    more = run([*launch, "train.py", *TINY, FSDP, "train.epochs=3", f"run.dir={run_dir}"],
               NPROC_PER_NODE=str(nproc))
    assert more.returncode == 0, more.stdout
    assert more.stdout.count(f"world 2 -> {nproc} at step ") == 1
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3
    newest = list_checkpoints(run_dir / "checkpoints")
    assert len(newest) > saved
    assert verified(newest[-1])  # every rank's shards are in its manifest, and match it
