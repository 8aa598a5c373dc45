"""Averaged weights (train.ema_decay, ddpkit/ema.py): the averages torch's own EMA
(AveragedModel with get_ema_multi_avg_fn) computes, validation and model.pt from them, and a
resume that goes on bit for bit under FSDP2."""

import json
import shutil

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from conftest import TINY, only_run_dir, run
from ddpkit.checkpoint_files import MODEL_FILE, list_checkpoints
from ddpkit.checkpoint_load import read_tensors
from ddpkit.config import UserError, load_config
from ddpkit.ema import WeightAverage
from ddpkit.lm import build_gpt


def test_the_averages_are_torchs_ema_bit_for_bit_and_swap_in_and_out():
    torch.manual_seed(0)
    cfg = load_config(["model.name=gpt", "model.hidden_dim=32", "model.num_layers=1"]).model
    model = build_gpt(cfg, (8,), 11)
    ours, theirs = WeightAverage(model, 0.9), AveragedModel(
        model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(5):
        model(torch.randint(0, 11, (4, 8))).logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ours.update()
        theirs.update_parameters(model)
    averaged = dict(theirs.module.named_parameters())
    assert all(torch.equal(average, averaged[name])
               for name, average in ours.state_dict().items())
    trained = {name: p.detach().clone() for name, p in model.named_parameters()}
    with ours.swapped_in():
        assert all(torch.equal(p, averaged[name]) for name, p in model.named_parameters())
    assert all(torch.equal(p, trained[name]) for name, p in model.named_parameters())


def test_export_ema_without_averaging_is_one_line():
    with pytest.raises(UserError) as error:
        load_config(["train.export=ema"])
    assert str(error.value) == ("train.export=ema needs averaged weights: set train.ema_decay "
                                "(e.g. 0.999), or train.export=last")


@pytest.mark.slow
def test_a_run_resumed_with_averages_ends_bit_for_bit(tmp_path, strategy="fsdp"):
    """40 steps, a checkpoint every 20, train.export=ema: resumed from step 20, model.pt (the
    averages) ends as the uninterrupted run's. Under FSDP2, whose averages are shards as its
    weights are (DDP's are whole tensors: the same code, nothing sharded)."""
    from test_checkpoints import assert_bitwise_equal

    settings = [*TINY, "train.max_steps=40", "train.ckpt_every=20", "train.keep_checkpoints=0",
                "train.ema_decay=0.9", "train.export=ema", f"parallel.strategy={strategy}"]
    result = run(["./run.sh", *settings, f"run.output_dir={tmp_path / 'whole'}"],
                 NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stdout
    whole = only_run_dir(tmp_path / "whole")
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["exported"] == {"from": "ema", "step": 40}
    copy = tmp_path / "copy"
    shutil.copytree(whole, copy)
    for later in list_checkpoints(copy / "checkpoints")[1:]:
        shutil.rmtree(later)
    (copy / MODEL_FILE).unlink()
    resumed = run(["./run.sh", *settings, f"run.dir={copy}"], NPROC_PER_NODE="2")
    assert resumed.returncode == 0, resumed.stdout
    weights = [torch.load(folder / MODEL_FILE, weights_only=True)["model"]
               for folder in (whole, copy)]
    assert_bitwise_equal(*weights)
    last = list_checkpoints(whole / "checkpoints")[-1]
    # model.pt holds the averages, not the last weights the checkpoint's model part holds.
    averages, last_weights = (read_tensors(last, part) for part in ("ema", "model"))
    assert all(torch.equal(weights[0][name], averages[name]) for name in averages)
    assert not all(torch.equal(averages[name], last_weights[name]) for name in averages)
