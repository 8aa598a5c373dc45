"""Your experiments: every configs/*.yaml trains a few steps on 2 processes, evaluates, and trains
like one process (check_equivalence.py). Add a config file and it is tested; nothing here names a
dataset, a model or a task, so it works unchanged for yours.

    pytest tests/test_experiments.py -k my_experiment      # one config (by file name)
"""

import json
import math
import sys

import pytest

from conftest import PROJECT, run
from ddpkit.config import load_config

pytestmark = pytest.mark.slow  # the quick tier (-m 'not slow') skips these

CONFIGS = sorted((PROJECT / "configs").glob("*.yaml"))
SHORT = ["train.max_steps=4", "train.log_every=1", "train.ckpt_every=0",
         "train.progress_bar=false"]


def processes(config) -> int:
    """2 processes, or the fewest above 1 that the config's global batch divides by."""
    batch = load_config(["--config", str(config)]).train.global_batch_size
    return next((n for n in (2, 3, 4, 5, 6, 7, 8) if batch % n == 0), 1)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.stem)
def test_experiment_trains_and_evaluates_on_several_processes(tmp_path, config):
    nproc = str(processes(config))
    run_dir = tmp_path / "run"
    trained = run(["./run.sh", "--config", str(config), *SHORT, f"run.dir={run_dir}"],
                  NPROC_PER_NODE=nproc)
    assert trained.returncode == 0, trained.stdout
    records = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in records)
    epoch = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert any(key.startswith("val_") for key in epoch)  # validation ran and was logged
    evaluated = run(["./run.sh", "evaluate.py", f"eval.checkpoint={run_dir}"],
                    NPROC_PER_NODE=nproc)
    assert evaluated.returncode == 0, evaluated.stdout
    metrics = json.loads((run_dir / "eval-test" / "metrics.json").read_text())
    assert metrics["num_samples"] > 0 and math.isfinite(metrics["loss"])


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.stem)
def test_experiment_trains_like_one_process(tmp_path, config):
    result = run([sys.executable, "check_equivalence.py", "--nproc", str(processes(config)),
                  "--steps", "4", "--workdir", str(tmp_path), "--config", str(config)])
    assert result.returncode == 0, result.stdout
    assert "PASS" in result.stdout
