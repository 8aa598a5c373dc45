"""Launching: run.sh's preflight stops bad launches before any worker starts, and two "nodes"
joined by torchrun's c10d rendezvous train exactly like one node with as many processes."""

import socket
import subprocess

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


def test_several_nodes_need_an_address_and_a_job_id():
    result = run(["./run.sh", *TINY], NNODES="2", NPROC_PER_NODE="1")
    assert result.returncode == 2
    assert "needs MASTER_ADDR" in result.stdout and "RDZV_ID" in result.stdout


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
