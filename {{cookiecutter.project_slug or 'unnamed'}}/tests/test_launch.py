"""Launching: run.sh's preflight stops bad launches before any worker starts, run.sh passes
torchrun only the flags it has, and two "nodes" joined by torchrun's c10d rendezvous train exactly
like one node with as many processes."""

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import venv

import pytest
import torch

from conftest import PROJECT, TINY, command_env, run
from ddpkit.checkpoint_files import list_checkpoints
from ddpkit.checkpoint_load import read_model
from ddpkit.launcher import PACKAGES

pytestmark = pytest.mark.slow  # the quick tier (-m 'not slow') skips these


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_nccl_without_cuda_stops_before_any_worker(tmp_path):
    result = run(["./run.sh", *TINY, "ddp.backend=nccl", f"run.output_dir={tmp_path}"],
                 NPROC_PER_NODE="4")
    assert result.returncode == 2
    assert result.stdout.strip().splitlines() == [
        "error: ddp.backend=nccl needs CUDA GPUs and this machine has none: use ddp.backend=gloo "
        "(or auto, which picks gloo on CPU)"]
    assert "torch.distributed" not in result.stdout  # torchrun never started
    assert not tmp_path.joinpath("runs").exists()


def test_taken_rendezvous_port_stops_the_head_node():
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("", port))
        holder.listen()
        result = run(["./run.sh", *TINY], NNODES="2", NODE_RANK="0", NPROC_PER_NODE="1",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_ID="taken")
    assert result.returncode == 2
    assert result.stdout.strip().splitlines() == [
        f"error: rendezvous port {port} on this head node (127.0.0.1) is already in use, "
        "perhaps by another job: set MASTER_PORT to a free port"]


def test_several_nodes_need_an_address_and_a_job_id_or_one_machine():
    result = run(["./run.sh", *TINY], NNODES="2", NPROC_PER_NODE="1")
    assert result.returncode == 2
    assert result.stdout.strip().splitlines() == [
        "error: NNODES=2 needs MASTER_ADDR (the head node's address) and RDZV_ID (a job id), the "
        "same on every node; to run on this machine alone, start it as NNODES=1 ./run.sh"]


def test_a_python_without_the_projects_packages_gets_one_line(tmp_path):
    venv.create(tmp_path / "bare", with_pip=False)  # a Python with none of the packages
    bare = tmp_path / "bare" / "bin" / "python"
    result = run(["./run.sh", *TINY], PYTHON=str(bare))
    assert result.returncode == 2
    assert result.stdout.strip().splitlines() == [
        f"error: {bare} lacks the project's packages (torch, numpy, omegaconf, scikit-learn, "
        "tensorboard, matplotlib, tqdm): activate the project's environment, or run pip install "
        "-e . there (README: Quick start)"]
    result = run(["./run.sh", *TINY], PYTHON=str(tmp_path / "nowhere"))
    assert result.returncode == 2
    assert result.stdout.strip().splitlines() == [
        f"error: {tmp_path / 'nowhere'} not found: set PYTHON to the Python that has the "
        "project's packages (README: Quick start)"]


@pytest.mark.parametrize(("env", "expected"), [
    (dict(NPROC_PER_NODE="0"), "NPROC_PER_NODE=0 is not valid: it must be a whole number of "
     "processes, at least 1"),
    (dict(MAX_RESTARTS="-1"), "MAX_RESTARTS=-1 is not valid: it must be a whole number, 0 or more"),
    (dict(SHUTDOWN_TIMEOUT="2m"), "SHUTDOWN_TIMEOUT=2m is not valid: it must be a whole number of "
     "seconds"),
    (dict(REPLICA_GROUP="2", REPLICA_GROUPS="2"), "REPLICA_GROUP=2 and REPLICA_GROUPS=2 are not "
     "valid: REPLICA_GROUPS is the number of replica groups, REPLICA_GROUP this group's, 0 to "
     "REPLICA_GROUPS-1"),
], ids=["nproc", "restarts", "shutdown", "replica-group"])
def test_a_run_sh_setting_that_is_not_valid_is_one_line(tmp_path, env, expected):
    # The preflight checks run.sh's environment (it was bash's, before) before any worker starts.
    launch = Launch(tmp_path, TINY, **env)
    assert launch.finish() == [f"error: {expected}"]
    assert launch.proc.returncode == 2


def test_run_sh_checks_for_every_package_pyproject_lists():
    pip_names = list(PACKAGES.values())  # what run.sh's preflight looks up
    pyproject = (PROJECT / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.M | re.S)
    # optuna is sweep.py's alone (ddpkit/extras/sweep/ says in one line when it is missing).
    assert pip_names == [name for name in re.findall(r'"([\w.-]+)', dependencies.group(1))
                         if name != "optuna"]


def test_run_sh_only_starts_and_signals_processes():
    """run.sh is a launcher a reader takes in at once: the checks and torchrun's command line are
    Python's (ddpkit/launcher.py, ddpkit/preflight.py); it starts torchrun, passes signals on to
    the workers and turns how the job ended into its exit status, without stopping torchrun or
    reading other processes' environments."""
    text = (PROJECT / "run.sh").read_text()
    assert len(text.splitlines()) <= 200
    assert "/proc/" not in text and "STOP" not in text


# torchrun's flags that run.sh passes when this torchrun has them (its --help lists them).
OPTIONAL_FLAGS = {"--signals-to-handle": "--signals-to-handle=SIGQUIT",
                  "--shutdown-timeout": "--shutdown-timeout=120"}


def torchrun_on_path(folder, body: str) -> dict:
    """A `torchrun` first on PATH that records its arguments in folder/argv, then runs `body`."""
    folder.mkdir()
    wrapper = folder / "torchrun"
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = --help ] || printf \'%s\\n\' "$@" > "{folder}/argv"\n'
                       f"{body}\n")
    wrapper.chmod(0o755)
    return {"PATH": f"{folder}:{command_env()['PATH']}"}


def test_run_sh_passes_the_flags_the_installed_torchrun_has(tmp_path):
    """With the installed torchrun (torch 2.13 here: both flags) run.sh passes exactly the
    optional flags its --help lists, and torchrun takes them: the run succeeds."""
    real = shutil.which("torchrun", path=command_env()["PATH"])
    help_text = subprocess.run([real, "--help"], capture_output=True, text=True, check=True).stdout
    env = torchrun_on_path(tmp_path / "bin", f'exec "{real}" "$@"')
    result = run(["./run.sh", *TINY, "train.fast_dev_run=true", f"run.output_dir={tmp_path}"],
                 NPROC_PER_NODE="1", **env)
    assert result.returncode == 0, result.stdout
    argv = (tmp_path / "bin" / "argv").read_text().splitlines()
    expected = [flag for name, flag in OPTIONAL_FLAGS.items() if f"{name} " in help_text]
    assert [arg for arg in argv if arg.split("=")[0] in OPTIONAL_FLAGS] == expected


@pytest.mark.parametrize(("listed", "passed"), [
    (["--signals-to-handle"], ["--signals-to-handle=SIGQUIT"]),  # as torch 2.11
    ([], []),  # as torchrun before --signals-to-handle
])
def test_run_sh_leaves_out_the_flags_torchrun_lacks(tmp_path, listed, passed):
    usage = " ".join(f"[{flag} VALUE]" for flag in ["--nnodes", *listed])
    env = torchrun_on_path(tmp_path / "bin", f'[ "$1" = --help ] && echo "usage: torchrun {usage}"'
                                             "\nexit 0")
    result = run(["./run.sh", *TINY], NPROC_PER_NODE="1", SHUTDOWN_TIMEOUT="300", **env)
    assert result.returncode == 0, result.stdout
    argv = (tmp_path / "bin" / "argv").read_text().splitlines()
    assert [arg for arg in argv if arg.split("=")[0] in OPTIONAL_FLAGS] == passed
    assert result.stdout.strip().splitlines() == [
        "note: this torchrun has no --shutdown-timeout (torch 2.12+), so SHUTDOWN_TIMEOUT=300 does "
        "not apply: it waits 30 s"]


def test_two_nodes_train_like_one_node_with_two_processes(tmp_path):
    one_node = run(["./run.sh", *TINY, f"run.dir={tmp_path / 'one'}"], NPROC_PER_NODE="2")
    assert one_node.returncode == 0, one_node.stdout

    port = free_port()
    nodes = [
        subprocess.Popen(
            ["./run.sh", *TINY, f"run.dir={tmp_path / 'two'}"], cwd=PROJECT, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=command_env(NNODES="2", NODE_RANK=str(node), NPROC_PER_NODE="1",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_ID="two-nodes"))
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert sum("2 process(es) on cpu, backend gloo" in out for out in outputs) == 1  # rank 0's

    def weights(run_dir):
        return read_model(list_checkpoints(run_dir / "checkpoints")[-1])

    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- signals, temporary files, waits (issue 24) -------------------------------------------------

class Launch:
    """./run.sh in a session of its own, its temporary folder (TMPDIR) private to the test.
    `finish()` waits for it and checks that it left no process and no temporary file."""

    def __init__(self, tmp_path, args, **env):
        self.tmp = tmp_path / "tmp"
        self.tmp.mkdir(exist_ok=True)
        self.proc = subprocess.Popen(
            ["./run.sh", *args], cwd=PROJECT, text=True, start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=command_env(TMPDIR=str(self.tmp), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ind"),
                            **env))
        self.lines: list[str] = []

    def read_until(self, marker: str) -> str:
        for line in self.proc.stdout:
            self.lines.append(line)
            if marker in line:
                return line
        raise AssertionError(f"no {marker!r} in:\n{''.join(self.lines)}")

    def signal_launcher(self, number):
        self.proc.send_signal(number)

    def signal_group(self, number):  # as a terminal does, to every process of the job
        os.killpg(self.proc.pid, number)

    def finish(self, timeout=240, tmp_left=()) -> list[str]:
        try:
            rest, _ = self.proc.communicate(timeout=timeout)
        finally:
            left = processes_in_group(self.proc.pid)
            if left:
                os.killpg(self.proc.pid, signal.SIGKILL)
        assert not left, left
        assert sorted(self.tmp.iterdir()) == sorted(tmp_left)
        return "".join([*self.lines, rest]).splitlines()


def processes_in_group(group: int) -> list[str]:
    listed = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-g", str(group)],
                            capture_output=True, text=True, check=False).stdout
    return [line for line in listed.splitlines() if line.split()[1][0] != "Z"]


def python_wrapper(folder, when_preflight: str) -> str:
    """A PYTHON for run.sh that runs `when_preflight` instead of the preflight (a known wait
    before any worker exists), and the real Python otherwise."""
    folder.mkdir()
    wrapper = folder / "python"
    wrapper.write_text(f'#!/bin/sh\nif [ "$2" = ddpkit.launcher ]; then {when_preflight}; fi\n'
                       f'exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def same_command(line: str, prefix: str) -> list[str]:
    """The command a line of run.sh's that starts with `prefix` prints, as words."""
    assert line.startswith(prefix), line
    return shlex.split(line.removeprefix(prefix))


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_before_the_workers_start_stops_the_launch_as_preempted(tmp_path, number):
    python = python_wrapper(tmp_path / "bin", "echo checking; exec sleep 600")
    args = [*TINY, f"run.output_dir={tmp_path}"]
    launch = Launch(tmp_path, args, PYTHON=python)
    launch.read_until("checking")
    launch.signal_launcher(number)
    lines = launch.finish()
    assert launch.proc.returncode == 75
    assert lines[0] == "checking" and len(lines) == 2
    assert same_command(lines[1], f"stopped by {number.name} before the workers started, nothing "
                        "to save: run the same command again: ") == ["./run.sh", *args]


def test_sigterm_while_waiting_for_the_other_nodes_stops_the_node(tmp_path):
    port = free_port()
    args = [*TINY, f"run.output_dir={tmp_path}"]
    launch = Launch(tmp_path, args, NNODES="2", NODE_RANK="0",
                    NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                    RDZV_ID="alone", RDZV_JOIN_TIMEOUT="300")
    launch.read_until(f"waiting up to 300 s for the other nodes at 127.0.0.1:{port}")
    while True:  # until torchrun hosts the rendezvous and waits in it
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
    launch.signal_launcher(signal.SIGTERM)
    lines = launch.finish()
    assert launch.proc.returncode == 75, lines
    assert same_command(lines[-1], "stopped by SIGTERM before the workers started, nothing to "
                        "save: run the same command again: ") == [
        "NPROC_PER_NODE=1", "NNODES=2", "./run.sh", *args]
    assert not any("Traceback" in line for line in lines)


def torchrun_before_2_10(folder) -> dict:
    """The installed torchrun as torch 2.9 has it: its --help without --signals-to-handle and
    --shutdown-timeout, so it runs without them, and then handles SIGTERM, SIGINT and SIGHUP
    itself (their default), as 2.9 does."""
    real = shutil.which("torchrun", path=command_env()["PATH"])
    hidden = "s/--signals[-_]to[-_]handle\\|--shutdown[-_]timeout/--x/g"
    return torchrun_on_path(folder, f'if [ "$1" = --help ]; then "{real}" --help | sed '
                                    f"'{hidden}'; exit 0; fi\nexec \"{real}\" \"$@\"")


@pytest.mark.parametrize("torchrun", ["installed", "before 2.10"])
def test_ctrl_c_stops_the_job_with_one_line(tmp_path, torchrun):
    env = torchrun_before_2_10(tmp_path / "bin") if torchrun == "before 2.10" else {}
    args = [*TINY, "train.epochs=1000", f"run.output_dir={tmp_path}"]
    launch = Launch(tmp_path, args, NPROC_PER_NODE="2", **env)
    launch.read_until("run folder:")
    launch.signal_group(signal.SIGINT)
    lines = launch.finish()
    assert launch.proc.returncode == 130
    # Rank 0's line once training started (at step N ...), else run.sh's (the job stopped ...).
    said = re.fullmatch(r"(interrupted \(SIGINT\).*, run the same command again: ).*", lines[-1])
    assert said, lines
    assert same_command(lines[-1], said[1]) == ["NPROC_PER_NODE=2", "./run.sh", *args]
    after = lines[[i for i, line in enumerate(lines) if "run folder:" in line][0] + 1:-1]
    assert [line for line in after if not re.match(r"\d\d:\d\d:\d\d ", line)] == []


def test_a_worker_that_does_not_leave_on_ctrl_c_is_killed_after_shutdown_timeout(tmp_path):
    script = tmp_path / "stuck.py"  # a worker stuck where Ctrl-C does not reach it
    script.write_text("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                      "print('stuck', flush=True)\ntime.sleep(600)\n")
    launch = Launch(tmp_path, [str(script)], NPROC_PER_NODE="1", SHUTDOWN_TIMEOUT="1")
    launch.read_until("stuck")
    launch.signal_group(signal.SIGINT)
    lines = launch.finish()
    assert lines[0] == "stuck" and len(lines) == 2
    assert same_command(lines[1], "interrupted (SIGINT): the job stopped; to continue it (from its "
                        "newest checkpoint, if it saved one), run the same command again: ") == [
        "NPROC_PER_NODE=1", "./run.sh", str(script)]
    assert launch.proc.returncode == 130


def test_a_syntax_error_in_the_users_code_stops_before_torchrun(tmp_path):
    model = tmp_path / "model.py"
    model.write_text("import torch\n" * 11 + "def build(cfg:\n    return None\n")
    env = torchrun_on_path(tmp_path / "bin", "exit 0")
    launch = Launch(tmp_path, [*TINY, f"model.name={model}:build"], **env)
    lines = launch.finish()
    assert launch.proc.returncode == 2
    assert len(lines) == 1 and lines[0].startswith(f"error: {model} line 12: ")
    assert lines[0].endswith(": fix it and run again")
    assert not (tmp_path / "bin" / "argv").exists()  # torchrun never started


def test_a_taken_port_without_node_rank_is_one_line(tmp_path):
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("", port))
        holder.listen()
        launch = Launch(tmp_path, TINY, NNODES="2", NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), RDZV_ID="taken")
        lines = launch.finish()
    assert launch.proc.returncode == 2
    assert lines == [f"error: rendezvous port {port} on this machine (127.0.0.1) is taken by a "
                     "program that is not torchrun's rendezvous, perhaps another job: set "
                     "MASTER_PORT to a free port"]


def test_a_killed_launchs_folder_goes_once_nothing_of_it_runs(tmp_path):
    python = python_wrapper(tmp_path / "bin", "echo checking; exec sleep 600")
    killed = Launch(tmp_path, TINY, PYTHON=python)
    killed.read_until("checking")
    killed.signal_launcher(signal.SIGKILL)  # run.sh alone: its preflight goes on
    killed.proc.wait()
    [folder] = killed.tmp.iterdir()
    assert folder.name.startswith("run-sh.")

    def launch_and_refuse(tmp_left):  # a launch that stops at once, after cleaning up
        refused = Launch(tmp_path, [*TINY, "train.epochs=abc"])
        lines = refused.finish(tmp_left=tmp_left)
        assert lines[0].startswith("error: train.epochs=abc")

    launch_and_refuse(tmp_left=[folder])  # the sleeping preflight, started in it, is alive
    os.killpg(killed.proc.pid, signal.SIGKILL)
    while processes_in_group(killed.proc.pid):
        pass  # SIGKILL takes effect at once; the kernel may list the process a moment longer
    launch_and_refuse(tmp_left=[])
