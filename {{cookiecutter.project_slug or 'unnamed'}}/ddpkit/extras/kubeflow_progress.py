"""Progress reports to a Kubeflow TrainJob's status (Kubeflow Trainer 2.3, alpha): rank 0 sends
the percent done, the time left and the headline metrics, at most every `every_seconds`.

The Trainer's progress plugin, when the cluster turns it on, gives each pod
KUBEFLOW_TRAINER_STATUS_URL (where to POST), KUBEFLOW_TRAINER_STATUS_TOKEN (a file holding the
pod's service account token) and KUBEFLOW_TRAINER_STATUS_CA_CERT (a file holding the CA that
signed the server's certificate); without the URL nothing is reported. `kubectl get trainjob
NAME -o jsonpath='{.status.trainerStatus}'` shows what arrived.

Training never waits for a report: `record` keeps the latest values and returns; a thread of
its own sends them. A server that fails is told once and the reports go on (the next may work);
one that never answers holds only that thread, which `close` stops waiting for.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import ssl
import threading
import time
import urllib.error
import urllib.request

log = logging.getLogger("ddp")

URL, TOKEN, CA_CERT = ("KUBEFLOW_TRAINER_STATUS_URL", "KUBEFLOW_TRAINER_STATUS_TOKEN",
                       "KUBEFLOW_TRAINER_STATUS_CA_CERT")


def status(step: int, total_steps: int, seconds_left: float | None, metrics: dict) -> dict:
    """The body of one report, as the Trainer's UpdateTrainJobStatusRequest has it (numbers as
    text in metrics: the API's type)."""
    trainer = {"progressPercentage": min(100, step * 100 // max(total_steps, 1)),
               "metrics": [{"name": name, "value": f"{value:.6g}"}
                           for name, value in metrics.items()],
               "lastUpdatedTime": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    if seconds_left is not None:
        trainer["estimatedRemainingSeconds"] = round(seconds_left)
    return {"trainerStatus": trainer}


class ProgressReporter:
    """Reports of one run to `url`; `record` from the training side, `close` at its end."""

    def __init__(self, url: str, total_steps: int, token: str = "", context=None,
                 every_seconds: float = 5.0, timeout_seconds: float = 5.0):
        self.url, self.total_steps, self.token, self.context = url, total_steps, token, context
        self.every, self.timeout = every_seconds, timeout_seconds
        self.latest: dict | None = None  # the newest body not sent yet
        self.first: tuple[int, float] | None = None  # (step, time) of the first record: the rate
        self.failed_once = False
        self.wake, self.closing = threading.Condition(), False
        self.thread = threading.Thread(target=self._send_loop, name="kubeflow-progress",
                                       daemon=True)
        self.thread.start()

    def record(self, step: int, metrics: dict) -> None:
        """The run reached `step` with these metrics: kept for the next report, never waited on."""
        now = time.monotonic()
        if self.first is None:
            self.first = (step, now)
        done, started = step - self.first[0], now - self.first[1]
        left = (self.total_steps - step) * started / done if done > 0 else None
        with self.wake:
            self.latest = status(step, self.total_steps, left, metrics)
            self.wake.notify()

    def close(self, wait_seconds: float = 5.0) -> None:
        """Send what is left, waiting at most `wait_seconds` for it."""
        with self.wake:
            self.closing = True
            self.wake.notify()
        self.thread.join(wait_seconds)

    def _send_loop(self) -> None:
        last_sent = -float("inf")
        while True:
            with self.wake:
                while self.latest is None and not self.closing:
                    self.wake.wait()
                if self.latest is None:  # closing, and all sent
                    return
                pause = last_sent + self.every - time.monotonic()
                if pause > 0 and not self.closing:
                    self.wake.wait(pause)  # later records replace this one meanwhile
                    continue
                body, self.latest = self.latest, None
            last_sent = time.monotonic()
            self._send(body)

    def _send(self, body: dict) -> None:
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json",
                     **({"Authorization": f"Bearer {self.token}"} if self.token else {})})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self.context):
                pass
        except (OSError, urllib.error.URLError) as error:  # HTTPError and timeouts included
            if not self.failed_once:
                self.failed_once = True
                log.warning(f"progress report to {self.url} failed ({error}); training goes on, "
                            "and so do the reports")


def from_environment(total_steps: int) -> ProgressReporter | None:
    """The reporter the Trainer's variables ask for, or None when there is no endpoint."""
    url = os.environ.get(URL)
    if not url:
        return None
    token_file, ca_file = os.environ.get(TOKEN, ""), os.environ.get(CA_CERT, "")
    with open(token_file) if token_file else open(os.devnull) as handle:
        token = handle.read().strip()
    context = ssl.create_default_context(cafile=ca_file or None) if url.startswith(
        "https:") else None
    return ProgressReporter(url, total_steps, token, context)
