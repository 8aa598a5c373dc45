"""Averaged weights (train.ema_decay, ddpkit/ema.py): the averages torch's own EMA
(AveragedModel with get_ema_multi_avg_fn) computes; the rule for which weights (ddpkit/
weight_choice.py): model.pt, every export, evaluate.py and sample.py take an averaged run's
averages (the trained ones when asked), each saying which; checkpoints that name the parts a
reader must understand (`requires`), refused in one line by a reader that does not know one; and
a resume that goes on bit for bit under FSDP2."""

import json
import logging
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_language_model import token_folder
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import evaluate
import export
import sample
from conftest import TINY, only_run_dir, run
from ddpkit import __version__, weight_choice
from ddpkit.checkpoint_files import (
    MANIFEST_FILE,
    MODEL_FILE,
    STATE_FILE,
    list_checkpoints,
    write_manifest,
)
from ddpkit.checkpoint_load import dropped_parts, read_tensors, saved_parts
from ddpkit.config import UserError, load_config, notes_at_start
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


def test_export_ema_without_averaging_is_one_line_and_with_them_deprecated():
    with pytest.raises(UserError) as error:
        load_config(["train.export=ema"])
    assert str(error.value) == ("train.export=ema needs averaged weights: set train.ema_decay "
                                "(e.g. 0.999), or train.export=last")
    given = ["train.export=ema", "train.ema_decay=0.9"]
    assert notes_at_start(load_config(given), ["train.export", "train.ema_decay"]) == [
        "train.export=ema is deprecated (removed in release 2.0.0): a run that keeps averaged "
        "weights exports them with train.export=last, the default; write that"]


def test_a_model_pt_of_1_x_is_read_as_its_summary_or_config_says(tmp_path):
    """A model.pt written before it recorded its weights: averaged where its run's summary.json
    says it exported the averages (from ema, or the best of an averaged run), or, with no
    summary beside it, where its config says the run exported them."""
    def old_export(folder: Path, setting: str, ema_decay: float, origin: str | None) -> str:
        folder.mkdir()
        state = {"format": "model export", "model": {}, "step": 8,
                 "config": {"train": {"export": setting, "ema_decay": ema_decay}}}
        if origin:
            (folder / "summary.json").write_text(json.dumps({"exported": {"from": origin}}))
        return weight_choice.recorded(folder / MODEL_FILE, state)

    assert old_export(tmp_path / "a", "ema", 0.9, "ema") == "averaged"
    assert old_export(tmp_path / "b", "best", 0.9, "best") == "averaged"
    assert old_export(tmp_path / "c", "best", 0.0, "best") == "trained"
    assert old_export(tmp_path / "d", "last", 0.9, "last") == "trained"
    assert old_export(tmp_path / "e", "ema", 0.9, None) == "averaged"
    assert old_export(tmp_path / "f", "last", 0.9, None) == "trained"


# The built-in GPT (its head shares the token embedding's weights), with averaged weights: 8
# steps on one process, a checkpoint and a validation every 4, model.pt from the best.
AVERAGED_GPT = ["data.dataset=tokens", "data.block_size=16", "model.name=gpt",
                "model.hidden_dim=16", "model.num_layers=1", "model.dropout=0",
                "train.global_batch_size=4", "train.max_steps=8", "train.ckpt_every=4",
                "train.val_every_steps=4", "train.keep_checkpoints=0", "train.ema_decay=0.9",
                "train.export=best", "optim.lr=0.01", "optim.warmup_steps=0",
                "train.progress_bar=false", "train.plot_curves=false"]


@pytest.fixture(scope="module")
def averaged_run(tmp_path_factory) -> tuple[Path, list[str], str]:
    """(the run folder, its settings, its output)."""
    root = tmp_path_factory.mktemp("averaged")
    tokens = token_folder(root / "tokens", np.arange(400) % 11, np.arange(40) % 11,
                          np.arange(40) % 11, 11)
    meta = json.loads((tokens / "meta.json").read_text())  # a token a letter, for sample.py
    (tokens / "meta.json").write_text(json.dumps({**meta, "tokenizer": "characters",
                                                  "characters": "abcdefghijk"}))
    settings = [*AVERAGED_GPT, f"data.root={tokens}"]
    result = run([sys.executable, "train.py", *settings, f"run.dir={root / 'run'}"])
    assert result.returncode == 0, result.stdout
    return root / "run", settings, result.stdout


@pytest.fixture
def in_process():
    """evaluate.main in this process: the logging it sets up put back afterwards."""
    log = logging.getLogger("ddp")
    handlers, level, propagate = list(log.handlers), log.level, log.propagate
    yield
    log.handlers[:], log.propagate = handlers, propagate
    log.setLevel(level)


def averages(checkpoint: Path) -> dict:
    """A checkpoint's averaged weights by every name the model's state has: the head shares the
    token embedding's parameter, whose average it is."""
    ema = read_tensors(checkpoint, "ema")
    return {**ema, "head.weight": ema["token_embedding.weight"]}


def assert_holds(weights: dict, expected: dict) -> None:
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], tensor) for name, tensor in expected.items())


def exported(path: Path) -> dict:
    state = torch.load(path, weights_only=True)
    return state["weights"], state["model"]


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-")[1])


@pytest.mark.slow
def test_model_pt_and_every_export_of_an_averaged_run_hold_its_averages(averaged_run, tmp_path,
                                                                         capsys):
    run_dir, _, output = averaged_run
    last = list_checkpoints(run_dir / "checkpoints")[-1]
    summary = json.loads((run_dir / "summary.json").read_text())
    best = Path(summary["best_checkpoint"])
    trained = read_tensors(last, "model")
    assert not torch.equal(trained["head.weight"], averages(last)["head.weight"])
    # The end of training: model.pt holds the best checkpoint's averages, and says so.
    assert (f"the final model (averaged weights, step {step_of(best)}) in "
            f"{run_dir / MODEL_FILE}") in output
    assert summary["exported"] == {"from": "best", "step": step_of(best), "weights": "averaged"}
    assert exported(run_dir / MODEL_FILE)[0] == "averaged"
    assert_holds(exported(run_dir / MODEL_FILE)[1], averages(best))

    # export.py: the averages by default, the trained weights when asked; each line says which.
    for number, (args, source, expected) in enumerate((
            ([], last, averages(last)), (["--best"], best, averages(best)),
            (["--weights", "trained"], last, trained))):
        target = tmp_path / f"export{number}.pt"
        export.main([str(run_dir), str(target), *args])
        which = "trained" if "trained" in args else "averaged"
        assert capsys.readouterr().out == (
            f"wrote {target}: the {which} weights of {source} (step {step_of(source)})\n")
        assert exported(target)[0] == which
        assert_holds(exported(target)[1], expected)

    # The run's own model.pt rewritten: with the last trained weights, the last averages, then
    # the best's again; summary.json says each time what it holds.
    for args, origin, source, which, expected in (
            (["--weights", "trained"], "last", last, "trained", trained),
            ([], "last", last, "averaged", averages(last)),
            (["--best"], "best", best, "averaged", averages(best))):
        export.main([str(run_dir), *args])
        assert json.loads((run_dir / "summary.json").read_text())["exported"] == {
            "from": origin, "step": step_of(source), "weights": which}
        assert exported(run_dir / MODEL_FILE)[0] == which
        assert_holds(exported(run_dir / MODEL_FILE)[1], expected)


@pytest.mark.slow
def test_safetensors_of_an_averaged_run_hold_its_averages(averaged_run):
    pytest.importorskip("safetensors")  # the baked project's [safetensors] extra
    from safetensors import safe_open

    run_dir, _, _ = averaged_run
    last = list_checkpoints(run_dir / "checkpoints")[-1]
    export.main([str(run_dir), "--format", "safetensors"])
    with safe_open(run_dir / "model.safetensors", "pt") as file:
        assert file.metadata()["weights"] == "averaged"
        stored = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 (not a dict)
    expected = averages(last)
    assert stored and all(torch.equal(stored[key], expected[key]) for key in stored)


@pytest.mark.slow
def test_readers_name_their_weights_and_score_the_averages_the_run_validated(
        averaged_run, tmp_path, capsys, in_process):
    run_dir, _, _ = averaged_run
    step_4, last = list_checkpoints(run_dir / "checkpoints")
    best = Path(json.loads((run_dir / "summary.json").read_text())["best_checkpoint"])
    logged = {record["step"]: record["val_loss"] for record in map(
        json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}

    def evaluated(source: Path, *settings: str) -> tuple[dict, str]:
        out = tmp_path / f"eval{len(list(tmp_path.iterdir()))}"
        evaluate.main([f"eval.checkpoint={source}", "eval.split=val", f"eval.output_dir={out}",
                       *settings])
        return json.loads((out / "metrics.json").read_text()), capsys.readouterr().out

    # A checkpoint: its averages, the loss the run's own validation logged for that step.
    metrics, output = evaluated(step_4)
    assert metrics["weights"] == "averaged"
    assert metrics["loss"] == pytest.approx(logged[4], rel=1e-6)
    assert f"evaluated the averaged weights of {step_4} (step 4) on the val split" in output
    metrics, output = evaluated(step_4, "eval.weights=trained")
    assert abs(metrics["loss"] - logged[4]) > 1e-3
    assert f"evaluated the trained weights of {step_4} (step 4)" in output
    # The newest checkpoint, and the run folder (its model.pt: the best's averages).
    metrics, output = evaluated(run_dir / "checkpoints")
    assert f"evaluated the averaged weights of {last} (step 8)" in output
    assert metrics["loss"] == pytest.approx(logged[8], rel=1e-6)
    metrics, output = evaluated(run_dir)
    model = run_dir / MODEL_FILE
    assert f"evaluated the averaged weights of {model} (step {step_of(best)})" in output
    assert metrics["loss"] == pytest.approx(logged[step_of(best)], rel=1e-6)
    with pytest.raises(UserError) as error:
        evaluated(model, "eval.weights=trained")
    assert str(error.value) == (
        f"eval.weights=trained: {model} holds the averaged weights only (a model file holds "
        f"one set): give the checkpoint it was written from, {best}")

    # sample.py: one line on stderr says which weights write the text.
    for given, args, said in (
            (run_dir, [], f"the averaged weights of {model} (step {step_of(best)})"),
            (step_4, ["--weights", "trained"], f"the trained weights of {step_4} (step 4)")):
        sample.main([str(given), "--prompt", "abc", "--tokens", "3", *args])
        assert capsys.readouterr().err == f"sampling {said}\n"


@pytest.mark.slow
def test_a_checkpoint_requiring_a_part_unknown_here_is_refused_by_every_reader(
        averaged_run, tmp_path, in_process):
    run_dir, settings, _ = averaged_run
    step_4 = list_checkpoints(run_dir / "checkpoints")[0]
    state = torch.load(step_4 / STATE_FILE, weights_only=True)
    assert state["requires"] == {"ema": "1.1.0"}  # the averaged weights: a reader must know them
    future = tmp_path / "future" / "checkpoints" / step_4.name
    shutil.copytree(step_4, future)
    torch.save({**state, "requires": {**state["requires"], "lora": "1.4.0"}},
               future / STATE_FILE)
    (future / MANIFEST_FILE).unlink()
    write_manifest(future)  # as the release that wrote it would have: intact
    refusal = (f"cannot load checkpoint {future}: it holds a part 'lora', written by template "
               f"release 1.4.0, which this engine (release {__version__}) does not know and "
               "would drop: update the project to release 1.4.0 or a later one (cruft update, "
               "docs/updates.md), or read the checkpoint with the project that wrote it")
    resumed = run([sys.executable, "train.py", *settings, f"train.resume={future}",
                   f"run.output_dir={tmp_path / 'runs'}"])
    assert resumed.returncode == 2, resumed.stdout
    assert f"error: {refusal}" in resumed.stdout.splitlines()
    assert resumed.stdout.count(refusal) == 1 and "Traceback" not in resumed.stdout
    for reader in (lambda: export.main([str(future), str(tmp_path / "model.pt")]),
                   lambda: evaluate.main([f"eval.checkpoint={future}"]),
                   lambda: sample.main([str(future)])):
        with pytest.raises(UserError) as error:
            reader()
        assert str(error.value) == refusal
    assert not (tmp_path / "model.pt").exists()


@pytest.mark.slow
def test_a_resume_without_averaging_drops_the_averages_in_one_warning(averaged_run, tmp_path):
    run_dir, settings, _ = averaged_run
    step_4 = list_checkpoints(run_dir / "checkpoints")[0]
    plain = tmp_path / "plain"
    resumed = run([sys.executable, "train.py", *settings, "train.ema_decay=0",
                   "train.export=last", f"train.resume={step_4}", f"run.dir={plain}"])
    assert resumed.returncode == 0, resumed.stdout
    assert resumed.stdout.count(
        f"resuming without the averaged weights that {step_4} holds: train.ema_decay is off in "
        "this run, so they are dropped (train.ema_decay=0.9 keeps them)") == 1
    last = list_checkpoints(plain / "checkpoints")[-1]
    assert saved_parts(last) == {"model", "optimizer"}
    assert torch.load(last / STATE_FILE, weights_only=True)["requires"] == {}
    assert json.loads((plain / "summary.json").read_text())["exported"] == {
        "from": "last", "step": 8, "weights": "trained"}
    # The step guard's state, dropped alike by a run with the guard off.
    guarded = {"guard": {"losses": [1.0], "in_a_row": [0]}, "requires": {"guard": "1.1.0"},
               "config": {"guard": {"enabled": True}}}
    assert dropped_parts(step_4, guarded, {"model", "optimizer"}, {"guard": None}) == [
        f"resuming without the step guard's recent losses that {step_4} holds: guard.enabled is "
        "off in this run, so they are dropped (guard.enabled=true keeps them)"]
    # Averaged weights asked of a checkpoint without them: one line.
    with pytest.raises(UserError) as error:
        export.main([str(plain), str(tmp_path / "model.pt"), "--weights", "averaged"])
    assert str(error.value) == (
        f"--weights averaged: {last} holds no averaged weights (its run kept none: "
        "train.ema_decay=0): leave it out for the trained ones, or give a checkpoint of a run "
        "trained with train.ema_decay")


@pytest.mark.slow
def test_a_run_resumed_with_averages_ends_bit_for_bit(tmp_path, strategy="fsdp"):
    """40 steps, a checkpoint every 20: resumed from step 20, model.pt (the averages) ends as
    the uninterrupted run's. Under FSDP2, whose averages are shards as its
    weights are (DDP's are whole tensors: the same code, nothing sharded)."""
    from test_checkpoints import assert_bitwise_equal

    settings = [*TINY, "train.max_steps=40", "train.ckpt_every=20", "train.keep_checkpoints=0",
                "train.ema_decay=0.9", f"parallel.strategy={strategy}"]
    result = run(["./run.sh", *settings, f"run.output_dir={tmp_path / 'whole'}"],
                 NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stdout
    whole = only_run_dir(tmp_path / "whole")
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["exported"] == {"from": "last", "step": 40, "weights": "averaged"}
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
