"""metrics.py against scikit-learn on seeded random cases: ties, tiny splits, absent classes."""

import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
import sklearn.metrics as skm
import torch

from ddpkit import metrics

# scikit-learn warns when a class is absent; those cases are tested on purpose.
pytestmark = [
    pytest.mark.filterwarnings("ignore::sklearn.exceptions.UndefinedMetricWarning"),
    pytest.mark.filterwarnings("ignore:No positive class found:UserWarning"),
    pytest.mark.filterwarnings("ignore:A single label was found:UserWarning"),
]


def make_case(seed: int, size: int, kind: str, rate: float | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores in [0, 1] that mildly predict the labels. kind: "continuous", "rounded" (2
    decimals: ties) or "coarse" (5 levels: many ties)."""
    generator = torch.Generator().manual_seed(seed)
    rate = torch.rand((), generator=generator).item() if rate is None else rate
    positive = torch.rand(size, generator=generator, dtype=torch.float64) < rate
    noise = torch.randn(size, generator=generator, dtype=torch.float64)
    scores = torch.sigmoid(positive.double() + noise)
    if kind == "rounded":
        scores = torch.round(scores, decimals=2)
    elif kind == "coarse":
        scores = torch.round(scores * 4) / 4
    return scores, positive


CASES = [(seed, size, kind, rate) for seed, size in enumerate([1, 2, 2, 3, 7, 50, 400])
         for kind in ["continuous", "rounded", "coarse"] for rate in [None, 0.0, 1.0]]


def case_id(case: tuple) -> str:
    seed, size, kind, rate = case
    return f"n{size}-{kind}-rate{rate}-s{seed}"


def both_classes(positive: torch.Tensor) -> bool:
    return bool(positive.any()) and bool((~positive).any())


def assert_close(ours: torch.Tensor, theirs: np.ndarray) -> None:
    assert ours.dtype == torch.float64
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_precision_recall_curve_and_average_precision(case):
    scores, positive = make_case(*case)
    precision, recall, thresholds = metrics.precision_recall_curve(scores, positive)
    want_p, want_r, want_t = skm.precision_recall_curve(positive.numpy(), scores.numpy())
    assert_close(precision, want_p)
    assert_close(recall, want_r)
    assert_close(thresholds, want_t)
    assert len(precision) == len(recall) == len(thresholds) + 1
    want_ap = skm.average_precision_score(positive.numpy(), scores.numpy())
    assert metrics.average_precision(precision, recall) == pytest.approx(want_ap, abs=1e-12)


def many_classes(seed: int, samples: int, classes: int, kind: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax scores [samples, classes] that mildly favour each sample's label; "rounded" and
    "coarse" round them (ties within a class's column and between positives and negatives)."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(classes, (samples,), generator=generator)
    logits = torch.randn(samples, classes, generator=generator, dtype=torch.float64)
    logits[torch.arange(samples), labels] += 1.5
    scores = logits.softmax(dim=1)
    if kind == "rounded":
        scores = torch.round(scores, decimals=2)
    elif kind == "coarse":
        scores = torch.round(scores * 4) / 4
    return scores, labels


@pytest.mark.parametrize("kind", ["continuous", "rounded", "coarse"])
@pytest.mark.parametrize(("seed", "samples", "classes"), [(0, 1, 2), (1, 7, 5), (2, 300, 50),
                                                           (3, 2000, 50), (4, 40, 60)])
def test_average_precision_per_class(kind, seed, samples, classes):
    """The vectorised per-class AP (validation's, every epoch) against scikit-learn and against
    the per-class curves it replaced, with absent classes (60 classes, 40 samples), ties and
    column blocks of several sizes."""
    scores, labels = many_classes(seed, samples, classes, kind)
    loop = [metrics.average_precision(*metrics.precision_recall_curve(scores[:, c],
                                                                      labels == c)[:2])
            for c in range(classes)]
    for chunk in (1, 97, 1 << 24):  # one sample per block, a few, all of them
        got = metrics.average_precision_per_class(scores, labels, chunk_elements=chunk)
        assert got.dtype == torch.float64 and got.shape == (classes,)
        # The same float64 terms added in another order: equal to the last bits.
        np.testing.assert_allclose(got.numpy(), loop, rtol=1e-15, atol=1e-16)
    for c in range(classes):
        positive = (labels == c).numpy()
        want = (skm.average_precision_score(positive, scores[:, c].numpy())
                if positive.any() else 0.0)  # scikit-learn warns and gives 0 (or -0.0)
        assert got[c].item() == pytest.approx(want, abs=1e-12), c


@pytest.mark.parametrize("kind", ["continuous", "coarse"])
def test_average_precision_per_class_unbalanced(kind):
    """One class with half the samples, a few with a tenth, the rest rare: the classes go into
    tables of several widths, and the result is still the per-class curves'."""
    scores, labels = many_classes(8, 1200, 40, kind)
    generator = torch.Generator().manual_seed(9)
    draw = torch.rand(1200, generator=generator)
    labels = torch.where(draw < 0.5, 0, torch.where(draw < 0.8, 1 + (draw * 100).long() % 3,
                                                    labels))
    loop = [metrics.average_precision(*metrics.precision_recall_curve(scores[:, c],
                                                                      labels == c)[:2])
            for c in range(40)]
    for chunk in (50, 1 << 24):
        got = metrics.average_precision_per_class(scores, labels, chunk_elements=chunk)
        np.testing.assert_allclose(got.numpy(), loop, rtol=1e-15, atol=1e-16)


def test_multiclass_validation_metrics_are_the_evaluation_ones():
    """What validation logs each epoch (detail=False, no curves) is what evaluate.py reports
    (detail=True) and scikit-learn's, at 50 classes with ties."""
    from omegaconf import OmegaConf

    from ddpkit.splits import Splits
    from ddpkit.tasks import MulticlassTask

    scores, labels = many_classes(6, 1500, 50, "rounded")
    task = MulticlassTask(OmegaConf.create({}), Splits(None, None, None, "multiclass", 50), None)
    rows = torch.cat([labels.double()[:, None], scores], dim=1)
    quick, full = task.metrics(rows, detail=False), task.metrics(rows, detail=True)
    assert set(quick) == {"accuracy", "average_precision_macro"}
    assert {key: full[key] for key in quick} == quick
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # absent classes
        per_class = [skm.average_precision_score(labels == c, scores[:, c]) for c in range(50)]
    np.testing.assert_allclose(full["average_precision_per_class"], per_class, atol=1e-12)
    assert quick["average_precision_macro"] == pytest.approx(np.mean(per_class), abs=1e-12)
    assert quick["accuracy"] == skm.accuracy_score(labels, scores.argmax(dim=1))


def test_average_precision_per_class_edge_cases():
    empty = metrics.average_precision_per_class(torch.zeros(0, 3, dtype=torch.float64),
                                                torch.zeros(0, dtype=torch.long))
    assert empty.tolist() == [0.0, 0.0, 0.0]
    # A perfect ranking, a reversed one, and every score tied.
    scores = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1])
    assert metrics.average_precision_per_class(scores, labels).tolist() == [1.0, 1.0]
    flat = metrics.average_precision_per_class(torch.full((4, 2), 0.5, dtype=torch.float64),
                                               torch.tensor([0, 1, 1, 1]))
    assert flat.tolist() == [0.25, 0.75]
    # Non-finite scores (a diverged model): nan for their classes, the others exact.
    bad, labels = many_classes(5, 50, 4, "continuous")
    bad[3, 1], bad[7, 2] = float("nan"), float("inf")
    result = metrics.average_precision_per_class(bad, labels)
    assert result[1].isnan() and result[2].isnan()
    for c in (0, 3):
        assert result[c].item() == pytest.approx(
            skm.average_precision_score((labels == c).numpy(), bad[:, c].numpy()), abs=1e-12)
    assert metrics.best_f1_threshold(*metrics.precision_recall_curve(bad[:, 1], labels == 1)) == 0.5
    assert math.isnan(metrics.roc_auc(*metrics.roc_curve(bad[:, 2], labels == 2)[:2]))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_roc_curve_and_auc(case):
    scores, positive = make_case(*case)
    fpr, tpr, thresholds = metrics.roc_curve(scores, positive)
    want = skm.roc_curve(positive.numpy(), scores.numpy(), drop_intermediate=False)
    for ours, theirs in zip((fpr, tpr, thresholds), want, strict=True):
        assert_close(ours, theirs)  # nan rates of an absent class compare equal
    auc = metrics.roc_auc(fpr, tpr)
    if both_classes(positive):
        assert auc == pytest.approx(skm.roc_auc_score(positive.numpy(), scores.numpy()),
                                    abs=1e-12)
    else:
        assert np.isnan(auc)


def test_empty_split_curves():
    empty = torch.zeros(0, dtype=torch.float64)
    precision, recall, thresholds = metrics.precision_recall_curve(empty, empty.bool())
    assert precision.tolist() == [1.0] and recall.tolist() == [0.0] and len(thresholds) == 0
    assert metrics.average_precision(precision, recall) == 0.0
    fpr, tpr, thresholds = metrics.roc_curve(empty, empty.bool())
    assert thresholds.tolist() == [float("inf")]
    assert np.isnan(metrics.roc_auc(fpr, tpr))


@pytest.mark.parametrize("case", CASES[::2], ids=case_id)
def test_counts_at_threshold(case):
    scores, positive = make_case(*case)
    # Scores themselves (ties at the threshold), between them, and beyond both ends.
    candidates = torch.cat([scores[:5], torch.tensor([-1.0, 0.0, 0.333, 0.5, 1.0, 2.0])])
    for threshold in candidates.tolist():
        got = metrics.counts_at_threshold(scores, positive, threshold)
        y, predicted = positive.numpy(), (scores >= threshold).numpy()
        tn, fp, fn, tp = skm.confusion_matrix(y, predicted, labels=[False, True]).ravel()
        assert (got["tp"], got["fp"], got["fn"], got["tn"]) == (tp, fp, fn, tn)
        assert all(isinstance(got[key], int) for key in ("tp", "fp", "fn", "tn"))
        for key, score in [("precision", skm.precision_score), ("recall", skm.recall_score),
                           ("f1", skm.f1_score)]:
            want = score(y, predicted, zero_division=0)
            assert got[key] == pytest.approx(want, abs=1e-12), key
        assert got["accuracy"] == pytest.approx(skm.accuracy_score(y, predicted), abs=1e-12)


def best_f1_brute_force(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """Exact F1 (fractions) at every distinct score; ties to the highest threshold."""
    best, best_threshold = Fraction(0), 0.5
    for threshold in sorted(set(scores.tolist())):
        counts = metrics.counts_at_threshold(scores, positive, threshold)
        tp, fp, fn = counts["tp"], counts["fp"], counts["fn"]
        f1 = Fraction(2 * tp, 2 * tp + fp + fn) if tp else Fraction(0)
        if f1 > 0 and f1 >= best:
            best, best_threshold = f1, threshold
    return best_threshold


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_best_f1_threshold(case):
    scores, positive = make_case(*case)
    curve = metrics.precision_recall_curve(scores, positive)
    got = metrics.best_f1_threshold(*curve)
    assert got == best_f1_brute_force(scores, positive)
    if not positive.any():
        assert got == 0.5


def test_best_f1_threshold_ties_and_no_threshold():
    scores = torch.tensor([0.9, 0.8, 0.3, 0.2], dtype=torch.float64)
    # F1 at 0.9: 2/3 (tp 1, fn 1), 0.8: 1/2, 0.3: 4/5 (tp 2, fp 1), 0.2: 2/3 (tp 2, fp 2).
    positive = torch.tensor([True, False, True, False])
    assert metrics.best_f1_threshold(*metrics.precision_recall_curve(scores, positive)) == 0.3
    # F1 at 0.9: 2/3 (tp 1, fn 1), 0.8: 1/2, 0.3: 2/5, 0.2: 2/3 (tp 2, fp 2): a tie.
    positive = torch.tensor([True, False, False, True])
    assert metrics.best_f1_threshold(*metrics.precision_recall_curve(scores, positive)) == 0.9
    empty = torch.zeros(0, dtype=torch.float64)
    assert metrics.best_f1_threshold(empty, empty, empty) == 0.5


@pytest.mark.parametrize("seed", range(4))
def test_confusion_matrix(seed):
    generator = torch.Generator().manual_seed(seed)
    classes = [1, 2, 5, 10][seed]
    size = [1, 2, 30, 500][seed]
    labels = torch.randint(classes, (size,), generator=generator)
    predicted = torch.randint(classes, (size,), generator=generator)
    got = metrics.confusion_matrix(labels, predicted, classes)
    assert got.dtype == torch.long and got.shape == (classes, classes)
    want = skm.confusion_matrix(labels.numpy(), predicted.numpy(), labels=range(classes))
    np.testing.assert_array_equal(got.numpy(), want)


def check_thinned(x: torch.Tensor, y: torch.Tensor, max_points: int) -> torch.Tensor:
    kept = metrics.thin_curve(x, y, max_points)
    assert kept.dtype == torch.long
    assert len(kept) <= max_points
    assert kept[0] == 0 and kept[-1] == len(x) - 1
    assert bool((kept[1:] > kept[:-1]).all())  # sorted and unique
    if len(x) <= max_points:
        assert kept.tolist() == list(range(len(x)))
    return kept


@pytest.mark.parametrize("size", [1, 2, 3, 10, 11, 1000])
@pytest.mark.parametrize("max_points", [2, 3, 10])
def test_thin_curve_properties(size, max_points):
    generator = torch.Generator().manual_seed(size * 100 + max_points)
    x = torch.rand(size, generator=generator, dtype=torch.float64).sort().values
    y = torch.rand(size, generator=generator, dtype=torch.float64)
    check_thinned(x, y, max_points)


def test_thin_curve_degenerate_and_invalid():
    flat = torch.zeros(50, dtype=torch.float64)  # no path length at all
    assert check_thinned(flat, flat, 5).tolist() == [0, 49]
    # A run of repeated last points must not push the count over max_points.
    x = torch.cat([torch.linspace(0, 1, 100, dtype=torch.float64), torch.ones(20)])
    check_thinned(x, x, 10)
    nan = torch.full((30,), float("nan"), dtype=torch.float64)  # ROC rates of an absent class
    check_thinned(nan, torch.linspace(0, 1, 30, dtype=torch.float64), 4)
    with pytest.raises(ValueError):
        metrics.thin_curve(flat, flat, 1)


def step_error(y: torch.Tensor, kept: torch.Tensor) -> float:
    """Largest |y| gap between each original point and the kept point at or before it: the
    distance between the original step curve and the thinned one."""
    before = kept[torch.searchsorted(kept, torch.arange(len(y)), right=True) - 1]
    return (y - y[before]).abs().max().item()


def test_thin_keeps_the_shape_of_large_curves():
    scores, positive = make_case(0, 40_000, "continuous", rate=0.3)
    precision, recall, thresholds = metrics.precision_recall_curve(scores, positive)
    fpr, tpr, _ = metrics.roc_curve(scores, positive)
    assert len(precision) > 39_000
    kept = check_thinned(recall, precision, 200)
    assert len(kept) > 150  # the budget is mostly used
    assert step_error(precision, kept) < 0.05 and step_error(recall, kept) < 0.05
    kept_roc = check_thinned(fpr, tpr, 200)
    assert step_error(tpr, kept_roc) < 0.05 and step_error(fpr, kept_roc) < 0.05


def test_thin_aligns_pr_thresholds():
    scores, positive = make_case(3, 3000, "rounded", rate=0.4)
    scores = scores + torch.rand(3000, generator=torch.Generator().manual_seed(1)) * 1e-3
    precision, recall, thresholds = metrics.precision_recall_curve(scores, positive)
    curve = {"precision": precision, "recall": recall, "thresholds": thresholds}
    thinned = metrics.thin(curve, "recall", "precision", 50)
    kept = metrics.thin_curve(recall, precision, 50)
    assert thinned["precision"] == precision[kept].tolist()
    assert thinned["recall"] == recall[kept].tolist()
    assert len(thinned["thresholds"]) == len(thinned["precision"]) - 1
    assert thinned["precision"][-1] == 1.0 and thinned["recall"][-1] == 0.0
    assert all(isinstance(value, float) for value in thinned["thresholds"])
    # Point k of the thinned curve is still the classifier score >= thresholds[k].
    for k, threshold in enumerate(thinned["thresholds"]):
        counts = metrics.counts_at_threshold(scores, positive, threshold)
        assert counts["precision"] == pytest.approx(thinned["precision"][k], abs=1e-12)
        assert counts["recall"] == pytest.approx(thinned["recall"][k], abs=1e-12)
    # A short curve is kept whole; ROC thresholds are as long as the rates.
    fpr, tpr, roc_thresholds = metrics.roc_curve(scores[:20], positive[:20])
    roc = metrics.thin({"fpr": fpr, "tpr": tpr, "thresholds": roc_thresholds}, "fpr", "tpr", 50)
    assert roc["thresholds"] == roc_thresholds.tolist() and roc["fpr"] == fpr.tolist()
    with pytest.raises(ValueError):
        metrics.thin({"x": fpr, "y": tpr, "bad": fpr[:-3]}, "x", "y", 5)


def test_binned_counts_bins_and_additivity():
    bins = 100
    scores = torch.tensor([0.0, 0.29, 0.999, 1.0, -0.5, 1.7, 0.005], dtype=torch.float64)
    positive = torch.tensor([True, False, True, True, False, True, False])
    counts = metrics.binned_counts(scores, positive, bins)
    assert counts.dtype == torch.float64 and counts.shape == (2, bins)
    assert counts.sum() == len(scores)
    assert counts[0, 0] == 1 and counts[1, 0] == 2  # 0.0, then -0.5 and 0.005 clamped / below
    assert counts[1, 29] == 1  # 0.29 * 100 rounds to 28.999...; it still is >= edge 0.29
    assert counts[0, 99] == 3  # 0.999, 1.0 and 1.7 (clamped)
    big_scores, big_positive = make_case(5, 1000, "continuous")
    parts = [metrics.binned_counts(big_scores[i:i + 300], big_positive[i:i + 300], bins)
             for i in range(0, 1000, 300)]
    assert torch.equal(sum(parts), metrics.binned_counts(big_scores, big_positive, bins))


def test_binned_counts_per_class():
    scores, labels = many_classes(7, 500, 30, "rounded")
    scores[0, 0], scores[1, 1] = -0.5, 1.5  # clamped into the end bins, as binned_counts does
    for bins in (1, 7, 100):
        want = torch.stack([metrics.binned_counts(scores[:, c], labels == c, bins)
                            for c in range(30)])
        assert torch.equal(metrics.binned_counts_per_class(scores, labels, bins), want)


@pytest.mark.parametrize("bins", [10, 100, 1000])
@pytest.mark.parametrize("seed", range(3))
def test_binned_curves_exact_on_bin_edges(bins, seed):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randint(bins, (2000,), generator=generator).double() / bins
    positive = torch.rand(2000, generator=generator) < scores  # informative, with ties
    counts = metrics.binned_counts(scores, positive, bins)
    exact_pr = metrics.precision_recall_curve(scores, positive)
    binned_pr = metrics.binned_pr_curve(counts)
    for ours, exact in zip(binned_pr, exact_pr, strict=True):
        torch.testing.assert_close(ours, exact, rtol=0, atol=1e-12)
    exact_ap = metrics.average_precision(*exact_pr[:2])
    assert metrics.average_precision(*binned_pr[:2]) == pytest.approx(exact_ap, abs=1e-12)
    binned_roc = metrics.binned_roc_curve(counts)
    exact_roc = metrics.roc_curve(scores, positive)
    for ours, exact in zip(binned_roc, exact_roc, strict=True):
        torch.testing.assert_close(ours, exact, rtol=0, atol=1e-12)
    exact_auc = metrics.roc_auc(*exact_roc[:2])
    assert metrics.roc_auc(*binned_roc[:2]) == pytest.approx(exact_auc, abs=1e-12)


def test_binned_curves_approximate_continuous_scores():
    scores, positive = make_case(7, 20_000, "continuous", rate=0.2)
    counts = metrics.binned_counts(scores, positive, 1000)
    precision, recall, thresholds = metrics.binned_pr_curve(counts)
    exact_ap = metrics.average_precision(*metrics.precision_recall_curve(scores, positive)[:2])
    assert abs(metrics.average_precision(precision, recall) - exact_ap) < 0.01
    exact_auc = metrics.roc_auc(*metrics.roc_curve(scores, positive)[:2])
    assert abs(metrics.roc_auc(*metrics.binned_roc_curve(counts)[:2]) - exact_auc) < 0.01
    # Exact at its own thresholds (the bin edges).
    assert bool((thresholds[1:] > thresholds[:-1]).all())
    for k in range(0, len(thresholds), 97):
        got = metrics.counts_at_threshold(scores, positive, thresholds[k].item())
        assert got["precision"] == pytest.approx(precision[k].item(), abs=1e-12)
        assert got["recall"] == pytest.approx(recall[k].item(), abs=1e-12)


def test_binned_absent_classes_and_empty():
    bins = 20
    scores, _ = make_case(2, 100, "continuous")
    none = torch.zeros(100, dtype=torch.bool)
    counts = metrics.binned_counts(scores, none, bins)
    precision, recall, _ = metrics.binned_pr_curve(counts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want_ap = skm.average_precision_score(none.numpy(), scores.numpy())
    assert metrics.average_precision(precision, recall) == want_ap == 0.0
    assert bool((recall[:-1] == 1).all())
    assert np.isnan(metrics.roc_auc(*metrics.binned_roc_curve(counts)[:2]))
    everything = metrics.binned_counts(scores, ~none, bins)
    assert metrics.average_precision(*metrics.binned_pr_curve(everything)[:2]) == 1.0
    assert np.isnan(metrics.roc_auc(*metrics.binned_roc_curve(everything)[:2]))
    precision, recall, thresholds = metrics.binned_pr_curve(torch.zeros(2, bins))
    assert precision.tolist() == [1.0] and recall.tolist() == [0.0] and len(thresholds) == 0
