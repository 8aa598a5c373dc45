"""The baked project's shard recipe (docs/recipes/shards.md), applied literally to a fresh bake:
jsonl shards of uneven sizes with a counts file, a generator reader and a training transform in
data_sources.py, a config that selects them. Only the user's files change; the recipe's
training runs on 1 process (27 steps an epoch, the last of 9 samples), and its evaluation on 2
processes scores every test sample once."""

import json
import sys

import pytest
from conftest import recipe_blocks, run
from test_recipe import apply, changed_files, two_bakes

pytestmark = pytest.mark.slow  # the quick tier (-m 'not slow') skips these

RECIPE_FILES = {"data_sources.py", "configs/my_shards.yaml"}
COMMANDS = ["./run.sh --config configs/my_shards.yaml data.num_workers=2", "./run.sh evaluate.py"]


@pytest.fixture(scope="module")
def applied(tmp_path_factory):
    fresh, project = two_bakes(tmp_path_factory.mktemp("recipe-shards"))
    blocks = recipe_blocks(project, "shards")
    assert [action for action, _ in blocks] == [
        "run", "append data_sources.py", "create configs/my_shards.yaml", "run"]
    for action, body in blocks[:-1]:
        apply(project, action, body, [])  # the data, the builder, the config
    assert blocks[-1][1].splitlines() == COMMANDS
    # The recipe's training on 1 process, 2 epochs, without loader workers (starting them costs
    # seconds; the engine's own tests stream through workers), then its evaluation as written.
    trained = run([sys.executable, "train.py", "--config", "configs/my_shards.yaml",
                   "train.epochs=2", "train.progress_bar=false"], cwd=project)
    assert trained.returncode == 0, trained.stdout
    evaluated = run(["bash", "-euo", "pipefail", "-c", COMMANDS[1]], cwd=project,
                    NPROC_PER_NODE="2")
    assert evaluated.returncode == 0, evaluated.stdout
    return fresh, project, trained.stdout, evaluated.stdout


def test_shard_recipe_trains_and_evaluates_every_sample_once(applied):
    fresh, project, trained, evaluated = applied
    assert changed_files(fresh, project) == RECIPE_FILES
    lint = run([sys.executable, "-m", "ruff", "check", "."], cwd=project, timeout=120)
    assert lint.returncode == 0, lint.stdout
    counts = json.loads((project / "data/my_shards/train/counts.json").read_text())
    assert len(set(counts.values())) == len(counts) == 5  # uneven shards
    assert sum(counts.values()) == 1257
    assert "27 steps per epoch" in trained  # ceil(1257 / 48): the last step holds 9 samples
    (run_dir,) = (project / "runs").iterdir()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [27, 54]
    assert "evaluating the newest run" in evaluated
    metrics = json.loads((run_dir / "eval-test" / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["num_samples"]) == (2, 270)  # each sample once
    assert metrics["accuracy"] > 0.5  # it learned: chance is 0.1
