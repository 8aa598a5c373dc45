"""Exact metrics of a whole evaluation split, as pure functions of float64 tensors.

Every function here sees every sample of the split: the caller gathers each process's per-sample
rows (scores, labels) first and calls these once on the whole split, so the numbers are the ones a
one-process evaluation gives, whatever the process count. Per-process metrics cannot simply be
averaged: a PR or ROC curve is a set of points at thresholds taken from all the scores, and a mean
of per-shard curves (or of their areas) is not the curve of the union. Even a mean of accuracies is
wrong when shards differ in size.

The exact curves are scikit-learn's (precision_recall_curve, roc_curve, auc, confusion_matrix on
the gathered rows): every distinct score is a threshold, equal scores are taken together, a sample
is predicted positive when its score is >= the threshold. What is written here is what it lacks:
every class's AP at once at 1,000 classes, and the binned mode.

Gathering every score costs memory proportional to the split. For very large splits the binned
mode keeps, per class, `bins` x 2 counts (positives and negatives per score bin), independent of
the split's size and additive across batches and processes (sum or all-reduce them); its curves
are exact at the bin edges and approximate the exact AP / ROC AUC.

`thin_curve` / `thin` cut a curve of up to one point per sample down to a bounded number of points
that keep its shape, for JSON, plots and TensorBoard.
"""

import warnings

import numpy as np
import torch


def _sklearn_metrics():
    """scikit-learn's metrics, imported on first use: the import costs about 1.5 s of CPU, which
    every process would otherwise pay at start-up, also in runs that never draw a curve."""
    import sklearn.metrics
    return sklearn.metrics


_F1_TIE = 1e-13  # F1 values closer than this are ties (float noise of 2pr / (p + r))


def _as_bool(positive: torch.Tensor) -> torch.Tensor:
    return positive.bool() if positive.dtype != torch.bool else positive


def _pr_from_counts(thresholds: torch.Tensor, true_pos: torch.Tensor, false_pos: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PR curve from counts at decreasing thresholds (every threshold predicts something)."""
    precision = true_pos / (true_pos + false_pos)
    positives = true_pos[-1] if len(true_pos) else true_pos.new_zeros(())
    # No positives: scikit-learn sets recall to 1 everywhere; so do we.
    recall = true_pos / positives if positives > 0 else torch.ones_like(true_pos)
    one, zero = precision.new_ones(1), precision.new_zeros(1)
    return (torch.cat([precision.flip(0), one]), torch.cat([recall.flip(0), zero]),
            thresholds.flip(0))


def _roc_from_counts(thresholds: torch.Tensor, true_pos: torch.Tensor, false_pos: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ROC curve from counts at decreasing thresholds, with the point (0, 0) at +inf first."""
    zero = true_pos.new_zeros(1)
    true_pos, false_pos = torch.cat([zero, true_pos]), torch.cat([zero, false_pos])
    thresholds = torch.cat([thresholds.new_full((1,), float("inf")), thresholds])
    # 0 / 0 gives nan when a class is absent, as scikit-learn does.
    return false_pos / false_pos[-1], true_pos / true_pos[-1], thresholds


def _numpy(*tensors: torch.Tensor) -> list[np.ndarray]:
    return [t.detach().cpu().numpy() for t in tensors]


def _tensors(*arrays: np.ndarray) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(np.array(a, dtype=np.float64, order="C")) for a in arrays)


def precision_recall_curve(scores: torch.Tensor, positive: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact precision-recall curve of one class (scikit-learn's): every distinct score is a
    threshold. Returns precision and recall (one more point than thresholds: precision 1 at
    recall 0, last) and the thresholds in increasing order: point k is the classifier
    `score >= thresholds[k]`. Recall is 1 when nothing is positive. Float64 CPU tensors.
    A nan or inf score (a diverged model) gives one nan point: its AP is nan."""
    if len(scores) == 0:
        one = torch.ones(1, dtype=torch.float64)
        return one, torch.zeros_like(one), torch.zeros(0, dtype=torch.float64)
    if not torch.isfinite(scores).all():
        nan = torch.full((1,), float("nan"), dtype=torch.float64)
        return torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 0.0]), nan
    truth, values = _numpy(_as_bool(positive), scores.double())
    with warnings.catch_warnings():  # no positive: recall set to 1, said by a warning
        warnings.simplefilter("ignore")
        return _tensors(*_sklearn_metrics().precision_recall_curve(truth, values))


def average_precision(precision: torch.Tensor, recall: torch.Tensor) -> float:
    """Area under the step-wise PR curve: sum over thresholds of precision x recall gained
    (scikit-learn's average_precision_score; no interpolation). 0 when nothing is positive."""
    return (-(recall[1:] - recall[:-1]) * precision[:-1]).sum().item()


def average_precision_per_class(scores: torch.Tensor, labels: torch.Tensor,
                                chunk_elements: int | None = None) -> torch.Tensor:
    """Exact one-vs-rest AP of every class at once: float64 [classes] for scores [samples,
    classes] and labels [samples] in [0, classes); the numbers of
    average_precision(*precision_recall_curve(scores[:, c], labels == c)[:2]) for each c.

    Why not that loop: it sorts every column, and at 1,000 classes its per-class calls (and, on
    a GPU, their synchronisations) cost more than a training epoch. Only a class's own positives
    move its recall, so AP needs, at each distinct positive score v, the positives at or above v
    and above it (the class's few positive scores searched among themselves) and the samples at
    or above v (every score of the column placed among those positive scores: searchsorted and
    a bincount, no sort of the column). Each term is the loop's very float64 expression,
    (recall - previous recall) x precision, with the same integer counts; only the order in
    which the terms are added differs, so values agree to the last bit or two.

    Samples go in blocks of `chunk_elements` scores, which bounds the temporary memory: by
    default 2M on a CPU, where a block's transposition then stays in cache (at 20,000 x 1,000,
    90 ms in all instead of 220 ms in blocks of 16M), and 16M elsewhere, where fewer, larger
    kernels do better.
    """
    samples, classes = scores.shape
    if samples == 0:
        return scores.new_zeros(classes, dtype=torch.float64)
    scores, labels = scores.double(), labels.long()
    # nan or inf (a sum of finite scores that overflows too: one reduction, not a mask): the
    # conventions of the sorting path, class by class.
    if not scores.sum().isfinite():
        return torch.tensor([average_precision(*precision_recall_curve(scores[:, c],
                                                                       labels == c)[:2])
                             for c in range(classes)], dtype=torch.float64)
    if chunk_elements is None:
        chunk_elements = 1 << (21 if scores.device.type == "cpu" else 24)
    positive_scores = _sorted_positives(scores, labels, classes)
    positives = positive_scores[-1]
    # A table row per class holds its positive scores, padded to the longest row of its table.
    # One table for all would pad every class to the largest (classes x samples for a dominant
    # class), so classes up to twice the mean count share one, and larger ones go by the bit
    # length of their count: the padding at most doubles a table, each under 2 x samples.
    group = torch.where(positives <= 2 * -(-samples // classes), 0,
                        torch.floor(torch.log2(positives.double())).long() + 1)
    result = scores.new_zeros(classes, dtype=torch.float64)
    for key in group.unique().tolist():
        members = torch.nonzero(group == key).flatten()
        table = _positive_table(positive_scores, members)
        histogram = _placed_counts(scores, members if len(members) < classes else None, table,
                                   max(1, chunk_elements // len(members)))
        result[members] = _table_average_precision(histogram, table, positives[members])
    return result


def _sorted_positives(scores: torch.Tensor, labels: torch.Tensor, classes: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every sample's score for its own class, sorted by class and then by score; their
    classes; their positions within their class; and every class's count of positives."""
    own = scores.gather(1, labels[:, None]).squeeze(1)
    order = torch.sort(own, stable=True).indices
    order = order[torch.sort(labels[order], stable=True).indices]  # by class, then by score
    positives = torch.bincount(labels, minlength=classes)
    ordered = labels[order]
    column = (torch.arange(len(labels), device=labels.device)
              - (positives.cumsum(0) - positives)[ordered])
    return own[order], ordered, column, positives


def _positive_table(positive_scores: tuple, members: torch.Tensor) -> torch.Tensor:
    """Row i: the positive scores of class members[i], increasing, padded with +inf."""
    own, ordered, column, positives = positive_scores
    row = torch.full_like(positives, -1)
    row[members] = torch.arange(len(members), device=members.device)
    row = row[ordered]
    kept = row >= 0
    table = own.new_full((len(members), int(positives[members].max())), float("inf"))
    table[row[kept], column[kept]] = own[kept]
    return table


def _placed_counts(scores: torch.Tensor, members: torch.Tensor | None, table: torch.Tensor,
                   step: int) -> torch.Tensor:
    """[classes of the table, width + 1]: how many samples' scores for the class are at or
    above exactly k of its positive scores, k = 0 .. width (+inf pads never are). `members`:
    the table's classes (their columns of scores), None when it has them all, in order."""
    classes, width = table.shape
    offsets = torch.arange(classes, device=table.device)[:, None] * (width + 1)
    histogram = torch.zeros(classes * (width + 1), dtype=torch.long, device=table.device)
    for start in range(0, len(scores), step):
        block = scores[start:start + step]
        block = block if members is None else block.index_select(1, members)
        # Row c of the block is the class's column of scores, as searchsorted wants it.
        placed = torch.searchsorted(table, block.T.contiguous(), right=True)
        placed += offsets  # one bincount for all classes
        histogram += torch.bincount(placed.flatten(), minlength=len(histogram))
    return histogram.reshape(classes, width + 1)


def _table_average_precision(histogram: torch.Tensor, table: torch.Tensor,
                             positives: torch.Tensor) -> torch.Tensor:
    """The AP of each class of a table (_positive_table), from the counts of its samples by
    how many of its positive scores they are at or above (_placed_counts)."""
    width = table.shape[1]
    # at_least[c, k]: samples with at least k of class c's positive scores at or under theirs.
    at_least = histogram.flip(1).cumsum(1).flip(1)
    below = torch.searchsorted(table, table, right=False)  # positives under each positive score
    not_above = torch.searchsorted(table, table, right=True)  # ... at or under it
    predicted = at_least.gather(1, not_above).double()  # samples at or above the score
    count = positives[:, None].double()
    true_pos, higher = count - below, count - not_above  # positives at or above, above
    index = torch.arange(width, device=table.device)
    # One term per distinct positive score: at the first of its ties, not at the padding.
    first = (below == index) & (index < positives[:, None])
    term = (true_pos / count - higher / count) * (true_pos / predicted)
    return torch.where(first, term, torch.zeros_like(term)).sum(1)


def roc_curve(scores: torch.Tensor, positive: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact ROC curve of one class: false and true positive rates and decreasing thresholds,
    the first +inf with the point (0, 0); scikit-learn's roc_curve(drop_intermediate=False).
    A rate is nan throughout when its class (negatives for fpr, positives for tpr) is absent,
    and both when a score is nan or inf (a diverged model)."""
    if len(scores) == 0 or not torch.isfinite(scores).all():
        nan = torch.full((1,), float("nan"), dtype=torch.float64)
        return nan, nan.clone(), torch.full((1,), float("inf"), dtype=torch.float64)
    truth, values = _numpy(_as_bool(positive), scores.double())
    with warnings.catch_warnings():  # a class absent: its rate is nan, said by a warning
        warnings.simplefilter("ignore")
        return _tensors(*_sklearn_metrics().roc_curve(truth, values, drop_intermediate=False))


def roc_auc(fpr: torch.Tensor, tpr: torch.Tensor) -> float:
    """Area under the ROC curve by the trapezoidal rule (scikit-learn's auc). nan when the split
    has no positives or no negatives (the rates are then nan; roc_auc_score raises)."""
    if len(fpr) < 2 or torch.isnan(fpr).any() or torch.isnan(tpr).any():
        return float("nan")
    return float(_sklearn_metrics().auc(*_numpy(fpr, tpr)))


def counts_at_threshold(scores: torch.Tensor, positive: torch.Tensor, threshold: float) -> dict:
    """Confusion counts and scores of the classifier `score >= threshold` (the PR curve's rule).

    Returns tp, fp, fn, tn (ints) and precision, recall, f1, accuracy (floats), with
    scikit-learn's zero_division=0: a ratio whose denominator is 0 is 0 (accuracy of nothing too).
    """
    truth, predicted = _numpy(_as_bool(positive), scores >= threshold)
    tn, fp, fn, tp = (int(n) for n in _sklearn_metrics().confusion_matrix(
        truth, predicted, labels=[False, True]).ravel())
    return _scores_from_counts(tp, fp, fn, tn)


def _ratio(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else 0.0


def _scores_from_counts(tp: int, fp: int, fn: int, tn: int) -> dict:
    # f1 from counts rather than from precision and recall: the same number without rounding.
    return {"tp": tp, "fp": fp, "fn": fn, "tn": tn,
            "precision": _ratio(tp, tp + fp), "recall": _ratio(tp, tp + fn),
            "f1": _ratio(2 * tp, 2 * tp + fp + fn), "accuracy": _ratio(tp + tn, tp + fp + fn + tn)}


def binned_counts_at_threshold(counts: torch.Tensor, threshold: float) -> dict:
    """counts_at_threshold from binned_counts, for a threshold that is a bin edge: the bins at
    or above it are predicted positive."""
    above = bin_edges(counts.shape[1]).to(counts.device) >= threshold - 1e-12
    tp, fp = (int(v) for v in counts[:, above].sum(1).tolist())
    fn, tn = (int(v) for v in counts[:, ~above].sum(1).tolist())
    return _scores_from_counts(tp, fp, fn, tn)


def best_f1_threshold(precision: torch.Tensor, recall: torch.Tensor,
                      thresholds: torch.Tensor) -> float:
    """The threshold of a PR curve (as precision_recall_curve returns it) with the highest F1;
    ties (within float noise) go to the highest threshold. 0.5 when the curve has no threshold,
    a nan one (non-finite scores) or the class has no positive (F1 is then 0 everywhere)."""
    count = len(thresholds)
    if count == 0 or not torch.isfinite(thresholds).all():
        return 0.5
    p, r = precision[:count], recall[:count]
    total = p + r
    f1 = torch.where(total > 0, 2 * p * r / total.clamp_min(1e-300), torch.zeros_like(total))
    best = f1.max()
    if best <= 0:
        return 0.5
    # Thresholds increase, so the last index among the best is the highest threshold.
    index = torch.nonzero(f1 >= best - _F1_TIE).flatten()[-1]
    return thresholds[index].item()


def confusion_matrix(labels: torch.Tensor, predicted: torch.Tensor, classes: int) -> torch.Tensor:
    """Counts [classes, classes], rows the true class and columns the predicted one (both in
    [0, classes)); scikit-learn's confusion_matrix(labels, predicted, labels=range(classes)),
    computed where the tensors are: the binned mode adds one up per batch on the GPU."""
    flat = labels.long() * classes + predicted.long()
    return torch.bincount(flat, minlength=classes * classes).reshape(classes, classes)


def thin_curve(x: torch.Tensor, y: torch.Tensor, max_points: int) -> torch.Tensor:
    """Indices (sorted, unique, LongTensor) of at most `max_points` points of the curve (x, y)
    that keep its shape: the first and the last point, and points spread evenly along the curve's
    path length in (x, y) space, so steep and flat parts keep the same detail. A curve of at most
    `max_points` points is kept whole.

    Every point left out lies within one step of path length (length / (max_points - 1)) of the
    kept point before it, in both x and y. nan coordinates count as no length.
    """
    if max_points < 2:
        raise ValueError(f"max_points must be at least 2, got {max_points}")
    count = len(x)
    if count <= max_points:
        return torch.arange(count, device=x.device)
    x, y = x.double(), y.double()
    step = torch.hypot(x[1:] - x[:-1], y[1:] - y[:-1]).nan_to_num(0.0, posinf=0.0)
    distance = torch.cat([step.new_zeros(1), step.cumsum(0)])  # path length up to each point
    targets = torch.linspace(0.0, distance[-1].item(), max_points, dtype=torch.float64,
                             device=x.device)
    # The first point at or past each target; duplicates (long segments) merge, so at most
    # max_points survive. The end targets are pinned to the end points (the last target could
    # stop early on a run of repeated final points).
    chosen = torch.searchsorted(distance, targets).clamp_max(count - 1)
    chosen[0], chosen[-1] = 0, count - 1
    return torch.unique(chosen)  # sorted


def thin(curve: dict[str, torch.Tensor], x: str, y: str, max_points: int
         ) -> dict[str, list[float]]:
    """Every array of a curve at the points thin_curve(curve[x], curve[y], max_points) keeps,
    as plain lists.

    Arrays as long as `x` (precision, recall, ROC thresholds...) take the kept indices. An array
    one shorter (a PR curve's thresholds: the last point, precision 1 at recall 0, has none) takes
    the kept indices but the last point's, which thin_curve always keeps: the result stays one
    shorter and aligned, point k at thresholds[k], as precision_recall_curve returns it.
    """
    count = len(curve[x])
    kept = thin_curve(curve[x], curve[y], max_points)
    result = {}
    for name, values in curve.items():
        if len(values) == count:
            result[name] = values[kept].tolist()
        elif len(values) == count - 1:
            result[name] = values[kept[:-1]].tolist()
        else:
            raise ValueError(f"{name} has {len(values)} values, the curve has {count} points")
    return result


def bin_edges(bins: int) -> torch.Tensor:
    """Lower edges i / bins of the score bins over [0, 1]: the binned curves' thresholds."""
    return torch.arange(bins, dtype=torch.float64) / bins


def binned_counts(scores: torch.Tensor, positive: torch.Tensor, bins: int) -> torch.Tensor:
    """Positives (row 0) and negatives (row 1) per score bin, float64 [2, bins]; bin i holds the
    scores in [i / bins, (i + 1) / bins), 1.0 in the last; scores outside [0, 1] are clamped.
    Counts add up across batches and processes: sum them, or all-reduce them."""
    edges = bin_edges(bins).to(scores.device)
    # Compare with the very edges reported as thresholds (score * bins can round below i).
    # contiguous: a column of a [samples, classes] block would be copied anyway, with a warning
    index = (torch.searchsorted(edges, scores.double().contiguous(), right=True) - 1
             ).clamp(0, bins - 1)
    negative = (~_as_bool(positive)).long()
    flat = torch.bincount(negative * bins + index, minlength=2 * bins)
    return flat.reshape(2, bins).double()


def binned_counts_per_class(scores: torch.Tensor, labels: torch.Tensor, bins: int
                            ) -> torch.Tensor:
    """binned_counts(scores[:, c], labels == c, bins) of every class c at once, float64
    [classes, 2, bins], for scores [samples, classes]: one searchsorted and one bincount for a
    batch instead of a call per class (at 1,000 classes, a thousand calls per batch)."""
    samples, classes = scores.shape
    edges = bin_edges(bins).to(scores.device)
    index = (torch.searchsorted(edges, scores.double().contiguous(), right=True) - 1
             ).clamp(0, bins - 1)
    class_index = torch.arange(classes, device=scores.device)
    negative = (labels.long()[:, None] != class_index).long()
    flat = (class_index * 2 + negative) * bins + index  # [class, negative, bin] in one number
    counts = torch.bincount(flat.flatten(), minlength=classes * 2 * bins)
    return counts.reshape(classes, 2, bins).double()


def _binned_threshold_counts(counts: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thresholds (edges of the non-empty bins, decreasing) and the true and false positives
    at each: a bin edge is a threshold as a distinct score is in the exact curves."""
    counts = counts.double()
    bins = counts.shape[1]
    non_empty = (counts.sum(0) > 0).flip(0)
    from_top = counts.flip(1).cumsum(1)  # positives, negatives at or above each edge
    edges = bin_edges(bins).to(counts.device).flip(0)
    return edges[non_empty], from_top[0][non_empty], from_top[1][non_empty]


def binned_pr_curve(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PR curve from binned_counts, thresholds the lower edges of the non-empty bins (increasing).
    Exact at those thresholds (same conventions as precision_recall_curve, so average_precision
    applies); its AP approximates the exact one, equal when every score is a bin edge."""
    return _pr_from_counts(*_binned_threshold_counts(counts))


def binned_roc_curve(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ROC curve from binned_counts: +inf, then the lower edges of the non-empty bins
    (decreasing), as roc_curve returns them, so roc_auc applies; exact at those thresholds, its
    area approximates the exact one, equal when every score is a bin edge."""
    return _roc_from_counts(*_binned_threshold_counts(counts))
