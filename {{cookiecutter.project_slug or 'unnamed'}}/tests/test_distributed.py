"""Real multi-process runs: torchrun with the gloo backend on CPU, as a user launches them."""

import json
import sys

import pytest
import torch

from conftest import TINY, TINY_SPLIT, only_run_dir, run, torchrun


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_rank_sees_its_own_shard(tmp_path, world_size):
    result = torchrun(world_size, "tests/probe_sharding.py", str(tmp_path), *TINY)
    assert result.returncode == 0, result.stdout
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]

    for epoch in range(len(ranks[0]["train"])):
        shards = [set(rank["train"][epoch]) for rank in ranks]
        assert sum(map(len, shards)) == TINY_SPLIT["train"]  # disjoint ...
        assert set().union(*shards) == set(range(TINY_SPLIT["train"]))  # ... and covering
    for rank in ranks:  # set_epoch really reaches the sampler: a new order every epoch
        orders = rank["train"]
        assert all(orders[e] != orders[e + 1] for e in range(len(orders) - 1))

    test_seen = [i for rank in ranks for i in rank["test"]]
    assert TINY_SPLIT["test"] % world_size != 0
    assert sorted(test_seen) == list(range(TINY_SPLIT["test"]))  # each test sample once


def test_run_sh_trains_and_evaluates_with_two_processes(tmp_path, tiny_args):
    result = run(["./run.sh", *tiny_args], NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stdout
    run_dir = only_run_dir(tmp_path / "runs")  # one folder for the job, not one per process
    assert "2 process(es) on cpu, backend gloo" in result.stdout

    steps = 3 * TINY_SPLIT["train"] // 12
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    expected = [f"step-{s:08d}.pt" for s in range(20, steps + 1, 20)]
    assert saved == expected + ([f"step-{steps:08d}.pt"] if steps % 20 else [])
    assert len(list((run_dir / "tb").iterdir())) == 1  # one event file: rank 0's
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3
    assert (run_dir / "config.yaml").is_file()
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "checkpoints", "config.yaml", "metrics.jsonl", "tb"]
    ckpt = torch.load(run_dir / "checkpoints" / saved[-1], weights_only=True)
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in ckpt["model"])

    # The same checkpoint evaluated by 1, 2 and 3 processes: same numbers, every sample once.
    reports = {}
    for nproc in (1, 2, 3):
        out = tmp_path / f"eval{nproc}"
        command = ["./run.sh", "evaluate.py", f"eval.checkpoint={run_dir}",
                   f"eval.output_dir={out}"]
        if nproc == 1:
            command = [sys.executable, "evaluate.py", *command[2:]]
        result = run(command, NPROC_PER_NODE=str(nproc))
        assert result.returncode == 0, result.stdout
        reports[nproc] = json.loads((out / "metrics.json").read_text())
        assert reports[nproc]["world_size"] == nproc
        assert reports[nproc]["num_samples"] == TINY_SPLIT["test"]
    for nproc in (2, 3):
        assert reports[nproc]["accuracy"] == reports[1]["accuracy"]
        assert reports[nproc]["loss"] == pytest.approx(reports[1]["loss"], rel=1e-6)
    assert reports[1]["accuracy"] > 0.8  # it learned: the synthetic classes are separable


def test_single_process_python_train(tmp_path, tiny_args):
    result = run([sys.executable, "train.py", *tiny_args])
    assert result.returncode == 0, result.stdout
    assert "1 process(es) on cpu, backend none" in result.stdout
    run_dir = only_run_dir(tmp_path / "runs")
    result = run([sys.executable, "evaluate.py", f"eval.checkpoint={run_dir}"])
    assert result.returncode == 0, result.stdout
    assert json.loads((run_dir / "eval-test" / "metrics.json").read_text())["accuracy"] > 0.8


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.lrr=0.1", "optim.lrr is not a config key"),
        ("train.epochs=abc", "train.epochs=abc is not valid"),
        ("train.global_batch_size=13", "does not divide by the 2 processes"),
    ],
)
def test_run_sh_rejects_bad_overrides_once(tmp_path, tiny_args, override, message):
    result = run(["./run.sh", *tiny_args, override], NPROC_PER_NODE="2", timeout=60)
    assert result.returncode != 0
    assert result.stdout.count(message) == 1, result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("error: ")
    assert not (tmp_path / "runs").exists()


def test_bare_torchrun_reports_a_config_error_once(tiny_args):
    # No run.sh preflight here: the workers themselves agree that rank 0 reports it.
    result = torchrun(3, "train.py", *tiny_args, "optim.lrr=0.1")
    assert result.returncode != 0
    assert result.stdout.count("optim.lrr is not a config key") == 1, result.stdout


def test_evaluate_rejects_missing_and_corrupt_checkpoints(tmp_path):
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"PK\x03\x04 this is not a whole checkpoint")
    missing = run([sys.executable, "evaluate.py", f"eval.checkpoint={tmp_path / 'nope.pt'}"])
    assert missing.returncode == 2
    assert missing.stdout.strip() == f"error: checkpoint not found: {tmp_path / 'nope.pt'}"
    result = run(["./run.sh", "evaluate.py", f"eval.checkpoint={corrupt}"], NPROC_PER_NODE="2")
    assert result.returncode != 0
    assert result.stdout.count("truncated or not a PyTorch checkpoint") == 1, result.stdout
