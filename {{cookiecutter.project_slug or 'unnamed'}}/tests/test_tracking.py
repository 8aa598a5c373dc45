"""Experiment tracking and run reports with real processes: one MLflow run and one W&B run id per
job through a worker killed mid-run, a resume and an evaluation, no step logged twice; a tracker
whose server is down, or never answers, costs a warning, not the run."""

import json
import socket
import sys
from pathlib import Path

import pytest
from test_evaluate_faults import run_sh
from test_faults import finish, kill_worker, launch, wait_for

from conftest import TINY, needs_extra, only_run_dir, run

pytestmark = pytest.mark.slow


def mlflow_runs(output_dir: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{output_dir / 'mlflow.db'}")
    experiments = client.search_experiments()
    return client, [r for e in experiments for r in client.search_runs([e.experiment_id])]


def tracked_step(output_dir: Path) -> int:
    """The last training step MLflow holds, as trackers.json records it (0: none yet)."""
    for path in output_dir.glob("*/trackers.json"):
        steps = json.loads(path.read_text()).get("mlflow", {}).get("steps", {})
        return steps.get("train/loss", 0)
    return 0


def jsonl_steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_one_tracker_run_per_job_through_a_kill_a_resume_and_an_evaluation(tmp_path):
    needs_extra("mlflow")
    needs_extra("wandb")
    output = tmp_path / "runs"
    tracked = [*TINY, "tracking.mlflow=true", "tracking.wandb=true", "tracking.wandb_mode=offline",
               f"run.output_dir={output}", "train.log_every=2"]
    launcher = launch(tracked)
    # Killed once the trackers hold steps after the checkpoint at step 20, which the restarted
    # job repeats: they must not be logged twice.
    wait_for(lambda: tracked_step(output) >= 24, launcher, "MLflow to hold step 24")
    kill_worker(launcher, 0)  # the rank that holds the trackers
    text = finish(launcher)
    assert launcher.returncode == 0, text
    assert text.count("resumed from") == 1, text
    (run_dir,) = [path.parent for path in output.glob("*/config.yaml")]
    resumed = run([sys.executable, "train.py", *tracked, f"run.dir={run_dir}", "train.epochs=4"])
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stdout
    evaluated = run([sys.executable, "evaluate.py", f"eval.checkpoint={run_dir}"])
    assert evaluated.returncode == 0, evaluated.stdout

    client, runs = mlflow_runs(output)
    assert len(runs) == 1, [r.info.run_id for r in runs]
    held = client.get_run(runs[0].info.run_id).data
    assert held.params["optim.lr"] == "0.01" and held.params["train.epochs"] == "3"
    history = {key: [m.step for m in client.get_metric_history(runs[0].info.run_id, key)]
               for key in held.metrics}
    twice = {key: steps for key, steps in history.items() if len(steps) != len(set(steps))}
    assert twice == {}
    assert sorted(history["train/loss"]) == jsonl_steps(run_dir / "train_log.jsonl")
    assert sorted(history["val/loss"]) == [19, 38, 57, 76]  # 4 epochs of 19 steps
    assert "test/accuracy" in history and "epoch/train_loss" in history
    artifacts = {a.path for a in client.list_artifacts(runs[0].info.run_id, "eval-test")}
    assert "eval-test/metrics.json" in artifacts

    wandb_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]["run_id"]
    starts = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(starts) == 4, starts  # the first start, the restart, the resume, evaluate.py
    assert {name.rsplit("-", 1)[1] for name in starts} == {wandb_id}


def test_a_tracker_whose_server_is_down_warns_once_and_the_run_goes_on(tmp_path):
    needs_extra("mlflow")
    result = run([sys.executable, "train.py", *TINY, "train.epochs=1", "tracking.mlflow=true",
                  "tracking.mlflow_uri=http://127.0.0.1:9", f"run.output_dir={tmp_path}"])
    assert result.returncode == 0, result.stdout
    warnings = [line for line in result.stdout.splitlines() if "mlflow: cannot" in line]
    assert len(warnings) == 1, result.stdout
    assert (only_run_dir(tmp_path) / "model.pt").is_file()




def test_a_tracker_server_that_never_answers_is_given_up_and_training_goes_on(tmp_path):
    needs_extra("mlflow")
    with socket.socket() as server:  # the kernel accepts its connections; nobody answers them
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        uri = f"http://127.0.0.1:{server.getsockname()[1]}"
        status, output = run_sh(tmp_path, [*TINY, "train.epochs=1", "tracking.mlflow=true",
                                           f"tracking.mlflow_uri={uri}",
                                           "tracking.timeout_seconds=2",
                                           f"run.output_dir={tmp_path / 'runs'}"],
                                script="train.py",
                                MLFLOW_HTTP_REQUEST_TIMEOUT="3600")  # only the deadline ends it
    assert status == 0, output
    warnings = [line for line in output.splitlines() if "mlflow: cannot" in line]
    assert len(warnings) == 1, output
    assert "no answer within tracking.timeout_seconds=2" in warnings[0], warnings
    assert (only_run_dir(tmp_path / "runs") / "model.pt").is_file()
