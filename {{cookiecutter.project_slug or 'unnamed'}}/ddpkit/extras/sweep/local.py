"""Running trials on this machine: the GPUs a sweep uses (--gpus, else the visible ones), the
packing of trials onto them (run_packed: k GPUs of its own for a trial of k processes, one trial
at a time without GPUs; the trials a list or chosen as slots free up), each trial started as
`./run.sh` in a session of its own with its log (start_trial), its end reported in one line
(report_end), and every running trial stopped with the sweep by a signal or a mistake (SIGTERM,
which run.sh treats as a preemption; the sweep waits for them, then raises Stopped)."""

import contextlib
import functools
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ddpkit import report
from ddpkit.config import PROJECT_DIR, UserError
from ddpkit.extras.sweep.folder import Sweep, trial_id

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LAUNCH_MARK = "### sweep.py started:"  # heads each launch in a trial's log


def visible_devices() -> list[str]:
    """The GPUs this process may use (ids as CUDA_VISIBLE_DEVICES names them)."""
    from ddpkit.preflight import visible_gpus

    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    return [str(i) for i in range(visible_gpus())]


def chosen_devices(args) -> list[str]:
    """--gpus, else the GPUs this process sees."""
    if args.gpus is None:
        return visible_devices()
    devices = [device.strip() for device in args.gpus.split(",") if device.strip()]
    if len(set(devices)) != len(devices):  # two trials would share a GPU
        raise UserError(f"--gpus {args.gpus} names a GPU twice: name each once")
    return devices


def check_devices(nproc: int, devices: list[str]) -> None:
    if devices and nproc > len(devices):
        raise UserError(f"a trial of {nproc} processes needs {nproc} GPUs and {len(devices)} "
                        f"are visible: use --nproc {len(devices)} or fewer")


def run_packed(trials, nproc: int, devices: list[str], start, wait_step=None,
               max_parallel: int = 0, watch=None, ended=None) -> dict[int, int]:
    """Run trials, as many at once as the devices allow (one at a time with none).

    `trials` is a list of trial indices, or a function that gives the next one when a slot is
    free (None: none for now; Optuna asks its study then). start(index, devices) starts a trial
    and returns something with poll() (a Popen); watch(index, process) is called while it runs,
    ended(index, status) once it has ended; wait_step() between polls (default: a short sleep).
    Returns each trial's exit status."""
    check_devices(nproc, devices)
    if isinstance(trials, list):
        trials = functools.partial(next, iter(list(trials)), None)
    free, running, statuses = list(devices), {}, {}  # each GPU to one trial at a time
    need = nproc if devices else 0
    limit = max_parallel or (len(devices) // nproc if devices else 1)
    while True:
        while len(running) < limit and len(free) >= need and (index := trials()) is not None:
            block, free = free[:need], free[need:]
            running[index] = (start(index, block), block)
        if not running:
            return statuses
        (wait_step or (lambda: time.sleep(0.2)))()
        for index, (process, block) in list(running.items()):
            if watch:
                watch(index, process)
            if (status := process.poll()) is not None:
                statuses[index] = status
                free += block
                del running[index]
                if ended:
                    ended(index, status)


def error_line(log_file: Path) -> str:
    """The line that says why a trial failed: its `error: ...`, else its last words."""
    try:
        lines = [line.strip() for line in log_file.read_text(errors="replace").splitlines()]
    except OSError:
        return "(no log)"
    for line in reversed(lines):
        if line.startswith("error:") or " error: " in line:
            return line
    return next((line for line in reversed(lines) if line), "(empty log)")


def start_trial(sweep: Sweep, index: int, devices: list[str], threads: int) -> subprocess.Popen:
    # Each trial a job of its own, on this machine alone (an exported NNODES, or a project
    # baked for several nodes, would have its run.sh wait for other nodes).
    env = dict(os.environ, NPROC_PER_NODE=str(sweep.nproc), OMP_NUM_THREADS=str(threads),
               NNODES="1")
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    for name in ("RDZV_ID", "SLURM_JOB_ID", "DDP_JOB_ID", "REPLICA_GROUP", "REPLICA_GROUPS",
                 "TORCHFT_LIGHTHOUSE"):
        env.pop(name, None)
    log_file = sweep.log_file(index)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a") as handle:
        handle.write(f"{LAUNCH_MARK} {time.strftime('%Y-%m-%d %H:%M:%S')} ./run.sh "
                     f"{' '.join(sweep.overrides(index))}\n")
        handle.flush()
        return subprocess.Popen(["./run.sh", *sweep.overrides(index)], cwd=PROJECT_DIR,
                                stdout=handle, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


class Stopped(Exception):
    """The sweep got a signal; its running trials are stopped."""

    def __init__(self, number: int):
        super().__init__(signal.Signals(number).name)
        self.number = number


def _terminate(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)


@contextlib.contextmanager
def trials_stop_with_the_sweep(processes: list[subprocess.Popen]) -> Iterator[None]:
    """Ctrl-C, SIGTERM from a scheduler or SIGHUP (the terminal closed): every running trial's
    process group (run.sh and its job) gets SIGTERM, which run.sh treats as a preemption (a
    checkpoint at the step all ranks reach), and the sweep waits for them before it raises
    Stopped; a rerun continues. Trials run in sessions of their own, so nothing else tells them.
    A mistake that stops the sweep (UserError) stops its running trials the same way."""
    received: list[int] = []

    def stop(number, frame):
        _terminate(processes)
        if not received:  # a second signal only forwards: the sweep is waiting already
            received.append(number)
            raise Stopped(number)

    previous = {number: signal.signal(number, stop) for number in STOP_SIGNALS}
    try:
        yield
    except (Stopped, UserError) as error:
        if isinstance(error, UserError):
            _terminate(processes)
        for process in processes:
            process.wait()
        raise
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def report_end(sweep: Sweep, index: int, status: int) -> None:
    """One line on a trial that ended: finished with its best headline value, or failed with
    the line that says why."""
    if status == 0 and sweep.finished(index):
        history = report.read_run(sweep.run_dir(index))
        print(f"{trial_id(index)} finished: val_{history.headline} "
              f"{report._cell(history.best())}", flush=True)
        return
    log_file = sweep.log_file(index)
    print(f"{trial_id(index)} failed (exit {status}): {error_line(log_file)}  [log: {log_file}]",
          flush=True)


def run_trials(sweep: Sweep, devices: list[str], trials, max_parallel: int = 0,
               start: Callable | None = None, wait_step=None, watch=None,
               ended=None) -> dict[int, int]:
    """Run trials on this machine, whoever picks them (a plan, or Optuna): packed onto the GPUs
    (run_packed), each start and end printed as it comes (`ended` replaces report_end), and
    stopped with the sweep. `start` replaces the launch of run.sh (tests)."""
    threads = max(1, (os.cpu_count() or 1) // max(1, len(devices) or sweep.nproc))
    processes: list[subprocess.Popen] = []

    def launch(index: int, block: list[str]) -> subprocess.Popen:
        settings = " ".join(f"{k}={v}" for k, v in sweep.trials[index].items())
        where = f" on GPU {','.join(block)}" if block else ""
        print(f"{trial_id(index)} started: {settings}{where}", flush=True)
        processes.append(start(index, block) if start else
                         start_trial(sweep, index, block, threads))
        return processes[-1]

    with trials_stop_with_the_sweep(processes):
        return run_packed(trials, sweep.nproc, devices, launch, wait_step, max_parallel, watch,
                          ended or functools.partial(report_end, sweep))


def run_local(sweep: Sweep, devices: list[str], max_parallel: int) -> dict[int, int]:
    """The trials of the plan that did not finish, run here."""
    todo = [i for i in range(len(sweep.trials)) if not sweep.finished(i)]
    done = len(sweep.trials) - len(todo)
    print(f"sweep {sweep.folder}: {len(sweep.trials)} trial(s), {done} finished before, "
          f"{len(todo)} to run, {sweep.nproc} process(es) each, "
          f"{'GPUs ' + ','.join(devices) if devices else 'no GPU: one at a time'}", flush=True)
    return run_trials(sweep, devices, todo, max_parallel)
