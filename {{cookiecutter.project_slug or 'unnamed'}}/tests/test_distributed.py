"""Real multi-process runs: torchrun with the gloo backend on CPU, as a user launches them."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import (
    accuracy_score,
    average_precision_score,
    f1_score,
    mean_absolute_error,
    precision_recall_curve,
    precision_score,
    r2_score,
    recall_score,
    roc_auc_score,
    root_mean_squared_error,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import TINY, TINY_SPLIT, fixture, only_run_dir, run, torchrun
from ddpkit.checkpoint_load import read_model

# The probes of tests/probes.py that look at TINY's ranks, in one launch: 3 processes (228 train
# samples: 76 each; uneven eval shards), 2 accumulation steps (where an extra all-reduce would
# hide: each micro-batch's backward; without it, one backward a step, the count is the same one
# per step).
PROBED_WORLD, PROBED_ACCUM = 3, 2


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> Path:
    """The folder the shards, padding-bias and allreduce probes wrote their reports to."""
    out = tmp_path_factory.mktemp("probes")
    result = torchrun(PROBED_WORLD, "tests/probes.py", "shards,padding-bias,allreduce", str(out),
                      *TINY, f"train.grad_accum_steps={PROBED_ACCUM}")
    assert result.returncode == 0, result.stdout
    return out


def test_each_rank_sees_its_own_shard(probed):
    world_size = PROBED_WORLD
    ranks = [json.loads((probed / f"rank{r}.json").read_text()) for r in range(world_size)]

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


def evaluate_with(run_dir, out, nproc: int, *extra: str) -> dict:
    """evaluate.py on the run's last checkpoint with nproc processes; returns its outputs."""
    command = ["./run.sh", "evaluate.py", f"eval.checkpoint={run_dir}", f"eval.output_dir={out}",
               *extra]
    if nproc == 1:
        command = [sys.executable, *command[1:]]
    result = run(command, NPROC_PER_NODE=str(nproc))
    assert result.returncode == 0, result.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == nproc
    curves = out / "curves.json"
    return {"metrics": metrics,
            "curves": json.loads(curves.read_text()) if curves.exists() else None}


def assert_same_numbers(a, b, tol=1e-6):
    """Equal structure, equal ints and strings, floats within tol (relative and absolute)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            if key not in ("world_size", "checkpoint"):
                assert_same_numbers(a[key], b[key], tol)
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_numbers(x, y, tol)
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=tol, abs=tol)
    else:
        assert a == b


@pytest.mark.slow
def agrees_with_scikit_learn(tmp_path, run_dir, runs) -> None:
    """scikit-learn as the oracle, on the one-process predictions; the binned mode close to it."""
    metrics = runs[1]["metrics"]
    saved_predictions = np.load(tmp_path / "eval1" / "predictions.npz")
    probs, labels = saved_predictions["predictions"], saved_predictions["targets"]
    assert probs.shape == (TINY_SPLIT["test"], 4)
    assert metrics["accuracy"] == pytest.approx(accuracy_score(labels, probs.argmax(1)), abs=1e-9)
    for cls in range(4):
        ap = average_precision_score(labels == cls, probs[:, cls])
        assert metrics["average_precision_per_class"][cls] == pytest.approx(ap, abs=1e-6)
        precision, recall, thresholds = precision_recall_curve(labels == cls, probs[:, cls])
        curve = runs[3]["curves"]["pr"][str(cls)]  # the three-process curve, against sklearn's
        np.testing.assert_allclose(curve["precision"], precision, atol=1e-6)
        np.testing.assert_allclose(curve["recall"], recall, atol=1e-6)
        np.testing.assert_allclose(curve["thresholds"], thresholds, atol=1e-6)
    macro = np.mean([average_precision_score(labels == c, probs[:, c]) for c in range(4)])
    assert metrics["average_precision_macro"] == pytest.approx(macro, abs=1e-6)
    # The constant-memory mode: counts exact, curves and AP at 1000 score thresholds.
    binned = evaluate_with(run_dir, tmp_path / "binned", 2, "eval.binned_thresholds=1000")
    assert binned["metrics"]["confusion_matrix"] == metrics["confusion_matrix"]
    assert binned["metrics"]["accuracy"] == metrics["accuracy"]
    assert binned["metrics"]["average_precision_macro"] == pytest.approx(macro, abs=0.02)
    micro = average_precision_score(np.eye(4)[labels].ravel(), probs.ravel())
    assert metrics["average_precision_micro"] == pytest.approx(micro, abs=1e-9)


def test_classification_trains_with_run_sh_and_evaluates_exactly(tmp_path, tiny_args):
    # The periodic checkpoints alone (test_validation.py keeps the best beside them).
    result = run(["./run.sh", *tiny_args, "train.keep_best=false"], NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stdout
    run_dir = only_run_dir(tmp_path / "runs")  # one folder for the job, not one per process
    assert "2 process(es) on cpu, backend gloo" in result.stdout
    assert "effective global batch 12 = 6 per micro-batch x 2 process(es)" in result.stdout

    steps = 3 * TINY_SPLIT["train"] // 12
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    expected = [f"step-{s:08d}" for s in range(20, steps + 1, 20)]
    assert saved == expected + ([f"step-{steps:08d}"] if steps % 20 else [])
    # Every rank wrote its share of the checkpoint (DDP: the tensors every rank holds, dealt out).
    shards = run_dir / "checkpoints" / saved[-1]
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp",
                                                        "__1_0.distcp", "manifest.json",
                                                        "state.pt"]
    assert all(p.stat().st_size > 1000 for p in shards.glob("*.distcp"))
    assert len(list((run_dir / "tb").iterdir())) == 1  # one event file: rank 0's
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".job_id", ".lock", "checkpoints", "config.yaml", "metrics.jsonl", "model.pt",
        "summary.json", "tb", "train_log.jsonl"]
    weights = read_model(shards)
    assert weights and not any(k.startswith(("module.", "_orig_mod.")) for k in weights)
    exported = torch.load(run_dir / "model.pt", weights_only=True)["model"]
    assert all(torch.equal(exported[k], weights[k]) for k in weights)

    # The same checkpoint evaluated by 1 process, then with its test split streamed from 3
    # uneven shards (ddpkit/streams.py) by 1, 2 and 3 processes: the same numbers and curves.
    runs = evaluate_at(tmp_path, run_dir, counts=(1,))
    for n in (1, 2, 3):
        stream = evaluate_with(run_dir, tmp_path / f"stream{n}", n,
                               f"data.dataset={fixture('stream_vectors')}")
        assert_same_numbers(stream["metrics"], runs[1]["metrics"])
        assert_same_numbers(stream["curves"], runs[1]["curves"])
        runs[n if n > 1 else "stream"] = stream
    metrics = runs[1]["metrics"]
    assert metrics["accuracy"] > 0.8

    agrees_with_scikit_learn(tmp_path, run_dir, runs)

    # Outputs a person and TensorBoard can open.
    png = tmp_path / "stream3" / "pr_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    events = EventAccumulator(str(tmp_path / "stream3" / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    tags = events.Tags()
    assert {f"test/pr_curve/class_{c}" for c in range(4)} <= set(tags["tensors"])
    assert "test/accuracy" in tags["scalars"] or "test/accuracy" in tags["tensors"]


def trained_run(tmp_path, dataset: str, nproc: int = 1):
    """A short training run on one of the tests' datasets; returns its folder."""
    command = ([sys.executable, "train.py"] if nproc == 1 else ["./run.sh"])
    result = run([*command, *TINY, f"data.dataset={fixture(dataset)}", "train.epochs=4",
                  f"run.output_dir={tmp_path / 'runs'}"], NPROC_PER_NODE=str(nproc))
    assert result.returncode == 0, result.stdout
    return only_run_dir(tmp_path / "runs")


def evaluate_at(tmp_path, run_dir, counts=(1, 2, 3)) -> dict:
    """The run evaluated by each number of processes in `counts` (1 first): the same numbers."""
    runs = {n: evaluate_with(run_dir, tmp_path / f"eval{n}", n, "eval.save_predictions=true")
            for n in counts}
    for n in counts[1:]:
        assert_same_numbers(runs[n]["metrics"], runs[1]["metrics"])
        assert_same_numbers(runs[n]["curves"], runs[1]["curves"])
    assert runs[1]["metrics"]["num_samples"] == TINY_SPLIT["test"]
    return runs


@pytest.mark.slow
def test_binary_evaluates_exactly(tmp_path):
    run_dir = trained_run(tmp_path, "binary_vectors")
    # 1 and 3 processes (71 test samples: uneven shards); 2 are the classification test's.
    runs = evaluate_at(tmp_path, run_dir, counts=(1, 3))
    metrics, curves = runs[1]["metrics"], runs[3]["curves"]
    saved = np.load(tmp_path / "eval1" / "predictions.npz")
    scores, labels = saved["predictions"], saved["targets"]
    assert scores.shape == (TINY_SPLIT["test"],) and set(labels) == {0, 1}
    assert metrics["average_precision"] == pytest.approx(
        average_precision_score(labels, scores), abs=1e-9)
    assert metrics["roc_auc"] == pytest.approx(roc_auc_score(labels, scores), abs=1e-9)
    precision, recall, thresholds = precision_recall_curve(labels, scores)
    np.testing.assert_allclose(curves["pr"]["precision"], precision, atol=1e-12)
    np.testing.assert_allclose(curves["pr"]["recall"], recall, atol=1e-12)
    # Scores from 3 processes against 1 process's: the same model, but float32 matmuls over
    # other batch compositions round differently (a few 1e-7 relative).
    np.testing.assert_allclose(curves["pr"]["thresholds"], thresholds, rtol=1e-5, atol=1e-12)
    # The decision threshold is the best-F1 one of the val split (as the last epoch's validation
    # found it for the final model), applied to the test split.
    last_epoch = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["threshold"] == pytest.approx(last_epoch["val_threshold"], rel=1e-6)
    predicted = scores >= metrics["threshold"]
    assert metrics["f1"] == pytest.approx(f1_score(labels, predicted), abs=1e-12)
    assert metrics["precision"] == pytest.approx(precision_score(labels, predicted), abs=1e-12)
    assert metrics["recall"] == pytest.approx(recall_score(labels, predicted), abs=1e-12)
    assert metrics["average_precision"] > 0.8  # it learned
    binned = evaluate_with(run_dir, tmp_path / "binned", 3, "eval.binned_thresholds=1000")
    for name in ("average_precision", "roc_auc"):
        assert binned["metrics"][name] == pytest.approx(metrics[name], abs=0.02), name
    png = tmp_path / "eval3" / "pr_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_regression_evaluates_exactly(tmp_path):
    run_dir = trained_run(tmp_path, "regression_vectors")
    metrics = evaluate_at(tmp_path, run_dir, counts=(1, 3))[1]["metrics"]
    saved = np.load(tmp_path / "eval1" / "predictions.npz")
    predictions, targets = saved["predictions"], saved["targets"]
    assert targets.min() > 20  # the data's own units, not the standardised ones
    assert metrics["mae"] == pytest.approx(mean_absolute_error(targets, predictions), rel=1e-9)
    assert metrics["rmse"] == pytest.approx(root_mean_squared_error(targets, predictions),
                                            rel=1e-9)
    assert metrics["r2"] == pytest.approx(r2_score(targets, predictions), rel=1e-9)
    assert metrics["r2"] > 0.5  # it learned
    # Regression metrics are sums: the constant-memory mode gives them exactly.
    binned = evaluate_with(run_dir, tmp_path / "binned", 2, "eval.binned_thresholds=100")
    for name in ("mae", "rmse", "r2", "loss"):
        # (2 processes against 1: float32 forward passes over other batches round apart)
        assert binned["metrics"][name] == pytest.approx(metrics[name], rel=1e-6), name


def test_evaluation_takes_model_and_task_from_the_checkpoint_and_data_from_the_call(tmp_path):
    from fixtures import write_vector_files

    write_vector_files(tmp_path / "data")
    files = [f"data.dataset={fixture('vector_files')}", f"data.root={tmp_path / 'data'}"]
    trained = run([sys.executable, "train.py", *TINY, *files, "train.epochs=1",
                   f"run.output_dir={tmp_path / 'runs'}"])
    assert trained.returncode == 0, trained.stdout
    (tmp_path / "data").rename(tmp_path / "moved")  # the data moved (scratch, another cluster)

    gone = run([sys.executable, "evaluate.py", f"run.output_dir={tmp_path / 'runs'}"])
    assert gone.returncode == 2
    assert gone.stdout.strip().splitlines()[-1] == (
        f"error: data.root={tmp_path / 'data'} holds no labels.txt")
    moved = run([sys.executable, "evaluate.py", f"run.output_dir={tmp_path / 'runs'}",
                 f"data.root={tmp_path / 'moved'}"])  # no eval.checkpoint: the newest run
    assert moved.returncode == 0, moved.stdout
    assert f"evaluating the newest run, {only_run_dir(tmp_path / 'runs')}" in moved.stdout
    metrics = json.loads((only_run_dir(tmp_path / "runs") / "eval-test" / "metrics.json")
                         .read_text())
    assert metrics["num_samples"] == TINY_SPLIT["test"]

    contradicting = run([sys.executable, "evaluate.py", f"run.output_dir={tmp_path / 'runs'}",
                         f"data.root={tmp_path / 'moved'}", "model.hidden_dim=64"])
    assert contradicting.returncode == 2
    assert contradicting.stdout.count("error") == 1
    assert contradicting.stdout.strip().splitlines()[-1:] == [
        "error: model.hidden_dim=64 contradicts the checkpoint "
        f"{next((only_run_dir(tmp_path / 'runs') / 'checkpoints').iterdir())}, which was "
        "trained with model.hidden_dim=32: drop the override (the model and the task come from "
        "the checkpoint)"]
    same = run([sys.executable, "evaluate.py", f"run.output_dir={tmp_path / 'runs'}",
                f"data.root={tmp_path / 'moved'}", "model.hidden_dim=32", "eval.split=val"])
    assert same.returncode == 0, same.stdout  # agreeing with the checkpoint is fine


@pytest.mark.slow
def test_padding_sampler_would_bias_the_metrics(probed):
    report = json.loads((probed / "bias.json").read_text())
    assert report["exact"]["num_samples"] == TINY_SPLIT["test"]  # 71
    assert TINY_SPLIT["test"] % PROBED_WORLD == PROBED_WORLD - 1  # padded with one sample ...
    assert report["padded"]["num_samples"] == TINY_SPLIT["test"] + 1  # ... scored twice
    assert report["padded"]["loss"] != pytest.approx(report["exact"]["loss"], rel=1e-9)
    assert report["padded"]["average_precision_macro"] != report["exact"]["average_precision_macro"]


def test_the_stall_watchdog_ends_before_the_interpreter(tmp_path):
    # A daemon thread in a store call when the interpreter tears down is ended there, in native
    # code that cannot unwind: the rank aborted ("terminate called without an active
    # exception"), at the end of a run that had finished, and torchrun restarted it.
    result = torchrun(2, "tests/probes.py", "watchdog", str(tmp_path), *TINY)
    assert result.returncode == 0, result.stdout
    assert "terminate called" not in result.stdout, result.stdout


@pytest.mark.slow
def test_gradient_allreduce_runs_once_per_optimizer_step(probed):
    report = json.loads((probed / "allreduce.json").read_text())
    assert report["steps"] == TINY_SPLIT["train"] // 12
    assert report["micro_batches"] == PROBED_ACCUM * report["steps"]
    # The tiny model fits in one DDP bucket: one all-reduce per step, whatever accum is.
    assert report["allreduce_calls"] == report["steps"]


@pytest.fixture(scope="module")
def equivalence_dir(tmp_path_factory):
    """One folder for all equivalence checks: candidates of one config share its 1-process run."""
    return tmp_path_factory.mktemp("equivalence")


def check_equivalence(workdir, *args: str):
    return run([sys.executable, "check_equivalence.py", "--steps", "8", "--workdir",
                str(workdir), *args, *TINY])


@pytest.mark.slow
# (2 processes without accumulation: test_experiments.py checks the default config so.)
@pytest.mark.parametrize(("nproc", "accum"), [(2, 2)])
def test_equivalence_check_passes_for_the_default_model(equivalence_dir, nproc, accum):
    result = check_equivalence(equivalence_dir, "--nproc", str(nproc), "--accum", str(accum))
    assert result.returncode == 0, result.stdout
    assert f"PASS: {nproc} process(es) x {accum} accumulation step(s)" in result.stdout


@pytest.mark.slow
def test_equivalence_check_catches_plain_batchnorm(equivalence_dir):
    plain = check_equivalence(equivalence_dir, "model.batchnorm=true")
    assert plain.returncode == 1, plain.stdout
    assert "FAIL: the loss differs from step 1" in plain.stdout
    assert "model.sync_batchnorm=true" in plain.stdout
    synced = check_equivalence(equivalence_dir, "model.batchnorm=true",
                               "model.sync_batchnorm=true")
    assert synced.returncode == 0, synced.stdout


# Runs a script and prints, at its exit, which of the optional packages it imported.
IMPORTS_PROBE = ("import atexit, runpy, sys\n"
                 "atexit.register(lambda: print('IMPORTED', sorted(m for m in ('mlflow', "
                 "'wandb', 'optuna', 'transformers') if m in sys.modules)))\n"
                 "sys.argv = sys.argv[1:]\n"
                 "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def test_single_process_python_train(tmp_path, tiny_args):
    # (Trackers and Optuna are off by default, transformers an extra: neither training nor
    # evaluation imports them.)
    result = run([sys.executable, "-c", IMPORTS_PROBE, "train.py", *tiny_args])
    assert result.returncode == 0, result.stdout
    assert "1 process(es) on cpu, backend none" in result.stdout
    assert "IMPORTED []" in result.stdout
    run_dir = only_run_dir(tmp_path / "runs")
    result = run([sys.executable, "-c", IMPORTS_PROBE, "evaluate.py",
                  f"eval.checkpoint={run_dir}"])
    assert result.returncode == 0 and "IMPORTED []" in result.stdout, result.stdout
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


@pytest.mark.slow
def test_bare_torchrun_reports_a_config_error_once(tiny_args):
    # No run.sh preflight here: the workers themselves agree that rank 0 reports it.
    result = torchrun(2, "train.py", *tiny_args, "optim.lrr=0.1")
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
