"""The baked project's transformer recipe (docs/recipes/transformer.md: a Hugging Face
transformer on sentences of any length), applied literally to a fresh bake: dict samples padded
per batch by the dataset's collate, keyword inputs, a head at 10x the rate with the no-decay rule
kept (decay_groups), a step schedule, validation every 10 steps and the best checkpoint
exported. Only the user's files change; training runs on 3 processes, evaluation is identical at
1, 2 and 3 processes and equal to scikit-learn's on the saved predictions, and
check_equivalence.py passes."""

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import recipe_blocks, run
from sklearn.metrics import accuracy_score, average_precision_score
from test_recipe import apply, changed_files, two_bakes

pytest.importorskip("transformers")  # the baked project's [transformers] extra
pytestmark = pytest.mark.slow  # the quick tier (-m 'not slow') skips these

RECIPE_FILES = {"data_sources.py", "model.py", "configs/pixel_bert.yaml"}


@pytest.fixture(scope="module")
def applied(tmp_path_factory):
    fresh, project = two_bakes(tmp_path_factory.mktemp("recipe-text"))
    blocks = recipe_blocks(project, "text")
    assert [action for action, _ in blocks] == [
        "append data_sources.py", "append model.py", "create configs/pixel_bert.yaml", "run"]
    outputs: list[str] = []
    for action, body in blocks:
        apply(project, action, body, outputs)  # each run block on 3 processes
    (run_dir,) = (project / "runs").iterdir()
    return fresh, project, run_dir, outputs[0]


def test_the_recipe_touches_only_the_users_files_and_trains_as_it_says(applied):
    fresh, project, run_dir, output = applied
    assert changed_files(fresh, project) == RECIPE_FILES
    lint = run([sys.executable, "-m", "ruff", "check", "."], cwd=project, timeout=120)
    assert lint.returncode == 0, lint.stdout
    assert "3 process(es) on cpu" in output
    # decay_groups: the encoder and the head, each split into weights that decay and biases and
    # norm weights that do not.
    assert re.search(r"optimizer (fused )?AdamW, 4 parameter group\(s\), lr 0\.002, 0\.02, "
                     r"weight decay 0\.01 on \d+ tensors \([\d,]+ params\), none on [1-9]", output)
    flops = [line for line in output.splitlines() if "model FLOPs: " in line]
    assert flops and float(flops[0].split("model FLOPs: ")[1].split()[0]) > 0, output
    assert "PASS: 2 process(es)" in output  # check_equivalence.py
    steps = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    rates = {record["step"]: record["lr"] for record in steps}
    # The step schedule halves the encoder's rate every 40 steps, after the warmup.
    assert [rates[step] for step in (10, 50, 100)] == pytest.approx([0.002, 0.001, 0.0005])
    # Every group's rate is logged under its name: the head's at 10x the encoder's.
    for record in steps:
        assert record["lr/encoder"] == record["lr/encoder.no_decay"] == record["lr"]
        assert record["lr/head"] == record["lr/head.no_decay"] == pytest.approx(10 * record["lr"])


def test_validation_every_10_steps_and_model_pt_from_the_best(applied):
    _, _, run_dir, _ = applied
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    validated = [r["step"] for r in records if "val_accuracy" in r]
    assert {10, 20, 30, 40} <= set(validated), validated
    assert all(r.get("mid_epoch") for r in records if r["step"] % 25)  # 25 steps an epoch
    summary = json.loads((run_dir / "summary.json").read_text())
    # The best: the highest validation accuracy, the first to reach it.
    best_step = max(records, key=lambda r: (r["val_accuracy"], -r["step"]))["step"]
    assert Path(summary["best_checkpoint"]).name == f"step-{best_step:08d}"
    assert (run_dir / "checkpoints" / f"step-{best_step:08d}").is_dir()
    assert summary["exported"] == {"from": "best", "step": best_step, "weights": "trained"}
    assert torch.load(run_dir / "model.pt", weights_only=False)["step"] == best_step


def evaluate(project: Path, run_dir: Path, out: Path, nproc: int) -> dict:
    command = ["./run.sh"] if nproc > 1 else [sys.executable]
    result = run([*command, "evaluate.py", f"eval.checkpoint={run_dir}", f"eval.output_dir={out}",
                  "eval.save_predictions=true", "eval.batch_size=32"], cwd=project,
                 NPROC_PER_NODE=str(nproc))
    assert result.returncode == 0, result.stdout
    return json.loads((out / "metrics.json").read_text())


def test_evaluation_is_identical_at_1_2_and_3_processes_and_equals_scikit_learn(applied,
                                                                                tmp_path):
    _, project, run_dir, _ = applied
    metrics = {n: evaluate(project, run_dir, tmp_path / f"eval{n}", n) for n in (1, 2, 3)}
    for n in (2, 3):
        for key, value in metrics[1].items():
            if key not in ("world_size", "checkpoint") and isinstance(value, float):
                assert metrics[n][key] == pytest.approx(value, rel=1e-9, abs=1e-12), (n, key)
        assert metrics[n]["confusion_matrix"] == metrics[1]["confusion_matrix"]
        np.testing.assert_allclose(metrics[n]["average_precision_per_class"],
                                   metrics[1]["average_precision_per_class"], rtol=1e-9)
    saved = np.load(tmp_path / "eval1" / "predictions.npz")
    labels, scores = saved["targets"], saved["predictions"]
    assert metrics[1]["num_samples"] == len(labels) == 360  # 20% of 1797, each sample once
    assert metrics[1]["accuracy"] == pytest.approx(accuracy_score(labels, scores.argmax(1)),
                                                   abs=1e-12)
    ours = metrics[1]["average_precision_per_class"]
    theirs = [average_precision_score(labels == digit, scores[:, digit]) for digit in range(10)]
    np.testing.assert_allclose(ours, theirs, atol=1e-9)
    assert metrics[1]["average_precision_macro"] == pytest.approx(np.mean(theirs), abs=1e-9)
    assert metrics[1]["accuracy"] > 0.4  # it learned: chance is 0.1
