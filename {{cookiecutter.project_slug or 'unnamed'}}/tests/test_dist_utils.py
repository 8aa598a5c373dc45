"""dist_utils and checkpoint in one process: environment parsing, state-dict keys, checkpoint
safety, run folders."""

import os
import socket
import subprocess
import sys
import zipfile

import pytest
import torch
from omegaconf import OmegaConf

from conftest import PROJECT, TINY, RunsCode, command_env
from ddpkit import checkpoint, checkpoint_load, dist_utils, run_folder
from ddpkit.config import UserError, load_config
from ddpkit.parallel import unwrap
from fixtures import MLP


def test_single_process_fallback(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    env = dist_utils.get_dist_env()
    assert (env.rank, env.local_rank, env.world_size, env.launched) == (0, 0, 1, False)


def test_torchrun_environment(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    env = dist_utils.get_dist_env()
    assert (env.rank, env.local_rank, env.world_size, env.is_main) == (5, 1, 8, False)
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(UserError, match="WORLD_SIZE"):
        dist_utils.get_dist_env()


# A gloo group keeps the same flight recorder as NCCL's, so its variables can be checked on a CPU.
FLIGHT_RECORDER_PROBE = """
import json, torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.all_reduce(torch.ones(1))
trace = json.loads(torch._C._distributed_c10d._dump_fr_trace_json())
print("recorded", len(trace.get("entries", [])))
dist.destroy_process_group()
"""


def flight_recorder_probe(**variables: str) -> str:
    """The probe's output, with these variables and none of the recorder's from this shell."""
    env = {k: v for k, v in command_env().items() if not k.startswith(("TORCH_FR_", "TORCH_NCCL_"))}
    env.update(variables)
    return subprocess.run([sys.executable, "-c", FLIGHT_RECORDER_PROBE], cwd=PROJECT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120, check=True).stdout


def test_flight_recorder_variables_are_the_ones_this_torch_reads():
    """The names dist_utils gives the flight recorder's variables (with NCCL) are read by the
    installed torch without a deprecation warning, and the buffer's size is really taken from
    its variable: set to 0, nothing is recorded."""
    chosen = dist_utils.FLIGHT_RECORDER_ENV
    output = flight_recorder_probe(**chosen)
    assert "deprecated" not in output and "recorded 1" in output, output
    (buffer,) = [name for name in chosen if name.endswith("BUFFER_SIZE")]
    assert "recorded 0" in flight_recorder_probe(**{**chosen, buffer: "0"})


def test_state_dict_keys_carry_no_wrapper_prefixes():
    model = MLP(4, 3, 8, 1, 0.0, batchnorm=False)
    wrapped = {f"module._orig_mod.{k}": v for k, v in model.state_dict().items()}
    assert checkpoint_load.clean_state_dict(wrapped).keys() == model.state_dict().keys()
    assert unwrap(torch.compile(model)) is model


def test_save_is_atomic_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    checkpoint.export_model({"w": torch.ones(2)}, path, 1, OmegaConf.create(), "trained")

    def write_half_then_fail(obj, handle):
        handle.write(b"PK\x03\x04 partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", write_half_then_fail)  # (writes.py imports it at use)
    with pytest.raises(UserError, match=f"cannot write {path}: disk full"):
        checkpoint.export_model({"w": torch.zeros(2)}, path, 2, OmegaConf.create(), "trained")
    assert torch.equal(checkpoint_load.load_checkpoint(path)["model"]["w"], torch.ones(2))
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temporary file left behind


def test_missing_truncated_and_foreign_checkpoints(tmp_path):
    with pytest.raises(UserError, match="checkpoint not found"):
        checkpoint_load.load_checkpoint(tmp_path / "nope.pt")
    good = tmp_path / "good.pt"
    checkpoint.export_model({"w": torch.ones(1000)}, good, 1, OmegaConf.create(), "trained")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(UserError, match="truncated or not a PyTorch checkpoint"):
        checkpoint_load.load_checkpoint(truncated)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.ones(1)}, other)
    with pytest.raises(UserError, match="not a checkpoint of this project"):
        checkpoint_load.load_checkpoint(other)


def test_checkpoint_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": RunsCode(marker)}, evil)
    assert zipfile.is_zipfile(evil)
    with pytest.raises(UserError, match="refusing to load checkpoint"):
        checkpoint_load.load_checkpoint(evil)
    assert not marker.exists()
    # The same file does run code when loaded unsafely: the refusal above is what saved us.
    torch.load(evil, weights_only=False)
    assert marker.exists()


def test_a_run_folder_the_job_made_and_never_used_is_removed(tmp_path):
    env = dist_utils.DistEnv(0, 0, 1, False)
    cfg = load_config([*TINY, f"run.output_dir={tmp_path / 'runs'}"])
    run = run_folder.open_run_dir(cfg, env)
    assert run.created and run.path.is_dir()
    run.discard_if_unused()
    assert list((tmp_path / "runs").iterdir()) == []
    given = tmp_path / "mine"
    given.mkdir()
    kept = run_folder.open_run_dir(load_config([*TINY, f"run.dir={given}"]), env)
    kept.discard_if_unused()  # it existed before: not this job's to remove
    assert given.is_dir()


def test_a_lost_peer_is_told_from_an_error_of_ones_own(tmp_path):
    # A real lost peer, as a torch release raises it: lifecycle.is_peer_failure must still know
    # it (gloo gives a plain RuntimeError, told by its text), or a rank would report the other's
    # death as its own failure.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    ranks = [subprocess.Popen([sys.executable, "tests/peer_gone.py"], cwd=PROJECT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=command_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                              RANK=str(rank), WORLD_SIZE="2"))
             for rank in (0, 1)]
    output = ranks[0].communicate(timeout=120)[0]
    ranks[1].communicate(timeout=120)
    assert "peer failure: True" in output, output
