"""Launching: run.sh's preflight stops bad launches before any worker starts, run.sh passes
torchrun only the flags it has, and two "nodes" joined by torchrun's c10d rendezvous train exactly
like one node with as many processes."""

import re
import shutil
import socket
import subprocess
import venv

import pytest
import torch

from checkpoint import list_checkpoints, read_model
from conftest import PROJECT, TINY, command_env, run

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


def test_run_sh_checks_for_every_package_pyproject_lists():
    listed = re.search(r"^packages=\(([^)]*)\)", (PROJECT / "run.sh").read_text(), re.M)
    pip_names = [pair.split(":")[1] for pair in listed.group(1).split()]
    pyproject = (PROJECT / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.M | re.S)
    assert pip_names == re.findall(r'"([\w.-]+)', dependencies.group(1))


# torchrun's flags that run.sh passes when this torchrun has them (its --help lists them).
OPTIONAL_FLAGS = {"--signals-to-handle": "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT",
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
    (["--signals-to-handle"], ["--signals-to-handle=SIGINT,SIGHUP,SIGQUIT"]),  # as torch 2.11
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
