"""Batches of any shape: a builder's collate (variable-length sequences padded per batch), its
training sampler and drop_last reach every loader; dict samples reach the model as keyword
arguments; a task reads a tensor, a dict or an object from the model; FLOPs are counted for
such models too."""

import json
import sys

import pytest
import torch

from conftest import TINY, fixture, only_run_dir, run, torchrun
from ddpkit.config import load_config
from ddpkit.data import DataModule
from ddpkit.dist_utils import DistEnv
from ddpkit.evaluation import evaluate_split
from ddpkit.models import call_model
from ddpkit.parallel import build_model
from ddpkit.tasks import build_task
from ddpkit.utilization import count_flops
from fixtures import BagOfTokens, Outputs

SEQUENCES = [*TINY, f"data.dataset={fixture('sequences')}",
             f"model.name={fixture('bag_of_tokens')}", "task.target_key=label",
             "model.hidden_dim=16", "eval.batch_size=10"]


def data_for(args: list[str], rank: int = 0, world: int = 1) -> DataModule:
    cfg = load_config(args, world_size=world)
    return DataModule(cfg, DistEnv(rank, rank, world, world > 1), torch.device("cpu"))


def test_the_builders_collate_makes_every_batch_and_limits_keep_it():
    data = data_for(SEQUENCES)
    widths = set()
    for batch in data.train_batches(epoch=0):
        assert batch.keys() == {"tokens", "mask", "label"}
        assert batch["tokens"].shape == batch["mask"].shape
        assert batch["mask"].sum(1).min() >= 3 and batch["mask"].any(0).all()  # the longest fills
        widths.add(batch["tokens"].shape[1])
    assert len(widths) > 1  # padded to each batch's own longest sequence
    # limit_val_batches: the first 2 batches of 10, made by the same collate.
    whole, limited = list(data.eval_loader("val")), list(data.eval_loader("val", 2))
    assert len(limited) == 2 and len(whole) == 6  # 53 samples
    for kept, full in zip(limited, whole, strict=False):
        assert kept.keys() == full.keys()
        assert all(torch.equal(kept[key], full[key]) for key in kept)
    # A dataset read in whole batches keeps that path under a limit too (no per-sample collate).
    assert data_for(TINY).eval_loader("val", 2).batch_size is None


def test_dict_batches_less_the_target_reach_the_model_as_keyword_arguments():
    data = data_for(SEQUENCES)
    cfg = data.cfg
    task = build_task(cfg, data.splits)
    batch = next(iter(data.train_batches(epoch=0)))
    inputs = task.model_inputs(batch)
    assert inputs.keys() == {"tokens", "mask"} and torch.equal(task.targets(batch), batch["label"])
    model = build_model(cfg.model, task.input_shape(data.datasets["train"][0]), task.num_outputs,
                        inputs)
    assert call_model(model, inputs).shape == (len(batch["label"]), 4)


def test_a_forward_that_takes_the_whole_dict_is_refused_at_start_in_one_line(tmp_path):
    result = torchrun(2, "train.py", *TINY, f"data.dataset={fixture('dict_vectors')}",
                      f"model.name={fixture('whole_dict_model')}", f"run.output_dir={tmp_path}")
    assert result.returncode != 0
    errors = [line for line in result.stdout.splitlines() if line.startswith("error")]
    assert errors == [
        f"error: model.name={fixture('whole_dict_model')}: dict samples reach the model as "
        "keyword arguments (features), which its forward(batch: dict) -> torch.Tensor does not "
        "take: write forward(self, features) instead of a forward that takes the whole dict"]
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # no run folder left


def test_a_task_reads_a_tensor_a_dict_or_an_object_and_ignores_the_models_loss():
    data = data_for(SEQUENCES)
    task = build_task(data.cfg, data.splits)
    results, losses = {}, {}
    batch = next(iter(data.train_batches(epoch=0)))
    for returns in ("tensor", "dict", "object"):
        torch.manual_seed(0)
        model = BagOfTokens(4, 16, returns)
        outputs = call_model(model, task.model_inputs(batch))
        losses[returns] = task.loss(outputs, batch).item()
        results[returns] = evaluate_split(model, data.eval_loader("test"), torch.device("cpu"),
                                          task)
    assert isinstance(outputs, Outputs)
    assert losses["dict"] == losses["object"] == losses["tensor"] < 10  # not the model's 1000 x
    for returns in ("dict", "object"):
        assert results[returns]["accuracy"] == results["tensor"]["accuracy"]
        assert results[returns]["loss"] == pytest.approx(results["tensor"]["loss"], rel=1e-12)


def test_drop_last_leaves_out_an_epochs_incomplete_batch():
    # 228 training samples in global batches of 40: 5 full steps and 28 samples left over.
    args = [*SEQUENCES, "train.global_batch_size=40"]
    padded = data_for(args, rank=1, world=2)
    assert padded.steps_per_epoch == 6
    for world in (1, 2):
        shards = [data_for([*args, f"data.dataset={fixture('sequences_drop_last')}"], rank,
                           world) for rank in range(world)]
        assert shards[0].steps_per_epoch == shards[0].full_steps_per_epoch == 5
        steps = [list(shard.train_steps(epoch=0)) for shard in shards]
        assert all(len(batches) == 5 for batches in steps)
        sizes = {len(step[0]["label"]) for batches in steps for step in batches}
        assert sizes == {40 // world}  # every batch full


def positions(data: DataModule, epoch: int, skip: int = 0) -> list[list[int]]:
    """The lengths of the sequences of every training batch (the sampler sorts by them)."""
    return [step[0]["mask"].sum(1).tolist() for step in data.train_steps(epoch, skip)]


def test_a_training_sampler_of_the_builder_orders_the_epoch_and_resumes_mid_epoch():
    args = [*SEQUENCES, f"data.dataset={fixture('sequences_by_length')}"]
    shards = [data_for(args, rank, 2) for rank in (0, 1)]
    for shard in shards:
        assert type(shard.train_sampler.sampler).__name__ == "ByLength"
        lengths = [length for batch in positions(shard, epoch=0) for length in batch]
        assert lengths == sorted(lengths)  # the builder's order, not a shuffle
        assert positions(shard, epoch=1, skip=3) == positions(shard, epoch=1)[3:]  # a resume
    # The two ranks' shares of an epoch are disjoint, and set_epoch reaches the sampler.
    for shard in shards:
        shard.train_sampler.set_epoch(0)
    orders = [list(shard.train_sampler) for shard in shards]
    assert not set(orders[0]) & set(orders[1])
    shards[0].train_sampler.set_epoch(1)
    assert list(shards[0].train_sampler) != orders[0]


class ReadsValues(BagOfTokens):
    """BagOfTokens that reads a value (.item()): it cannot run on the meta device."""

    def forward(self, tokens, mask):
        if mask.sum().item() < 0:
            raise AssertionError
        return super().forward(tokens, mask)


def test_flops_of_a_model_that_cannot_run_on_meta_are_counted_on_a_copy():
    data = data_for(SEQUENCES)
    task = build_task(data.cfg, data.splits)
    shape = task.input_shape(data.datasets["train"][0])
    model = ReadsValues(4, 16)
    on_meta = count_flops(data.cfg, data, task, shape, BagOfTokens(4, 16))
    state = torch.get_rng_state()
    on_copy = count_flops(data.cfg, data, task, shape, model)
    assert torch.equal(torch.get_rng_state(), state)  # the run's random stream is untouched
    assert not any(p.grad is not None for p in model.parameters())  # nor its model
    assert on_meta and on_copy == on_meta


@pytest.mark.slow  # three launches: the quick tier (-m 'not slow') skips it
def test_padded_sequences_train_on_two_processes_and_evaluate_alike_at_one_and_three(tmp_path):
    # A training sampler of the builder's, dict samples padded by its collate, keyword inputs,
    # a model returning a dict with a loss of its own; limit_val_batches during training.
    result = torchrun(2, "train.py", *SEQUENCES, "train.epochs=2", "train.limit_val_batches=2",
                      f"data.dataset={fixture('sequences_by_length')}", "model.name="
                      f"{fixture('bag_of_tokens_dict')}", f"run.output_dir={tmp_path}")
    assert result.returncode == 0, result.stdout
    assert "model FLOPs: not counted" not in result.stdout
    run_dir = only_run_dir(tmp_path)
    steps = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert all(step["loss"] < 10 for step in steps)  # the task's loss, not the model's
    assert steps[-1].get("tflops_per_rank", 1) > 0
    metrics = {}
    for nproc in (1, 3):
        out = tmp_path / f"eval-{nproc}"
        command = [sys.executable, "evaluate.py", f"eval.checkpoint={run_dir}",
                   f"eval.output_dir={out}"]
        evaluated = (run(command) if nproc == 1 else
                     torchrun(nproc, *command[1:]))
        assert evaluated.returncode == 0, evaluated.stdout
        metrics[nproc] = json.loads((out / "metrics.json").read_text())
    assert metrics[1]["num_samples"] == metrics[3]["num_samples"] == 71
    for key in ("accuracy", "loss", "average_precision_macro"):
        assert metrics[1][key] == pytest.approx(metrics[3][key], rel=1e-9)


def test_a_target_key_the_batches_lack_is_one_line(tmp_path):
    result = run([sys.executable, "train.py", *SEQUENCES, f"run.output_dir={tmp_path}",
                  "task.target_key=target"])
    assert result.returncode != 0
    assert result.stdout.strip().splitlines()[-1] == (
        "error: task.target_key=target is not a key of the dict samples (label, tokens): set it "
        "to the key of the target")


def test_fast_dev_run_goes_through_the_collate_and_the_sampler_of_the_builder(tmp_path):
    result = torchrun(2, "train.py", *SEQUENCES, "train.fast_dev_run=true",
                      f"data.dataset={fixture('sequences_by_length')}",
                      f"run.output_dir={tmp_path / 'runs'}")
    assert result.returncode == 0, result.stdout
    assert result.stdout.count("fast_dev_run ok") == 1, result.stdout


def test_a_training_sampler_that_gives_the_ranks_different_lengths_is_one_line(tmp_path):
    result = torchrun(2, "train.py", *SEQUENCES, f"data.dataset={fixture('sequences_uneven')}",
                      f"run.output_dir={tmp_path}")
    assert result.returncode != 0
    errors = [line for line in result.stdout.splitlines() if line.startswith("error")]
    assert errors == [f"error: data.dataset={fixture('sequences_uneven')}: its train_sampler "
                      "gives the ranks different numbers of samples ([114, 113]): every rank "
                      "must take as many as the others"]
