"""The built-in examples of ddpkit/datasets.py and ddpkit/models.py; every other test uses the
tests' own fixtures (tests/fixtures.py)."""

import numpy as np
import pytest
import torch

from ddpkit import datasets
from ddpkit.config import load_config
from ddpkit.data import DataModule
from ddpkit.datasets import DATASETS
from ddpkit.dist_utils import DistEnv
from ddpkit.parallel import build_model
from ddpkit.schema import DATASET_NAMES, declarations
from ddpkit.tasks import build_task

ONE = DistEnv(0, 0, 1, False)
CPU = torch.device("cpu")


def built(*overrides: str):
    cfg = load_config(list(overrides))
    data = DataModule(cfg, ONE, CPU)
    return data, build_task(cfg, data.splits)


def test_digits_is_the_default_dataset():
    data, task = built()
    assert sum(len(d) for d in data.datasets.values()) == 1797  # scikit-learn's digits
    sample = data.datasets["train"][0]
    assert (task.input_shape(sample), task.num_outputs) == ((1, 8, 8), 10)
    assert type(task).__name__ == "MulticlassTask"


def test_digits_files_are_written_once_and_read_from_disk(tmp_path):
    data, _ = built()
    folder, files = built("data.dataset=digits_files")
    samples = folder.datasets["train"]
    assert (samples.root / "labels.csv").is_file() and len(list(samples.root.glob("*.npy"))) == 1797
    # The same split as the in-memory digits, image for image (no augmentation off training).
    test_disk = torch.stack([folder.datasets["test"][i][0] for i in range(5)])
    assert torch.equal(test_disk, data.datasets["test"].inputs[:5])
    moved = tmp_path / "moved"
    samples.root.rename(moved)
    try:
        again, _ = built("data.dataset=digits_files", f"data.root={moved}")
        assert len(again.datasets["test"]) == len(folder.datasets["test"])
    finally:
        moved.rename(samples.root)


def test_breast_cancer_is_binary_with_malignant_positive():
    data, task = built("data.dataset=breast_cancer")
    assert sum(len(d) for d in data.datasets.values()) == 569
    assert type(task).__name__ == "BinaryTask" and task.num_outputs == 1
    labels = torch.cat([data.datasets[s].targets for s in ("train", "val", "test")])
    assert labels.sum().item() == 212  # malignant tumours
    assert abs(data.datasets["train"].inputs.mean().item()) < 1e-5  # standardised


def test_diabetes_is_regression_in_the_original_units():
    data, task = built("data.dataset=diabetes")
    assert sum(len(d) for d in data.datasets.values()) == 442
    assert type(task).__name__ == "RegressionTask"
    targets = data.datasets["train"].targets
    assert targets.min().item() >= 25 and targets.max().item() <= 346  # the data's own units
    assert task.mean == pytest.approx(targets.double().mean().item())


@pytest.mark.parametrize("dataset", ["synthetic", "images"])
def test_synthetic_examples(dataset):
    data, task = built(f"data.dataset={dataset}", "data.synthetic_samples=200")
    assert sum(len(d) for d in data.datasets.values()) == 200 and task.num_outputs == 4


@pytest.mark.parametrize(("name", "dataset"), [("mlp", "digits"), ("cnn", "digits")])
def test_example_models_give_one_output_per_class(name, dataset):
    data, task = built(f"model.name={name}", f"data.dataset={dataset}")
    sample = data.datasets["train"][0]
    model = build_model(load_config([f"model.name={name}"]).model, task.input_shape(sample),
                        task.num_outputs)
    assert model(sample[0][None]).shape == (1, 10)
    assert np.isfinite(model(sample[0][None]).detach().numpy()).all()


class ReadsRecorded:
    """A data section that notes each key a builder reads (as attribute, item or get)."""

    def __init__(self, section):
        self.section, self.read = section, set()

    def __getattr__(self, key):
        self.read.add(key)
        return self.section[key]

    __getitem__ = __getattr__

    def get(self, key, default=None):
        self.read.add(key)
        return self.section.get(key, default)


def test_each_data_setting_names_the_built_in_datasets_that_read_it(tmp_path, monkeypatch):
    """A data setting that only some built-in datasets read names them in its acts_with, so that
    given with another it is named as having no effect (config.inactive_settings); the
    declarations are held to what each builder really reads. The folders of digits_files and
    digits_shards are written afresh, as on first use (written, they are read as they are)."""
    monkeypatch.setattr(datasets, "PROJECT_DIR", tmp_path)
    built_in = [name for name, builder in DATASETS.items()  # (not those of data_sources.py)
                if builder.__module__ in ("ddpkit.datasets", "ddpkit.tokens")]
    assert tuple(built_in) == DATASET_NAMES
    reads = {}
    for name in DATASET_NAMES:
        section = ReadsRecorded(load_config([f"data.dataset={name}"]).data)
        DATASETS[name](section)
        reads[name] = {f"data.{key}" for key in section.read}
    read_by_some = set.union(*reads.values()) - set.intersection(*reads.values())
    declared = {key: tuple(d.acts_with[1:]) for key, d in declarations().items()
                if d.acts_with[:1] == ("data.dataset",)}
    assert set(declared) == read_by_some
    assert {key: tuple(name for name in DATASET_NAMES if key in reads[name])
            for key in declared} == declared
