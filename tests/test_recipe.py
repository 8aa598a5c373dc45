"""The baked README's recipe ("Bring your own data, model and loss"), applied literally to a fresh
bake: a file-backed dataset, a model with BatchNorm and a flag-gated head, the binary task, a loss
term and a logged scalar of the user's own. Only the files the recipe names change; training runs
on 3 processes and evaluation is identical on 1, 2 and 3 (201 test samples: uneven shards), and
equal to scikit-learn's."""

import filecmp
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import apply_edit, recipe_blocks, run
from sklearn.metrics import average_precision_score, precision_recall_curve, roc_auc_score
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.slow  # the quick tier (-m 'not slow') skips these

# The recipe's own files (all of them the user's: none is the template's), and what its
# commands write (data, runs).
RECIPE_FILES = {"data_sources.py", "model.py", "tasks.py", "settings.py", "configs/my_scans.yaml"}


def apply(project: Path, action: str, body: str, outputs: list) -> None:
    if action != "run":
        apply_edit(project, action, body)
        return
    result = run(["bash", "-euo", "pipefail", "-c", body], cwd=project, NPROC_PER_NODE="3")
    assert result.returncode == 0, f"{body}\n{result.stdout}"
    outputs.append(result.stdout)


def changed_files(fresh: Path, edited: Path) -> set[str]:
    names = {str(p.relative_to(edited)) for p in edited.rglob("*") if p.is_file()}
    ignored = ("data/", "runs/", ".ruff_cache", "__pycache__", ".pytest_cache")
    return {name for name in names if not name.startswith(ignored) and "__pycache__" not in name
            and not ((fresh / name).is_file() and filecmp.cmp(fresh / name, edited / name,
                                                              shallow=False))}


def two_bakes(root: Path) -> tuple[Path, Path]:
    """Two bakes of the default project under `root`: one left fresh, one for a recipe to edit."""
    from conftest import TEMPLATE
    from cookiecutter.main import cookiecutter

    fresh = Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(root / "fresh")))
    return fresh, Path(cookiecutter(str(TEMPLATE), no_input=True, output_dir=str(root / "edited")))


def evaluate(project: Path, run_dir: Path, out: Path, nproc: int) -> dict:
    command = ["./run.sh"] if nproc > 1 else [sys.executable]
    result = run([*command, "evaluate.py", f"eval.checkpoint={run_dir}", f"eval.output_dir={out}",
                  "eval.save_predictions=true"], cwd=project, NPROC_PER_NODE=str(nproc))
    assert result.returncode == 0, result.stdout
    return {"metrics": json.loads((out / "metrics.json").read_text()),
            "curves": json.loads((out / "curves.json").read_text())}


@pytest.fixture(scope="module")
def applied(tmp_path_factory):
    fresh, project = two_bakes(tmp_path_factory.mktemp("recipe"))
    blocks = recipe_blocks(project)
    assert len(blocks) >= 8, blocks
    outputs: list[str] = []
    for action, body in blocks:
        apply(project, action, body, outputs)
    return fresh, project, outputs


def test_recipe_touches_only_the_files_it_names(applied):
    fresh, project, outputs = applied
    assert changed_files(fresh, project) == RECIPE_FILES
    lint = run([sys.executable, "-m", "ruff", "check", "."], cwd=project, timeout=120)
    assert lint.returncode == 0, lint.stdout
    assert "3 process(es) on cpu" in outputs[1]  # ./run.sh --config configs/my_scans.yaml
    assert "evaluating the newest run" in outputs[1]  # ./run.sh evaluate.py without a checkpoint
    assert "PASS: 2 process(es)" in outputs[1]  # check_equivalence.py with the recipe's flags


def test_recipe_model_evaluates_exactly_at_1_2_and_3_processes(applied, tmp_path):
    _, project, _ = applied
    run_dir = min((project / "runs").iterdir())  # the first run: the built-in binary task
    runs = {n: evaluate(project, run_dir, tmp_path / f"eval{n}", n) for n in (1, 2, 3)}
    for n in (2, 3):
        for key, value in runs[1]["metrics"].items():
            if key not in ("world_size", "checkpoint") and isinstance(value, float):
                assert runs[n]["metrics"][key] == pytest.approx(value, rel=1e-9, abs=1e-12), (
                    n, key)
        assert runs[n]["metrics"]["confusion"] == runs[1]["metrics"]["confusion"]
    saved = np.load(tmp_path / "eval1" / "predictions.npz")
    labels, scores = saved["targets"], saved["predictions"]
    metrics = runs[1]["metrics"]
    assert metrics["num_samples"] == len(labels) == 201  # 20% of 1001, each sample once
    assert metrics["average_precision"] == pytest.approx(average_precision_score(labels, scores),
                                                         abs=1e-12)
    assert metrics["roc_auc"] == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    precision, recall, thresholds = precision_recall_curve(labels, scores)
    # curves.json keeps at most eval.curve_points points of a curve: every point it keeps is a
    # point of scikit-learn's curve (found by its threshold), the ends included.
    curve = runs[1]["curves"]["pr"]
    at = np.searchsorted(thresholds, curve["thresholds"])
    np.testing.assert_array_equal(thresholds[at], curve["thresholds"])
    np.testing.assert_allclose(curve["precision"][:-1], precision[at], atol=1e-12)
    np.testing.assert_allclose(curve["recall"][:-1], recall[at], atol=1e-12)
    assert at[0] == 0 and (curve["precision"][-1], curve["recall"][-1]) == (1.0, 0.0)
    assert 2 < len(curve["precision"]) <= 200 < len(precision)
    # The same points from 2 and 3 processes.
    for n in (2, 3):
        np.testing.assert_allclose(runs[n]["curves"]["pr"]["precision"], curve["precision"],
                                   atol=1e-12)
    assert metrics["average_precision"] > 0.5  # it learned (positives are about 20%)


def test_recipe_loss_term_and_scalar_reach_every_log(applied):
    _, project, _ = applied
    aux_run = max((project / "runs").iterdir())  # the last run: task binary_aux
    steps = [json.loads(line) for line in (aux_run / "train_log.jsonl").read_text().splitlines()]
    epochs = [json.loads(line) for line in (aux_run / "metrics.jsonl").read_text().splitlines()]
    for name in ("loss_bce", "loss_aux", "mean_probability"):
        assert all(name in record for record in steps), name
        assert all(f"train_{name}" in record for record in epochs), name
    first = steps[0]
    assert first["loss"] == pytest.approx(first["loss_bce"] + first["loss_aux"], rel=1e-6)
    assert all(f"val_{name}" in epochs[-1] for name in ("loss_aux", "average_precision"))
    events = EventAccumulator(str(aux_run / "tb"))
    events.Reload()
    assert {"train/loss_aux", "train/loss_bce", "train/mean_probability"} <= set(
        events.Tags()["scalars"])


def test_equivalence_without_find_unused_parameters_is_one_line(applied, tmp_path):
    _, project, _ = applied
    result = run([sys.executable, "check_equivalence.py", "--config", "configs/my_scans.yaml",
                  "ddp.find_unused_parameters=false", "--workdir", str(tmp_path)], cwd=project)
    assert result.returncode == 2, result.stdout
    errors = [line for line in result.stdout.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "ddp.find_unused_parameters=true" in errors[0], result.stdout
    assert "Traceback" not in result.stdout
