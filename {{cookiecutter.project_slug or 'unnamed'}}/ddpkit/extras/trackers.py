"""Experiment trackers, opt-in: MLflow and Weights & Biases, logged by rank 0 only.

    ./run.sh tracking.mlflow=true      # SQLite store runs/mlflow.db; `mlflow ui` to browse it
    ./run.sh tracking.wandb=true       # offline unless you are logged in (wandb login)

One tracker run per job. Its id is kept in <run>/trackers.json, so a torchrun restart, a resume
with `run.dir=` and a SLURM requeue (which finds the same run folder) all continue the same
tracker run. The last step logged for each metric is kept there too (and, for MLflow, read back
from the store itself): a resumed run repeats the steps after its checkpoint, with the very same
values, and those are not logged a second time.

What is logged: the resolved config as parameters (dotted keys), every training window as
train/<name> (as TensorBoard has them: each parameter group's learning rate as train/lr/<group>,
the first's as train/lr too), every epoch as val/<metric> and epoch/<name>, at the optimizer
step; the curves PNG and config.yaml at the end of training; evaluate.py adds its metrics (as
<split>/<metric>) and its files (metrics.json, curves.json, plots).

Nothing here is imported unless the config turns a tracker on. A tracker that fails (its server
is down, its disk is full) is reported once and dropped; training goes on. So is one that does
not answer within tracking.timeout_seconds (a server that accepts connections and never replies):
each tracker's calls run on a thread of its own, which the caller stops waiting for. The metrics
come from the training log's tracker thread (training_log.py), never from the training loop.
"""

import concurrent.futures
import contextlib
import json
import logging
import math
import os
import queue
import shutil
import threading
import uuid
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ddpkit import writes
from ddpkit.config import PROJECT_DIR, UserError

log = logging.getLogger("ddp")

STATE_FILE = "trackers.json"
RUN_FOLDER_TAG = "run_folder"  # MLflow tag: the run folder, to find a run again


def flat_params(cfg: DictConfig) -> dict[str, str]:
    """The resolved config as {dotted.key: text}."""
    flat: dict[str, str] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            flat[prefix] = "" if node is None else str(node)

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return flat


def experiment_name(cfg: DictConfig) -> str:
    return cfg.tracking.project or PROJECT_DIR.name


class Tracker:
    """One tracker. `start` opens (or continues) the run; the others log to it."""

    name = ""
    package = ""  # the import that must work
    extra = ""  # the pyproject extra that installs it

    def __init__(self, cfg: DictConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir

    def start(self, state: dict, keep) -> None:
        """Open the run recorded in `state` (this tracker's part of trackers.json), or a new one;
        call keep(state) as soon as the new run has an id."""
        raise NotImplementedError

    def logged(self) -> dict[str, int]:
        """The last step of each metric the tracker itself holds ({}: cannot tell)."""
        return {}

    def log_params(self, params: dict[str, str]) -> None:
        raise NotImplementedError

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_files(self, paths: list[Path], folder: str) -> None:
        raise NotImplementedError

    def close(self, status: str) -> None:
        """status: finished | preempted (the job continues later) | failed."""


class MLflowTracker(Tracker):
    name, package, extra = "mlflow", "mlflow", "mlflow"
    BATCH = 100  # MLflow takes at most 100 parameters and 1000 metrics in one call

    def start(self, state, keep):
        from mlflow.entities import RunStatus
        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its store's set-up chatter

        output_dir = Path(self.cfg.run.output_dir).resolve()
        uri = self.cfg.tracking.mlflow_uri or f"sqlite:///{output_dir / 'mlflow.db'}"
        self.client = client = MlflowClient(tracking_uri=uri)
        name = experiment_name(self.cfg)
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            # Artifacts of a local store beside it (not ./mlruns of whatever folder ran this).
            location = (output_dir / "mlartifacts").as_uri() if uri.startswith("sqlite:") else None
            experiment_id = client.create_experiment(name, artifact_location=location)
        else:
            experiment_id = experiment.experiment_id
        self.run_id = state.get("run_id")
        if not self.run_id:  # a job killed between creating its run and recording the id
            found = client.search_runs([experiment_id],
                                       f"tags.{RUN_FOLDER_TAG} = '{self.run_dir}'",
                                       max_results=1)
            self.run_id = found[0].info.run_id if found else None
        if self.run_id:
            client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        else:
            run = client.create_run(experiment_id, run_name=self.cfg.tracking.run_name
                                    or self.run_dir.name,
                                    tags={RUN_FOLDER_TAG: str(self.run_dir)})
            self.run_id = run.info.run_id
        keep({"run_id": self.run_id, "tracking_uri": uri, "experiment": name})
        log.info("mlflow: run %s in experiment %r at %s", self.run_id, name, uri)

    def logged(self):
        run = self.client.get_run(self.run_id)
        return {key: max(m.step for m in self.client.get_metric_history(self.run_id, key))
                for key in run.data.metrics}

    def log_params(self, params):
        from mlflow.entities import Param

        held = self.client.get_run(self.run_id).data.params
        changed = sorted(key for key, value in params.items() if key in held
                         and held[key] != value)
        if changed:  # MLflow keeps a parameter's first value
            log.warning("mlflow: parameters changed since the run began keep their first values "
                        "there: %s (config.yaml has the current ones)", ", ".join(changed))
        new = [Param(key, value) for key, value in params.items() if key not in held]
        for start in range(0, len(new), self.BATCH):
            self.client.log_batch(self.run_id, params=new[start:start + self.BATCH])

    def log_metrics(self, metrics, step):
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step)
                                                    for key, value in metrics.items()])

    def log_files(self, paths, folder):
        for path in paths:
            self.client.log_artifact(self.run_id, str(path), artifact_path=folder)

    def close(self, status):
        mlflow_status = {"finished": "FINISHED", "failed": "FAILED"}.get(status)
        if mlflow_status:  # preempted: left RUNNING, the requeued job goes on with it
            self.client.set_terminated(self.run_id, mlflow_status)


def _logged_in_to_wandb() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    with contextlib.suppress(OSError):
        return "api.wandb.ai" in netrc.read_text()
    return False


class WandbTracker(Tracker):
    name, package, extra = "wandb", "wandb", "wandb"

    def start(self, state, keep):
        import wandb

        run_id = state.get("run_id") or uuid.uuid4().hex[:12]
        keep({"run_id": run_id})  # before init: a job killed during it continues this id
        mode = self.cfg.tracking.wandb_mode
        if mode == "auto":
            mode = os.environ.get("WANDB_MODE") or ("online" if _logged_in_to_wandb()
                                                    else "offline")
        # Offline, every start of the job writes a folder of its own under <run>/wandb/, all
        # with this run's id: `wandb sync <run>/wandb/offline-run-*` uploads them as one run.
        self.run = wandb.init(
            id=run_id, resume="allow", project=experiment_name(self.cfg),
            name=self.cfg.tracking.run_name or self.run_dir.name, dir=str(self.run_dir),
            mode=mode, settings=wandb.Settings(console="off", x_disable_stats=True,
                                               silent=True))
        log.info("wandb: run %s (%s) in %s", run_id, mode, self.run_dir / "wandb")

    def log_params(self, params):
        self.run.config.update(params, allow_val_change=True)

    def log_metrics(self, metrics, step):
        self.run.log(metrics, step=step)

    def log_files(self, paths, folder):
        # Files in the run's own folder are W&B's "files" of the run, uploaded (or synced) at
        # its end; copies, so that a later change to the originals does not reach them.
        target = Path(self.run.dir) / folder
        target.mkdir(parents=True, exist_ok=True)
        for path in paths:
            shutil.copyfile(path, target / path.name)

    def close(self, status):
        self.run.finish(exit_code=0 if status != "failed" else 1)


TRACKERS = {"mlflow": MLflowTracker, "wandb": WandbTracker}


class KubeflowProgress(Tracker):
    """Progress to a Kubeflow TrainJob's status (extras/kubeflow_progress.py): on when the
    Trainer gives the pod its endpoint (KUBEFLOW_TRAINER_STATUS_URL), whatever the config says;
    the percent done, the time left and the newest scalars, sent from a thread of its own."""

    name, package = "kubeflow", "urllib.request"

    def __init__(self, cfg: DictConfig, run_dir: Path, total_steps: int):
        super().__init__(cfg, run_dir)
        self.total_steps, self.reporter = total_steps, None

    def start(self, state, keep):
        from ddpkit.extras import kubeflow_progress

        self.reporter = kubeflow_progress.from_environment(self.total_steps)

    def log_params(self, params):
        pass  # the TrainJob's status has no place for them

    def log_metrics(self, metrics, step):
        if self.reporter:  # the learning rates stay out: the status shows the headline numbers
            self.reporter.record(step, {key: value for key, value in metrics.items()
                                        if "/lr" not in key})

    def log_files(self, paths, folder):
        pass

    def close(self, status):
        if self.reporter:
            self.reporter.close()


def progress_reported() -> bool:
    """Whether this pod has a Kubeflow Trainer status endpoint to report progress to."""
    from ddpkit.extras.kubeflow_progress import URL

    return bool(os.environ.get(URL))


class TrackerTimeout(Exception):
    """A tracker call that did not return within tracking.timeout_seconds."""


class CallThread:
    """One tracker's calls, in order, on a daemon thread of its own; the caller waits at most
    `timeout` seconds for each. A call that hangs is left behind in that thread, which the
    process does not wait for when it ends."""

    def __init__(self, name: str, timeout: float):
        self.timeout = timeout
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=f"tracker-{name}", daemon=True).start()

    def _serve(self) -> None:
        while (call := self.calls.get()) is not None:
            function, args, future = call
            try:
                future.set_result(function(*args))
            except BaseException as error:  # handed to the caller, who reports it
                future.set_exception(error)

    def __call__(self, function, *args):
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.calls.put((function, args, future))
        try:
            return future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            raise TrackerTimeout(f"no answer within tracking.timeout_seconds={self.timeout:g}"
                                 ) from None

    def stop(self) -> None:
        self.calls.put(None)


def enabled(cfg: DictConfig) -> list[str]:
    return [name for name in TRACKERS if cfg.tracking.get(name)]


def check_installed(cfg: DictConfig) -> None:
    """A tracker turned on but not installed is a mistake in the input (UserError)."""
    import importlib.util

    for name in enabled(cfg):
        cls = TRACKERS[name]
        if importlib.util.find_spec(cls.package) is None:
            raise UserError(f"tracking.{name}=true needs the {cls.package} package: pip install "
                            f"-e '.[{cls.extra}]' (or set tracking.{name}=false)")


class Trackers:
    """The trackers the config turns on, for rank 0. No method raises: a tracker that fails is
    reported once and dropped. `start` runs at the first record, in the caller's thread."""

    def __init__(self, cfg: DictConfig, run_dir: Path, total_steps: int = 0):
        self.run_dir = run_dir
        self.trackers = [TRACKERS[name](cfg, run_dir) for name in enabled(cfg)]
        if total_steps and progress_reported():  # training, in a TrainJob that asks for it
            self.trackers.append(KubeflowProgress(cfg, run_dir, total_steps))
        timeout = float(cfg.tracking.get("timeout_seconds", 30))
        # A server that is down costs seconds, not minutes of retries, and a call left behind
        # by its deadline ends soon after it (the environment may say otherwise).
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(math.ceil(timeout)))
        for tracker in self.trackers:  # imported here, by the main thread (see Writer)
            __import__(tracker.package)
        self.calls = {tracker.name: CallThread(tracker.name, timeout) for tracker in self.trackers}
        self.saving = threading.Lock()  # trackers.json: a call left behind may still save it
        self.cfg = cfg
        self.started = False
        self.state: dict = {}
        self.steps: dict[str, dict[str, int]] = {}  # tracker -> metric -> last step logged

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def _path(self) -> Path:
        return self.run_dir / STATE_FILE

    def _save(self) -> None:
        with self.saving:
            writes.write_text(self._path(), json.dumps(self.state, indent=1, sort_keys=True))

    def _fail(self, tracker: Tracker, doing: str, error: BaseException) -> None:
        log.warning("%s: cannot %s (%s: %s); going on without %s", tracker.name, doing,
                    type(error).__name__, str(error).splitlines()[0] if str(error) else "",
                    tracker.name)
        self.trackers.remove(tracker)
        if not isinstance(error, TrackerTimeout):  # else its thread is still stuck in a call
            with contextlib.suppress(Exception):
                self.calls[tracker.name](tracker.close, "failed")
        self.calls[tracker.name].stop()

    def _begin(self, tracker: Tracker, part: dict, params: bool) -> None:
        """Open the tracker's run (its thread): what it holds, and the parameters."""

        def keep(values: dict) -> None:
            with self.saving:
                part.update(values)
            self._save()

        tracker.start(dict(part), keep)
        held = tracker.logged()
        ours = part.get("steps", {})
        self.steps[tracker.name] = {key: max(ours.get(key, -1), held.get(key, -1))
                                    for key in {*ours, *held}}
        if params:
            tracker.log_params(flat_params(self.cfg))

    def start(self, params: bool = True) -> None:
        if self.started:
            return
        self.started = True
        with contextlib.suppress(OSError, json.JSONDecodeError):
            self.state = json.loads(self._path().read_text())
        for tracker in list(self.trackers):
            part = self.state.setdefault(tracker.name, {})
            try:
                self.calls[tracker.name](self._begin, tracker, part, params)
            except Exception as error:
                self._fail(tracker, "start", error)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log the metrics that this tracker run does not hold at `step` yet."""
        self.start()
        for tracker in list(self.trackers):
            last = self.steps.setdefault(tracker.name, {})
            new = {key: value for key, value in metrics.items() if step > last.get(key, -1)}
            if not new:
                continue
            try:
                self.calls[tracker.name](tracker.log_metrics, new, step)
            except Exception as error:
                self._fail(tracker, "log metrics", error)
                continue
            last.update(dict.fromkeys(new, step))
            self.state[tracker.name]["steps"] = last
        with contextlib.suppress(OSError):
            self._save()

    def log_files(self, paths: list[Path], folder: str = "") -> None:
        self.start()
        paths = [path for path in paths if path.is_file()]
        for tracker in list(self.trackers):
            try:
                self.calls[tracker.name](tracker.log_files, paths, folder)
            except Exception as error:
                self._fail(tracker, "upload files", error)

    def close(self, status: str = "finished") -> None:
        if not self.started:
            return
        for tracker in self.trackers:
            try:
                self.calls[tracker.name](tracker.close, status)
            except Exception as error:
                log.warning("%s: cannot close the run (%s)", tracker.name, error)
            self.calls[tracker.name].stop()
        self.trackers = []


def _continued(cfg: DictConfig, run_dir: Path) -> bool:
    """Whether evaluate.py continues the tracker runs of the run that trained the checkpoint:
    that run had trackers on (its trackers.json)."""
    return bool(enabled(cfg)) and (run_dir / STATE_FILE).is_file()


def check_for_evaluation(cfg: DictConfig, run_dir: Path) -> None:
    """evaluate.py, before any work: the trackers it will continue are installed (UserError)."""
    if _continued(cfg, run_dir):
        check_installed(cfg)


def continue_for_evaluation(cfg: DictConfig, run_dir: Path) -> Trackers | None:
    """evaluate.py: the trackers of the run that trained the checkpoint, if that run had them
    on (check_for_evaluation said whether they are installed); None otherwise."""
    if not _continued(cfg, run_dir):
        return None
    trackers = Trackers(cfg, run_dir)
    trackers.start(params=False)
    return trackers
