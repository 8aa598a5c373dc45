"""dist_utils and checkpoint in one process: environment parsing, state-dict keys, checkpoint
safety, run folders."""

import os
import zipfile

import pytest
import torch
from omegaconf import OmegaConf

import checkpoint
import dist_utils
from config import UserError, load_config
from conftest import TINY, RunsCode
from fixtures import MLP
from parallel import unwrap


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


def test_state_dict_keys_carry_no_wrapper_prefixes():
    model = MLP(4, 3, 8, 1, 0.0, batchnorm=False)
    wrapped = {f"module._orig_mod.{k}": v for k, v in model.state_dict().items()}
    assert checkpoint.clean_state_dict(wrapped).keys() == model.state_dict().keys()
    assert unwrap(torch.compile(model)) is model


def test_save_is_atomic_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    checkpoint.export_model({"w": torch.ones(2)}, path, 1, OmegaConf.create())

    def write_half_then_fail(obj, handle):
        handle.write(b"PK\x03\x04 partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", write_half_then_fail)
    with pytest.raises(UserError, match=f"cannot write {path}: disk full"):
        checkpoint.export_model({"w": torch.zeros(2)}, path, 2, OmegaConf.create())
    assert torch.equal(checkpoint.load_checkpoint(path)["model"]["w"], torch.ones(2))
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temporary file left behind


def test_missing_truncated_and_foreign_checkpoints(tmp_path):
    with pytest.raises(UserError, match="checkpoint not found"):
        checkpoint.load_checkpoint(tmp_path / "nope.pt")
    good = tmp_path / "good.pt"
    checkpoint.export_model({"w": torch.ones(1000)}, good, 1, OmegaConf.create())
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(UserError, match="truncated or not a PyTorch checkpoint"):
        checkpoint.load_checkpoint(truncated)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.ones(1)}, other)
    with pytest.raises(UserError, match="not a checkpoint of this project"):
        checkpoint.load_checkpoint(other)


def test_checkpoint_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": RunsCode(marker)}, evil)
    assert zipfile.is_zipfile(evil)
    with pytest.raises(UserError, match="refusing to load checkpoint"):
        checkpoint.load_checkpoint(evil)
    assert not marker.exists()
    # The same file does run code when loaded unsafely: the refusal above is what saved us.
    torch.load(evil, weights_only=False)
    assert marker.exists()


def test_a_run_folder_the_job_made_and_never_used_is_removed(tmp_path):
    env = dist_utils.DistEnv(0, 0, 1, False)
    cfg = load_config([*TINY, f"run.output_dir={tmp_path / 'runs'}"])
    run = checkpoint.open_run_dir(cfg, env)
    assert run.created and run.path.is_dir()
    run.discard_if_unused()
    assert list((tmp_path / "runs").iterdir()) == []
    given = tmp_path / "mine"
    given.mkdir()
    kept = checkpoint.open_run_dir(load_config([*TINY, f"run.dir={given}"]), env)
    kept.discard_if_unused()  # it existed before: not this job's to remove
    assert given.is_dir()
