"""launch/: Kubernetes pods' and SkyPilot nodes' start (launch/node.sh) refuses a node its system
did not set up in one line; progress reports to a Kubeflow TrainJob's status never hold training
back. (The runs themselves, preempted and resumed as two pods or two nodes: test_cluster.py.)"""

import http.server
import json
import socket
import subprocess
import sys
import threading

import pytest

from conftest import PROJECT, TINY, command_env
from ddpkit.extras.kubeflow_progress import ProgressReporter, status


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [(["kubeflow"], {"PET_NNODES": "2"},
      "error: PET_NPROC_PER_NODE is not set: launch/node.sh kubeflow runs on a node that a "
      "Kubeflow TrainJob (launch/trainjob.yaml) starts (a Kubeflow TrainJob "
      "(launch/trainjob.yaml) sets it)"),
     (["skypilot"], {},
      "error: SKYPILOT_NUM_NODES is not set: launch/node.sh skypilot runs on a node that "
      "SkyPilot (launch/sky.yaml) starts (SkyPilot (launch/sky.yaml) sets it)"),
     (["slurm"], {},
      "error: launch/node.sh slurm: give the system that starts this node, kubeflow or skypilot")],
    ids=["kubeflow", "skypilot", "unknown"],
)
def test_a_node_its_system_did_not_set_up_is_one_line(args, env, message):
    started = subprocess.run(["bash", "launch/node.sh", *args], cwd=PROJECT, text=True,
                             env=command_env(**env), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, timeout=60, check=False)
    assert started.returncode == 2
    assert started.stdout.splitlines() == [message]


class Recorder(http.server.BaseHTTPRequestHandler):
    """A Kubeflow status endpoint that keeps what it is sent."""

    received: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.headers["Authorization"], json.loads(body)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    Recorder.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/status", Recorder.received
    server.shutdown()
    server.server_close()


def wait_until(condition):
    for _ in range(10_000):  # polled while the reporter's thread works
        if condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError("still waiting: it hangs")


def test_progress_reports_are_the_latest_and_at_most_one_an_interval(endpoint):
    url, received = endpoint
    reporter = ProgressReporter(url, total_steps=200, token="pod-token", every_seconds=3600)
    reporter.record(1, {"loss": 2.5})
    wait_until(lambda: len(received) == 1)  # the first at once
    for step in range(2, 101):  # within the interval: each replaces the last, none is sent
        reporter.record(step, {"loss": 2.5 - step / 100, "val_accuracy": 0.5})
    reporter.close()  # what is left goes at the end
    assert [auth for auth, _ in received] == ["Bearer pod-token"] * 2
    first, last = (body["trainerStatus"] for _, body in received)
    assert first["progressPercentage"] == 0 and "estimatedRemainingSeconds" not in first
    assert first["metrics"] == [{"name": "loss", "value": "2.5"}]
    assert last["progressPercentage"] == 50 and last["estimatedRemainingSeconds"] >= 0
    assert last["metrics"] == [{"name": "loss", "value": "1.5"},
                               {"name": "val_accuracy", "value": "0.5"}]


def test_a_status_endpoint_that_never_answers_holds_no_training_step():
    silent = socket.socket()  # listens, never accepts: a connection waits for an answer
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    reporter = ProgressReporter(f"http://127.0.0.1:{silent.getsockname()[1]}/status",
                                total_steps=10, every_seconds=0, timeout_seconds=600)
    for step in range(1, 11):  # a record that waited for the server would hang here
        reporter.record(step, {"loss": 1.0})
    reporter.close(wait_seconds=0)
    assert reporter.thread.is_alive()  # still waiting for the server, on its own thread
    silent.close()  # the server goes: the waiting report fails, the thread ends
    reporter.thread.join()
    assert reporter.failed_once


def test_a_progress_report_is_what_the_kubeflow_trainer_api_accepts():
    models = pytest.importorskip(  # the Kubeflow Trainer API's models: no extra of the project
        "kubeflow_trainer_api.models", reason="needs kubeflow-trainer-api (pip install "
        "kubeflow-trainer-api), which the template's own test environment has")
    body = status(30, 120, 90.4, {"loss": 0.25, "val_accuracy": 0.875})
    parsed = models.TrainerV1alpha1UpdateTrainJobStatusRequest.from_dict(body)
    again = parsed.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert again["trainerStatus"]["progressPercentage"] == 25
    assert again["trainerStatus"]["estimatedRemainingSeconds"] == 90
    assert {key: value for key, value in again["trainerStatus"].items()
            if key != "lastUpdatedTime"} == {key: value for key, value in
                                             body["trainerStatus"].items()
                                             if key != "lastUpdatedTime"}


def test_a_training_run_in_a_trainjob_reports_its_progress(endpoint, tmp_path):
    """The Trainer gives the pod its endpoint: rank 0 reports from the first window to 100%,
    the losses and the validation's numbers, not the learning rates."""
    url, received = endpoint
    trained = subprocess.run([sys.executable, "train.py", *TINY, f"run.dir={tmp_path / 'run'}"],
                             cwd=PROJECT, env=command_env(KUBEFLOW_TRAINER_STATUS_URL=url),
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             timeout=300, check=False)
    assert trained.returncode == 0, trained.stdout
    reports = [body["trainerStatus"] for _, body in received]
    assert reports, "no progress report arrived"
    assert reports[-1]["progressPercentage"] == 100
    names = {metric["name"] for report in reports for metric in report["metrics"]}
    assert "train/loss" in names and any(name.startswith("val/") for name in names)
    assert not any("lr" in name.split("/") for name in names)
