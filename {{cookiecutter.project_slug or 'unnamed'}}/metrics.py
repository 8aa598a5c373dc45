"""Tasks (what the model predicts and how it is scored) and exact metrics across processes.

Every rank keeps one row per sample of its shard of the evaluation split (the sample's loss, its
target and the model's prediction: class probabilities or a value). `SplitOutputs.compute()`
gathers the rows of all ranks, in rank order, which is the split's own order because the shards
are contiguous blocks (data.EvalShardSampler), and computes every metric once over the whole
split, on every rank. So loss, accuracy, the confusion matrix, precision-recall curves and average
precision (classification), MAE and RMSE (regression) are the numbers a one-process evaluation
gives, summed in the same order, whatever the process count. Averaging per-rank metrics would not
be: a PR curve cannot be averaged, and even a mean of means is wrong when shards differ in size.

One gather of all rows costs two collectives per evaluation, however many metrics there are.
Exact PR curves need every prediction anyway; rows take (classes + 2) float64 numbers a sample.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class Task:
    """What the model's outputs mean. Regression targets are standardised for training;
    `target_mean` / `target_std` turn predictions back into the data's own units for metrics."""

    kind: str  # "classification" | "regression"
    num_outputs: int  # classes, or 1 for regression
    target_mean: float = 0.0
    target_std: float = 1.0

    @property
    def is_classification(self) -> bool:
        return self.kind == "classification"

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor,
             reduction: str = "mean") -> torch.Tensor:
        if self.is_classification:
            return F.cross_entropy(outputs, targets, reduction=reduction)
        return F.mse_loss(outputs.squeeze(-1), targets, reduction=reduction)

    def correct(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Correct predictions in a batch (classification), for cheap running accuracy."""
        return (outputs.argmax(dim=-1) == targets).sum()

    def predictions(self, outputs: torch.Tensor) -> torch.Tensor:
        """Class probabilities, or predictions in the target's own units."""
        if self.is_classification:
            return outputs.double().softmax(dim=-1)
        return outputs.squeeze(-1).double() * self.target_std + self.target_mean

    def originals(self, targets: torch.Tensor) -> torch.Tensor:
        """Targets in the data's own units."""
        if self.is_classification:
            return targets
        return targets.double() * self.target_std + self.target_mean


class SplitOutputs:
    """One rank's per-sample rows of an evaluation split: [loss, target, prediction(s)], float64,
    the target and predictions in the data's own units."""

    def __init__(self, task: Task):
        self.task = task
        self.rows: list[torch.Tensor] = []

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        task = self.task
        loss = task.loss(outputs.double(), targets if task.is_classification
                         else targets.double(), reduction="none")
        predictions = task.predictions(outputs).reshape(len(targets), -1)
        self.rows.append(torch.cat([loss[:, None], task.originals(targets).double()[:, None],
                                    predictions], dim=1))

    def compute(self, shard_sizes: list[int] | None = None) -> dict:
        """Metrics over the whole split (collectives: call on every rank, the same number of
        times, whatever the size of its shard). `shard_sizes`, every rank's sample count when
        known in advance, saves the collective that would ask for them."""
        width = 2 + (self.task.num_outputs if self.task.is_classification else 1)
        mine = torch.cat(self.rows) if self.rows else torch.zeros(0, width, dtype=torch.float64)
        return split_metrics(gather_rows(mine, shard_sizes), self.task)


def gather_rows(rows: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
    """Every rank's rows, concatenated in rank order, on every rank (shards may differ in size:
    they are padded to the largest for the all_gather and trimmed after)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rows
    world = dist.get_world_size()
    if counts is None:
        sizes = torch.zeros(world, dtype=torch.long, device=rows.device)
        sizes[dist.get_rank()] = len(rows)
        dist.all_reduce(sizes)
        counts = sizes.tolist()
    padded = rows.new_zeros(max(counts), rows.shape[1])
    padded[:len(rows)] = rows
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])


def split_metrics(rows: torch.Tensor, task: Task) -> dict:
    """Plain values from the rows of a whole split. Scalars go in the top level; classification
    adds `average_precision_per_class`, `confusion_matrix` and `pr_curves` (per class:
    precision, recall, thresholds); `predictions` and `targets` hold the split's own."""
    loss, targets, predictions = rows[:, 0], rows[:, 1], rows[:, 2:]
    count = len(rows)
    result = {"loss": (loss.sum() / max(count, 1)).item(), "num_samples": count}
    if task.is_classification:
        classes, labels = task.num_outputs, targets.long()
        predicted = predictions.argmax(dim=1)
        confusion = torch.bincount(labels * classes + predicted, minlength=classes * classes)
        confusion = confusion.reshape(classes, classes)  # rows: true class, columns: predicted
        curves = [precision_recall_curve(predictions[:, c], labels == c) for c in range(classes)]
        per_class = [average_precision(precision, recall) for precision, recall, _ in curves]
        result.update(
            accuracy=(confusion.trace().double() / max(count, 1)).item(),
            average_precision_macro=sum(per_class) / classes,
            average_precision_per_class=per_class,
            confusion_matrix=confusion.tolist(),
            pr_curves=[{"precision": p.tolist(), "recall": r.tolist(), "thresholds": t.tolist()}
                       for p, r, t in curves],
            predictions=predictions, targets=labels,
        )
    else:
        error = predictions[:, 0] - targets
        result.update(mae=(error.abs().sum() / max(count, 1)).item(),
                      rmse=(error.square().sum() / max(count, 1)).sqrt().item(),
                      predictions=predictions[:, 0], targets=targets)
    return result


def precision_recall_curve(scores: torch.Tensor, positive: torch.Tensor) -> tuple:
    """The exact precision-recall curve of one class: every distinct score is a threshold.

    Returns precision and recall (one more point than thresholds: precision 1 at recall 0) and
    the thresholds in increasing order, the conventions of scikit-learn's precision_recall_curve.
    """
    order = torch.sort(scores, descending=True, stable=True).indices
    scores, positive = scores[order], positive[order].double()
    # The last position of each run of equal scores: a threshold takes all of its ties at once.
    last_of_run = torch.cat([torch.nonzero(scores[1:] != scores[:-1]).flatten(),
                             torch.tensor([len(scores) - 1], device=scores.device)])
    true_pos = positive.cumsum(0)[last_of_run]
    predicted_pos = (last_of_run + 1).double()
    precision = true_pos / predicted_pos
    recall = true_pos / true_pos[-1] if true_pos[-1] > 0 else torch.ones_like(true_pos)
    one, zero = precision.new_ones(1), precision.new_zeros(1)
    return (torch.cat([precision.flip(0), one]), torch.cat([recall.flip(0), zero]),
            scores[last_of_run].flip(0))


def average_precision(precision: torch.Tensor, recall: torch.Tensor) -> float:
    """Area under the step-wise PR curve: sum over thresholds of precision x recall gained
    (scikit-learn's average_precision_score; no interpolation)."""
    return (-(recall[1:] - recall[:-1]) * precision[:-1]).sum().item()


def scalars(result: dict) -> dict:
    """The single-number metrics of a result (for logs, TensorBoard and summary tables)."""
    return {k: v for k, v in result.items() if isinstance(v, float)}
