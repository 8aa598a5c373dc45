"""The traps a first experiment of one's own fell into (issue 43), each closed: a parameter-group
builder of yours keeps the no-decay rule (optimizers.decay_groups), the curves show every group's
learning rate, samples that cannot be stacked are one line naming Splits(collate=...), a
schedule that keeps the default warmup says so, check_equivalence.py lists --config, the
project's data/ stays out of git, and a setting of settings.py named like a template one is
warned of. (The logged rate is the step's own: test_training_log.py's real run; evaluating a
run folder that exported its best: test_validation.py.)"""

import dataclasses
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import check_equivalence
import fixtures
from conftest import TINY
from ddpkit import optimizers, recipes
from ddpkit.config import load_config, notes_at_start
from ddpkit.data import DataModule
from ddpkit.dist_utils import DistEnv
from ddpkit.report import RunHistory
from ddpkit.schema import names_near_the_templates
from ddpkit.streams import DataError

PROJECT = Path(__file__).resolve().parent.parent


class Encoder(nn.Module):
    """A BERT-like model in small: an embedding, a LayerNorm and a classifier head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.classifier = nn.Linear(16, 3)


def head_faster(model: nn.Module, cfg) -> list[dict]:
    """The README's example: the classifier head at ten times the rate."""
    def is_head(name: str) -> bool:
        return name.startswith("classifier.")

    decay = cfg.optim.weight_decay
    return [*optimizers.decay_groups(model, decay, only=lambda name: not is_head(name),
                                     name="body"),
            *optimizers.decay_groups(model, decay, only=is_head, name="head",
                                     lr=cfg.optim.lr * 10)]


def test_a_param_groups_builder_of_yours_keeps_biases_and_norms_out_of_the_decay(monkeypatch):
    monkeypatch.setitem(optimizers.PARAM_GROUPS, "head_faster", head_faster)
    model = Encoder()
    cfg = load_config(["optim.param_groups=head_faster", "optim.lr=0.001",
                       "optim.weight_decay=0.1"])
    optimizer = optimizers.build_optimizer(model, cfg, fused=False)
    names = {id(p): name for name, p in model.named_parameters()}
    assert [(group["name"], sorted(names[id(p)] for p in group["params"]), group["lr"],
             group["weight_decay"]) for group in optimizer.param_groups] == [
        ("body", ["embed.weight"], 0.001, 0.1),
        ("body.no_decay", ["embed.bias", "norm.bias", "norm.weight"], 0.001, 0.0),
        ("head", ["classifier.weight"], 0.01, 0.1),
        ("head.no_decay", ["classifier.bias"], 0.01, 0.0)]
    assert optimizers.rate_names(optimizer) == [
        "lr/body", "lr/body.no_decay", "lr/head", "lr/head.no_decay"]


def test_the_curves_show_each_groups_learning_rate():
    windows = [{"step": step, "lr": 0.1 * step, "lr/body": 0.1 * step,
                "lr/body.no_decay": 0.1 * step, "lr/head": step, "lr/head.no_decay": step}
               for step in (1, 5)]
    assert RunHistory(Path("run"), windows).learning_rates() == {
        "body, body.no_decay": [(1, 0.1), (5, 0.5)], "head, head.no_decay": [(1, 1), (5, 5)]}
    older = [{"step": 1, "lr": 0.1}, {"step": 5, "lr": 0.5}]  # a log of release 1.0.0
    assert RunHistory(Path("run"), older).learning_rates() == {"lr": [(1, 0.1), (5, 0.5)]}


def unpadded_sequences(cfg):
    """Token sequences of different lengths, without the collate that pads them."""
    return dataclasses.replace(fixtures.sequences(cfg), collate=None)


def test_samples_that_cannot_be_stacked_are_one_line_naming_splits_collate():
    dataset = "tests/test_first_hour.py:unpadded_sequences"
    cfg = load_config([*TINY, f"data.dataset={dataset}", "task.target_key=label"])
    data = DataModule(cfg, DistEnv(0, 0, 1, False), torch.device("cpu"))
    lengths = list(dict.fromkeys(len(sample["tokens"]) for sample in data.first_samples(3)))
    assert len(lengths) == 2  # two of one length, then another
    message = (f"data.dataset={dataset}: the samples of a batch differ in shape at "
               f"sample['tokens'] ([{lengths[0]}], [{lengths[1]}]), which torch's default "
               "collate cannot stack: give the dataset builder a collate that pads them, "
               "Splits(collate=...) in data_sources.py")
    with pytest.raises(DataError) as raised:
        data.sample_batch(3)  # what start-up makes first (of 2 samples)
    assert str(raised.value) == message
    with pytest.raises(DataError, match=r"Splits\(collate=\.\.\.\)"):
        next(iter(data.train_batches(epoch=0)))


def test_a_chosen_schedule_that_keeps_the_default_warmup_says_so():
    given = ["optim.schedule", "optim.step_size"]
    cfg = load_config(["optim.schedule=step", "optim.step_size=100"])
    assert notes_at_start(cfg, given) == [
        "optim.schedule=step keeps the default warmup: the rate rises from lr/20 to lr over the "
        "first 20 steps (optim.warmup_steps=0 for none)"]
    assert notes_at_start(load_config([]), []) == []  # the defaults: the run description says
    chosen = load_config(["optim.schedule=step", "optim.step_size=100", "optim.warmup_steps=5"])
    assert notes_at_start(chosen, [*given, "optim.warmup_steps"]) == []


def test_check_equivalence_help_lists_config(capsys):
    with pytest.raises(SystemExit):
        check_equivalence.main(["--help"])
    assert "--config FILE" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_projects_data_folder_stays_out_of_git(tmp_path):
    shutil.copy(PROJECT / ".gitignore", tmp_path / ".gitignore")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", "data/digits_shards-0/train.npy", "data/mine.csv",
         "ddpkit/data.py", "tests/data/x.csv"], cwd=tmp_path, capture_output=True, text=True)
    assert ignored.stdout.split() == ["data/digits_shards-0/train.npy", "data/mine.csv"]


def test_a_setting_of_yours_named_like_a_template_one_is_warned_of(monkeypatch):
    @dataclasses.dataclass
    class ModelSettings:
        n_layer: int = 4
        vocab_size: int = 100

    @dataclasses.dataclass
    class Empty:
        pass

    mine = SimpleNamespace(DataSettings=Empty, ModelSettings=ModelSettings, TaskSettings=Empty)
    monkeypatch.setattr(recipes, "load_settings", lambda: mine)
    assert names_near_the_templates() == [
        "settings.py's model.n_layer is named like the template's model.num_layers, and the "
        "config holds both: if yours means the same, drop it and read model.num_layers; if "
        "not, a name less alike ends this warning"]
