"""Tasks (what the model predicts and how it is scored) and exact metrics across processes.

Every rank feeds its own shard of the evaluation split into torchmetrics objects; `compute()`
then gathers the metric *states* of all ranks (predictions and targets for curves, sums and
counts for the rest; shards of different sizes are fine) and computes each metric once over the
whole split. So accuracy, the confusion matrix, precision-recall curves and average precision
(classification), MAE and RMSE (regression) are those of a one-process evaluation, whatever the
process count. Averaging per-rank metrics would not be: a PR curve cannot be averaged, and even a
mean of means is wrong when shards differ in size.
"""

from dataclasses import dataclass

import torch
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


def build_metrics(task: Task):
    """The metric states one rank accumulates (a torchmetrics MetricCollection); see the module
    docstring for how they combine."""
    # Imported here, not at the top: torchmetrics takes a second or two to import, and training
    # should not wait for it before its first step.
    from torchmetrics import MeanMetric, MetricCollection, SumMetric
    from torchmetrics.classification import (
        MulticlassAveragePrecision,
        MulticlassConfusionMatrix,
        MulticlassPrecisionRecallCurve,
    )
    from torchmetrics.regression import MeanAbsoluteError, MeanSquaredError

    # Loss as a sample-weighted mean in float64: exact under any sharding, not a mean of means.
    metrics = {"loss": MeanMetric().set_dtype(torch.float64),
               "num_samples": SumMetric().set_dtype(torch.float64)}
    if task.is_classification:
        n = task.num_outputs
        metrics.update(
            # Integer counts: accuracy is computed from them in float64 (trace / total).
            confusion_matrix=MulticlassConfusionMatrix(n),
            # thresholds=None keeps every prediction: exact curves, not binned approximations.
            pr_curve=MulticlassPrecisionRecallCurve(n, thresholds=None),
            average_precision=MulticlassAveragePrecision(n, average=None, thresholds=None),
        )
    else:
        metrics.update(mae=MeanAbsoluteError().set_dtype(torch.float64),
                       rmse=MeanSquaredError(squared=False).set_dtype(torch.float64))
    # compute_groups: metrics with the same state (the PR curve and AP) share it and sync once.
    return MetricCollection(metrics, compute_groups=True)


def update_metrics(metrics, task: Task, outputs: torch.Tensor,
                   targets: torch.Tensor) -> None:
    per_sample_loss = task.loss(outputs.double(), targets if task.is_classification
                                else targets.double(), reduction="none")
    metrics["loss"].update(per_sample_loss)
    metrics["num_samples"].update(float(targets.shape[0]))
    preds, truth = task.predictions(outputs), task.originals(targets)
    for name, metric in metrics.items():
        if name not in ("loss", "num_samples"):
            metric.update(preds, truth)


def finish_metrics(metrics, task: Task) -> dict:
    """Gather all ranks' states (collectives: call on every rank) and return plain values.

    Scalars go in the top level; classification adds `average_precision_per_class`,
    `confusion_matrix` and `pr_curves` (per class: precision, recall, thresholds).
    """
    values = metrics.compute()
    result = {"loss": values["loss"].item(), "num_samples": int(values["num_samples"].item())}
    if task.is_classification:
        per_class = values["average_precision"].double()
        precision, recall, thresholds = values["pr_curve"]
        confusion = values["confusion_matrix"]
        result.update(
            accuracy=(confusion.trace().double() / confusion.sum().clamp(min=1)).item(),
            average_precision_macro=per_class.mean().item(),
            average_precision_per_class=per_class.tolist(),
            confusion_matrix=confusion.tolist(),
            pr_curves=[{"precision": p.tolist(), "recall": r.tolist(), "thresholds": t.tolist()}
                       for p, r, t in zip(precision, recall, thresholds, strict=True)],
        )
    else:
        result.update(mae=values["mae"].item(), rmse=values["rmse"].item())
    metrics.reset()
    return result


def scalars(result: dict) -> dict:
    """The single-number metrics of a result (for logs, TensorBoard and summary tables)."""
    return {k: v for k, v in result.items() if isinstance(v, float)}
