"""A Hugging Face model through the whole project: a tiny BERT built from its config (nothing
downloaded) reads padded, variable-length dict batches as keyword arguments (input_ids,
attention_mask) and returns a ModelOutput. It trains on 2 processes, evaluates alike at 1, 2 and
3 (metrics equal to scikit-learn's on the saved predictions), its FLOPs are counted, and
check_equivalence.py passes. The recipe is a file of the test's own, outside the project; the
test is skipped where the [transformers] extra is not installed."""

import json
import re
import sys
import textwrap

import numpy as np
import pytest
from sklearn.metrics import accuracy_score, average_precision_score, log_loss

from conftest import only_run_dir, run, torchrun

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # several multi-process runs: the quick tier skips them

RECIPE = '''
"""Sentences of token ids of different lengths (dict samples) and a tiny BERT classifier."""

import numpy as np
import torch
import transformers

from ddpkit.splits import Splits, split_indices

VOCABULARY, CLASSES, SAMPLES = 40, 3, 240


class Sentences(torch.utils.data.Dataset):
    def __init__(self, ids, labels):
        self.ids, self.labels = ids, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "label": torch.tensor(int(self.labels[index]))}


def pad(samples):
    """input_ids padded with 0 to the batch's longest; attention_mask marks the tokens."""
    ids = torch.nn.utils.rnn.pad_sequence([s["input_ids"] for s in samples], batch_first=True)
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask,
            "label": torch.stack([s["label"] for s in samples])}


def sentences(cfg):
    rng = np.random.default_rng(cfg.split_seed)
    labels = rng.permutation(np.arange(SAMPLES) % CLASSES)
    ids = []
    for label in labels:  # [CLS]=1, then tokens mostly from the class's own range
        length = int(rng.integers(4, 14))
        own = rng.random(length) < 0.7
        tokens = np.where(own, 2 + label * 12 + rng.integers(0, 12, length),
                          rng.integers(2, VOCABULARY, length))
        ids.append(torch.from_numpy(np.concatenate([[1], tokens])).long())
    split = split_indices(cfg, SAMPLES, labels)
    parts = [Sentences([ids[i] for i in split[name]], labels[split[name]])
             for name in ("train", "val", "test")]
    return Splits(*parts, task="multiclass", num_classes=CLASSES, collate=pad)


def tiny_bert(cfg, input_shape, num_outputs):
    config = transformers.BertConfig(
        vocab_size=VOCABULARY, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, num_labels=num_outputs,
        hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout)
    return transformers.BertForSequenceClassification(config)
'''


@pytest.fixture
def recipe(tmp_path):
    """The recipe's file, outside the project, and the settings that name it."""
    path = tmp_path / "recipe" / "bert_recipe.py"
    path.parent.mkdir()
    path.write_text(textwrap.dedent(RECIPE))
    return [f"data.dataset={path}:sentences", f"model.name={path}:tiny_bert",
            "task.target_key=label", "train.global_batch_size=12", "train.epochs=4",
            "optim.lr=0.01", "optim.warmup_steps=5", "train.log_every=5",
            "train.progress_bar=false", "train.plot_curves=false", "eval.batch_size=8"]


def test_a_tiny_bert_trains_on_two_processes_and_evaluates_alike_at_one_two_and_three(
        tmp_path, recipe):
    result = torchrun(2, "train.py", *recipe, f"run.output_dir={tmp_path / 'runs'}")
    assert result.returncode == 0, result.stdout
    counted = re.search(r"model FLOPs: ([0-9.e+-]+) GFLOP per training sample", result.stdout)
    assert counted and float(counted.group(1)) > 0, result.stdout
    run_dir = only_run_dir(tmp_path / "runs")
    steps = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert all(step["tflops_per_rank"] > 0 for step in steps[1:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "done" and summary["last"] > 0.5  # it learned (3 classes)
    metrics, saved = {}, {}
    for nproc in (1, 2, 3):
        out = tmp_path / f"eval-{nproc}"
        args = ["evaluate.py", f"eval.checkpoint={run_dir}", f"eval.output_dir={out}",
                "eval.save_predictions=true"]
        evaluated = run([sys.executable, *args]) if nproc == 1 else torchrun(nproc, *args)
        assert evaluated.returncode == 0, evaluated.stdout
        metrics[nproc] = json.loads((out / "metrics.json").read_text())
        saved[nproc] = np.load(out / "predictions.npz")
    for nproc in (2, 3):  # padded to other widths in other batches: equal to float rounding
        assert metrics[nproc]["num_samples"] == metrics[1]["num_samples"] == 48
        assert np.array_equal(saved[nproc]["targets"], saved[1]["targets"])
        np.testing.assert_allclose(saved[nproc]["predictions"], saved[1]["predictions"],
                                   rtol=1e-5, atol=1e-6)
        for key in ("accuracy", "average_precision_macro", "average_precision_micro", "loss"):
            assert metrics[nproc][key] == pytest.approx(metrics[1][key], rel=1e-5, abs=1e-6)
    for nproc in (1, 2, 3):  # each against scikit-learn on its own saved predictions
        targets, probabilities = saved[nproc]["targets"], saved[nproc]["predictions"]
        onehot = np.eye(3)[targets]
        assert metrics[nproc]["accuracy"] == pytest.approx(
            accuracy_score(targets, probabilities.argmax(1)), abs=1e-12)
        assert metrics[nproc]["average_precision_macro"] == pytest.approx(
            average_precision_score(onehot, probabilities, average="macro"), abs=1e-9)
        assert metrics[nproc]["average_precision_micro"] == pytest.approx(
            average_precision_score(onehot, probabilities, average="micro"), abs=1e-9)
        assert metrics[nproc]["loss"] == pytest.approx(
            log_loss(targets, probabilities, labels=[0, 1, 2]), rel=1e-5)


def test_check_equivalence_passes_for_the_tiny_bert(tmp_path, recipe):
    result = run([sys.executable, "check_equivalence.py", "--nproc", "2", "--steps", "6",
                  *recipe], timeout=400)
    assert result.returncode == 0, result.stdout
    assert "PASS: 2 process(es)" in result.stdout
